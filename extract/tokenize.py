"""Turn conversations (or pre-tokenized rows) into training sequences with exact loss masks.

Engine-faithful ids. A serving engine (vLLM, SGLang, ``transformers serve``) answers an assistant turn
by rendering the chat template over the history with ``add_generation_prompt=True`` and the request's
template arguments, tokenizing that prompt, and generating. So for every trained assistant turn a
sample holds ``encode(prompt)`` followed by ``encode(generated)``, where *generated* is the part of
the turn's render after the prompt: reasoning, ``</think>``, answer, tool calls, up to and including
the end-of-turn token (``<|im_end|>``). The two are never tokenized as one string: with the
generation prompt ending in ``<think>\\n`` and an empty reasoning the model generated ``\\n``,
``</think>`` where one string would give ``\\n\\n``. The loss mask is 1 exactly on the generated
tokens. Special-token text *inside* a generated turn (a literal ``<|im_end|>`` in an answer) is
encoded as ordinary text, as the model must have produced it: the engine stops at the real token.
A turn the engine cut (``finish_reason: length``, an unclosed think block) gets no end-of-turn token
in its mask: the model never generated one.

Multi-turn. Qwen-style templates drop the reasoning of assistant turns before the last user message,
so earlier turns do not appear in later prompts as the target generated them. Turns are grouped into
one sample while the later prompt renders the earlier turns exactly as they were generated (as text,
and as tokens: the sample's ids before each turn equal ``encode`` of that turn's own prompt); a turn
that breaks this starts a sample of its own with everything before it as context. Every assistant
turn is masked exactly once, in the context it was generated in. With Qwen3/3.5 templates this means
one sample per user message answered (tool-call turns of one exchange share it); with a template that
keeps all reasoning (Qwen3.6 with ``preserve_thinking``) one sample per conversation. Ids:
``{id}#t{k}``, k the 0-based index among the conversation's assistant turns of the sample's last
turn; a conversation that gives one sample keeps its ``id``. ``expand=False`` keeps only the last.

Engine ids. A turn that records the serving engine's own ids (``prompt_token_ids`` + ``token_ids``, as
``hsstore regenerate`` writes them) is taken as exactly those, since re-tokenizing text loses the
non-canonical splits a model samples and whatever the server's parsers reformatted
(:meth:`ChatTokenizer.engine_samples`; docs/FORMAT.md, "Engine ids").

Rows as engines see them. Tool-call ``arguments`` given as a JSON string (the OpenAI wire format) are
parsed to objects before rendering, as vLLM and SGLang do (empty -> ``{}``). Reasoning comes from the
row's ``reasoning_content`` (or ``reasoning``/``thinking``) field when it has one, and the content is
then kept whole (a literal ``</think>`` in an answer stays in the answer); only a row without such a
field has an inline ``<think>...</think>`` split out of its content. Template arguments
(``enable_thinking``, ``preserve_thinking``, ...) come from ``chat_template_kwargs``: a default for all
rows, overridden per row by the row's own ``chat_template_kwargs`` object.

Bad rows never abort a run: a row that cannot be tokenized faithfully raises :class:`RowError` with a
reason (``SKIP_REASONS``); :func:`load_samples` skips it, logs it and counts it by reason and id in
:class:`TokenizeStats`, and the quality gate fails only when the skipped share passes its threshold.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .readers import (  # noqa: F401 (re-export)
    ALL_ROWS, ChatRecord, Malformed, Record, RowShard, TokenRecord, derive_id, read_inputs, read_records,
)
from .response import THINK_END, THINK_START, ResponseMarkers, response_stats

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool"}
#: Assistant-message fields that hold the reasoning (older vLLM releases: `reasoning_content`; newer: `reasoning`).
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
# Control-token-like strings a template may emit; each must be one token of the tokenizer.
_MARKUP = re.compile(r"<\|[^<>|\s]+\|>|</?(?:think|tool_call|tool_response)>")


#: Why a row was skipped (see :class:`RowError`), in the order reports list them.
SKIP_REASONS = ("malformed_json", "invalid_row", "tool_arguments", "template_error", "prompt_mismatch",
                "no_end_of_turn", "engine_prompt_mismatch")
#: Where an assistant turn records the serving engine's own ids (``hsstore regenerate`` writes the first
#: spelling; ``output_ids`` is SGLang's native name for the generated ids). See docs/FORMAT.md.
PROMPT_IDS_KEY = "prompt_token_ids"
GENERATED_IDS_KEYS = ("token_ids", "output_ids")


class RowError(ValueError):
    """One row cannot be tokenized faithfully; ``reason`` is one of ``SKIP_REASONS``.

    Raised by :meth:`ChatTokenizer.tokenize`; :func:`load_samples` skips the row and counts it.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class TemplateError(RowError):
    """The chat template cannot give this row's turns as the engine generated them."""


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
    #: assistant turns taken from the engine's recorded ids (prompt_token_ids + token_ids)
    engine_turns: int = 0
    #: of those, turns whose ids differ from what re-tokenizing the row's text gives (what the text rule would
    #: have stored: non-canonical splits the model sampled, text the server's parsers reformatted)
    non_canonical: int = 0
    #: turns whose recorded prompt ids differ from this tokenizer's render, kept because the engine is trusted
    #: (``trust_engine_ids``; without it such rows are skipped as ``engine_prompt_mismatch``)
    engine_prompt_mismatch_trusted: int = 0
    #: rows that could not be tokenized faithfully: reason -> sample ids (nothing of them is used)
    skipped: dict[str, list[str]] = field(default_factory=dict)
    #: reason -> the error message of the first row skipped for it (names file, line and id)
    first_skipped: dict[str, str] = field(default_factory=dict)

    @property
    def skipped_rows(self) -> int:
        return sum(len(ids) for ids in self.skipped.values())

    def skip(self, reason: str, sample_id: str, message: str = "") -> None:
        self.skipped.setdefault(reason, []).append(sample_id)
        self.first_skipped.setdefault(reason, message)

    def to_dict(self, max_listed: int = 20) -> dict:
        """JSON-ready counts; skipped ids are listed up to ``max_listed`` per reason, with the first message."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("skipped", "first_skipped")}  # not asdict: it would deep-copy every skipped id
        out["skipped_rows"] = self.skipped_rows
        out["skipped"] = {r: {"count": len(ids), "ids": ids[:max_listed], "first": self.first_skipped.get(r, "")}
                          for r, ids in sorted(self.skipped.items())}
        return out


# ---------------------------------------------------------------------------------------------- messages


def split_inline_think(text: str) -> tuple[str | None, str, bool]:
    """Split ``<think>r</think>a`` content into (reasoning, answer, closed).

    The reasoning ends at the first ``</think>`` (what the model emitted to close it; anything later is
    answer text). Returns reasoning None when the content has no think markup. An opened but never
    closed block (generation cut inside the reasoning) gives (reasoning, "", False).
    """
    if THINK_END in text:
        head, _, tail = text.partition(THINK_END)
        reasoning = head.split(THINK_START, 1)[1] if THINK_START in head else head
        return reasoning.strip(), tail.strip(), True
    stripped = text.lstrip()
    if stripped.startswith(THINK_START):
        return stripped[len(THINK_START) :].strip(), "", False
    return None, text, True


def reasoning_field(message: dict) -> str | None:
    """The message's reasoning from its own field (``reasoning_content``/``reasoning``/``thinking``), or None
    when it has none: only then may reasoning be split out of the content."""
    return next((message[k] for k in REASONING_KEYS if isinstance(message.get(k), str)), None)


def split_reasoning(message: dict) -> tuple[str, str, bool]:
    """(reasoning, content, closed) of an assistant message by the rule in the module docstring."""
    content = message.get("content") or ""
    reasoning = reasoning_field(message)
    if reasoning is not None:
        return reasoning, content, True
    inline, answer, closed = split_inline_think(content)
    return (inline or "", answer, closed) if inline is not None else ("", content, True)


def parse_tool_calls(calls, where: str, i: int) -> list:
    """Tool calls with string ``arguments`` parsed to objects, as vLLM and SGLang do before rendering
    (templates such as Qwen3.5's iterate ``arguments|items``); empty or missing arguments -> ``{}``."""
    if not isinstance(calls, list):
        raise RowError("invalid_row", f"{where}: message {i} tool_calls must be a list")
    out = []
    for k, call in enumerate(calls):
        if not isinstance(call, dict):
            raise RowError("invalid_row", f"{where}: message {i} tool call {k} is not an object")
        call = dict(call)
        fn = call.get("function") if isinstance(call.get("function"), dict) else None
        holder = dict(fn) if fn is not None else call
        args = holder.get("arguments")
        if not args:
            holder["arguments"] = {}
        elif isinstance(args, str):
            try:
                holder["arguments"] = json.loads(args)
            except json.JSONDecodeError as e:
                name = holder.get("name", "?")
                raise RowError(
                    "tool_arguments",
                    f"{where}: message {i} tool call {k} ({name}): arguments is not valid JSON "
                    f"({e.msg} at column {e.colno}): {args[:80]!r}",
                ) from None
        if fn is not None:
            call["function"] = holder
        else:
            call = holder
        out.append(call)
    return out


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
                raise RowError("invalid_row", f"{where}: message {i} has a non-text content part ({part!r:.60})")
        return "".join(parts)
    raise RowError("invalid_row", f"{where}: message {i} content must be a string, got {type(content).__name__}")


def parse_message_list(raw, where: str) -> list:
    """The raw message list of a row (a JSON string is decoded: Parquet/CSV exports often store it so)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise RowError("invalid_row", f"{where}: messages is a string that is not a JSON list of messages") from None
    if not isinstance(raw, list):
        raise RowError("invalid_row", f"{where}: messages must be a list of objects, got {type(raw).__name__}")
    if not raw:
        raise RowError("invalid_row", f"{where}: empty conversation")
    return raw


def role_and_content(m, where: str, i: int) -> tuple[str, str]:
    """Role (OpenAI or ShareGPT naming) and text content of message ``i``, validated."""
    if not isinstance(m, dict):
        raise RowError("invalid_row", f"{where}: message {i} is not an object")
    if "role" in m:
        role = m["role"]
    elif "from" in m:
        role = _SHAREGPT_ROLES.get(m["from"], m["from"])
    else:
        raise RowError("invalid_row", f"{where}: message {i} has no role")
    if role not in ROLES:
        raise RowError(
            "invalid_row", f"{where}: message {i} has unknown role {role!r} (expected one of {', '.join(ROLES)})"
        )
    return role, _text(m.get("content", m.get("value")), where, i)


def normalize_messages(raw, where: str) -> tuple[list[dict], set[int]]:
    """Validate and normalise messages to ``{role, content, reasoning_content?, tool_calls?, name?}``.

    Assistant turns always get a string ``reasoning_content`` (so templates never split the content
    themselves); tool-call arguments become objects. Returns the messages and the indices of assistant
    turns known to be cut off (unclosed think, ``finish_reason: length``).
    """
    raw = parse_message_list(raw, where)
    out: list[dict] = []
    cut: set[int] = set()
    for i, m in enumerate(raw):
        role, content = role_and_content(m, where, i)
        msg: dict = {"role": role, "content": content}
        if role == "assistant":
            reasoning, msg["content"], closed = split_reasoning({**m, "content": content})
            msg["reasoning_content"] = reasoning
            if not closed or m.get("finish_reason") == "length":
                cut.add(i)
            if m.get("tool_calls"):
                msg["tool_calls"] = parse_tool_calls(m["tool_calls"], where, i)
        if m.get("name") is not None:
            msg["name"] = m["name"]
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    assistants = [i for i, m in enumerate(out) if m["role"] == "assistant"]
    if not assistants:
        raise RowError("invalid_row", f"{where}: conversation has no assistant turn")
    if assistants[0] == 0:
        raise RowError("invalid_row", f"{where}: conversation starts with an assistant turn (no prompt to condition on)")
    return out, cut


def template_kwargs_of(value, where: str) -> dict:
    """A row's (or the command line's) ``chat_template_kwargs``: an object, or a JSON string of one."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError("invalid_row", f"{where}: chat_template_kwargs is not valid JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise RowError("invalid_row", f"{where}: chat_template_kwargs must be an object, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------------------------------------- tokenizer


@dataclass(frozen=True)
class TurnRender:
    """One assistant turn as the engine met it: the prompt it answered and where its output ends.

    ``text`` is the render that includes the turn; ``text[:len(prompt)]`` is the prompt and
    ``text[len(prompt):end]`` what the model generated, up to and including the end-of-turn token.
    """

    prompt: str
    text: str
    end: int
    #: the message's own text (reasoning, answer) as rendered in ``generated``: special-token text inside
    #: these is ordinary text; markers outside them were inserted by the template
    own_text: tuple[str, ...] = ()

    @property
    def generated(self) -> str:
        return self.text[len(self.prompt) : self.end]


class ChatTokenizer:
    """A tokenizer plus what exact masking needs: its template, end-of-turn id and response markers.

    ``template_kwargs`` are passed to every render (``enable_thinking``, ``preserve_thinking``, ...);
    a row's own ``chat_template_kwargs`` override them.
    """

    def __init__(self, tokenizer, end_of_turn: str | None = None, markers: ResponseMarkers | None = None,
                 template_kwargs: dict | None = None, trust_engine_ids: bool = False):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {_name(tokenizer)} has no chat template")
        self.tokenizer = tokenizer
        self.markers = markers or ResponseMarkers.from_tokenizer(tokenizer, end_of_turn)
        self.template_kwargs = dict(template_kwargs or {})
        self.eot_text = tokenizer.convert_ids_to_tokens(self.markers.end_of_turn)
        self.trust_engine_ids = trust_engine_ids
        self._marker_ids: dict[str, int | None] = {}
        self.vocab_size = len(tokenizer)
        self._check_control_tokens()

    def _check_control_tokens(self) -> None:
        """Fail early when the template emits markers the tokenizer would split into pieces."""
        probe = [
            {"role": "system", "content": "probe system"},
            {"role": "user", "content": "probe question"},
            {"role": "assistant", "content": "probe answer", "reasoning_content": "probe reasoning"},
        ]
        try:
            text = self.render(probe, kwargs=self.template_kwargs)
        except RowError as e:
            raise ValueError(f"tokenizer {_name(self.tokenizer)}: its chat template fails on a plain conversation: {e}")
        missing = sorted({tok for tok in _MARKUP.findall(text) if self._single(tok) is None})
        if missing:
            raise ValueError(
                f"tokenizer {_name(self.tokenizer)} lacks special token(s) {', '.join(missing)} used by its chat "
                "template (they would be split into several tokens)"
            )

    def _single(self, text: str) -> int | None:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[0] if len(ids) == 1 else None

    def render(self, messages: list[dict], tools=None, add_generation_prompt: bool = False,
               kwargs: dict | None = None, label: str = "") -> str:
        """The template's text; any failure inside the template is this row's ``template_error``."""
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **(kwargs or {})
            )
        except Exception as e:  # jinja raises TemplateError, TypeError (`|items` on a string), ...
            where = f"{label}: " if label else ""
            raise RowError("template_error", f"{where}chat template failed: {type(e).__name__}: {e}") from None

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of text as the engine tokenizes a rendered prompt (special-token text -> special ids)."""
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    def encode_generated(self, texts: list[str], own_text: list[tuple[str, ...]] | None = None) -> list[list[int]]:
        """Token ids of generated turns: the closing end-of-turn token, template-inserted markers (``</think>``,
        ``<tool_call>``, ...) as the one id the model emits for each, even where the tokenizer marks them
        special, and special-token text from the message's own text (``own_text``) as ordinary text: the model
        cannot have emitted the real token there (the engine stops at the end-of-turn one; a parser would have
        taken a marker out of the text)."""
        if not texts:
            return []
        own_text = own_text or [()] * len(texts)
        eot, n = self.markers.end_of_turn, len(self.eot_text)
        bodies = [t[:-n] if t.endswith(self.eot_text) else t for t in texts]
        # split each body at the markers the template put there; the pieces between are encoded with special
        # text split (added tokens split the text before the BPE either way, so no merge crosses a marker)
        pieces: list[str] = []
        layout: list[list[int | str]] = []  # per body: a marker's id, or a piece's index (as str)
        for body, own in zip(bodies, own_text, strict=True):
            spans = _own_spans(body, own)
            parts: list[int | str] = []
            start = 0
            for m in _MARKUP.finditer(body):
                marker = self._marker_id(m.group(0))
                if marker is None or any(a <= m.start() < b for a, b in spans):
                    continue
                if m.start() > start:
                    parts.append(str(len(pieces)))
                    pieces.append(body[start : m.start()])
                parts.append(marker)
                start = m.end()
            if start < len(body):
                parts.append(str(len(pieces)))
                pieces.append(body[start:])
            layout.append(parts)
        encoded = self.tokenizer(pieces, add_special_tokens=False, split_special_tokens=True)["input_ids"] if pieces else []
        out = []
        for parts, t in zip(layout, texts, strict=True):
            ids: list[int] = []
            for part in parts:
                ids += encoded[int(part)] if isinstance(part, str) else [part]
            out.append(ids + [eot] if t.endswith(self.eot_text) else ids)
        return out

    def _marker_id(self, text: str) -> int | None:
        if text not in self._marker_ids:
            self._marker_ids[text] = self._single(text)
        return self._marker_ids[text]

    def _turn(self, messages: list[dict], t: int, tools, kwargs: dict, label: str) -> TurnRender:
        prompt = self.render(messages[:t], tools, add_generation_prompt=True, kwargs=kwargs, label=label)
        text = self.render(messages[: t + 1], tools, kwargs=kwargs, label=label)
        if not text.startswith(prompt):
            shown = json.dumps(kwargs, sort_keys=True) if kwargs else "none"
            raise TemplateError(
                "prompt_mismatch",
                f"{label}: assistant message {t} does not render as a continuation of its generation prompt "
                f"(template arguments: {shown}); e.g. data generated with thinking on/off rendered with the other "
                "setting: pass --chat-template-kwargs or the row's chat_template_kwargs",
            )
        close = text.rfind(self.eot_text, len(prompt))
        if close < 0:
            raise TemplateError(
                "no_end_of_turn",
                f"{label}: assistant message {t} renders without the end-of-turn token {self.eot_text!r}",
            )
        m = messages[t]
        own = tuple(x for x in (m.get("reasoning_content"), m.get("content")) if isinstance(x, str) and x.strip())
        return TurnRender(prompt, text, close + len(self.eot_text), own)

    def plan(self, messages: list[dict], tools, label: str, kwargs: dict | None = None
             ) -> tuple[list[list[int]], dict[int, TurnRender]]:
        """Groups of assistant turns that can share a sample, by text: a group ends at its last turn, and
        every turn in it renders inside that turn's render exactly as when it was generated. Sorted by end.
        """
        kwargs = self.template_kwargs if kwargs is None else kwargs
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        renders = {t: self._turn(messages, t, tools, kwargs, label) for t in turns}
        groups, pending = [], turns
        while pending:
            full = renders[pending[-1]].text
            stable = [t for t in pending if full.startswith(renders[t].text[: renders[t].end])]
            groups.append(stable)
            pending = [t for t in pending if t not in stable]
        return sorted(groups, key=lambda g: g[-1]), renders

    def build(self, group: list[int], renders: dict[int, TurnRender], cut: set[int]
              ) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
        """Samples of one text group: [(masked turns, ids, loss_mask)].

        Ids are ``encode(prompt of the first turn)``, then per turn ``encode(generated)`` and the encoded
        text up to the next turn's prompt. Before each later turn the ids so far must equal ``encode`` of
        that turn's own prompt (what the engine saw); where they do not (tokens merging across a turn
        boundary), that turn starts a new sample from its own prompt.
        """
        text = renders[group[-1]].text
        prompts = self.encode([renders[t].prompt for t in group])
        gens = self.encode_generated([renders[t].generated for t in group], [renders[t].own_text for t in group])
        # the text from the end of each turn to the next turn's generation prompt, all in one call
        gaps = [[]] + self.encode([text[renders[a].end : len(renders[b].prompt)] for a, b in zip(group, group[1:])])
        out = []
        ids: list[int] = []
        mask: list[int] = []
        turns: list[int] = []
        for k, t in enumerate(group):
            if turns:
                between = gaps[k]
                if ids + between != prompts[k]:
                    out.append((turns, ids, mask))
                    ids, mask, turns = [], [], []
            if not turns:
                between = prompts[k]
            gen = gens[k]
            n_mask = len(gen) - (1 if t in cut and gen and gen[-1] == self.markers.end_of_turn else 0)
            ids += between + gen
            mask += [0] * len(between) + [1] * n_mask + [0] * (len(gen) - n_mask)
            turns.append(t)
        out.append((turns, ids, mask))
        samples = []
        for turns, ids, mask in out:
            last = turns[-1]
            if last in cut and ids and ids[-1] == self.markers.end_of_turn and not mask[-1]:
                ids, mask = ids[:-1], mask[:-1]  # the engine cut the turn: it never generated the end of turn
            samples.append((turns, np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)))
        return samples

    def tokenize(self, record: ChatRecord, expand: bool = True, stats: TokenizeStats | None = None
                 ) -> list[TokenizedSample]:
        """Samples of one conversation (see the module docstring); ``expand=False`` keeps only the last one.
        A row whose assistant turns carry the engine's ids is built from those (:meth:`engine_samples`);
        ``stats`` gets its engine counts.

        Raises :class:`RowError` (with its reason) when the row cannot be tokenized faithfully.
        """
        label = f"{record.where} (id={record.sample_id})" if record.where else f"id={record.sample_id}"
        messages, cut = normalize_messages(record.messages, label)
        kwargs = {**self.template_kwargs, **template_kwargs_of(record.template_kwargs, label)}
        engine = engine_ids_of(record.messages, self.vocab_size, label)
        flags: dict[int, list[str]] = {}
        if engine:
            built, counts, flags = self.engine_samples(messages, engine, cut, record.tools, kwargs, label)
            if stats is not None:
                for k, v in counts.items():
                    setattr(stats, k, getattr(stats, k) + v)
        else:
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            messages = messages[: last + 1]  # trailing user/tool messages have no response to learn from
            groups, renders = self.plan(messages, record.tools, label, kwargs)
            built = [s for g in groups for s in self.build(g, renders, cut)]
        ordinal = {j: k for k, j in enumerate(i for i, m in enumerate(messages) if m["role"] == "assistant")}
        samples = []
        for turns, ids, mask in built if expand else built[-1:]:
            sample_id = record.sample_id if len(built) == 1 else f"{record.sample_id}#t{ordinal[turns[-1]]}"
            sample = TokenizedSample(sample_id, ids, mask, record.source)
            annotate(sample, self.markers)
            if cut.intersection(turns):
                sample.add_flag("truncated")
            for t in turns:
                for f in flags.get(t, ()):
                    sample.add_flag(f)
            samples.append(sample)
        return samples

    def engine_samples(self, messages: list[dict], engine: dict[int, tuple[list[int], list[int]]], cut: set[int],
                       tools, kwargs: dict, label: str):
        """Samples of a row whose generated turns carry the engine's ids: ``[(turns, ids, mask)]``, the counts
        for :class:`TokenizeStats` and the flags per turn.

        A sample is exactly a turn's ``prompt_token_ids + token_ids`` with the loss mask on the ``token_ids``;
        the next turn joins it only when its ``prompt_token_ids`` begin with everything the sample holds (then
        the ids between are context). Only turns with recorded ids are learnt from (others were not generated
        by the engine). Each recorded prompt is compared with this tokenizer's render of the same messages: a
        difference means the template, tokenizer or template arguments are not the engine's (skipped as
        ``engine_prompt_mismatch`` unless ``trust_engine_ids``). Each turn is also compared with what the text
        rule would give (re-tokenizing its rendered text): a difference is flagged ``non_canonical``.
        """
        counts = {"engine_turns": 0, "non_canonical": 0, "engine_prompt_mismatch_trusted": 0}
        flags: dict[int, list[str]] = {}
        out: list[tuple[list[int], list[int], list[int]]] = []
        for t in sorted(engine):
            prompt_ids, gen_ids = engine[t]
            own_prompt = self.render(messages[:t], tools, add_generation_prompt=True, kwargs=kwargs, label=label)
            own = self.encode([own_prompt])[0]
            turn_flags = ["engine_ids"]
            if own != prompt_ids:
                at = next((i for i, (a, b) in enumerate(zip(own, prompt_ids)) if a != b), min(len(own), len(prompt_ids)))
                if not self.trust_engine_ids:
                    shown = json.dumps(kwargs, sort_keys=True) if kwargs else "none"
                    raise RowError(
                        "engine_prompt_mismatch",
                        f"{label}: assistant message {t}: the engine's prompt_token_ids ({len(prompt_ids)} ids) differ "
                        f"from this tokenizer's render of the chat template ({len(own)} ids) from token {at} "
                        f"({self.tokenizer.decode(prompt_ids[at:at + 8])!r} vs {self.tokenizer.decode(own[at:at + 8])!r}; "
                        f"template arguments: {shown}): the template, tokenizer or chat_template_kwargs are not the "
                        "serving engine's; fix them, or pass --trust-engine-ids to use the engine's ids as recorded")
                counts["engine_prompt_mismatch_trusted"] += 1
                turn_flags.append("engine_prompt_mismatch")
            if self._retokenized(messages, t, tools, kwargs, label, t in cut) != gen_ids:
                counts["non_canonical"] += 1
                turn_flags.append("non_canonical")
            counts["engine_turns"] += 1
            flags[t] = turn_flags
            if out and prompt_ids[: len(out[-1][1])] == out[-1][1]:
                turns, ids, mask = out[-1]
                between = prompt_ids[len(ids):]
                out[-1] = (turns + [t], ids + between + gen_ids, mask + [0] * len(between) + [1] * len(gen_ids))
            else:
                out.append(([t], list(prompt_ids) + gen_ids, [0] * len(prompt_ids) + [1] * len(gen_ids)))
        built = [(turns, np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)) for turns, ids, mask in out]
        return built, counts, flags

    def _retokenized(self, messages: list[dict], t: int, tools, kwargs: dict, label: str, cut: bool) -> list[int] | None:
        """What the text rule gives for turn ``t``'s generated ids (None when it cannot tokenize the turn)."""
        try:
            r = self._turn(messages, t, tools, kwargs, label)
        except RowError:
            return None
        ids = self.encode_generated([r.generated], [r.own_text])[0]
        return ids[:-1] if cut and ids and ids[-1] == self.markers.end_of_turn else ids


def engine_ids_of(raw_messages, vocab_size: int, where: str) -> dict[int, tuple[list[int], list[int]]]:
    """``{message index: (prompt ids, generated ids)}`` of the assistant turns that record the engine's ids
    (``prompt_token_ids`` and ``token_ids`` or ``output_ids``); validated: lists of ids in the vocabulary."""
    out = {}
    for i, m in enumerate(parse_message_list(raw_messages, where)):
        if not isinstance(m, dict):
            continue
        gen_key = next((k for k in GENERATED_IDS_KEYS if m.get(k) is not None), None)
        prompt = m.get(PROMPT_IDS_KEY)
        if gen_key is None and prompt is None:
            continue
        if gen_key is None or prompt is None:
            raise RowError("invalid_row", f"{where}: message {i} has {PROMPT_IDS_KEY if prompt is not None else gen_key} "
                           f"without {'token_ids' if prompt is not None else PROMPT_IDS_KEY} (both are needed)")
        pair = []
        for key, ids in ((PROMPT_IDS_KEY, prompt), (gen_key, m[gen_key])):
            if not isinstance(ids, list) or not all(type(x) is int and 0 <= x < vocab_size for x in ids):
                raise RowError("invalid_row", f"{where}: message {i} {key} must be a list of token ids in "
                               f"[0, {vocab_size})")
            pair.append(ids)
        if not pair[0] or not pair[1]:
            raise RowError("invalid_row", f"{where}: message {i} has an empty {PROMPT_IDS_KEY if not pair[0] else gen_key}")
        if m.get("role", m.get("from")) not in ("assistant", "gpt"):
            raise RowError("invalid_row", f"{where}: message {i} records engine ids but is not an assistant turn")
        out[i] = (pair[0], pair[1])
    return out


def _own_spans(body: str, own: tuple[str, ...]) -> list[tuple[int, int]]:
    """[start, end) of each of the message's own texts in the rendered turn, found in order (templates insert
    them verbatim, often stripped): special-token text inside them came from the content, not the template."""
    spans, cursor = [], 0
    for text in own:
        for candidate in (text, text.strip()):
            at = body.find(candidate, cursor) if candidate else -1
            if at >= 0:
                spans.append((at, at + len(candidate)))
                cursor = at + len(candidate)
                break
    return spans


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
    chat_template_kwargs: dict | None = None,
    shard: RowShard = ALL_ROWS,
    trust_engine_ids: bool = False,
) -> Iterator[TokenizedSample]:
    """Stream samples from input files/directories (only the rows ``shard`` owns: one rank's share).

    Conversations need ``tokenizer`` (its chat template, rendered with ``chat_template_kwargs`` unless a
    row has its own); pre-tokenized rows only use it for the thinking/answer counts. A row that cannot be
    tokenized faithfully is skipped, logged and counted in ``stats.skipped`` by reason. Samples longer
    than ``max_length`` are skipped and counted in ``stats`` (``keep_over_length=True`` yields them
    flagged ``over_length``, as the quality gate wants), or cut to ``max_length`` with ``truncate=True``.
    """
    stats = stats if stats is not None else TokenizeStats()
    paths = [inputs] if isinstance(inputs, (str, Path)) else list(inputs)
    chat: ChatTokenizer | None = None
    markers = ResponseMarkers.from_tokenizer(tokenizer) if tokenizer is not None else None

    def malformed(row: Malformed) -> None:  # a row that is not JSON, or not a record: skipped as any other
        stats.rows += 1
        skip_row(stats, row.reason, row.sample_id, row.message)

    for record in read_inputs(paths, shard, on_malformed=malformed):
        stats.rows += 1
        if isinstance(record, TokenRecord):
            samples = [sample_from_tokens(record, markers)]
        else:
            if tokenizer is None:
                raise ValueError(f"{record.where}: conversations need a tokenizer (the target model's)")
            if chat is None:
                try:
                    chat = ChatTokenizer(tokenizer, markers=markers, template_kwargs=chat_template_kwargs,
                                         trust_engine_ids=trust_engine_ids)
                except ValueError as e:
                    raise ValueError(f"{record.where} (id={record.sample_id}): {e}") from e
            try:
                samples = chat.tokenize(record, expand=expand, stats=stats)
            except RowError as e:
                skip_row(stats, e.reason, record.sample_id, str(e))
                continue
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


_LOGGED_PER_REASON = 5


def skip_row(stats: TokenizeStats, reason: str, sample_id: str, message: str) -> None:
    """Count a row left out (``stats.skip``) and log it, the first few of each reason."""
    stats.skip(reason, sample_id, message)
    n = len(stats.skipped[reason])
    if n <= _LOGGED_PER_REASON:
        logger.warning("skipped row (%s): %s", reason, message)
    elif n == _LOGGED_PER_REASON + 1:
        logger.warning("more rows skipped for %s; the count is in the report", reason)


def tokenize_conversation(
    tokenizer, messages: list[dict], sample_id: str | None = None, source: str = "", tools=None, expand: bool = True,
    chat_template_kwargs: dict | None = None,
) -> list[TokenizedSample]:
    """Convenience wrapper for one conversation (builds a ``ChatTokenizer`` each call; use one for bulk work).
    Raises :class:`RowError` when the conversation cannot be tokenized faithfully."""
    sid = sample_id or derive_id({"messages": messages, "tools": tools})
    chat = ChatTokenizer(tokenizer, template_kwargs=chat_template_kwargs)
    return chat.tokenize(ChatRecord(sid, source, messages, tools), expand=expand)
