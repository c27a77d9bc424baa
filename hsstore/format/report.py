"""What ``verify`` finds: a :class:`Problem` names the shard, the file and the samples at fault; a
:class:`VerifyReport` collects them with counts. Its own module so that each layout's check (layouts/zarr.py,
layouts/wds.py) fills a report without importing ``verify``, which calls the layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..terminal import escape


@dataclass
class Problem:
    shard: str
    message: str
    file: str | None = None
    samples: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        """One printable line: every part may hold a store's strings (ids, names), escaped (``terminal``)."""
        where = f"shard {escape(self.shard)}" + (f", file {escape(self.file)}" if self.file else "")
        who = ""
        if self.samples:
            shown = ", ".join(map(escape, self.samples[:5])) + (
                f", ... ({len(self.samples)} samples)" if len(self.samples) > 5 else "")
            who = f" [samples: {shown}]"
        return f"{where}: {escape(self.message)}{who}"


@dataclass
class VerifyReport:
    shards: int = 0
    files: int = 0
    bytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    uncommitted: list[str] = field(default_factory=list)
    assets: int = 0  # asset files listed and checked; 0: the store has none (train and show need them)
    # shards whose commit records (format version 1) list checksums that cannot tell one valid chunk from
    # another: checked as far as they go, not problems; `hsstore upgrade` re-derives them
    weak_records: list[str] = field(default_factory=list)
    # the index against the records (verify.check_index): segments, entries checked, shards not indexed, ...
    index: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems
