"""The serving engine's own token ids, end to end against a real OpenAI-compatible server on loopback
(tools/engine_server.py: vLLM's wire format, the trained tiny Qwen3.5 target sampling at temperature 1):
regenerate records them, check/show/extract build samples from exactly ``prompt_token_ids + token_ids``,
and the store gives them back bit-exact. Expected ids come from the server's answers and from the HF
tokenizer itself, never from hsstore's tokenization."""

from __future__ import annotations

import json
import re
import logging
import shutil

import pytest
from tools.engine_server import EngineServer

import hsstore
from hsstore.app.cli import main
from hsstore.extract.job import ExtractSettings, GateRefused, run_extract
from hsstore.extract.regenerate import RegenerateSettings, run_regenerate
from hsstore.extract.tiny import CHAT_TEMPLATE, trained_files, trained_target_dir
from hsstore.extract.tokenize import TokenizeStats, load_samples, tokenize_conversation
from hsstore.app.schema import build

pytestmark = pytest.mark.slow  # the tiny target sampled by a real server for every test


@pytest.fixture(scope="module")
def target():
    return trained_target_dir()


@pytest.fixture(scope="module")
def tok(target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target))


def prompts(path, n, start=0, **extra):
    rows = [json.loads(line) for line in (trained_files() / "conversations.jsonl").read_text().splitlines()]
    rows = rows[start : start + n]
    for r in rows:
        r.update(extra)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def regenerate(url, inp, out, **kw):
    cfg = build(RegenerateSettings, input=[str(inp)], out=str(out), server=url, temperature=1.0, max_tokens=200,
                concurrency=1, progress=False, backoff_s=0.01, **kw)
    return run_regenerate(cfg)


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_json(capsys, *args):
    rc = main(["check", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def retokenized(tok, gen):
    """The generated ids as re-tokenizing their decoded text gives them (the end-of-turn id kept as one)."""
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    body = gen[:-1] if gen[-1] == eot else gen
    return tok(tok.decode(body), add_special_tokens=False)["input_ids"] + gen[len(body):]


def test_sampled_ids_survive_regenerate_check_extract_read(target, tok, tmp_path, capsys):
    """Temperature-1 samples where the server emits each sampled " is" as " i" + "s" (a split the tokenizer
    never makes; natural ones are rare in the tiny model): each row records the server's prompt_token_ids/token_ids; check counts exactly the turns whose
    ids differ from re-tokenizing their text as non_canonical; the store holds prompt + generated ids with
    the loss mask on exactly the generated ones, bit-exact; info counts the flags."""
    banned = tok.convert_tokens_to_ids("Ġis")
    inp, out = prompts(tmp_path / "in.jsonl", 6), tmp_path / "out.jsonl"
    split = {banned: tok.convert_tokens_to_ids(["Ġi", "s"])}
    with EngineServer(target, split=split) as url:
        regenerate(url, inp, out)
    rows = read_rows(out)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    answers = {}
    for r in rows:
        turn = r["messages"][-1]
        assert r["generation"]["token_ids"] == "engine"
        assert turn["prompt_token_ids"] and turn["token_ids"]
        assert banned not in turn["token_ids"]
        if turn["finish_reason"] == "stop":
            assert turn["token_ids"][-1] == eot  # vLLM keeps the stop token in the generated ids
        answers[r["id"]] = (turn["prompt_token_ids"], turn["token_ids"])
    want_nc = sum(retokenized(tok, g) != g for _, g in answers.values())
    assert want_nc >= 1, "the split should give at least one non-canonical turn"

    rc, rep = check_json(capsys, "--model", str(target), "--input", str(out), "--max-truncated-share", "1")
    assert rep["input"]["engine_turns"] == len(rows)
    assert rep["input"]["non_canonical"] == want_nc
    assert rep["input"]["skipped_rows"] == 0

    store_url = str(tmp_path / "store")
    run_extract(build(ExtractSettings, model=str(target), input=[str(out)], out=store_url, device="cpu",
                      dtype="float32", layers=[1, 4], progress=False, force=True))
    store = hsstore.open(store_url)
    assert len(store) == len(rows)
    for i in range(len(store)):
        item = store.read(i, layers=store.layers[:1])
        prompt, gen = answers[item["sample_id"]]
        assert item["input_ids"].tolist() == prompt + gen
        assert item["loss_mask"].tolist() == [False] * len(prompt) + [True] * len(gen)
    assert main(["info", store_url, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["flags"]["engine_ids"] == len(rows)
    assert info["flags"].get("non_canonical", 0) == want_nc


def test_show_uses_the_recorded_ids(target, tok, tmp_path, capsys):
    """A hand-written row whose generated ids are a non-canonical split: show decodes the recorded ids (the
    masked part is exactly them), not a re-tokenization."""
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         enable_thinking=True, return_dict=False)
    text_ids = tok("<think>\nIt is 5.\n</think>\n\n5.", add_special_tokens=False)["input_ids"]
    split = [tok.convert_tokens_to_ids("Ġi"), tok.convert_tokens_to_ids("s")]
    k = text_ids.index(tok.convert_tokens_to_ids("Ġis"))
    gen = text_ids[:k] + split + text_ids[k + 1 :] + [tok.convert_tokens_to_ids("<|im_end|>")]
    row = {"id": "hand", "messages": messages + [{"role": "assistant", "content": "5.", "reasoning_content": "It is 5.",
                                                  "prompt_token_ids": prompt_ids, "token_ids": gen}],
           "chat_template_kwargs": {"enable_thinking": True}}
    path = tmp_path / "row.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (s,) = load_samples(path, tok, stats=(st := TokenizeStats()))
    assert s.input_ids.tolist() == prompt_ids + gen
    assert s.loss_mask.tolist() == [0] * len(prompt_ids) + [1] * len(gen)
    assert "non_canonical" in s.flags and st.non_canonical == 1
    assert main(["show", str(path), "hand", "--model", str(target), "--color", "never"]) == 0
    shown = capsys.readouterr().out
    assert "non_canonical" in shown and "⟦" in shown


def test_server_without_ids_falls_back(target, tok, tmp_path, caplog, capsys):
    """A server that ignores return_token_ids (older vLLM), and one that refuses the field (422, as transformers
    serve does): each is noted once in the log and in every row; check re-tokenizes the text as before."""
    for kind, server in (("not returned by the server", EngineServer(target, ids=False)),
                         ("refused by the server", EngineServer(target, strict=True))):
        inp, out = prompts(tmp_path / "in.jsonl", 3), tmp_path / f"out-{len(kind)}.jsonl"
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hsstore.extract.regenerate"), server as url:
            regenerate(url, inp, out)
        rows = read_rows(out)
        assert [r["generation"]["token_ids"] for r in rows] == [kind] * 3
        assert all("token_ids" not in m and "prompt_token_ids" not in m for r in rows for m in r["messages"])
        notes = [r.message for r in caplog.records if "return_token_ids" in r.message or "no prompt_token_ids" in r.message]
        assert len(notes) == 1
        if server.strict:
            assert "return_token_ids" not in server.requests[-1] and "return_token_ids" in server.requests[0]
        rc, rep = check_json(capsys, "--model", str(target), "--input", str(out), "--max-truncated-share", "1")
        assert rep["samples"] == 3 and rep["input"]["engine_turns"] == 0 and rep["input"]["skipped_rows"] == 0


def test_prompt_mismatch_is_counted_named_and_trusted_on_request(target, tok, tmp_path, capsys):
    """The engine serves a template that keeps the user's trailing spaces (ours trims them): rows with such
    messages get other prompt ids than our render. check skips and names them (engine_prompt_mismatch) and
    fails past --max-skipped-share; extract notes them in the commit records (info); --trust-engine-ids
    keeps them as the engine computed them."""
    template = CHAT_TEMPLATE.replace("'<|im_start|>user\\n' + msg.content | trim", "'<|im_start|>user\\n' + msg.content")
    assert template != CHAT_TEMPLATE
    inp = tmp_path / "in.jsonl"
    rows = [json.loads(line) for line in prompts(tmp_path / "p.jsonl", 4).read_text().splitlines()]
    for r in rows[:2]:
        next(m for m in r["messages"] if m["role"] == "user")["content"] += "   "
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    with EngineServer(target, chat_template=template) as url:
        regenerate(url, inp, out)
    mismatched = [r["id"] for r in rows[:2]]

    rc, rep = check_json(capsys, "--model", str(target), "--input", str(out), "--max-truncated-share", "1")
    assert rc == 1
    assert rep["skipped"]["engine_prompt_mismatch"]["count"] == 2
    assert rep["skipped"]["engine_prompt_mismatch"]["ids"] == mismatched
    assert any("engine_prompt_mismatch" in f for f in rep["failures"])
    assert "--trust-engine-ids" in rep["skipped"]["engine_prompt_mismatch"]["first"]

    base = dict(model=str(target), input=[str(out)], device="cpu", dtype="float32", layers=[1], progress=False)
    with pytest.raises(GateRefused):
        run_extract(build(ExtractSettings, out=str(tmp_path / "refused"), **base))
    store_url = str(tmp_path / "store")
    from hsstore.extract.gate import GateThresholds

    lenient = GateThresholds(max_skipped_share=0.5, max_truncated_share=1)
    run_extract(build(ExtractSettings, out=store_url, thresholds=lenient, **base))
    assert main(["info", store_url, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["skipped"] == {"engine_prompt_mismatch": 2} and info["samples"] == 2

    rc, rep = check_json(capsys, "--model", str(target), "--input", str(out), "--max-truncated-share", "1",
                         "--trust-engine-ids")
    assert rc == 0 and rep["input"]["skipped_rows"] == 0
    assert rep["input"]["engine_prompt_mismatch_trusted"] == 2
    assert rep["flags"].get("engine_prompt_mismatch") == 2
    recorded = {r["id"]: r["messages"][-1] for r in read_rows(out)}
    for s in load_samples(out, tok, trust_engine_ids=True):
        m = recorded[s.sample_id]
        assert s.input_ids.tolist() == m["prompt_token_ids"] + m["token_ids"]


TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def tool_server(target, compact: bool):
    """The tiny model never calls tools, so the server forces a call (a constrained decode): compact JSON,
    which the template's ``tojson`` re-renders with spaces, or exactly the template's own rendering."""
    args = '{"a":2,"b":3}' if compact else '{"a": 2, "b": 3}'
    call = f'<think>\nI add them.\n</think>\n\n<tool_call>\n{{"name": "add", "arguments": {args}}}\n</tool_call>'
    return EngineServer(target, script={"Add 2 and 3": call, "5": "<think>\nThe tool said 5.\n</think>\n\n5."})


def tool_row(tmp_path):
    path = tmp_path / "tool.jsonl"
    path.write_text(json.dumps({"id": "tool", "tools": TOOLS,
                                "messages": [{"role": "user", "content": "Add 2 and 3 with the tool."}]}) + "\n")
    return path


@pytest.mark.parametrize("compact", [True, False])
def test_tool_call_keeps_the_engine_ids(target, tok, tmp_path, compact):
    """The hermes-style parser turns the call into JSON arguments; re-rendering them differs from what the
    model generated when it wrote compact JSON: the sample keeps the engine's ids (non_canonical counted)."""
    out = tmp_path / "out.jsonl"
    with tool_server(target, compact) as url:
        regenerate(url, tool_row(tmp_path), out)
    (row,) = read_rows(out)
    turn = row["messages"][-1]
    assert turn["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert turn["finish_reason"] == "tool_calls"
    stats = TokenizeStats()
    (s,) = load_samples(out, tok, stats=stats)
    assert s.input_ids.tolist() == turn["prompt_token_ids"] + turn["token_ids"]
    assert tok.decode(turn["token_ids"]).count('"a":2') == (1 if compact else 0)
    assert stats.non_canonical == (1 if compact else 0)


@pytest.mark.parametrize("compact", [True, False])
def test_tool_loop_merges_only_when_the_next_prompt_extends_the_sample(target, tok, tmp_path, compact):
    """A tool loop through the engine: call, tool result, final answer. The second request's prompt holds the
    engine's own re-tokenization of the first turn: it begins with the first sample's ids only when that
    re-tokenization equals what the model generated (here: the template's JSON spacing), and only then are
    the two turns one sample; otherwise each turn is a sample of its own prompt + generated ids."""
    import httpx

    with tool_server(target, compact) as url:
        msgs = [{"role": "user", "content": "Add 2 and 3 with the tool."}]
        body = {"model": "tiny", "tools": TOOLS, "max_tokens": 100, "return_token_ids": True,
                "chat_template_kwargs": {"enable_thinking": True}}
        turns = []
        for _ in range(2):
            data = httpx.post(f"{url}/v1/chat/completions", json={**body, "messages": msgs}, timeout=60).json()
            ch = data["choices"][0]
            m = {k: v for k, v in ch["message"].items() if v is not None}
            m["reasoning_content"] = m.pop("reasoning")
            turns.append({**m, "prompt_token_ids": data["prompt_token_ids"], "token_ids": ch["token_ids"]})
            msgs = msgs + [m] + ([{"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "5"}]
                                if m.get("tool_calls") else [])
    first, second = turns
    extends = second["prompt_token_ids"][: len(first["prompt_token_ids"]) + len(first["token_ids"])] == \
        first["prompt_token_ids"] + first["token_ids"]
    assert extends == (not compact)
    row = {"id": "loop", "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": True},
           "messages": [msgs[0], turns[0], msgs[2], turns[1]]}
    samples = tokenize_conversation(tok, row["messages"], "loop", tools=TOOLS,
                                    chat_template_kwargs=row["chat_template_kwargs"])
    p2, g2 = second["prompt_token_ids"], second["token_ids"]
    if compact:
        assert [s.sample_id for s in samples] == ["loop#t0", "loop#t1"]
        assert samples[1].input_ids.tolist() == p2 + g2
        assert samples[1].loss_mask.tolist() == [0] * len(p2) + [1] * len(g2)
    else:
        (s,) = samples
        n1 = len(first["prompt_token_ids"])
        g1 = first["token_ids"]
        assert s.input_ids.tolist() == p2 + g2
        assert s.loss_mask.tolist() == [0] * n1 + [1] * len(g1) + [0] * (len(p2) - n1 - len(g1)) + [1] * len(g2)


def test_engine_answer_dumps_are_read_as_token_rows(tok, tmp_path):
    """A saved vLLM answer (top-level prompt_token_ids, choice token_ids), an SGLang one (both in the choice,
    output_ids) and a flat row: each is one sample, prompt then generated ids, the mask on the generated."""
    p, g = [513, 84, 393, 198], [515, 34, 516, 514]
    rows = [{"id": "vllm", "prompt_token_ids": p, "choices": [{"index": 0, "token_ids": g, "message": {}}]},
            {"id": "sglang", "choices": [{"index": 0, "prompt_token_ids": p, "output_ids": g}]},
            {"id": "flat", "prompt_token_ids": p, "token_ids": g}]
    path = tmp_path / "dump.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = list(load_samples(path, tok))
    assert [s.sample_id for s in samples] == ["vllm", "sglang", "flat"]
    for s in samples:
        assert s.input_ids.tolist() == p + g and s.loss_mask.tolist() == [0] * 4 + [1] * 4
    # an answer without its ids is a row that cannot be tokenized as the engine did: skipped and counted, named
    path.write_text(json.dumps({"id": "x", "prompt_token_ids": p, "choices": [{"message": {}}]}) + "\n"
                    + json.dumps(rows[2]) + "\n")
    stats = TokenizeStats()
    assert [s.sample_id for s in load_samples(path, tok, stats=stats)] == ["flat"]
    assert stats.skipped == {"invalid_row": ["dump.jsonl:1"]}
    assert re.search(r"dump\.jsonl:1.*an engine answer needs", stats.first_skipped["invalid_row"])


@pytest.fixture(scope="module")
def special_markers(target, tmp_path_factory):
    """The tiny target with its reasoning/tool markers flipped to ``special: true`` in tokenizer.json."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("special") / "target"
    shutil.copytree(target, d)
    spec = json.loads((d / "tokenizer.json").read_text())
    flipped = [t["content"] for t in spec["added_tokens"] if not t["special"]]
    for t in spec["added_tokens"]:
        t["special"] = True
    (d / "tokenizer.json").write_text(json.dumps(spec))
    tok = AutoTokenizer.from_pretrained(str(d))
    assert "</think>" in flipped
    # what made the old rule split it: special text is split into pieces when asked to
    assert len(tok("</think>", add_special_tokens=False, split_special_tokens=True)["input_ids"]) > 1
    return tok


def test_template_markers_stay_one_id_when_special(special_markers):
    """Without recorded ids, with `</think>`/`<tool_call>` marked special: the markers the template inserts are
    one id each (as the model emits them), while the same text inside the message's own content is ordinary
    text (split into pieces, as the model must have written it)."""
    tok = special_markers
    ids_of = tok.convert_tokens_to_ids
    messages = [{"role": "user", "content": "Say the closing tag."},
                {"role": "assistant", "content": "It is <tool_call> here.", "reasoning_content": "Tags: </think> x.",
                 "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]}]
    (s,) = tokenize_conversation(tok, messages, "m", tools=TOOLS)
    gen = s.input_ids[s.loss_mask.astype(bool)].tolist()
    assert gen.count(ids_of("<think>")) == 1 and gen.count(ids_of("</think>")) == 1
    assert gen.count(ids_of("<tool_call>")) == 1 and gen.count(ids_of("</tool_call>")) == 1
    assert gen[-1] == ids_of("<|im_end|>")
    as_text = tok(" <tool_call> here.", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert ids_of("<tool_call>") not in as_text and len(as_text) > 2
    text = tok.decode(gen, skip_special_tokens=False)
    assert text.count("</think>") == 2 and text.count("<tool_call>") == 2  # one marker, one literal each
    k = next(i for i in range(len(gen)) if gen[i : i + len(as_text)] == as_text)
    assert k > gen.index(ids_of("</think>"))  # the answer's literal, after the template's </think>
