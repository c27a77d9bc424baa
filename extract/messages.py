"""Rows as engines see them: a conversation row validated and normalised to the messages a serving engine
renders, and the errors that make a row unusable.

Tool-call ``arguments`` given as a JSON string (the OpenAI wire format) are parsed to objects before
rendering, as vLLM and SGLang do (empty -> ``{}``). Reasoning comes from the row's ``reasoning_content``
(or ``reasoning``/``thinking``) field when it has one, and the content is then kept whole (a literal
``</think>`` in an answer stays in the answer); only a row without such a field has an inline
``<think>...</think>`` split out of its content. Template arguments (``enable_thinking``,
``preserve_thinking``, ...) come from ``chat_template_kwargs``: a default for all rows, overridden per row
by the row's own ``chat_template_kwargs`` object.

Bad rows never abort a run: a row that cannot be tokenized faithfully raises :class:`RowError` with a
reason (``SKIP_REASONS``); ``tokenize.load_samples`` skips it, logs it and counts it by reason and id, and
the quality gate fails only when the skipped share passes its threshold.
"""

from __future__ import annotations

import json

from .response import THINK_END, THINK_START

ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool"}
#: Assistant-message fields that hold the reasoning (older vLLM releases: `reasoning_content`; newer: `reasoning`).
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
#: Why a row was skipped (see :class:`RowError`), in the order reports list them.
SKIP_REASONS = ("malformed_json", "invalid_row", "tool_arguments", "template_error", "prompt_mismatch",
                "no_end_of_turn", "engine_prompt_mismatch")


class RowError(ValueError):
    """One row cannot be tokenized faithfully; ``reason`` is one of ``SKIP_REASONS``.

    Raised while a row is tokenized; ``tokenize.load_samples`` skips the row and counts it.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class TemplateError(RowError):
    """The chat template cannot give this row's turns as the engine generated them."""


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


#: An assistant message's field saying who wrote it: ``false`` marks a turn the target did not generate (hand-written,
#: or another model's; ``regenerate --turns last`` marks the earlier turns it keeps so): context, never learnt unless
#: asked (``--learn-not-generated``, which flags the sample ``not_generated``).
GENERATED_KEY = "generated"


def not_generated_turns(raw, where: str) -> set[int]:
    """Indices of the assistant messages marked ``"generated": false`` (any other value than a bool is refused)."""
    out = set()
    for i, m in enumerate(parse_message_list(raw, where)):
        if not isinstance(m, dict) or m.get(GENERATED_KEY) is None:
            continue
        if not isinstance(m[GENERATED_KEY], bool):
            raise RowError("invalid_row", f"{where}: message {i} {GENERATED_KEY} must be true or false")
        if m[GENERATED_KEY] is False and role_and_content(m, where, i)[0] == "assistant":
            out.add(i)
    return out


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

