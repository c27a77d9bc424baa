"""Read the anatomy of loss-masked responses: thinking tokens, answer tokens, end of turn.

Works on token ids alone (given a few marker ids), so it applies equally to freshly tokenized
conversations, pre-tokenized shards and samples read back from a store.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ResponseMarkers:
    """Token ids that delimit a response, and which ids decode to whitespace only."""

    end_of_turn: int
    think_start: int | None
    think_end: int | None
    blank: np.ndarray  # bool per token id

    @classmethod
    def from_tokenizer(cls, tokenizer, end_of_turn: str | None = None) -> ResponseMarkers:
        """Markers of a transformers tokenizer; the end of turn defaults to its eos token (``<|im_end|>`` for Qwen)."""
        eot = end_of_turn or tokenizer.eos_token
        if not eot:
            raise ValueError("tokenizer has no eos token; pass end_of_turn= the token that closes an assistant turn")
        eot_id = single_token_id(tokenizer, eot)
        if eot_id is None:
            raise ValueError(f"tokenizer lacks the end-of-turn token {eot!r} as a single token")
        size = len(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        ids = [[i] for i in range(size)]
        if backend is not None:
            pieces = backend.decode_batch(ids, skip_special_tokens=False)
        else:  # pragma: no cover - slow tokenizers
            pieces = [tokenizer.decode(i, skip_special_tokens=False) for i in ids]
        blank = np.array([p.strip() == "" for p in pieces], dtype=bool)
        return cls(eot_id, single_token_id(tokenizer, THINK_START), single_token_id(tokenizer, THINK_END), blank)


def single_token_id(tokenizer, text: str) -> int | None:
    """Id of ``text`` if the tokenizer encodes it as exactly one token, else None."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return int(ids[0]) if len(ids) == 1 else None


@dataclass(frozen=True)
class TurnStats:
    """One contiguous loss-masked span (one assistant turn)."""

    start: int
    end: int  # exclusive
    thinking_tokens: int
    answer_tokens: int
    has_think_block: bool
    think_closed: bool
    ends_with_eot: bool


@dataclass(frozen=True)
class ResponseStats:
    """Per-sample summary: thinking summed over turns; answer, emptiness and closure of the final turn."""

    thinking_tokens: int
    answer_tokens: int
    empty_thinking: bool
    truncated: bool
    turns: tuple[TurnStats, ...]


def masked_spans(loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) runs of ones in a 0/1 mask."""
    m = np.asarray(loss_mask).astype(np.int8)
    if m.size == 0:
        return []
    edges = np.diff(np.concatenate(([0], m, [0])))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def _content_len(ids: np.ndarray, blank: np.ndarray) -> int:
    """Token count after trimming whitespace-only tokens at both ends (so ``\\n\\n`` alone counts 0)."""
    if ids.size == 0:
        return 0
    in_vocab = (ids >= 0) & (ids < blank.size)
    is_blank = np.zeros(ids.size, dtype=bool)
    is_blank[in_vocab] = blank[ids[in_vocab]]
    idx = np.flatnonzero(~is_blank)
    return int(idx[-1] - idx[0] + 1) if idx.size else 0


def turn_stats(ids: np.ndarray, start: int, end: int, markers: ResponseMarkers) -> TurnStats:
    """Split one masked span into thinking and answer: thinking is between ``<think>`` and ``</think>``."""
    span = np.asarray(ids[start:end])
    ends_with_eot = bool(span.size) and int(span[-1]) == markers.end_of_turn
    body = span[:-1] if ends_with_eot else span
    t_end = np.flatnonzero(body == markers.think_end) if markers.think_end is not None else np.empty(0, int)
    t_start = np.flatnonzero(body == markers.think_start) if markers.think_start is not None else np.empty(0, int)
    if t_end.size:
        close = int(t_end[0])
        opens = t_start[t_start < close]
        open_ = int(opens[0]) + 1 if opens.size else 0
        thinking = _content_len(body[open_:close], markers.blank)
        answer = _content_len(body[close + 1 :], markers.blank)
        return TurnStats(start, end, thinking, answer, True, True, ends_with_eot)
    if t_start.size:  # opened, never closed: generation stopped inside the reasoning
        thinking = _content_len(body[int(t_start[0]) + 1 :], markers.blank)
        return TurnStats(start, end, thinking, 0, True, False, ends_with_eot)
    return TurnStats(start, end, 0, _content_len(body, markers.blank), False, True, ends_with_eot)


def response_stats(ids: np.ndarray, loss_mask: np.ndarray, markers: ResponseMarkers) -> ResponseStats:
    """Summarise a sample's responses. The final turn decides ``answer_tokens``/``empty_thinking``/``truncated``:
    it is the response the sample exists for (earlier turns of a tool loop are mostly tool calls)."""
    turns = tuple(turn_stats(ids, s, e, markers) for s, e in masked_spans(loss_mask))
    if not turns:
        return ResponseStats(0, 0, False, False, ())
    last = turns[-1]
    return ResponseStats(
        thinking_tokens=sum(t.thinking_tokens for t in turns),
        answer_tokens=last.answer_tokens,
        empty_thinking=last.has_think_block and last.thinking_tokens == 0,
        truncated=not (last.ends_with_eot and last.think_closed),
        turns=turns,
    )
