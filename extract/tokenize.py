"""The tokenize pass: stream input files into training samples, skipping (and counting) the rows that cannot be
tokenized faithfully, so a bad row never aborts a run.

A conversation goes through :class:`.chat_tokenizer.ChatTokenizer` (the chat template, the engine's ids);
a pre-tokenized row is taken as it is (:func:`.sample.sample_from_tokens`). What was dropped and why is
counted in :class:`.tokenize_stats.TokenizeStats`; the quality gate fails only when the skipped share passes its threshold.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

from .chat_tokenizer import ChatTokenizer
from .messages import RowError
from .readers import ALL_ROWS, ChatRecord, Malformed, RowShard, TokenRecord, derive_id, read_inputs
from .response import ResponseMarkers
from .sample import TokenizedSample, apply_max_length, sample_from_tokens
from .tokenize_stats import TokenizeStats

logger = logging.getLogger(__name__)


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
    learn_not_generated: bool = False,
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
                                         trust_engine_ids=trust_engine_ids,
                                         learn_not_generated=learn_not_generated)
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
