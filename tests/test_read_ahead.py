"""The trainer's read-ahead: batches in order with their states, the per-batch breakdown it records, and the
torch thread count of its thread (CPU; the CUDA side-stream copy runs the same code path plus events)."""

from __future__ import annotations

import math

import torch

from hsstore.train.data import ReadAheadStats, read_ahead


class ListSource:
    """A source as StoreBatches is one: iteration, and the state after the last batch handed out."""

    def __init__(self, n: int):
        self.n, self.pos, self.threads_seen = n, 0, []

    def __iter__(self):
        for i in range(self.n):
            self.threads_seen.append(torch.get_num_threads())
            self.pos = i + 1
            yield {"x": torch.full((2, 3), float(i)), "sample_id": [f"s{i}"]}

    def state_dict(self):
        return {"pos": self.pos}


def test_batches_in_order_with_stats_per_batch():
    src, stats = ListSource(5), ReadAheadStats()
    got = list(read_ahead(src, lambda b: {**b, "prepared": True}, torch.device("cpu"), depth=2, stats=stats))
    assert [int(b["x"][0, 0]) for b, _ in got] == [0, 1, 2, 3, 4]
    assert [s["pos"] for _, s in got] == [1, 2, 3, 4, 5]  # the state after each batch travels with it
    assert all(b["prepared"] for b, _ in got)
    assert len(stats.read) == len(stats.prep) == len(stats.copy) == len(stats.wait) == len(stats.ready) == 5
    assert all(0 <= r <= 2 for r in stats.ready)  # never more queued than the depth
    assert not stats.events  # no CUDA: no copy events
    s = stats.summary(skip=1, count=3)
    assert set(s) == {"read_ms", "prep_ms", "copy_issue_ms", "wait_ms", "ready_mean"}
    assert all(v >= 0 for v in s.values())
    assert math.isnan(ReadAheadStats().summary()["wait_ms"])  # nothing recorded: not a zero wait


def test_reader_threads_apply_to_the_read_ahead_thread_only():
    before = torch.get_num_threads()
    src = ListSource(3)
    for _ in read_ahead(src, lambda b: b, torch.device("cpu"), threads=1):
        assert torch.get_num_threads() == before  # the consumer's own setting is untouched
    assert src.threads_seen == [1, 1, 1]
    src = ListSource(2)
    list(read_ahead(src, lambda b: b, torch.device("cpu")))
    assert src.threads_seen == [before] * 2  # default: as the process has them (the setting above was undone)


def test_closing_early_stops_the_thread():
    src = ListSource(100)
    it = read_ahead(src, lambda b: b, torch.device("cpu"), depth=2)
    next(it)
    it.close()
    assert src.pos <= 1 + 2 + 2  # read at most the depth (+ one in hand) past the consumer
