"""Engine ids: a turn that records the serving engine's own ids (``prompt_token_ids`` + ``token_ids``, as
``hsstore regenerate`` writes them) is taken as exactly those, since re-tokenizing text loses the
non-canonical splits a model samples and whatever the server's parsers reformatted (docs/FORMAT.md,
"Engine ids")."""

from __future__ import annotations

import json
from typing import Protocol

from .messages import RowError, parse_message_list
from .sample import MaskedIds

#: Where an assistant turn records the serving engine's own ids (``hsstore regenerate`` writes the first
#: spelling; ``output_ids`` is SGLang's native name for the generated ids). See docs/FORMAT.md.
PROMPT_IDS_KEY = "prompt_token_ids"
GENERATED_IDS_KEYS = ("token_ids", "output_ids")


class OwnIds(Protocol):
    """What a row's recorded ids are held against: the chat tokenizer's own render and tokenization of the same turn
    (``chat_tokenizer.ChatTokenizer``)."""

    trust_engine_ids: bool

    def prompt_ids(self, messages: list[dict], t: int, tools, kwargs: dict, label: str) -> list[int]:
        """Turn ``t``'s generation prompt, rendered and encoded as an engine serving this template does."""
        ...

    def text_ids(self, messages: list[dict], t: int, tools, kwargs: dict, label: str, cut: bool) -> list[int] | None:
        """What the text rule gives for turn ``t``'s generated ids (None when it cannot tokenize the turn)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Token ids as text (to show where two tokenizations part)."""
        ...


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

def engine_samples(chat: OwnIds, messages: list[dict], engine: dict[int, tuple[list[int], list[int]]],
                   cut: set[int], tools, kwargs: dict, label: str):
    """Samples of a row whose generated turns carry the engine's ids: ``[(turns, ids, mask)]``, the counts
    for ``TokenizeStats`` and the flags per turn.

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
    out: list[MaskedIds] = []
    for t in sorted(engine):
        prompt_ids, gen_ids = engine[t]
        own = chat.prompt_ids(messages, t, tools, kwargs, label)
        turn_flags = ["engine_ids"]
        if own != prompt_ids:
            if not chat.trust_engine_ids:
                raise _prompt_mismatch(chat, prompt_ids, own, kwargs, f"{label}: assistant message {t}")
            counts["engine_prompt_mismatch_trusted"] += 1
            turn_flags.append("engine_prompt_mismatch")
        if chat.text_ids(messages, t, tools, kwargs, label, t in cut) != gen_ids:
            counts["non_canonical"] += 1
            turn_flags.append("non_canonical")
        counts["engine_turns"] += 1
        flags[t] = turn_flags
        if out and prompt_ids[: len(out[-1].ids)] == out[-1].ids:
            out[-1].add_turn(t, prompt_ids[len(out[-1].ids):], gen_ids)
        else:
            out.append(MaskedIds())
            out[-1].add_turn(t, list(prompt_ids), gen_ids)
    return [s.arrays() for s in out], counts, flags


def _prompt_mismatch(chat: OwnIds, prompt_ids: list[int], own: list[int], kwargs: dict, where: str
                     ) -> RowError:
    """The row's error when the engine's recorded prompt is not this tokenizer's render of it."""
    at = next((i for i, (a, b) in enumerate(zip(own, prompt_ids)) if a != b), min(len(own), len(prompt_ids)))
    shown = json.dumps(kwargs, sort_keys=True) if kwargs else "none"
    decode = chat.decode
    return RowError(
        "engine_prompt_mismatch",
        f"{where}: the engine's prompt_token_ids ({len(prompt_ids)} ids) differ "
        f"from this tokenizer's render of the chat template ({len(own)} ids) from token {at} "
        f"({decode(prompt_ids[at:at + 8])!r} vs {decode(own[at:at + 8])!r}; "
        f"template arguments: {shown}): the template, tokenizer or chat_template_kwargs are not the "
        "serving engine's; fix them, or pass --trust-engine-ids to use the engine's ids as recorded")
