"""One training sequence and its loss mask, built once for both ways a sample is made (the chat template's
text rule and the engine's recorded ids): the mask is 1 exactly on the tokens the target generated."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .readers import TokenRecord
from .response import ResponseMarkers, response_stats


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
class MaskedIds:
    """A sample being built, turn by turn: its ids, the loss mask beside them and the assistant turns it learns.

    The one place ids and mask grow, so the text rule and the engine-ids rule cannot disagree on the mask."""

    turns: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)

    def add_turn(self, turn: int, context: list[int], generated: list[int], learnt: int | None = None) -> None:
        """Append ``context`` (not learnt) and the turn's ``generated`` ids, of which the first ``learnt`` (all by
        default) are learnt: a turn the engine cut leaves its template-added end-of-turn token out of the mask."""
        n = len(generated) if learnt is None else learnt
        self.ids += context + generated
        self.mask += [0] * len(context) + [1] * n + [0] * (len(generated) - n)
        self.turns.append(turn)

    def arrays(self) -> tuple[list[int], np.ndarray, np.ndarray]:
        """(turns, ids as int32, loss_mask as uint8): what a :class:`TokenizedSample` is made of."""
        return self.turns, np.asarray(self.ids, dtype=np.int32), np.asarray(self.mask, dtype=np.uint8)


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
