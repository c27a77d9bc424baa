"""Threads of one process sharing a follow journal (hsstore/loader/follow.py): the trainer's loop plans epoch 0 from
the journal (its length, what arrived) while its read-ahead thread reads the joins, and the leader's thread appends
to the journal the loop reads. Each interleaving is driven step by step: one thread is held at the exact point
(its read of an entry done, not yet kept; its entry written, not yet kept) while the other reads the same entry."""

from __future__ import annotations

import collections
import threading

import hsstore
from hsstore.io import door, transfer
from hsstore.loader.dataset import HiddenStateDataset
from hsstore.loader.follow import Follow, Journal, Leader
from hsstore.loader.options import Planning
from hsstore.store.writer import StoreWriter
from hsstore.testing.stores import TOKEN_BYTES

from conftest import make_manifest, make_samples
from test_follow import SEED, add, until_end

HOLD_S = 60.0  # a bound on each hand-over between the two threads, never a wait for luck


class Hold:
    """Holds the thread ``who`` once it has passed the call whose target ends with ``name`` (the first time)."""

    def __init__(self, name: str) -> None:
        self.name, self.who = name, None
        self.reached, self.go = threading.Event(), threading.Event()

    def after(self, target: str) -> None:
        if self.who is threading.current_thread() and target.endswith(self.name) and not self.reached.is_set():
            self.reached.set()
            assert self.go.wait(HOLD_S), "never released"

    def wait(self) -> None:
        assert self.reached.wait(HOLD_S), "the held thread never reached its point"


def test_a_follower_read_while_its_loop_plans_takes_every_join_exactly_once(tmp_path, monkeypatch):
    """The reader (the read-ahead thread) has read join 1's entry and is held before keeping it; the loop (this
    thread) reads the same entry meanwhile, planning epoch 0 as the trainer's schedule does. Join 2 arrives after.
    Every sample comes once: join 1 is not taken again in join 2's place, and join 2 is read."""
    monkeypatch.setenv("HSSTORE_WRITER_HEARTBEAT_S", "0.2")  # the writer's end is believed two beats after it
    url, journal = str(tmp_path / "s"), str(tmp_path / "journal")
    samples = make_samples(30, max_len=50)
    w = StoreWriter(url, make_manifest(), shard_bytes=TOKEN_BYTES * 100)
    add(w, samples[:10])
    follow = Follow(journal, lead=False, poll_s=(0.01, 0.05))
    leader = Leader(Journal.create(journal, [url]), [hsstore.open(url)], follow)
    assert leader.poll()  # join 0
    ds = HiddenStateDataset(url, planning=Planning(seed=SEED), follow=follow)
    assert len(ds.planned_ids(0)) == 10  # the loop's plan of what joined so far (this process's journal)

    hold = Hold("000001.json")
    read = door.read

    def held_read(fs, root, key, **kw):
        data = read(fs, root, key, **kw)
        hold.after(key)
        return data

    monkeypatch.setattr(door, "read", held_read)
    seen: list[str] = []
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            seen.extend(item["sample_id"] for item in ds)
        except BaseException as e:  # noqa: BLE001 (handed to the test's thread)
            errors.append(e)

    reader = threading.Thread(target=consume, daemon=True)
    hold.who = reader
    reader.start()
    add(w, samples[10:20])
    assert leader.poll()  # join 1: the reader, waiting for it, reads its entry and is held there
    hold.wait()
    assert len(ds.planned_ids(0)) == 20  # the loop reads join 1's entry meanwhile
    hold.go.set()
    add(w, samples[20:])
    w.close()
    assert leader.poll()  # join 2
    until_end(leader)
    reader.join(HOLD_S)
    assert not reader.is_alive() and not errors
    count = collections.Counter(seen)
    twice = sorted(i for i, n in count.items() if n > 1)
    never = sorted({s["sample_id"] for s in samples} - set(count))
    assert not twice and not never, f"trained twice: {twice}; never: {never}"


def test_a_journal_read_while_its_leader_appends_stays_contiguous(tmp_path, monkeypatch):
    """The leader's thread has written entry 1 and is held before keeping it; the loop (this thread) reads the
    journal through the same object meanwhile (what arrived, for its metrics row). The leader's next entry is entry
    2, not 3: a reader would wait for entry 2 for ever."""
    path = str(tmp_path / "journal")
    journal = Journal.create(path, [str(tmp_path / "s")])
    hold = Hold("000001.json")
    put = transfer.put_atomic

    def held_put(fs, target, data, root=None):
        stamp = put(fs, target, data, root)
        hold.after(target)
        return stamp

    monkeypatch.setattr(transfer, "put_atomic", held_put)
    errors: list[BaseException] = []

    def lead() -> None:
        try:
            for n in range(3):
                journal.append("join", shards=n, samples=n, tokens=n)
        except BaseException as e:  # noqa: BLE001 (handed to the test's thread)
            errors.append(e)

    leader = threading.Thread(target=lead, daemon=True)
    hold.who = leader
    leader.start()
    hold.wait()
    assert [e.index for e in journal.entries()] == [0, 1]  # the loop reads entry 1 once its file is there
    hold.go.set()
    leader.join(HOLD_S)
    assert not leader.is_alive() and not errors
    assert [e.index for e in journal.entries()] == [0, 1, 2]
    assert [(e.index, e.samples) for e in Journal(path).entries()] == [(0, 0), (1, 1), (2, 2)]
