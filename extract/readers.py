"""Read training inputs: chat conversations or pre-tokenized sequences, from JSONL, Parquet or Arrow.

Every record carries ``where`` (``file:line`` or ``file row N``) so errors point at the exact row. Rows
with ``input_ids`` + ``loss_mask`` are pre-tokenized (the shape of the brief's Arrow shards) and skip
templating; rows with ``messages`` (OpenAI style) or ``conversations`` (ShareGPT style) are chats.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

DATA_SUFFIXES = (".jsonl", ".parquet", ".arrow")


@dataclass
class ChatRecord:
    """One conversation as read from the input, not yet validated."""

    sample_id: str
    source: str
    messages: Any
    tools: list | None = None
    where: str = ""
    #: the row's own ``chat_template_kwargs`` (validated when tokenized; they override the command line's)
    template_kwargs: Any = None


@dataclass
class TokenRecord:
    """One pre-tokenized sequence (``input_ids`` + ``loss_mask``) as read from the input."""

    sample_id: str
    source: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    where: str = ""


Record = ChatRecord | TokenRecord


def derive_id(payload: Any) -> str:
    """Stable id from content, for rows without one: same content -> same id, across runs and machines."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        data = bytes(payload)
    else:
        data = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return "h" + hashlib.blake2b(data, digest_size=8).hexdigest()


def _token_array(values: Any, where: str, name: str, dtype) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{where}: '{name}' must be a flat list of integers, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.bool_) or (
            np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.round(arr))
        ):
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"{where}: '{name}' must hold integers, got dtype {arr.dtype}")
    return arr.astype(dtype, copy=False)


def make_token_record(input_ids: Any, loss_mask: Any, sample_id: Any, source: str, where: str) -> TokenRecord:
    """Validate a pre-tokenized row (equal lengths, 0/1 mask) and give it an id if it has none."""
    ids = _token_array(input_ids, where, "input_ids", np.int32)
    mask = _token_array(loss_mask, where, "loss_mask", np.int64)
    if ids.shape != mask.shape:
        raise ValueError(f"{where}: input_ids has {ids.size} tokens but loss_mask has {mask.size}")
    if mask.size and (mask.min() < 0 or mask.max() > 1):
        raise ValueError(f"{where}: loss_mask must contain only 0 and 1")
    mask = mask.astype(np.uint8)
    if sample_id is None or sample_id == "":
        sample_id = derive_id(ids.astype("<i4").tobytes() + mask.tobytes())
    return TokenRecord(str(sample_id), source, ids, mask, where)


def record_from_row(row: Any, where: str, default_source: str) -> Record:
    """Classify one row as pre-tokenized or chat; keeps ``id``/``source`` or derives them."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object per row, got {type(row).__name__}")
    sample_id = row.get("id", row.get("sample_id"))
    source = row.get("source") or default_source
    if "input_ids" in row and "loss_mask" in row:
        return make_token_record(row["input_ids"], row["loss_mask"], sample_id, str(source), where)
    key = "messages" if "messages" in row else "conversations" if "conversations" in row else None
    if key is None:
        raise ValueError(f"{where}: row has neither 'messages' nor 'input_ids' + 'loss_mask'")
    messages, tools = row[key], row.get("tools")
    if sample_id is None or sample_id == "":
        sample_id = derive_id({"messages": messages, "tools": tools})
    return ChatRecord(str(sample_id), str(source), messages, tools, where, row.get("chat_template_kwargs"))


def read_jsonl(path: Path, source: str) -> Iterator[Record]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            yield record_from_row(row, where, source)


def _list_column(column) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, flat values) of a list column, without building Python lists (the brief's shards are GBs)."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_large_list(column.type) or pa.types.is_list(column.type):
        offsets = column.offsets.to_numpy()
        values = column.values
        if column.null_count:
            raise ValueError("null rows in a token column")
        return offsets, values.to_numpy(zero_copy_only=False)
    raise ValueError(f"expected a list column, got {column.type}")


def read_table_batches(batches, label: str, source: str) -> Iterator[Record]:
    """Records from an iterable of Arrow record batches (Parquet and Arrow readers share this)."""
    row0 = 0
    for batch in batches:
        names = batch.schema.names
        n = batch.num_rows
        ids = batch.column(names.index("id")).to_pylist() if "id" in names else [None] * n
        sources = batch.column(names.index("source")).to_pylist() if "source" in names else [None] * n
        if "input_ids" in names and "loss_mask" in names:
            try:
                i_off, i_val = _list_column(batch.column(names.index("input_ids")))
                m_off, m_val = _list_column(batch.column(names.index("loss_mask")))
            except ValueError as e:
                raise ValueError(f"{label} rows {row0}-{row0 + n - 1}: {e}") from None
            for r in range(n):
                where = f"{label} row {row0 + r}"
                yield make_token_record(
                    i_val[i_off[r] : i_off[r + 1]], m_val[m_off[r] : m_off[r + 1]], ids[r], sources[r] or source, where
                )
        else:
            for r, row in enumerate(batch.to_pylist()):
                yield record_from_row(row, f"{label} row {row0 + r}", source)
        row0 += n


def read_parquet(path: Path, source: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    yield from read_table_batches(pq.ParquetFile(path).iter_batches(batch_size=1024), str(path), source)


def read_arrow(path: Path, source: str) -> Iterator[Record]:
    """An Arrow IPC file: stream format (what ``datasets`` writes) or random-access file format."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as src:
        try:
            reader = pa.ipc.open_stream(src)
        except pa.ArrowInvalid:
            src.seek(0)
            reader = pa.ipc.open_file(src)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            yield from read_table_batches(batches, str(path), source)
            return
        yield from read_table_batches(reader, str(path), source)


def _hf_dataset_dir(path: Path) -> bool:
    return (path / "state.json").exists() or (path / "dataset_dict.json").exists()


def _read_with_datasets(path: Path, source: str) -> Iterator[Record]:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    splits = (
        [(name, loaded[name]) for name in sorted(loaded)]
        if isinstance(loaded, datasets.DatasetDict)
        else [("", loaded)]
    )
    for name, ds in splits:
        if getattr(ds, "_indices", None) is not None:
            ds = ds.flatten_indices()
        label = f"{path}[{name}]" if name else str(path)
        yield from read_table_batches(ds.data.table.to_batches(max_chunksize=1024), label, source)


def _arrow_files_of_dataset_dir(path: Path) -> list[Path]:
    """Shard order of a ``save_to_disk`` directory read without ``datasets``: state.json's list, else sorted."""
    state = path / "state.json"
    if state.exists():
        files = json.loads(state.read_text()).get("_data_files") or []
        if files:
            return [path / f["filename"] for f in files]
    return sorted(path.rglob("*.arrow"))


def input_files(path: str | Path) -> list[Path]:
    """Data files under ``path`` (itself if a file), sorted so reading order is stable."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.exists():
        raise FileNotFoundError(f"input not found: {p}")
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in DATA_SUFFIXES)
    if not files:
        raise ValueError(f"{p}: no .jsonl, .parquet or .arrow files found")
    return files


def read_records(path: str | Path, source: str | None = None) -> Iterator[Record]:
    """Yield records from a file or directory (JSONL, Parquet, Arrow, or a ``datasets.save_to_disk`` dir).

    ``source`` defaults to the row's ``source`` column, else the file (or directory) stem.
    """
    p = Path(path)
    if p.is_dir() and _hf_dataset_dir(p):
        default = source or p.name
        try:
            import datasets  # noqa: F401
        except ImportError:
            for f in _arrow_files_of_dataset_dir(p):
                yield from read_arrow(f, default)
        else:
            yield from _read_with_datasets(p, default)
        return
    for f in input_files(p):
        default = source or (p.name if p.is_dir() else f.stem)
        if f.suffix == ".jsonl":
            if f.stat().st_size == 0:  # an empty input is a mistake (a failed export), not zero samples
                raise ValueError(f"{f}: empty file (no samples)")
            yield from read_jsonl(f, default)
        elif f.suffix == ".parquet":
            yield from read_parquet(f, default)
        elif f.suffix == ".arrow":
            yield from read_arrow(f, default)
        else:
            raise ValueError(f"{f}: unsupported input format (expected .jsonl, .parquet or .arrow)")
