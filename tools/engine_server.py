"""A small OpenAI-compatible server for tests and tools (tests/test_engine_ids.py, tools/engine_ids_report.py; not installed): a real
tiny HF model sampled token by token, answered in vLLM's wire format (field names and semantics from vLLM's
code, not from hsstore's).

What it does, as vLLM's ``/v1/chat/completions`` does (vllm/entrypoints/openai/chat_completion/serving.py):
- renders the chat template over the request's messages (tool-call ``arguments`` strings parsed to objects)
  with ``add_generation_prompt=True`` and the request's ``chat_template_kwargs``, and tokenizes it without
  added special tokens (the request's ``add_special_tokens`` defaults to false for chat);
- samples one token at a time at the request's temperature until the eos token (``<|im_end|>``, kept in the
  generated ids as vLLM's ``check_stop`` leaves it in ``output_token_ids``) or ``max_tokens``
  (``finish_reason: "length"``);
- decodes the text with ``skip_special_tokens=True`` and splits it as vLLM's qwen3 reasoning parser does
  (non-streaming: text after a generated ``<think>``, partitioned at the first ``</think>``; no ``</think>``:
  all reasoning), answering the reasoning in ``message.reasoning``; with ``tools``, ``<tool_call>{json}
  </tool_call>`` blocks become ``tool_calls`` whose ``arguments`` is ``json.dumps`` of the parsed arguments
  (vLLM's hermes parser), ``content`` the text before the first block or null;
- with ``"return_token_ids": true``: a top-level ``prompt_token_ids`` and per choice ``token_ids`` (null
  otherwise, as vLLM serializes them).

Variants (``EngineServer`` arguments): ``ids=False`` ignores ``return_token_ids`` (a server older than vLLM
0.10.2); ``strict=True`` refuses unknown request fields with 422 (as ``transformers serve`` does);
``chat_template`` serves another template than the tokenizer's (an engine started with ``--chat-template``);
``script`` replaces sampling by forcing the given text's tokens (a constrained decode) for requests whose
last message contains a key of the dict, which the tool-call test uses: the tiny model never calls tools by
itself. ``bias`` (token id -> logit added) tilts sampling; ``split`` (token id -> ids of the same text) emits
a sampled token as several (each fed to the model in turn): a non-canonical split on demand, since the
trained tiny model samples few by itself (about 1 turn in 40 at temperature 1).
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_KNOWN_FIELDS = {"model", "messages", "max_tokens", "temperature", "chat_template_kwargs", "tools", "seed"}
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class EngineServer:
    """``with EngineServer(model_dir) as url:`` a server on 127.0.0.1 (port chosen by the OS)."""

    def __init__(self, model_dir, *, ids: bool = True, strict: bool = False, chat_template: str | None = None,
                 script: dict[str, str] | None = None, bias: dict[int, float] | None = None,
                 split: dict[int, list[int]] | None = None, seed: int = 0):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.template = chat_template or self.tokenizer.chat_template
        self.ids, self.strict, self.script, self.bias, self.split = ids, strict, script or {}, bias or {}, split or {}
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.generator = torch.Generator().manual_seed(seed)
        self.lock = threading.Lock()  # one sampling at a time: the generator's draws stay in request order
        self.requests: list[dict] = []
        self.httpd: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------------------------------------- engine

    def render(self, body: dict) -> str:
        messages = []
        for m in body["messages"]:
            m = dict(m)
            if m.get("tool_calls"):  # vLLM parses the OpenAI string arguments before rendering
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                    c["function"].get("arguments") or "{}")}} for c in m["tool_calls"]]
            messages.append(m)
        return self.tokenizer.apply_chat_template(
            messages, tools=body.get("tools"), chat_template=self.template, tokenize=False,
            add_generation_prompt=True, **(body.get("chat_template_kwargs") or {}))

    def sample(self, prompt_ids: list[int], max_tokens: int, temperature: float, forced: list[int] | None
               ) -> tuple[list[int], str]:
        import torch

        out: list[int] = []
        pending: list[int] = []
        with self.lock, torch.no_grad():
            past, step = None, torch.tensor([prompt_ids])
            while len(out) < max_tokens:
                res = self.model(input_ids=step, past_key_values=past, use_cache=True)
                past = res.past_key_values
                if forced is not None:
                    token = forced[len(out)]
                elif pending:
                    token = pending.pop(0)
                else:
                    logits = res.logits[0, -1].float()
                    for tid, b in self.bias.items():
                        logits[tid] += b
                    if temperature <= 0:
                        token = int(logits.argmax())
                    else:
                        probs = torch.softmax(logits / temperature, dim=-1)
                        token = int(torch.multinomial(probs, 1, generator=self.generator))
                    if token in self.split:  # emit the same text as several tokens, each fed to the model
                        token, *pending = self.split[token]
                out.append(token)
                if token == self.eos:
                    return out, "stop"
                if forced is not None and len(out) == len(forced):
                    return out, "stop"
                step = torch.tensor([[token]])
        return out, "length"

    def answer(self, body: dict) -> dict:
        prompt = self.render(body)
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        last = str(body["messages"][-1].get("content") or "")
        forced = next((self.forced_ids(text) for key, text in self.script.items() if key in last), None)
        gen, finish = self.sample(prompt_ids, int(body.get("max_tokens") or 256),
                                  float(body.get("temperature", 1.0)), forced)
        text = self.tokenizer.decode(gen, skip_special_tokens=True)
        kwargs = body.get("chat_template_kwargs") or {}
        reasoning, content = qwen3_reasoning(text, kwargs.get("enable_thinking", True))
        message = {"role": "assistant", "content": content, "reasoning": reasoning}
        if body.get("tools") and content and "<tool_call>" in content:
            calls = [json.loads(m) for m in _TOOL_CALL.findall(content)]
            message["tool_calls"] = [
                {"id": f"chatcmpl-tool-{k}", "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                for k, c in enumerate(calls)]
            message["content"] = content[: content.find("<tool_call>")] or None
            finish = "tool_calls"
        want_ids = self.ids and body.get("return_token_ids")
        return {
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or "tiny",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                         "stop_reason": None, "token_ids": gen if want_ids else None}],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(gen),
                      "total_tokens": len(prompt_ids) + len(gen)},
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids if want_ids else None,
        }

    def forced_ids(self, text: str) -> list[int]:
        """The script's text as the model would emit it: markers one id each, the end of turn last."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos]

    # ------------------------------------------------------------------------------------------- http

    def __enter__(self) -> str:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.rstrip("/") == "/v1/models":
                    self.reply(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
                else:
                    self.reply(200 if self.path == "/health" else 404, {})

            def do_POST(self):
                if self.path.rstrip("/") != "/v1/chat/completions":
                    return self.reply(404, {"error": "not found"})
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                unknown = set(body) - _KNOWN_FIELDS
                if server.strict and unknown:
                    return self.reply(422, {"detail": [{"type": "extra_forbidden", "loc": ["body", k],
                                                        "msg": "Extra inputs are not permitted"} for k in unknown]})
                self.reply(200, server.answer(body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def qwen3_reasoning(text: str, thinking: bool) -> tuple[str | None, str | None]:
    """vLLM's Qwen3ReasoningParser.extract_reasoning (non-streaming), without the implicit end at a bare
    ``<tool_call>`` (the tiny model closes its think block)."""
    head, sep, tail = text.partition("<think>")
    text = tail if sep else head
    if "</think>" in text:
        reasoning, _, content = text.partition("</think>")
        return reasoning, content or None
    if not thinking:
        return None, text
    return text, None
