"""A writer tag is one writer at a time (hsstore/format/sessions.py, ``claim_slot``): a second writer of a tag that
is being written is refused where it starts, in one line, writing nothing; the ranks of one job (different tags),
a re-run after the first finished and a re-run after a kill -9 keep working. Local disk (O_CREAT | O_EXCL through
the sinks) and S3 (a conditional PUT, ``If-None-Match: *``, on moto's server); through two identical
``hsstore extract`` commands."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hsstore
from hsstore.app.schema import build
from hsstore.extract import job
from hsstore.extract.tiny import demo_conversations_path
from hsstore.format import sessions
from hsstore.io import storage
from hsstore.ops.verify import verify
from hsstore.store.writer import StoreWriter

from conftest import make_manifest, make_samples

REPO = Path(__file__).resolve().parents[1]


def add(w: StoreWriter, samples) -> None:
    for s in samples:
        w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
    w.flush()


def writer_objects(url) -> list[str]:
    return sorted(os.listdir(Path(url) / sessions.WRITERS_DIR))


def dead_pid() -> int:
    """The pid of a process of this machine that has exited."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def plant(url, tag: str, session: str, *, host: str, pid: int, beat_age: float = 0.0, end: bool = False) -> None:
    """A slot of ``tag`` held by ``session`` (its session record last beating ``beat_age`` seconds ago; with an end
    record written just now, before that beat when the beat is recent)."""
    fs, root = storage.resolve(str(url))
    rec = sessions.new_session(tag, session, host=host, pid=pid, beat_s=1.0)
    rec.heartbeat_unix -= beat_age
    sessions.write_session(fs, root, rec)
    slot = sessions.SlotRecord(tag, session, host, pid, rec.started_unix, rec.heartbeat_s)
    fs.pipe_file(f"{root}/{sessions.slot_key(tag)}", slot.to_json())
    if end:
        sessions.write_end(fs, root, sessions.EndRecord(tag, session, "then", rec.heartbeat_unix - 5, 0, 0, 0))


def test_a_second_writer_of_a_live_tag_is_refused_and_the_tag_is_free_once_it_ends(tmp_path):
    url = str(tmp_path / "s")
    samples = make_samples(6, max_len=30)
    first = StoreWriter(url, make_manifest(), writer_tag="rank00000")
    add(first, samples[:2])
    before = writer_objects(url)
    with pytest.raises(sessions.SlotHeld) as refused:
        StoreWriter(url, make_manifest(), writer_tag="rank00000")
    line = str(refused.value)
    assert "\n" not in line and "writer rank00000 is being written by another session" in line
    assert f"session {first.session}" in line and f"pid {os.getpid()}" in line
    assert writer_objects(url) == before  # nothing of the refused writer: no session record, no heartbeat
    other = StoreWriter(url, make_manifest(), writer_tag="rank00001")  # another rank of the same job writes at once
    add(other, samples[2:4])
    other.close()
    first.close()
    again = StoreWriter(url, make_manifest(), writer_tag="rank00000")  # a re-run after it finished
    add(again, samples[4:])
    again.close()
    slot = json.loads((Path(url) / sessions.slot_key("rank00000")).read_text())
    assert slot["session"] == again.session and slot["kind"] == "slot"
    assert sorted(hsstore.open(url).sample_ids()) == sorted(s["sample_id"] for s in samples)


def test_the_slot_of_a_writer_that_no_longer_runs_is_taken_over_and_a_live_ones_is_not(tmp_path):
    url = tmp_path / "s"
    add(StoreWriter(str(url), make_manifest(), writer_tag="w0"), make_samples(1))  # the store, left open
    host = os.uname().nodename

    plant(url, "w1", "killed00", host=host, pid=dead_pid())  # killed here: its process is gone
    StoreWriter(str(url), make_manifest(), writer_tag="w1").close()

    plant(url, "w2", "elsewh00", host="another-host", pid=1)  # on another machine, beating
    with pytest.raises(sessions.SlotHeld, match="session elsewh00, host another-host"):
        StoreWriter(str(url), make_manifest(), writer_tag="w2")
    plant(url, "w2", "elsewh00", host="another-host", pid=1, beat_age=60)  # silent for 60 beats: dead
    StoreWriter(str(url), make_manifest(), writer_tag="w2").close()

    # an end record planted beside a writer that still beats does not free its tag
    plant(url, "w3", "planted0", host="another-host", pid=1, end=True)
    with pytest.raises(sessions.SlotHeld, match="session planted0"):
        StoreWriter(str(url), make_manifest(), writer_tag="w3")
    assert not any(n.endswith(".takeover") for n in writer_objects(url))  # every taker's marker removed


def test_a_late_taker_of_a_dead_slot_replaces_nothing(tmp_path, monkeypatch):
    """A writer reads the slot as a dead session's (as it was when it looked), but by the time it may take it over
    another writer has done so and writes: the re-read sees the new holder, the late one is refused, and the live
    writer's slot is left as it was."""
    url = tmp_path / "s"
    live = StoreWriter(str(url), make_manifest(), writer_tag="w")
    path = Path(url) / sessions.slot_key("w")
    mine = path.read_bytes()
    dead = sessions.SlotRecord("w", "dead0000", os.uname().nodename, dead_pid(), time.time(), 1.0)
    real, reads = sessions._read_slot, []

    def stale_first(*a):  # its first look: the slot as the dead holder left it
        reads.append(1)
        return (dead.to_json(), dead) if len(reads) == 1 else real(*a)

    monkeypatch.setattr(sessions, "_read_slot", stale_first)
    with pytest.raises(sessions.SlotHeld, match=f"session {live.session}"):
        StoreWriter(str(url), make_manifest(), writer_tag="w")
    assert path.read_bytes() == mine
    live.close()


def test_one_writer_per_tag_on_s3(s3_store):
    """moto's server honours ``If-None-Match: *`` on a PUT (412 once the object exists), which s3fs sends for
    ``mode="create"``: the second writer is refused by the store itself. (Two PUTs racing at the same instant
    are not serialised by moto; tests/test_hostile_limits.py shows that and S3's own guarantee is relied on.)"""
    url, opts = s3_store
    first = StoreWriter(url, make_manifest(), writer_tag="rank00000", storage_options=opts)
    with pytest.raises(sessions.SlotHeld, match="writer rank00000 is being written by another session"):
        StoreWriter(url, make_manifest(), writer_tag="rank00000", storage_options=opts)
    add(first, make_samples(3))
    first.close()
    again = StoreWriter(url, make_manifest(), writer_tag="rank00000", storage_options=opts)  # taken over
    add(again, make_samples(2, prefix="b"))
    again.close()
    fs, root = storage.resolve(url, opts)
    assert json.loads(fs.cat_file(f"{root}/{sessions.slot_key('rank00000')}"))["session"] == again.session
    assert len(hsstore.open(url, **opts)) == 5


def test_two_identical_extract_commands_one_is_refused_and_a_killed_one_is_resumed(tiny_dir, tmp_path, monkeypatch):
    """The first extraction holds after its second shard; the same command started meanwhile is refused in one
    line (exit 2), before it loads the model; the first is killed with -9 and the same command, run again on this
    machine at once, takes its slot and finishes; run once more it writes nothing. Every sample once."""
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:10]) + "\n")
    store, control = tmp_path / "store", tmp_path / "control"
    control.mkdir()
    cmd = ["extract", "--model", str(tiny_dir), "--input", str(data), "--out", str(store), "--device", "cpu", "-q",
           "--shard-mb", "0.05", "--token-budget", "600"]
    env = {**os.environ, "FOLLOW_PAUSE": "2", "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "tests/follow_extract.py", str(control), "--", *cmd], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (control / "paused").exists():
            assert first.poll() is None, first.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the first extraction did not reach its second shard"
            time.sleep(0.1)
        held = sorted(hsstore.open(str(store)).sample_ids())
        second = subprocess.run([sys.executable, "-m", "hsstore", *cmd], cwd=REPO, capture_output=True, text=True,
                                timeout=300)
        lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
        assert "writer rank00000 is being written by another session" in lines[0], lines[0]
        assert sorted(hsstore.open(str(store)).sample_ids()) == held  # the refused one wrote nothing

        def no_model(*args, **kwargs):
            raise AssertionError("the target was loaded for a run that is refused")

        monkeypatch.setattr(job, "load_target", no_model)  # refused before the target is loaded
        with pytest.raises(sessions.SlotHeld, match="writer rank00000 is being written by another session"):
            job.run_extract(build(job.ExtractSettings, model=str(tiny_dir), input=[str(data)], out=str(store),
                                  device="cpu", progress=False, shard_bytes=50_000, token_budget=600))
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(60)
    rerun = subprocess.run([sys.executable, "-m", "hsstore", *cmd], cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    once_more = subprocess.run([sys.executable, "-m", "hsstore", *cmd], cwd=REPO, capture_output=True, text=True,
                               timeout=300)
    assert once_more.returncode == 0 and "wrote 0 samples" in once_more.stdout, once_more.stderr[-3000:]
    ids = hsstore.open(str(store)).sample_ids()
    assert len(ids) == len(set(ids)) == 10 and verify(hsstore.open(str(store))).ok
