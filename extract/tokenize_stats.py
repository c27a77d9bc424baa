"""What a tokenize pass counts: rows in, samples out, and what was dropped and why (``tokenize.load_samples``
fills it; ``ChatTokenizer.tokenize`` adds a row's engine-id counts; the quality gate and extraction report it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


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
