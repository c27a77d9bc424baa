"""While a store is written, its commit records are the authority (hsstore/format/sessions.py, ``end_verdict``;
hsstore/loader/follow.py, ``check_join``): an end record is believed only where it agrees with the shards
committed under its session and its writer has stayed silent since; a follow journal taken up again is believed
only where its records are the stores' own; store strings in a follower's lines are escaped; at its deadline a
follower says what it trained and what the stores hold; ``train --follow`` ends saying trained vs held, exit 1
when they differ. Through ``hsstore train --follow`` and ``hsstore extract``."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hsstore
from hsstore.app.cli import main
from hsstore.app.schema import build
from hsstore.errors import CorruptionError
from hsstore.extract.job import ExtractSettings, run_extract
from hsstore.extract.tiny import demo_conversations_path
from hsstore.format import codec, index, records, sessions
from hsstore.format.commit import CommitRecord
from hsstore.io import storage
from hsstore.loader.dataset import HiddenStateDataset
from hsstore.loader.follow import Follow, Journal, Leader
from hsstore.loader.options import Planning
from hsstore.store.writer import StoreWriter
from hsstore.testing.stores import TOKEN_BYTES

from conftest import make_manifest, make_samples
from test_train_follow import kill, start, wait_for
from train_helpers import REPO, small_input  # noqa: F401  (fixture)

BEAT = "0.2"
TRAIN = ["--token-budget", "1024", "--draft-layers", "1", "--block-size", "8", "--anchors", "32", "--log-every", "1",
         "--device", "cpu", "-q", "--log-samples"]


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    """Writers beat every 0.2 s and followers look every 0.2 s: an end is believed 0.4 s after it is written."""
    monkeypatch.setenv("HSSTORE_WRITER_HEARTBEAT_S", BEAT)
    monkeypatch.setenv("HSSTORE_FOLLOW_POLL_S", BEAT)


def add(w: StoreWriter, samples) -> None:
    for s in samples:
        w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
    w.flush()


def committed(url) -> dict[str, tuple[int, int]]:
    """Shard -> (samples, tokens) of every committed shard, from the records."""
    t = hsstore.open(str(url)).table
    return dict(zip(t.shard.tolist(), zip(t.n_samples.tolist(), t.n_tokens.tolist())))


def plant_end(url, w: StoreWriter, ended_unix: float | None = None, **change) -> sessions.EndRecord:
    """An end record for ``w``'s session that agrees with what it committed (less what ``change`` changes)."""
    mine = [c for n, c in committed(url).items() if n.startswith(f"{w.tag}-{w.session}-")]
    end = sessions.EndRecord(w.tag, w.session, "planted", time.time() if ended_unix is None else ended_unix,
                             len(mine), sum(c[0] for c in mine), sum(c[1] for c in mine))
    for k, v in change.items():
        setattr(end, k, v)
    sessions.write_end(*storage.resolve(str(url)), end)
    return end


def states(url) -> dict[str, sessions.SessionState]:
    fs, root = storage.resolve(str(url))
    return {s.record.key: s for s in sessions.read_writers(fs, root).states(None, committed(url))}


def journal_kinds(path) -> list[str]:
    return [e.kind for e in Journal(path).entries()]


def test_an_end_record_planted_beside_a_live_writer_is_not_believed(tmp_path, caplog):
    url, journal = str(tmp_path / "s"), str(tmp_path / "journal")
    samples = make_samples(20, max_len=40)
    w = StoreWriter(url, make_manifest(), shard_bytes=TOKEN_BYTES * 80, writer_tag="rank00000")
    add(w, samples[:8])
    leader = Leader(Journal.create(journal, [url]), [hsstore.open(url)], Follow(journal, lead=False))
    plant_end(url, w)  # it agrees with every record committed so far
    with caplog.at_level(logging.WARNING, logger="hsstore.loader.follow"):
        deadline = time.monotonic() + 3  # 15 beats: the writer beats on after its "end"
        while time.monotonic() < deadline:
            leader.poll()
            time.sleep(0.05)
    assert journal_kinds(journal) == ["join"]  # what was there joined; the end was not believed
    (s,) = states(url).values()
    assert s.state == "disputed" and "after its end record: it still runs" in s.describe()
    warned = [r.getMessage() for r in caplog.records if "is not believed" in r.getMessage()]
    assert len(warned) == 1 and w.session in warned[0]
    add(w, samples[8:])  # the writer goes on, and its own end record replaces the planted one
    w.close()
    deadline = time.monotonic() + 30
    while journal_kinds(journal)[-1] != "end":
        assert time.monotonic() < deadline
        leader.poll()
        time.sleep(0.05)
    assert Journal(journal).entries()[-1].samples == 20


def test_an_end_record_is_held_to_the_records_its_plan_and_its_own_name(tmp_path):
    url = tmp_path / "s"
    w = StoreWriter(str(url), make_manifest(), shard_bytes=TOKEN_BYTES * 80, writer_tag="a", planned_samples=6)
    add(w, make_samples(4, max_len=40))
    w._session._halt()  # the writer stops beating (killed): only its records speak now
    later = time.time() + 1
    plant_end(url, w, ended_unix=later, samples=5)
    time.sleep(1.5)
    assert states(url)[f"a-{w.session}"].state == "disputed"
    assert "its end record says 5 sample(s)" in states(url)[f"a-{w.session}"].why
    plant_end(url, w, ended_unix=later)  # agrees with the records, not with what it planned
    assert "it planned 6 sample(s), its end record says 4" in states(url)[f"a-{w.session}"].why
    plant_end(url, w, ended_unix=later, shards=99)
    assert "counts 99 shard(s)" in states(url)[f"a-{w.session}"].why

    # an end record under another session's name is not read as that session's
    fs, root = storage.resolve(str(url))
    other = sessions.EndRecord("a", "0ther000", "x", later, 0, 0, 0).to_json()
    fs.pipe_file(f"{root}/{sessions.WRITERS_DIR}/a-{w.session}{sessions.END_SUFFIX}", other)
    ws = sessions.read_writers(fs, root)
    assert f"a-{w.session}{sessions.END_SUFFIX}" in ws.damaged and not ws.finished(committed(url))


def reencode(journal: Path, change) -> None:
    """Join 0's records in the journal rewritten: ``change(record_json)`` on the first, the rest as they were, and
    the segment encoded again (a valid segment: only the store can say it is not its own)."""
    name = "000000.s0.idx"
    t = index.decode_segment(name, (journal / name).read_bytes()).table
    items = []
    for i, raw in enumerate(records.raws(t)):
        if i == 0:
            d = json.loads(raw)
            change(d)
            raw = json.dumps(d).encode()
        items.append((CommitRecord.from_json(raw, "test"), raw, None, codec.crc32c(raw)))
    (journal / name).write_bytes(index.encode_segment("follow", "join 0", records.from_records(items)))


def test_the_loader_refuses_a_journal_whose_records_are_not_the_stores(tmp_path):
    """Two samples of a record swap their ids in the journal's copy: served, each would carry the other's
    features; the leader that takes the journal up compares it with the store first."""
    url, journal = str(tmp_path / "s"), tmp_path / "journal"
    samples = make_samples(40, max_len=40)
    w = StoreWriter(url, make_manifest(), shard_bytes=TOKEN_BYTES * 200)
    add(w, samples)
    w.close()
    time.sleep(0.5)
    leader = Leader(Journal.create(str(journal), [url]), [hsstore.open(url)], Follow(str(journal), lead=False))
    leader.poll()
    assert journal_kinds(journal) == ["join", "end"]

    def swap(d):
        ids = d["samples"]["sample_id"]
        ids[0], ids[1] = ids[1], ids[0]

    entry = journal / "000000.json"
    whole = entry.read_text()
    entry.write_text(whole.replace('"samples": 40', '"samples": 400'))  # its counts are its records' too
    with pytest.raises(CorruptionError, match=r"join 0: its entry counts \d+ shard\(s\), 400 sample\(s\)"):
        Leader(Journal(str(journal)), [hsstore.open(url)], Follow(str(journal), lead=False))
    entry.write_text(whole)
    other = str(tmp_path / "other")  # a store at another place: the journal names shards it has not committed
    add(StoreWriter(other, make_manifest(), writer_tag="x"), samples[:3])
    with pytest.raises(CorruptionError, match=r"join 0: names shard .*, which store .* has not committed"):
        Leader(Journal(str(journal)), [hsstore.open(other)], Follow(str(journal), lead=False))

    reencode(journal, swap)
    ds = HiddenStateDataset(url, planning=Planning(seed=1), follow=Follow(str(journal), lead=True))
    store = hsstore.open(url)
    index_of = {sid: i for i, sid in enumerate(store.sample_ids())}
    served = []
    with pytest.raises(CorruptionError, match=r"join 0: its record of shard .* is not the one store"):
        for item in ds:  # without the check: the swapped pair is served with each other's features
            own = store.read(index_of[item["sample_id"]])["hidden_states"]
            served.append(item["sample_id"] if own.shape == item["hidden_states"].shape and bool(
                (own == item["hidden_states"]).all()) else "another's features")
    assert served == []


@pytest.fixture
def extracted(tiny_dir, small_input, tmp_path):  # noqa: F811
    """A finished store of the tiny target (its writers beat every 0.2 s: believed finished 0.4 s after)."""
    store = tmp_path / "store"
    run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(small_input)], out=str(store), device="cpu",
                      progress=False))
    return store


def test_a_resumed_train_follow_refuses_a_journal_changed_since_it_was_written(extracted, tmp_path, capsys):
    """A received run's journal whose record copy names an id the store does not have: the resumed run would
    train it; the leader that takes the journal up compares it with the store first (one line, exit 2)."""
    run = tmp_path / "run"
    argv = ["train", "--store", str(extracted), "--out", str(run), "--follow", *TRAIN]
    assert main([*argv, "--epochs", "1"]) == 0
    capsys.readouterr()
    reencode(run / "follow", lambda d: d["samples"]["sample_id"].__setitem__(0, "forged"))
    samples_log = run / "samples.rank00000.jsonl"
    before = samples_log.read_text()
    rc = main([*argv, "--epochs", "2"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "join 0: its record of shard" in lines[0], lines
    assert "is not the one store" in lines[0] and samples_log.read_text() == before  # nothing trained


@pytest.mark.parametrize("name, stores, said", [
    *[("journal.json", v, "journal.json: not a follow journal") for v in (None, 5, [7])],  # not a list of URLs
    *[("000000.json", v, "000000.json: malformed journal entry") for v in (None, 5, 1.5, "0")]])  # no list
def test_a_resumed_train_follow_refuses_a_journal_whose_store_list_is_not_one(extracted, tmp_path, capsys, name,
                                                                             stores, said):
    """A received run's journal head, or an entry, whose store list is not one: one line naming the file, exit 2,
    not a traceback, nothing trained."""
    run = tmp_path / "run"
    argv = ["train", "--store", str(extracted), "--out", str(run), "--follow", *TRAIN]
    assert main([*argv, "--epochs", "1"]) == 0
    capsys.readouterr()
    path = run / "follow" / name
    path.write_text(json.dumps({**json.loads(path.read_text()), "stores": stores}))
    samples_log = run / "samples.rank00000.jsonl"
    before = samples_log.read_text()
    rc = main([*argv, "--epochs", "2"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and said in lines[0], lines
    assert samples_log.read_text() == before


def test_train_follow_ends_saying_trained_vs_held_and_exits_1_when_they_differ(extracted, tmp_path, capsys):
    run = tmp_path / "run"
    n = len(hsstore.open(str(extracted)))
    argv = ["train", "--store", str(extracted), "--out", str(run), "--follow", *TRAIN]
    assert main([*argv, "--epochs", "1"]) == 0
    assert f"--follow: epoch 0 trained {n} sample(s), all the stores hold" in capsys.readouterr().out

    # a sample committed after epoch 0 ended: the resumed run finishes, says so, exits 1
    held = hsstore.open(str(extracted))
    with StoreWriter(str(extracted), held.manifest, writer_tag="late") as w:
        x = held.read(0)
        w.add("late-0", x["input_ids"], x["loss_mask"], x["hidden_states"])
    assert main([*argv, "--epochs", "2"]) == 1
    err = capsys.readouterr().err
    assert f"epoch 0 trained {n} sample(s); the stores hold {n + 1} now: samples committed after epoch 0" in err
    assert main([*argv, "--steps", "20"]) == 0  # a run bounded by --steps says so and exits 0
    assert "(--steps 20 bounds the run)" in capsys.readouterr().out


def test_a_follower_stops_at_its_deadline_saying_what_it_trained_and_what_the_stores_hold(extracted, tmp_path):
    store, run = extracted, tmp_path / "run"
    n = len(hsstore.open(str(store)))
    fs, root = storage.resolve(str(store))
    dead = sessions.new_session("rank00001", "deadbeef", host="h", pid=1, beat_s=0.2)
    dead.heartbeat_unix -= 60
    sessions.write_session(fs, root, dead)
    cmd = [sys.executable, "-m", "hsstore", "train", "--store", str(store), "--out", str(run), "--follow",
           "--follow-deadline", "1", "--epochs", "1", *TRAIN]
    got = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    lines = [ln for ln in got.stderr.splitlines() if ln.strip() and not ln.startswith(("INFO", "WARNING"))]
    assert got.returncode == 2 and len(lines) == 1, got.stderr[-3000:]  # said once, not logged and raised both
    assert "epoch 0 stopped at its deadline" in lines[0] and f"it trained the {n} sample(s) that joined" in lines[0]
    assert "rank00001 (session deadbeef" in lines[0]
    assert list((run / "checkpoints").glob("step_*/trainer.json"))  # what was trained is kept

    # the deadline ended that run only: once the writer is accounted for, the same command follows on and finishes
    fs.rm_file(f"{root}/{sessions.WRITERS_DIR}/rank00001-deadbeef{sessions.SESSION_SUFFIX}")
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"--follow: epoch 0 trained {n} sample(s), all the stores hold" in again.stdout


def test_train_follow_does_not_end_on_an_end_record_planted_beside_a_live_extraction(tiny_dir, tmp_path):
    """The extraction holds after its third shard, beating; an end record that agrees with everything it committed
    is planted for it. The trainer must not take the store as finished: it warns and waits; the extraction is
    killed and re-run, and epoch 0 holds every sample, trained vs held said at the end (exit 0)."""
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:24]) + "\n")
    store, run, control = tmp_path / "store", tmp_path / "run", tmp_path / "control"
    control.mkdir()
    extract = ["extract", "--model", str(tiny_dir), "--input", str(data), "--out", str(store), "--device", "cpu",
               "-q", "--shard-mb", "0.05", "--token-budget", "600"]
    train = [sys.executable, "-m", "hsstore", "train", "--store", str(store), "--out", str(run), "--follow",
             "--epochs", "1", *TRAIN]
    e1_log, t_log, e2_log = tmp_path / "extract1.log", tmp_path / "train.log", tmp_path / "extract2.log"
    procs = []
    try:
        e1 = start([sys.executable, "tests/follow_extract.py", str(control), "--", *extract], e1_log,
                   {"FOLLOW_PAUSE": "3"})
        procs.append(e1)
        wait_for(lambda: (control / "paused").exists(), "the extraction's third shard", [(e1, e1_log)])
        fs, root = storage.resolve(str(store))
        (key,) = [k for k in sessions.read_writers(fs, root).sessions]
        mine = [c for n, c in committed(store).items() if n.startswith(key + "-")]
        sessions.write_end(fs, root, sessions.EndRecord(*key.split("-", 1), "planted", time.time(), len(mine),
                                                        sum(c[0] for c in mine), sum(c[1] for c in mine)))
        t = start(train, t_log)
        procs.append(t)
        wait_for(lambda: "is not believed" in t_log.read_text(), "the trainer's warning", [(t, t_log)])
        kill(e1)
        e2 = start([sys.executable, "-m", "hsstore", *extract], e2_log)
        procs.append(e2)
        assert e2.wait(300) == 0, e2_log.read_text()[-3000:]
        assert t.wait(300) == 0, t_log.read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                kill(p)
    ids = hsstore.open(str(store)).sample_ids()
    epoch0 = [s for line in (run / "samples.rank00000.jsonl").read_text().splitlines()
              for s in json.loads(line)["samples"] if json.loads(line)["epoch"] == 0]
    assert sorted(epoch0) == sorted(ids) and len(ids) == len(set(ids))
    assert f"--follow: epoch 0 trained {len(ids)} sample(s), all the stores hold" in t_log.read_text()


def test_a_newline_in_a_dead_writers_host_does_not_forge_a_line(extracted, tmp_path):
    store, run = extracted, tmp_path / "run"
    forged = "INFO hsstore.loader.follow: epoch 0: every writer finished; 8 shard(s), 8 sample(s) joined in all"
    fs, root = storage.resolve(str(store))
    dead = sessions.new_session("rank00001", "deadbeef", host="h\n" + forged, pid=1, beat_s=0.5)
    dead.heartbeat_unix -= 60
    sessions.write_session(fs, root, dead)
    log = tmp_path / "train.log"
    t = start([sys.executable, "-m", "hsstore", "train", "--store", str(store), "--out", str(run), "--follow",
               "--epochs", "1", *TRAIN], log)
    try:
        wait_for(lambda: "no heartbeat for" in log.read_text(), "the dead writer's warning", [(t, log)])
    finally:
        kill(t)
    text = log.read_text()
    assert not any(line.startswith(forged) for line in text.splitlines()), text[-3000:]
    assert "host h\\n" + forged in text


def edit_trained(run: Path, change) -> None:
    """``change`` applied to the sample ids of the first step in the run's samples log (what epoch 0 trained)."""
    path = run / "samples.rank00000.jsonl"
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    change(first["samples"])
    path.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")


def test_train_follow_counts_the_sample_ids_it_trained_not_the_items(extracted, tmp_path, capsys, caplog):
    """The end of a --follow run counts what epoch 0 trained by sample id against the stores' ids: a sample trained
    twice (with every count still right) or one never trained (another id in its place) makes its line say so and
    the run exit 1. The record is what the trainer took, step by step; here it is changed between runs as a reader
    serving a join twice would have written it."""
    run = tmp_path / "run"
    ids = hsstore.open(str(extracted)).sample_ids()
    unasked = [a for a in TRAIN if a != "--log-samples"]  # --follow writes the samples log it counts, unasked
    argv = ["train", "--store", str(extracted), "--out", str(run), "--follow", *unasked, "--epochs", "1"]
    assert main(argv) == 0
    assert f"--follow: epoch 0 trained {len(ids)} sample(s), all the stores hold" in capsys.readouterr().out
    lines = (run / "samples.rank00000.jsonl").read_text().splitlines()
    assert {json.loads(ln)["epoch"] for ln in lines} == {0}
    assert sorted(s for ln in lines for s in json.loads(ln)["samples"]) == sorted(ids)  # every id it took, once
    first = json.loads(lines[0])["samples"]
    assert len(first) >= 2

    edit_trained(run, lambda got: got.append(got[0]))  # one sample trained twice
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert (f"--follow: epoch 0 trained {len(ids)} distinct sample(s) in {len(ids) + 1}: 1 trained more than once "
            f"({first[0]!r}); the stores hold {len(ids)}") in err

    edit_trained(run, lambda got: got.__setitem__(slice(None), ["not-in-the-store", *got[2:]]))  # and one never
    with caplog.at_level("WARNING"):  # the id no store holds named, never counted: it would make the count right
        assert main(argv) == 1
    err = capsys.readouterr().err
    assert any("1 sample id(s) of the samples logs are in none of the stores" in r.getMessage()
               and "'not-in-the-store'" in r.getMessage() for r in caplog.records), caplog.text
    assert f"epoch 0 trained {len(ids) - 1} sample(s); the stores hold {len(ids)} now" in err
    assert f"(1 never trained: {first[1]!r})" in err


def test_a_follower_holds_one_group_of_writer_records_at_a_time(tmp_path, monkeypatch):
    """Hundreds of writer records each listing a job of 1e5 ranks: a poll reads them a group at a time (what it
    holds at once bounded whatever their number), and every record is still read."""
    from hsstore.io import door

    fs, root = storage.resolve(str(tmp_path / "s"))
    tags = [f"rank{i:05d}" for i in range(100_000)]
    for i in range(24):
        sessions.write_session(fs, root, sessions.new_session(f"rank{i:05d}", f"{i:08x}", host="h", pid=1,
                                                              expects=tags))
    held, read_many = [], door.read_many
    monkeypatch.setattr(door, "read_many", lambda fs, root, keys, **kw: held.append(sum(
        fs.size(storage.join(root, k)) for k in keys)) or read_many(fs, root, keys, **kw))
    writers = sessions.read_writers(fs, root)
    assert len(writers.sessions) == 24 and not writers.damaged
    assert sum(held) > sessions.READ_GROUP_BYTES and max(held) <= sessions.READ_GROUP_BYTES, held
