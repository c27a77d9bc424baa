"""Turn conversations (or pre-tokenized rows) into training sequences with exact loss masks.

Loss masks come from the tokenizer's own chat template, which needs no ``{% generation %}`` markers
(Qwen's templates have none): for every assistant turn we render the conversation up to the turn with
the generation prompt and up to the end of the turn, check that both renders are a prefix of the full
render (as text and as token ids), and mask the tokens in between, up to and including the turn's
end-of-turn token (``<|im_end|>``). The ``<|im_start|>assistant\\n`` header, the newline after the
end-of-turn token (dropped at the end of a sample) and every system/user/tool token stay unmasked.

Expansion rule. Qwen-style templates drop the reasoning of assistant turns before the last user
message (Qwen3's also drops an empty think block of a non-final turn), so in a multi-turn conversation
earlier turns do not appear as the target generated them. A turn is therefore masked only in a sample
that renders it exactly as it renders when it is the last message; a turn that renders differently in
the full conversation gets a sample of its own that ends at it, with everything before it as context.
Every assistant turn is masked exactly once, in the context it was generated in, with its reasoning,
so every thinking block in the data reaches the store. With Qwen-style templates this means one sample
per user message answered (tool-call turns of the same exchange share it). A template that keeps all
reasoning yields a single sample. Ids: ``{id}#t{k}``, k the 0-based index among the conversation's
assistant turns of the sample's last turn; a conversation that gives one sample keeps its ``id``.
``expand=False`` keeps only the sample ending at the last turn.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from extract.readers import ChatRecord, Record, TokenRecord, derive_id, read_records  # noqa: F401 (re-export)
from extract.response import THINK_END, THINK_START, ResponseMarkers, response_stats

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool"}
#: Assistant-message fields that hold the reasoning (vLLM once said `reasoning_content`, now `reasoning`).
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
# Control-token-like strings a template may emit; each must be one token of the tokenizer.
_MARKUP = re.compile(r"<\|[^<>|\s]+\|>|</?(?:think|tool_call|tool_response)>")


class TemplateError(ValueError):
    """The chat template cannot give exact masks (not prefix-stable, no end-of-turn token, ...)."""


@dataclass
class TokenizedSample:
    """One training sequence. ``loss_mask`` is 1 on tokens the drafter learns to predict (assistant output)."""

    sample_id: str
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8
    source: str = ""
    thinking_tokens: int = 0
    flags: list[str] = field(default_factory=list)
    #: Answer tokens of the final assistant turn (stub detection); None when not analysed (no tokenizer).
    answer_tokens: int | None = None

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.size)

    def add_flag(self, flag: str) -> None:
        if flag not in self.flags:
            self.flags.append(flag)


@dataclass
class TokenizeStats:
    """Counts a caller reports after a pass (rows in, samples out, what was dropped and why)."""

    rows: int = 0
    samples: int = 0
    expanded: int = 0  # extra samples created by splitting multi-exchange conversations
    skipped_over_length: int = 0
    truncated: int = 0  # cut to max_length (truncate=True)
    skipped_no_loss: int = 0  # nothing left to learn after truncation


# ---------------------------------------------------------------------------------------------- messages


def split_inline_think(text: str) -> tuple[str | None, str, bool]:
    """Split ``<think>r</think>a`` content into (reasoning, answer, closed).

    Returns reasoning None when the content has no think markup. An opened but never closed block
    (generation cut inside the reasoning) gives (reasoning, "", False).
    """
    if THINK_END in text:
        head, _, tail = text.partition(THINK_END)
        reasoning = head.split(THINK_START, 1)[1] if THINK_START in head else head
        return reasoning.strip(), tail.strip(), True
    stripped = text.lstrip()
    if stripped.startswith(THINK_START):
        return stripped[len(THINK_START) :].strip(), "", False
    return None, text, True


def _text(content, where: str, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type", "text") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise ValueError(f"{where}: message {i} has a non-text content part ({part!r:.60})")
        return "".join(parts)
    raise ValueError(f"{where}: message {i} content must be a string, got {type(content).__name__}")


def parse_message_list(raw, where: str) -> list:
    """The raw message list of a row (a JSON string is decoded: Parquet/CSV exports often store it so)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: messages is a string that is not a JSON list of messages") from None
    if not isinstance(raw, list):
        raise ValueError(f"{where}: messages must be a list of objects, got {type(raw).__name__}")
    if not raw:
        raise ValueError(f"{where}: empty conversation")
    return raw


def role_and_content(m, where: str, i: int) -> tuple[str, str]:
    """Role (OpenAI or ShareGPT naming) and text content of message ``i``, validated."""
    if not isinstance(m, dict):
        raise ValueError(f"{where}: message {i} is not an object")
    if "role" in m:
        role = m["role"]
    elif "from" in m:
        role = _SHAREGPT_ROLES.get(m["from"], m["from"])
    else:
        raise ValueError(f"{where}: message {i} has no role")
    if role not in ROLES:
        raise ValueError(f"{where}: message {i} has unknown role {role!r} (expected one of {', '.join(ROLES)})")
    return role, _text(m.get("content", m.get("value")), where, i)


def normalize_messages(raw, where: str) -> tuple[list[dict], set[int]]:
    """Validate and normalise messages to ``{role, content, reasoning_content?, tool_calls?, name?}``.

    Inline ``<think>`` blocks in assistant content become ``reasoning_content``. Returns the messages
    and the indices of assistant turns known to be cut off (unclosed think, ``finish_reason: length``).
    """
    raw = parse_message_list(raw, where)
    out: list[dict] = []
    cut: set[int] = set()
    for i, m in enumerate(raw):
        role, content = role_and_content(m, where, i)
        msg: dict = {"role": role, "content": content}
        if role == "assistant":
            reasoning = next((m[k] for k in REASONING_KEYS if isinstance(m.get(k), str)), None)
            inline, answer, closed = split_inline_think(content)
            if inline is not None:
                if reasoning and reasoning.strip():
                    logger.debug("%s: message %d has reasoning_content and inline <think>; keeping the field", where, i)
                else:
                    reasoning = inline
                msg["content"] = answer
                if not closed:
                    cut.add(i)
            msg["reasoning_content"] = (reasoning or "").strip()
            if m.get("tool_calls"):
                msg["tool_calls"] = m["tool_calls"]
            if m.get("finish_reason") == "length":
                cut.add(i)
        if m.get("name") is not None:
            msg["name"] = m["name"]
        out.append(msg)
    assistants = [i for i, m in enumerate(out) if m["role"] == "assistant"]
    if not assistants:
        raise ValueError(f"{where}: conversation has no assistant turn")
    if assistants[0] == 0:
        raise ValueError(f"{where}: conversation starts with an assistant turn (no prompt to condition on)")
    return out, cut


# ---------------------------------------------------------------------------------------------- tokenizer


class ChatTokenizer:
    """A tokenizer plus what exact masking needs: its template, end-of-turn id and response markers."""

    def __init__(self, tokenizer, end_of_turn: str | None = None, markers: ResponseMarkers | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {_name(tokenizer)} has no chat template")
        self.tokenizer = tokenizer
        self.markers = markers or ResponseMarkers.from_tokenizer(tokenizer, end_of_turn)
        self._check_control_tokens()

    def _check_control_tokens(self) -> None:
        """Fail early when the template emits markers the tokenizer would split into pieces."""
        probe = [
            {"role": "system", "content": "probe system"},
            {"role": "user", "content": "probe question"},
            {"role": "assistant", "content": "probe answer", "reasoning_content": "probe reasoning"},
        ]
        text = self.render(probe)
        missing = sorted({tok for tok in _MARKUP.findall(text) if self._single(tok) is None})
        if missing:
            raise ValueError(
                f"tokenizer {_name(self.tokenizer)} lacks special token(s) {', '.join(missing)} used by its chat "
                "template (they would be split into several tokens)"
            )

    def _single(self, text: str) -> int | None:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[0] if len(ids) == 1 else None

    def render(self, messages: list[dict], tools=None, add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def _turn_renders(self, messages: list[dict], turns: list[int], tools) -> dict[int, tuple[str, str]]:
        """Per assistant turn t: (render of messages[:t] + generation prompt, render of messages[:t+1]).

        Neither depends on where a sample ends, so each is rendered once per conversation.
        """
        return {
            t: (self.render(messages[:t], tools, add_generation_prompt=True), self.render(messages[: t + 1], tools))
            for t in turns
        }

    def plan(
        self, messages: list[dict], tools, label: str
    ) -> tuple[list[tuple[int, list[int]]], dict[int, tuple[str, str]]]:
        """Which samples to emit: [(last message index, assistant turns masked in that sample)] sorted by
        end, plus the per-turn renders (see ``_turn_renders``) that ``mask`` reuses.

        A turn is masked in a sample only if the sample renders it exactly as it renders when it is the
        last message, i.e. as the target generated it: both of its renders are prefixes of the sample's.
        Turns that render differently there get a sample ending at them. Every turn is masked once.
        """
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        renders = self._turn_renders(messages, turns, tools)
        plan, pending = [], turns
        while pending:
            end = pending[-1]
            full_text = renders[end][1]
            stable = [t for t in pending if full_text.startswith(renders[t][0]) and full_text.startswith(renders[t][1])]
            if end not in stable:
                raise TemplateError(
                    f"{label}: chat template is not prefix-stable: the render up to the generation prompt of "
                    f"assistant message {end} is not a prefix of the render that includes it, so masks cannot be "
                    "derived by diffing"
                )
            plan.append((end, stable))
            pending = [t for t in pending if t not in stable]
        return sorted(plan), renders

    def mask(
        self, renders: dict[int, tuple[str, str]], end: int, turns: list[int], label: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of the sample ending at assistant message ``end`` and its mask over ``turns``."""
        texts = [renders[end][1]]
        for t in turns:
            texts += list(renders[t])
        encoded = self.encode(texts)
        full = encoded[0]
        ids = np.asarray(full, dtype=np.int32)
        mask = np.zeros(ids.size, dtype=np.uint8)
        eot = self.markers.end_of_turn
        stop = 0
        for n, t in enumerate(turns):
            head, upto = encoded[1 + 2 * n], encoded[2 + 2 * n]
            if full[: len(head)] != head or full[: len(upto)] != upto:
                raise TemplateError(
                    f"{label}: tokens of a rendered prefix differ from the sample's at assistant message {t} "
                    "(a token merges across the turn boundary)"
                )
            start, end_t = len(head), len(upto)
            closes = np.flatnonzero(ids[start:end_t] == eot)
            if not closes.size:
                raise TemplateError(
                    f"{label}: assistant message {t} renders without the end-of-turn token "
                    f"{self.tokenizer.convert_ids_to_tokens(eot)!r}"
                )
            stop = start + int(closes[-1]) + 1
            mask[start:stop] = 1
        # The sample ends with the last turn's end-of-turn token: what the template adds after it (a newline)
        # belongs to no turn of this sample.
        return ids[:stop].copy(), mask[:stop].copy()

    def tokenize(self, record: ChatRecord, expand: bool = True) -> list[TokenizedSample]:
        """Samples of one conversation (see the module docstring); ``expand=False`` keeps only the last one."""
        label = f"{record.where} (id={record.sample_id})" if record.where else f"id={record.sample_id}"
        messages, cut = normalize_messages(record.messages, label)
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        messages = messages[: last + 1]  # trailing user/tool messages have no response to learn from
        plan, renders = self.plan(messages, record.tools, label)
        ordinal = {j: k for k, j in enumerate(i for i, m in enumerate(messages) if m["role"] == "assistant")}
        samples = []
        for end, turns in plan if expand else plan[-1:]:
            ids, mask = self.mask(renders, end, turns, label)
            sample_id = record.sample_id if len(plan) == 1 else f"{record.sample_id}#t{ordinal[end]}"
            sample = TokenizedSample(sample_id, ids, mask, record.source)
            annotate(sample, self.markers)
            if cut.intersection(turns):
                sample.add_flag("truncated")
            samples.append(sample)
        return samples


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def annotate(sample: TokenizedSample, markers: ResponseMarkers | None) -> TokenizedSample:
    """Fill thinking/answer counts and the ``empty_thinking``/``truncated``/``no_loss`` flags from the tokens."""
    if sample.loss_tokens == 0:
        sample.add_flag("no_loss")
    if markers is None:
        return sample
    stats = response_stats(sample.input_ids, sample.loss_mask, markers)
    sample.thinking_tokens = stats.thinking_tokens
    sample.answer_tokens = stats.answer_tokens
    if stats.empty_thinking:
        sample.add_flag("empty_thinking")
    if stats.truncated and stats.turns:
        sample.add_flag("truncated")
    return sample


def sample_from_tokens(record: TokenRecord, markers: ResponseMarkers | None = None) -> TokenizedSample:
    """A pre-tokenized row as a sample (no templating); counts need the tokenizer's markers."""
    sample = TokenizedSample(
        record.sample_id,
        np.ascontiguousarray(record.input_ids, dtype=np.int32),
        np.ascontiguousarray(record.loss_mask, dtype=np.uint8),
        record.source,
    )
    return annotate(sample, markers)


# ---------------------------------------------------------------------------------------------- pipeline


def apply_max_length(
    sample: TokenizedSample, max_length: int | None, truncate: bool, markers: ResponseMarkers | None
) -> tuple[TokenizedSample, str | None]:
    """Flag (``over_length``) or cut (``truncated``) a sample longer than ``max_length``.

    Returns the sample and what happened: None, ``"over_length"`` or ``"truncated"``.
    """
    if not max_length or sample.num_tokens <= max_length:
        return sample, None
    if not truncate:
        sample.add_flag("over_length")
        return sample, "over_length"
    cut = TokenizedSample(
        sample.sample_id,
        sample.input_ids[:max_length].copy(),
        sample.loss_mask[:max_length].copy(),
        sample.source,
        flags=[f for f in sample.flags if f not in ("empty_thinking", "no_loss")],
    )
    annotate(cut, markers)
    cut.add_flag("truncated")
    return cut, "truncated"


def load_samples(
    inputs: str | Path | Iterable[str | Path],
    tokenizer=None,
    *,
    max_length: int | None = None,
    truncate: bool = False,
    keep_over_length: bool = False,
    expand: bool = True,
    stats: TokenizeStats | None = None,
) -> Iterator[TokenizedSample]:
    """Stream samples from input files/directories.

    Conversations need ``tokenizer`` (its chat template); pre-tokenized rows only use it for the
    thinking/answer counts. Samples longer than ``max_length`` are skipped and counted in ``stats``
    (``keep_over_length=True`` yields them flagged ``over_length``, as the quality gate wants), or cut
    to ``max_length`` with ``truncate=True``.
    """
    stats = stats if stats is not None else TokenizeStats()
    paths = [inputs] if isinstance(inputs, (str, Path)) else list(inputs)
    chat: ChatTokenizer | None = None
    markers = ResponseMarkers.from_tokenizer(tokenizer) if tokenizer is not None else None
    for path in paths:
        for record in read_records(path):
            stats.rows += 1
            if isinstance(record, TokenRecord):
                samples = [sample_from_tokens(record, markers)]
            else:
                if tokenizer is None:
                    raise ValueError(f"{record.where}: conversations need a tokenizer (the target model's)")
                if chat is None:
                    try:
                        chat = ChatTokenizer(tokenizer, markers=markers)
                    except ValueError as e:
                        raise ValueError(f"{record.where} (id={record.sample_id}): {e}") from e
                samples = chat.tokenize(record, expand=expand)
                stats.expanded += len(samples) - 1
            for sample in samples:
                sample, action = apply_max_length(sample, max_length, truncate, markers)
                if action == "over_length":
                    stats.skipped_over_length += 1
                    if not keep_over_length:
                        continue
                elif action == "truncated":
                    stats.truncated += 1
                    if sample.loss_tokens == 0:
                        stats.skipped_no_loss += 1
                        continue
                stats.samples += 1
                yield sample


def tokenize_conversation(
    tokenizer, messages: list[dict], sample_id: str | None = None, source: str = "", tools=None, expand: bool = True
) -> list[TokenizedSample]:
    """Convenience wrapper for one conversation (builds a ``ChatTokenizer`` each call; use one for bulk work)."""
    sid = sample_id or derive_id({"messages": messages, "tools": tools})
    return ChatTokenizer(tokenizer).tokenize(ChatRecord(sid, source, messages, tools), expand=expand)
