"""Following a store while it is written (hsstore/loader/follow.py, hsstore/format/sessions.py): writer sessions
say who finished; epoch 0 takes shards as they commit, exactly once over ranks, through a resume and another world
size; an unhealthy arrival stops it naming the shard and the feature; epoch 1 is an ordinary epoch; S3 and the node
partition with its cache too. The trainer's side, with real processes: tests/test_train_follow.py."""

from __future__ import annotations

import collections
import threading
import time

import pytest
import torch

import hsstore
from hsstore.io import storage
from hsstore.distributed import World
from hsstore.format import commit, sessions
from hsstore.loader.dataset import HiddenStateDataset
from hsstore.loader.follow import Entry, Follow, FollowStopped, Journal, Leader
from hsstore.loader.options import Planning, Reading
from hsstore.loader.resume import merge_states
from hsstore.store.writer import StoreWriter
from hsstore.testing.stores import TOKEN_BYTES

from conftest import PATIENT_S3, make_manifest, make_samples

SEED = 3


def add(w: StoreWriter, samples) -> None:
    for s in samples:
        w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
    w.flush()  # committed now: the leader's next look finds them


@pytest.fixture(autouse=True)
def quick_beats(monkeypatch):
    """Writers beat every 0.2 s here: an end record is believed once its writer has stayed silent two beats."""
    monkeypatch.setenv("HSSTORE_WRITER_HEARTBEAT_S", "0.2")


def settled() -> float:
    """A moment at which every end record written until now is old enough to be believed."""
    return time.time() + sessions.SETTLE_BEATS * sessions.heartbeat_s() + 1


def until_end(leader: Leader, timeout: float = 30.0) -> None:
    """Poll until epoch 0 ended (the writers' end records believed once they settled)."""
    deadline = time.monotonic() + timeout
    while (Journal(leader.journal.path).outcome() or Entry(0, "join", 0)).kind != "end":
        assert time.monotonic() < deadline, "epoch 0 did not end"
        leader.poll()
        time.sleep(0.05)


def writers_of(url) -> sessions.Writers:
    fs, root = storage.resolve(str(url))
    return sessions.read_writers(fs, root)


def listed(url) -> set[str]:
    fs, root = storage.resolve(str(url))
    return set(commit.list_committed(fs, root))


def test_writer_sessions_say_which_writer_finished(tmp_path):
    url = tmp_path / "s"
    samples = make_samples(6, max_len=40)
    with StoreWriter(str(url), make_manifest(), writer_tag="rank00000", expects=["rank00000", "rank00001"]) as w:
        add(w, samples[:3])
        live = writers_of(url)
        assert [s.state for s in live.states()] == ["open"] and not live.finished(listed(url))
    done = writers_of(url)
    assert [s.state for s in done.states()] == ["ending"]  # believed once it has stayed silent two beats
    assert [s.state for s in done.states(settled())] == ["ended"] and done.states()[0].end.samples == 3
    # its job expects rank 1 as well, which never started: not finished, and said so
    assert not done.finished(listed(url)) and done.expected_missing() == ["rank00001"]
    assert "writer rank00001: expected by its job, not started yet" in done.waiting_for(listed(url))

    # rank 1 is killed: its session record stays, its heartbeat stops, no end record
    fs, root = storage.resolve(str(url))
    killed = sessions.new_session("rank00001", "deadbeef", host="h", pid=1, expects=["rank00000", "rank00001"],
                                  beat_s=1.0)
    killed.heartbeat_unix -= 60
    sessions.write_session(fs, root, killed)
    w1 = writers_of(url)
    (dead,) = [s for s in w1.states() if s.state == "dead"]
    assert "no heartbeat for 60s" in dead.describe() and not w1.finished(listed(url))
    assert any("rank00001 (session deadbeef" in line for line in w1.waiting_for(listed(url)))

    # a re-run of rank 1 (a later session of its tag) that ends replaces the dead one: the store is finished
    with StoreWriter(str(url), make_manifest(), writer_tag="rank00001", expects=["rank00000", "rank00001"]) as w:
        add(w, samples[3:5])
    w2 = writers_of(url)
    assert sorted(s.state for s in w2.states(settled())) == ["ended", "ended", "replaced"]
    assert w2.finished(listed(url), settled())
    # ... unless the listing does not show every shard an ended session committed yet
    assert not w2.finished(listed(url) - {min(listed(url))}, settled())

    # an unreadable writer record may be an open writer's: not finished, and named
    (url / sessions.WRITERS_DIR / "rank00009-0badf00d.json").write_text("{not json")
    w3 = writers_of(url)
    assert not w3.finished(listed(url)) and any("rank00009-0badf00d.json" in x for x in w3.waiting_for(listed(url)))
    (url / sessions.WRITERS_DIR / "rank00009-0badf00d.json").unlink()

    # a writer that fails says so (a follower waits for a re-run)
    with pytest.raises(RuntimeError):
        with StoreWriter(str(url), make_manifest(), writer_tag="rank00002") as w:
            add(w, samples[5:])
            raise RuntimeError("the target ran out of memory")
    (failed,) = [s for s in writers_of(url).states() if s.state == "failed"]
    assert "RuntimeError: the target ran out of memory" in failed.describe()

    # a store written before writer records existed is finished, as readers always took it
    old = tmp_path / "old"
    with StoreWriter(str(old), make_manifest()) as w:
        add(w, samples[:2])
    storage.resolve(str(old))[0].rm(str(old / sessions.WRITERS_DIR), recursive=True)
    assert writers_of(old).finished(listed(old))


def consume(ds, out: list, errors: list) -> None:
    try:
        for item in ds:
            out.append(item["sample_id"])
    except BaseException as e:  # noqa: BLE001 (handed to the test's thread)
        errors.append(e)


def wait_until(cond, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_epoch0_takes_shards_as_they_commit_exactly_once_and_epoch1_is_ordinary(tmp_path):
    url, journal = str(tmp_path / "s"), str(tmp_path / "journal")
    samples = make_samples(48, max_len=60)
    w = StoreWriter(url, make_manifest(), shard_bytes=TOKEN_BYTES * 120, writer_tag="rank00000",
                    planned_samples=48, planned_tokens=sum(len(s["input_ids"]) for s in samples))
    add(w, samples[:16])
    follow = Follow(journal, lead=False, poll_s=(0.01, 0.05))
    leader = Leader(Journal.create(journal, [url]), [hsstore.open(url)], follow)
    ranks = [HiddenStateDataset(url, world=World(r, 2), planning=Planning(seed=SEED), follow=follow)
             for r in range(2)]
    seen = [[], []]
    errors: list = []
    threads = [threading.Thread(target=consume, args=(ds, seen[r], errors), daemon=True) for r, ds in enumerate(ranks)]
    for t in threads:
        t.start()
    assert leader.poll()  # join 0: what was there
    wait_until(lambda: len(seen[0]) + len(seen[1]) == 16)
    add(w, samples[16:32])
    assert leader.poll()  # join 1: what committed since
    wait_until(lambda: len(seen[0]) + len(seen[1]) == 32)
    time.sleep(0.2)
    assert all(t.is_alive() for t in threads) and not leader.poll()  # caught up: the writer is open, they wait
    add(w, samples[32:])
    w.close()
    assert leader.poll()  # join 2
    until_end(leader)  # and the end: every writer finished
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    count = collections.Counter(seen[0] + seen[1])
    assert set(count) == {s["sample_id"] for s in samples} and set(count.values()) == {1}
    assert seen[0] and seen[1] and not set(seen[0]) & set(seen[1])
    assert [e.kind for e in Journal(journal).entries()] == ["join", "join", "join", "end"]
    assert Journal(journal).entries()[0].expected_tokens == sum(len(s["input_ids"]) for s in samples)

    # 2 ranks x 2 workers: the four slots' epoch-0 orders hold every sample once
    slots = [ranks[r].planned_ids(0, ranks[r].world.at(r, k, 2)) for r in range(2) for k in range(2)]
    assert collections.Counter(i for s in slots for i in s) == collections.Counter(count)
    assert all(slots)

    # epoch 1 is an ordinary epoch of the finished store: the plan of a run started on it
    for r, ds in enumerate(ranks):
        ordinary = HiddenStateDataset(url, world=World(r, 2), planning=Planning(seed=SEED))
        ds.set_epoch(1)
        assert [x["sample_id"] for x in ds] == ordinary.planned_ids(1)
        for k in range(2):
            assert ds.planned_ids(1, ds.world.at(r, k, 2)) == ordinary.planned_ids(1, ordinary.world.at(r, k, 2))


def grown(tmp_path, n=40, parts=(10, 25)):
    """A store written in three commits, each joined by its own look, then ended: (url, journal, ids)."""
    url, journal = str(tmp_path / "s"), str(tmp_path / "journal")
    samples = make_samples(n, max_len=50)
    w = StoreWriter(url, make_manifest(), shard_bytes=TOKEN_BYTES * 100)
    add(w, samples[:parts[0]])
    follow = Follow(journal, lead=False)
    leader = Leader(Journal.create(journal, [url]), [hsstore.open(url)], follow)
    leader.poll()
    add(w, samples[parts[0]:parts[1]])
    leader.poll()
    add(w, samples[parts[1]:])
    w.close()
    leader.poll()
    until_end(leader)
    assert [e.kind for e in Journal(journal).entries()] == ["join", "join", "join", "end"]
    return url, follow, {s["sample_id"] for s in samples}


def test_a_resumed_follower_continues_exactly_once_also_on_another_world(tmp_path):
    url, follow, ids = grown(tmp_path)
    ds = HiddenStateDataset(url, planning=Planning(seed=SEED), follow=follow)
    it = iter(ds)
    first = [next(it)["sample_id"] for _ in range(17)]  # into the second join
    state = ds.state_dict()
    assert state["follow"]["joins"] == 2 and state["config"]["follow"] == Journal(follow.journal).id
    again = HiddenStateDataset(url, planning=Planning(seed=SEED), follow=follow)
    again.load_state_dict(state)
    rest = [x["sample_id"] for x in again]
    assert sorted(first + rest) == sorted(ids) and len(first + rest) == len(ids)

    # two ranks stop part way, one resumes from their merged states: the rest of every join, exactly once
    ranks = [HiddenStateDataset(url, world=World(r, 2), planning=Planning(seed=SEED), follow=follow) for r in range(2)]
    its = [iter(ds) for ds in ranks]
    taken = [next(its[0])["sample_id"] for _ in range(14)] + [next(its[1])["sample_id"] for _ in range(3)]
    one = HiddenStateDataset(url, planning=Planning(seed=SEED), follow=follow)
    one.load_state_dict(merge_states([ds.state_dict() for ds in ranks]))
    rest = [x["sample_id"] for x in one]
    assert collections.Counter(taken + rest) == collections.Counter(ids)

    # a state of another journal is refused
    other = dict(state, follow={**state["follow"], "journal": "0" * 32})
    with pytest.raises(ValueError, match="journal|follow"):
        HiddenStateDataset(url, planning=Planning(seed=SEED), follow=follow).load_state_dict(
            dict(other, config={**state["config"], "follow": "0" * 32}))


def test_a_resumed_follower_continues_exactly_once_over_two_world_size_changes(tmp_path):
    """2 ranks, then 1, then 2 again, each phase stopped part way: every phase keeps what the ones before it
    consumed (a re-cut folds the earlier phases' ``done`` into its own), so every sample is handed out once."""
    url, follow, ids = grown(tmp_path)

    def started(world: int, state=None) -> list:
        ranks = [HiddenStateDataset(url, world=World(r, world), planning=Planning(seed=SEED), follow=follow)
                 for r in range(world)]
        for ds in ranks:
            if state is not None:
                ds.load_state_dict(state)
        return ranks

    def take(ds, it, n: int) -> list[str]:
        return [next(it)["sample_id"] for _ in range(n)]

    first = started(2)
    its = [iter(ds) for ds in first]
    taken = take(first[0], its[0], 9) + take(first[1], its[1], 4)  # rank 0 into the second join
    one = started(1, merge_states([ds.state_dict() for ds in first]))[0]
    it = iter(one)
    taken += take(one, it, 11)
    assert one.state_dict()["phase"] == 1
    again = started(2, merge_states([one.state_dict()]))
    rest = [x["sample_id"] for ds in again for x in ds]
    assert again[0].state_dict()["phase"] == 2
    count = collections.Counter(taken + rest)
    assert set(count) == ids and set(count.values()) == {1}, [k for k, v in count.items() if v > 1]


def test_a_rerun_after_a_killed_rerun_is_waited_for(tmp_path, monkeypatch):
    """Writer tag rank00000 ran once and ended; a re-run of it (more input) was killed, its heartbeat stopped, no
    end record; a third run ends. The killed session is never taken for a finished one (the tag's earlier end,
    believed by then, came before it): epoch 0 waits, and ends with the third run's shards."""
    monkeypatch.setenv("HSSTORE_WRITER_HEARTBEAT_S", "0.1")  # an end is believed after two silent beats
    url, journal = str(tmp_path / "s"), str(tmp_path / "journal")
    samples = make_samples(9, max_len=40)
    with StoreWriter(url, make_manifest(), writer_tag="rank00000") as w:
        add(w, samples[:3])
    fs, root = storage.resolve(url)
    killed = sessions.new_session("rank00000", "deadbeef", host="h", pid=1, beat_s=0.05)  # started after that end
    sessions.write_session(fs, root, killed)
    # silent past its beats (dead by the rule), and the first run's end settled (believed)
    time.sleep(max(1.5 * sessions.STALE_BEATS * killed.heartbeat_s, 3 * sessions.SETTLE_BEATS * 0.1))
    follow = Follow(journal, lead=False)
    leader = Leader(Journal.create(journal, [url]), [hsstore.open(url)], follow)
    assert leader.poll()  # the first run's shards join; the killed re-run may still write: no end
    assert [e.kind for e in Journal(journal).entries()] == ["join"]
    assert not leader.poll() and not leader.done
    assert any("deadbeef" in line and "no heartbeat" in line for line in leader.waiting)
    with StoreWriter(url, make_manifest(), writer_tag="rank00000") as w:  # the next re-run finishes the work
        add(w, samples[3:])
    assert leader.poll()  # its shards join; its end is believed once the session has stayed silent a while
    deadline = time.time() + 30
    while not leader.done and time.time() < deadline:
        time.sleep(0.1)
        leader.poll()
    assert leader.done, leader.waiting
    assert [e.kind for e in Journal(journal).entries()] == ["join", "join", "end"]
    ds = HiddenStateDataset(url, planning=Planning(seed=SEED), follow=follow)
    assert sorted(x["sample_id"] for x in ds) == sorted(s["sample_id"] for s in samples)


def test_a_journal_of_another_store_is_refused(tmp_path):
    """A journal folder keeps the stores it follows: a follower of another store given it (another run's --out)
    is refused in one line, never planned from the other store's joins."""
    a, b, journal = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "journal")
    for url, prefix in ((a, "a"), (b, "b")):
        with StoreWriter(url, make_manifest()) as w:
            add(w, make_samples(4, max_len=40, prefix=prefix))
    Leader(Journal.create(journal, [a]), [hsstore.open(a)], Follow(journal, lead=False)).poll()
    with pytest.raises(hsstore.StoreError, match=r"holds the follow journal of stores \[.*/a'\], not \[.*/b'\]"):
        Journal.create(journal, [b])
    with pytest.raises(hsstore.StoreError, match="holds the follow journal of stores"):
        HiddenStateDataset(b, planning=Planning(seed=SEED), follow=Follow(journal))  # the leader's own look
    assert sorted(x["sample_id"] for x in HiddenStateDataset(a, planning=Planning(seed=SEED),
                                                              follow=Follow(journal))) == [f"a{i}" for i in range(4)]


def test_an_arrival_that_trains_nothing_stops_epoch0_naming_shard_and_feature(tmp_path):
    url, journal = str(tmp_path / "s"), str(tmp_path / "journal")
    samples = make_samples(8, max_len=40)
    zero = dict(samples[7], sample_id="zeros", hidden_states=torch.zeros_like(samples[7]["hidden_states"]))
    w = StoreWriter(url, make_manifest())
    add(w, samples[:7])
    follow = Follow(journal, lead=False)
    leader = Leader(Journal.create(journal, [url]), [hsstore.open(url)], follow)
    leader.poll()
    add(w, [zero])
    w.close()
    bad_shard = max(listed(url))
    assert leader.poll() and leader.done
    (stop,) = [e for e in Journal(journal).entries() if e.kind == "stop"]
    assert bad_shard in stop.why and "'zeros', layer 1: all zero" in stop.why and "\n" not in stop.why
    ds = HiddenStateDataset(url, planning=Planning(seed=SEED), follow=follow)
    got = []
    with pytest.raises(FollowStopped, match=bad_shard):
        for x in ds:
            got.append(x["sample_id"])
    assert sorted(got) == sorted(s["sample_id"] for s in samples[:7])  # everything before it was handed out

    # allowed: the leader of a re-run joins it (logged) and epoch 0 ends
    allow = Follow(journal, lead=False, allow_unhealthy=True)
    again = Leader(Journal(journal), [hsstore.open(url)], allow)
    assert again.poll()
    until_end(again)
    assert Journal(journal).outcome().kind == "end"
    ds = HiddenStateDataset(url, planning=Planning(seed=SEED), follow=allow)
    assert sorted(x["sample_id"] for x in ds) == sorted([s["sample_id"] for s in samples[:7]] + ["zeros"])


def test_follow_on_s3_with_the_node_partition_and_its_cache(s3_endpoint, tmp_path):
    import s3fs
    import uuid

    s3fs.S3FileSystem.clear_instance_cache()
    opts = {"endpoint_url": s3_endpoint, **PATIENT_S3}
    bucket = f"hs-follow-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**opts).mkdir(bucket)
    url, journal = f"s3://{bucket}/stores/a", str(tmp_path / "journal")
    samples = make_samples(24, max_len=60)
    w = StoreWriter(url, make_manifest(), shard_bytes=TOKEN_BYTES * 150, storage_options=opts)
    add(w, samples[:10])
    follow = Follow(journal, lead=False)
    leader = Leader(Journal.create(journal, [url]), [hsstore.open(url, **opts)], follow)
    assert leader.poll()
    add(w, samples[10:])
    w.close()
    assert leader.poll()
    until_end(leader)
    assert Journal(journal).outcome().kind == "end"

    def node_ds(r, follow=follow):
        return HiddenStateDataset(url, world=World(r, 2, node=r, nodes=2), storage_options=opts, follow=follow,
                                  planning=Planning(seed=SEED, partition="node"),
                                  reading=Reading(cache_dir=str(tmp_path / f"cache{r}")))

    ranks = [node_ds(r) for r in range(2)]
    seen = [[x["sample_id"] for x in ds] for ds in ranks]
    assert collections.Counter(seen[0] + seen[1]) == collections.Counter(s["sample_id"] for s in samples)
    assert seen[0] and seen[1]
    assert all(any((tmp_path / f"cache{r}").rglob("*")) for r in range(2))  # remote chunks went through the cache
    for r, ds in enumerate(ranks):  # epoch 1: the node partition of the finished store
        ds.set_epoch(1)
        assert [x["sample_id"] for x in ds] == node_ds(r, None).planned_ids(1)
