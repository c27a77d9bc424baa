"""Sharded, streaming input reading: each rank reads only its rows, the ranks together read every row once."""

import json
import tracemalloc
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hsstore.extract.readers import RowShard, read_inputs
from hsstore.extract.chat_tokenizer import ChatTokenizer
from hsstore.extract.tokenize import TokenizeStats, load_samples


def chat(i: int) -> dict:
    return {"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}?"},
                                         {"role": "assistant", "content": f"Answer {i}.", "reasoning_content": "Hm."}]}


def tokens(i: int) -> dict:
    n = 3 + i % 5
    return {"id": f"t{i}", "input_ids": list(range(i, i + n)), "loss_mask": [0] * (n - 2) + [1, 1]}


def write_arrow(path, rows, stream: bool, batch: int = 7):
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as f:
        writer = pa.ipc.new_stream(f, table.schema) if stream else pa.ipc.new_file(f, table.schema)
        with writer:
            for b in table.to_batches(max_chunksize=batch):
                writer.write_batch(b)


@pytest.fixture
def mixed_inputs(tmp_path):
    """Two input arguments: a directory with JSONL (blank lines included), Parquet (several row groups) and
    Arrow stream files, and a single Arrow file-format file; chats and pre-tokenized rows. Ids are what we wrote."""
    d = tmp_path / "data"
    d.mkdir()
    ids = []
    rows = [chat(i) for i in range(23)]
    (d / "a.jsonl").write_text("\n".join(json.dumps(r) + ("\n" if i % 6 == 0 else "") for i, r in enumerate(rows))
                               + "\n")
    ids += [r["id"] for r in rows]
    rows = [tokens(i) for i in range(100, 141)]
    pq.write_table(pa.Table.from_pylist(rows), d / "b.parquet", row_group_size=9)
    ids += [r["id"] for r in rows]
    rows = [chat(i) for i in range(200, 219)]
    write_arrow(d / "c.arrow", rows, stream=True)
    ids += [r["id"] for r in rows]
    single = tmp_path / "d.arrow"
    rows = [tokens(i) for i in range(300, 311)]
    write_arrow(single, rows, stream=False, batch=4)
    ids += [r["id"] for r in rows]
    return [str(d), str(single)], ids


@pytest.mark.parametrize("world", [1, 2, 3, 8, 64])
def test_ranks_read_every_row_exactly_once(mixed_inputs, world):
    inputs, ids = mixed_inputs
    per_rank = [[r.sample_id for r in read_inputs(inputs, RowShard(rank, world))] for rank in range(world)]
    union = [i for part in per_rank for i in part]
    assert sorted(union) == sorted(ids) and len(union) == len(set(union))  # union == all, disjoint
    sizes = [len(p) for p in per_rank]
    assert max(sizes) - min(sizes) <= 1  # row i -> rank i % world: shares differ by at most one row
    for rank in range(world):  # deterministic: the same input and world size give the same rows
        assert [r.sample_id for r in read_inputs(inputs, RowShard(rank, world))] == per_rank[rank]
        assert per_rank[rank] == ids[rank::world]  # the rule: row i (in reading order) belongs to rank i % world


def test_shard_keeps_row_positions_in_errors(tmp_path):
    """A rank names the bad row by its real line / row number, not its position in the rank's share."""
    path = tmp_path / "x.jsonl"
    lines = [json.dumps(chat(i)) for i in range(5)]
    lines[3] = '{"id": "broken", "messages": ['
    path.write_text("\n".join(lines) + "\n")
    assert [r.sample_id for r in read_inputs([path], RowShard(0, 2))] == ["c0", "c2", "c4"]  # line 4 not parsed
    with pytest.raises(ValueError, match=r"x\.jsonl:4:\d+: malformed JSON"):
        list(read_inputs([path], RowShard(1, 2)))
    pq.write_table(pa.Table.from_pylist([chat(i) for i in range(6)]), tmp_path / "y.parquet")
    assert [r.where.rsplit(" ", 1)[1] for r in read_inputs([tmp_path / "y.parquet"], RowShard(2, 4))] == ["2"]


def test_rank_samples_and_skip_accounting_add_up(tok, tmp_path):
    """Sharded tokenization: the ranks' samples are the unsharded run's, and each bad row is counted by the one
    rank that owns it (so the per-rank store notes add up to the whole input's)."""
    rows = [chat(i) for i in range(20)]
    rows[5]["messages"][1]["tool_calls"] = [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]
    rows[12]["messages"] = [{"role": "assistant", "content": "no prompt"}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    whole = TokenizeStats()
    want = [s.sample_id for s in load_samples(path, tok, stats=whole)]
    got, rows_seen, skipped = [], 0, {}
    for rank in range(3):
        st = TokenizeStats()
        got += [s.sample_id for s in load_samples(path, tok, stats=st, shard=RowShard(rank, 3))]
        rows_seen += st.rows
        for reason, sids in st.skipped.items():
            skipped.setdefault(reason, []).extend(sids)
    assert sorted(got) == sorted(want) and len(want) == 18
    assert rows_seen == whole.rows == 20
    assert {r: sorted(v) for r, v in skipped.items()} == {"tool_arguments": ["c5"], "invalid_row": ["c12"]}


def test_a_rank_tokenizes_only_its_rows(tok, tmp_path, monkeypatch):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(chat(i)) + "\n" for i in range(40)))
    seen = []
    real = ChatTokenizer.tokenize
    monkeypatch.setattr(ChatTokenizer, "tokenize", lambda self, rec, **k: seen.append(rec.sample_id) or
                        real(self, rec, **k))
    list(load_samples(path, tok, shard=RowShard(3, 8)))
    assert seen == [f"c{i}" for i in range(3, 40, 8)]


def test_reading_streams_in_bounded_memory(tmp_path):
    """A 40 MB JSONL read through the readers: peak traced memory stays far below the file (one row at a time)."""
    path = tmp_path / "big.jsonl"
    filler = "x" * 2000
    with open(path, "w") as f:
        for i in range(20000):
            f.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": filler},
                                                            {"role": "assistant", "content": filler}]}) + "\n")
    size = path.stat().st_size
    assert size > 40e6
    records = read_inputs([path], RowShard(1, 2))
    assert isinstance(records, types.GeneratorType)
    tracemalloc.start()
    try:
        n = sum(1 for _ in records)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 10000
    assert peak < size / 50, f"peak {peak / 1e6:.1f} MB for a {size / 1e6:.0f} MB file"


def parquet_read_peak(path, n: int, length: int = 512) -> int:
    """Peak Arrow memory (bytes) while a rank reads a Parquet file of ``n`` pre-tokenized rows of ``length``."""
    flat = pa.array(np.arange(n * length, dtype=np.int32) % 1000)
    offsets = pa.array(np.arange(0, (n + 1) * length, length, dtype=np.int32))
    table = pa.table({"id": pa.array([f"t{i}" for i in range(n)]),
                      "input_ids": pa.ListArray.from_arrays(offsets, flat),
                      "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(np.ones(n * length, dtype=np.int8)))})
    pq.write_table(table, path, row_group_size=2048, compression="none")
    del table, flat, offsets
    pool = pa.default_memory_pool()
    base, peak, count = pool.bytes_allocated(), 0, 0
    for _ in read_inputs([path], RowShard(0, 4)):
        count += 1
        peak = max(peak, pool.bytes_allocated() - base)
    assert count == n // 4
    return peak


@pytest.mark.slow
def test_parquet_memory_does_not_grow_with_the_file(tmp_path):
    """Parquet is read a batch at a time: three times the rows, the same peak Arrow memory (pyarrow's default
    pre-buffering kept every row group read so far: 29 MB -> 56 MB for 51 -> 154 MB files)."""
    small = parquet_read_peak(tmp_path / "small.parquet", 10000)
    large = parquet_read_peak(tmp_path / "large.parquet", 30000)
    assert large < 1.2 * small + (1 << 20), f"peak {small / 1e6:.1f} MB -> {large / 1e6:.1f} MB"
