"""Read training inputs: chat conversations or pre-tokenized sequences, from JSONL, Parquet or Arrow.

Every record carries ``where`` (``file:line`` or ``file row N``) so errors point at the exact row. Rows
with ``input_ids`` + ``loss_mask`` are pre-tokenized (the shape of a tokenized Arrow data set's shards) and skip
templating; rows with ``messages`` (OpenAI style) or ``conversations`` (ShareGPT style) are chats.

Readers stream: a JSONL line or an Arrow/Parquet batch of 1024 rows at a time, never the whole input.
Given a :class:`RowShard` they build records only for one rank's rows (row ``i`` over all inputs, in
reading order, belongs to rank ``i % world``): other ranks' JSONL lines are not parsed and their
table rows not converted, so a rank's parsing and tokenizing is its share of the input.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hsstore.io import door

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


@dataclass
class Malformed:
    """A JSONL row that is not a record (not JSON, not an object, neither chat nor tokens): a caller that counts
    skipped rows (``load_samples``) is handed it instead of an error; ``sample_id`` is ``file:line`` (no id of
    the row can be trusted), ``where`` names file, line and column."""

    sample_id: str
    reason: str  # "malformed_json" or "invalid_row" (messages.SKIP_REASONS)
    message: str


@dataclass(frozen=True)
class RowShard:
    """One rank's rows of the input: row ``i`` (0-based over all input files in reading order; a JSONL row is a
    non-blank line, a table row a row) belongs to rank ``i % world``.

    Decided by position alone, so it needs no counting pass, is the same on every rank for a given input and
    world size, and gives every row to exactly one rank. Interleaved rather than contiguous ranges: inputs
    are often concatenations of sources with very different lengths, and every rank gets a share of each.
    """

    rank: int = 0
    world: int = 1

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} out of range for world size {self.world}")

    def owns(self, row: int) -> bool:
        return row % self.world == self.rank

    def rows_in(self, start: int, n: int) -> range:
        """Local indices ``r`` in ``[0, n)`` of this rank's rows among global rows ``start .. start + n - 1``."""
        return range((self.rank - start) % self.world, n, self.world)


ALL_ROWS = RowShard()


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
    bounds = np.iinfo(dtype)  # a cast past them wraps: token 2**32 + 5 would be read as token 5
    if arr.size and (arr.min() < bounds.min or arr.max() > bounds.max):
        raise ValueError(f"{where}: '{name}' holds {arr.min() if arr.min() < bounds.min else arr.max()}, outside "
                         f"{np.dtype(dtype).name}")
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
    if key is None and (engine := engine_answer_ids(row, where)) is not None:
        prompt, gen = engine
        return make_token_record(prompt + gen, [0] * len(prompt) + [1] * len(gen), sample_id, str(source), where)
    if key is None:
        raise ValueError(f"{where}: row has neither 'messages' nor 'input_ids' + 'loss_mask' (nor an engine answer's "
                         "prompt_token_ids + token_ids)")
    messages, tools = row[key], row.get("tools")
    if sample_id is None or sample_id == "":
        sample_id = derive_id({"messages": messages, "tools": tools})
    return ChatRecord(str(sample_id), str(source), messages, tools, where, row.get("chat_template_kwargs"))


def engine_answer_ids(row: dict, where: str) -> tuple[list, list] | None:
    """(prompt ids, generated ids) of a saved engine answer without messages: vLLM's chat/completion response
    (top-level ``prompt_token_ids``, ``choices[0].token_ids``), SGLang's (both in the choice; ``output_ids``
    its native name for the generated ids) or a flat row with those keys. None when the row is none of these."""
    choices = row.get("choices")
    choice = {}
    if isinstance(choices, list) and choices:
        if len(choices) != 1 or not isinstance(choices[0], dict):
            raise ValueError(f"{where}: an engine answer with {len(choices)} choices; write one choice per row")
        choice = choices[0]
    prompt = row.get("prompt_token_ids", choice.get("prompt_token_ids"))
    gen = next((src[k] for src in (row, choice) for k in ("token_ids", "output_ids") if src.get(k) is not None), None)
    if prompt is None and gen is None:
        return None
    if not isinstance(prompt, list) or not isinstance(gen, list) or not prompt or not gen:
        raise ValueError(f"{where}: an engine answer needs non-empty prompt_token_ids and token_ids (or output_ids) "
                         "lists; this row lacks one (was return_token_ids set?)")
    return prompt, gen


OnMalformed = Callable[[Malformed], None] | None


def read_jsonl(path: Path, source: str, shard: RowShard = ALL_ROWS, start: int = 0,
               on_malformed: OnMalformed = None) -> Iterator[Record]:
    """Records of the rows ``shard`` owns (``start``: global index of the file's first row); returns the
    global index after its last row. Other ranks' lines are read as bytes, never decoded or parsed. A row that
    is not a record is an error naming ``file:line:column``, or, with ``on_malformed``, handed to it and left out."""
    row = start
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            row += 1
            if not shard.owns(row - 1):
                continue
            where = f"{path}:{lineno}"
            try:
                yield record_from_row(_json_row(raw, where), where, source)
            except ValueError as e:
                if on_malformed is None:
                    raise
                malformed = "malformed JSON" in str(e)
                on_malformed(Malformed(f"{path.name}:{lineno}", "malformed_json" if malformed else "invalid_row",
                                       str(e)))
    return row


def _json_row(raw: bytes, where: str) -> Any:
    """One JSONL line parsed; an error names the line's column (the character, counted from 1)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        column = len(raw[:e.start].decode("utf-8", "replace")) + 1
        raise ValueError(f"{where}:{column}: malformed JSON (not UTF-8: {e.reason})") from None
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        column = e.pos - line.rfind("\n", 0, e.pos)  # characters, not bytes; the line has no newline inside
        what = e.msg[:-3] + " here" if e.msg.endswith(" at") else e.msg  # "Unterminated string starting at"
        raise ValueError(f"{where}:{column}: malformed JSON ({what})") from None


def _list_column(column) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, flat values) of a list column, without building Python lists (a data set's shards are GBs)."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_large_list(column.type) or pa.types.is_list(column.type):
        offsets = column.offsets.to_numpy()
        values = column.values
        if column.null_count:
            raise ValueError("null rows in a token column")
        # offsets past the values or going back are a damaged file (a slice would clamp them into other rows' tokens)
        if offsets.size and (offsets[0] < 0 or offsets[-1] > len(values) or np.any(np.diff(offsets) < 0)):
            raise ValueError(f"list offsets outside its {len(values):,} values (a damaged Arrow file)")
        return offsets, values.to_numpy(zero_copy_only=False)
    raise ValueError(f"expected a list column, got {column.type}")


def read_table_batches(batches, label: str, source: str, shard: RowShard = ALL_ROWS, start: int = 0
                       ) -> Iterator[Record]:
    """Records from an iterable of Arrow record batches (Parquet and Arrow readers share this), only of the
    rows ``shard`` owns (``start``: global index of the first row); returns the global index after the last."""
    import pyarrow as pa

    row0 = 0
    for batch in batches:
        n = batch.num_rows
        local = shard.rows_in(start + row0, n)
        if len(local) < n:  # other ranks' rows are never converted to Python objects
            batch = batch.take(pa.array(local, type=pa.int64()))
        names = batch.schema.names
        m = batch.num_rows
        ids = batch.column(names.index("id")).to_pylist() if "id" in names else [None] * m
        sources = batch.column(names.index("source")).to_pylist() if "source" in names else [None] * m
        if "input_ids" in names and "loss_mask" in names:
            try:
                i_off, i_val = _list_column(batch.column(names.index("input_ids")))
                m_off, m_val = _list_column(batch.column(names.index("loss_mask")))
            except ValueError as e:
                raise ValueError(f"{label} rows {row0}-{row0 + n - 1}: {e}") from None
            for k, r in enumerate(local):
                where = f"{label} row {row0 + r}"
                yield make_token_record(
                    i_val[i_off[k] : i_off[k + 1]], m_val[m_off[k] : m_off[k + 1]], ids[k], sources[k] or source, where
                )
        else:
            for r, row in zip(local, batch.to_pylist(), strict=True):
                yield record_from_row(row, f"{label} row {row0 + r}", source)
        row0 += n
    return start + row0


def read_parquet(path: Path, source: str, shard: RowShard = ALL_ROWS, start: int = 0) -> Iterator[Record]:
    import pyarrow.parquet as pq

    # pre_buffer=False: with it, iter_batches keeps the column chunks of row groups already read (memory grows
    # with the file: 45 MB for a 150 MB file here, against 8 MB without)
    batches = pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=1024)
    return (yield from read_table_batches(batches, str(path), source, shard, start))


def read_arrow(path: Path, source: str, shard: RowShard = ALL_ROWS, start: int = 0) -> Iterator[Record]:
    """An Arrow IPC file: stream format (what ``datasets`` writes) or random-access file format. What pyarrow
    cannot read (not Arrow, a record batch whose row count its buffers do not hold) is one ``ValueError`` naming
    the file."""
    import pyarrow as pa

    try:
        src = pa.memory_map(str(path))
    except (pa.ArrowException, OSError) as e:
        raise ValueError(_unreadable(path, e)) from None
    with src:
        try:
            reader = pa.ipc.open_stream(src)
            batches = _named_batches(reader, path)
        except pa.ArrowInvalid:
            src.seek(0)
            try:
                reader = pa.ipc.open_file(src)
            except (pa.ArrowException, OSError) as e:
                raise ValueError(_unreadable(path, e)) from None
            batches = _named_batches((reader.get_batch(i) for i in range(reader.num_record_batches)), path)
        return (yield from read_table_batches(batches, str(path), source, shard, start))


def _unreadable(path: Path, e: Exception) -> str:
    return f"{path}: not a readable Arrow file ({(str(e).splitlines() or [''])[0][:200]})"


def _named_batches(batches, path: Path) -> Iterator[Any]:
    """``batches`` as they are read, pyarrow's refusal of one (a damaged file) a ``ValueError`` naming ``path``."""
    import pyarrow as pa

    it = iter(batches)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:
            raise ValueError(_unreadable(path, e)) from None
        yield batch


def read_dataset_folder(path: str | Path, source: str | None = None) -> Iterator[Record]:
    """Records of a dataset folder from elsewhere (a peer's): the Arrow files its ``state.json`` names, else every
    ``.arrow`` below it, each a regular file beneath the folder (a link planted in it is refused, never followed,
    as ``read_records`` follows the links of the user's own input folder). A file is read as ``read_records``
    reads it."""
    p = Path(path)
    if not p.is_dir():
        return (yield from read_records(p, source))
    start = 0
    for f in _arrow_files_of_dataset_dir(p):
        start = yield from read_arrow(f, source or p.name, ALL_ROWS, start)
    return start


def _hf_dataset_dir(path: Path) -> bool:
    return (path / "state.json").exists() or (path / "dataset_dict.json").exists()


def _arrow_files_of_dataset_dir(path: Path) -> list[Path]:
    """Shard order of a ``save_to_disk`` directory: state.json's list, else sorted. Read with pyarrow whether or
    not ``datasets`` is installed, so a folder reads the same on every machine (``save_to_disk`` writes its rows
    flattened: no indices mapping to apply)."""
    if door.is_file_beneath(path, "state.json"):  # a folder from elsewhere: state.json and its files through the door
        state = door.read_json_beneath(path, "state.json", bound=door.JSON_CAP)
        files = (state.get("_data_files") if isinstance(state, dict) else None) or []
        if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
            raise ValueError(f"{path / 'state.json'}: _data_files is not a list of files")
        if files:
            return [_beneath(path, f.get("filename"), "state.json names") for f in files]
    return [_beneath(path, p.relative_to(path).as_posix(), "found") for p in sorted(path.rglob("*.arrow"))]


def _beneath(folder: Path, name: Any, how: str) -> Path:
    """``folder/name`` when it is a regular file beneath ``folder`` (a relative name, no link on the way); one
    ``ValueError`` naming it otherwise (``state.json`` naming ``/etc/x.arrow`` or ``../x.arrow``, a planted link)."""
    why = door.key_problem(name)
    if why:
        raise ValueError(f"{folder}: {how} {name!r}: refused ({why}; files of a dataset folder are read beneath it)")
    try:
        fd, _ = door.open_beneath(str(folder), name, where=str(folder))
    except door.Refused as e:
        raise ValueError(str(e)) from None
    os.close(fd)
    return folder / name


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


def read_records(path: str | Path, source: str | None = None, shard: RowShard = ALL_ROWS, start: int = 0,
                 on_malformed: OnMalformed = None) -> Iterator[Record]:
    """Yield records from a file or directory (JSONL, Parquet, Arrow, or a ``datasets.save_to_disk`` dir).

    ``source`` defaults to the row's ``source`` column, else the file (or directory) stem. With ``shard``
    only that rank's rows (``start``: global index of the first row); returns the global index after the last.
    """
    p = Path(path)
    if p.is_dir() and _hf_dataset_dir(p):
        default = source or p.name
        for f in _arrow_files_of_dataset_dir(p):
            start = yield from read_arrow(f, default, shard, start)
        return start
    for f in input_files(p):
        default = source or (p.name if p.is_dir() else f.stem)
        if f.suffix == ".jsonl":
            if f.stat().st_size == 0:  # an empty input is a mistake (a failed export), not zero samples
                raise ValueError(f"{f}: empty file (no samples)")
            start = yield from read_jsonl(f, default, shard, start, on_malformed)
        elif f.suffix == ".parquet":
            start = yield from read_parquet(f, default, shard, start)
        elif f.suffix == ".arrow":
            start = yield from read_arrow(f, default, shard, start)
        else:
            raise ValueError(f"{f}: unsupported input format (expected .jsonl, .parquet or .arrow)")
    return start


def read_inputs(paths: Iterable[str | Path], shard: RowShard = ALL_ROWS, on_malformed: OnMalformed = None
                ) -> Iterator[Record]:
    """Records of several inputs in order, row indices running on across them (so ``shard`` splits the
    whole input, not each file)."""
    start = 0
    for path in paths:
        start = yield from read_records(path, shard=shard, start=start, on_malformed=on_malformed)
