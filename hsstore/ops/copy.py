"""``hsstore copy``: a store to another place (local disk <-> S3, one bucket to another), verified at the end.

A copy is a merge by copy of one store into a new or empty destination (``merge``): every file of every
committed shard is read, checked against its commit record and written under the same key, each record after
its files, the assets with them. Then the destination is verified as ``hsstore verify`` does (every byte re-read
and checked against the records) and its shards compared with the source's, so a copy that ends OK holds the
source's samples bit for bit. Re-running resumes: shards already there are skipped. A destination holding
shards the source does not is refused before anything is written (that is a merge).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..io import storage
from ..errors import StoreError
from ..format import commit
from ..redaction import recordable_url
from ..store.reader import Store
from .merge import merge
from .verify import verify


@dataclass
class CopyResult:
    shards: int = 0  # copied by this run
    samples: int = 0
    bytes_copied: int = 0
    already: int = 0  # shards an earlier run had copied
    verified_shards: int = 0  # the destination's, all re-read at the end
    verified_bytes: int = 0
    problems: list[str] = field(default_factory=list)  # what the end's verification found: the copy is not good

    @property
    def ok(self) -> bool:
        return not self.problems


def copy(src_url: str, dst_url: str, *, src_options: dict[str, Any] | None = None,
         dst_options: dict[str, Any] | None = None, progress: bool = True) -> CopyResult:
    """Copy the store at ``src_url`` to ``dst_url`` (new, empty, or an earlier copy of it: resumed), then verify
    the destination: every byte, and the same shards as the source."""
    from ..progress import progress_bar

    src_options, dst_options = src_options or {}, dst_options or {}
    src = Store(src_url, src_options)
    fs, root = storage.resolve(dst_url, dst_options)
    if storage.store_exists(fs, root, dst_url):
        theirs = sorted({c.shard for c in Store(dst_url, dst_options).commits} - {c.shard for c in src.commits})
        if theirs:
            raise StoreError(f"destination {recordable_url(dst_url)!r} holds {len(theirs)} shard(s) that "
                             f"{recordable_url(src_url)!r} does not ({theirs[0]}, ...): a copy goes to a new or "
                             "empty place, or resumes a copy of the same store (`hsstore merge` adds stores together)")
    m = merge(dst_url, [src_url], by="copy", dst_options=dst_options, src_options=src_options, progress=progress)
    result = CopyResult(shards=m.shards, samples=m.samples, bytes_copied=m.bytes_copied, already=m.already)
    dst = Store(dst_url, dst_options)
    total = int(dst.table.ints["stored_bytes"].sum())
    with progress_bar(total=total, unit="B", unit_scale=True, desc="verify the copy", disable=not progress) as bar:
        report = verify(dst, progress=bar.update)
    result.verified_shards, result.verified_bytes = report.shards, report.bytes
    result.problems = [str(p) for p in report.problems] + differences(src, dst)
    return result


def differences(src: Store, dst: Store) -> list[str]:
    """Where the destination's committed shards are not the source's (missing, extra, other files)."""
    mine = {c.shard: c for c in dst.commits}
    out = [f"shard {c.shard}: not in the copy" for c in src.commits if c.shard not in mine]
    out += [f"shard {c.shard}: lists other files than the source's" for c in src.commits
            if c.shard in mine and not commit.same_files(c, mine[c.shard])]
    theirs = {c.shard for c in src.commits}
    out += [f"shard {s}: in the copy, not in the source" for s in mine if s not in theirs]
    return out
