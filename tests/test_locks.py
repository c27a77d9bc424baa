"""A forked child never waits for a lock a parent thread held at fork time: the DataLoader ``fork`` context
starts workers while the parent's read-ahead threads may be inside a records read."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading

import pytest

import hsstore
from hsstore.format import records
from hsstore.locks import ProcessLock
from hsstore.testing.stores import make_samples, write_store

FORK = mp.get_context("fork")


def _held_by_a_thread(lock) -> threading.Event:
    """Make a parent thread take ``lock`` and keep it until the returned event is set."""
    taken, done = threading.Event(), threading.Event()

    def hold():
        with lock:
            taken.set()
            done.wait(30)

    threading.Thread(target=hold, daemon=True).start()
    assert taken.wait(10)
    return done


def _acquire_in_child(lock, out) -> None:
    out.put(lock.acquire(timeout=2))


@pytest.mark.parametrize("kind", [threading.Lock, ProcessLock])
def test_a_lock_held_at_fork_time(kind):
    lock, out = kind(), FORK.Queue()
    done = _held_by_a_thread(lock)
    try:
        p = FORK.Process(target=_acquire_in_child, args=(lock, out), daemon=True)
        p.start()
        got = out.get(timeout=30)
        p.join(30)
    finally:
        done.set()
    # a plain lock stays held in the child for good (the hazard); a ProcessLock is the child's own
    assert got is (kind is ProcessLock)


def test_pickled_copy_is_a_fresh_lock():
    lock = ProcessLock()
    with lock:
        copy = pickle.loads(pickle.dumps(lock))
        assert lock.locked() and not copy.locked()


def _read_record(store, out) -> None:
    out.put(store.commits[1].shard)


def test_child_reads_records_while_a_parent_thread_is_inside_a_records_read(tmp_path, monkeypatch):
    url = write_store(str(tmp_path / "s"), make_samples(30, max_len=120), shard_tokens=400)
    store = hsstore.open(url)
    want = store.commits.table.shard[1]
    parent, release, inside = os.getpid(), threading.Event(), threading.Event()
    raw = records.RecordTable.raw

    def slow_raw(self, i, cache=None):  # the parent's read of row 0 is slow (a large block), holding the lock
        if os.getpid() == parent and i == 0:
            inside.set()
            release.wait(30)
        return raw(self, i, cache)

    monkeypatch.setattr(records.RecordTable, "raw", slow_raw)
    reader = threading.Thread(target=lambda: store.commits[0], daemon=True)
    reader.start()
    assert inside.wait(10)
    out = FORK.Queue()
    try:
        p = FORK.Process(target=_read_record, args=(store, out), daemon=True)
        p.start()
        assert out.get(timeout=30) == want
        p.join(30)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
        release.set()
        reader.join(30)
