"""``hsstore train --follow`` against a real extraction in another process (the tiny trained target, the demo's 320
conversations), under torchrun with 2 ranks x 2 loader workers: the first step comes before a quarter of the
samples are extracted; the extractor is killed and the trainer says so and waits; the trainer is killed mid
epoch 0 and resumed; a re-run of the extraction completes the store; epoch 0 held every sample exactly once and
epoch 1 is an ordinary epoch of the finished store. Where the extraction stands when the trainer looks is decided by
the test (tests/follow_extract.py holds its commits), not by the machine's speed."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import hsstore
from hsstore.distributed import World
from hsstore.extract.tiny import trained_files, trained_target_dir
from hsstore.loader.dataset import HiddenStateDataset
from hsstore.loader.options import Planning

from train_helpers import FAST, REPO, small_input  # noqa: F401  (fixtures)

SAMPLES = 320
ENV = {"HSSTORE_WRITER_HEARTBEAT_S": "0.5", "HSSTORE_FOLLOW_POLL_S": "0.5", "OMP_NUM_THREADS": "1"}


def start(cmd, log: Path, env=None, started: list | None = None) -> subprocess.Popen:
    p = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
                         start_new_session=True, env={**os.environ, **ENV, **(env or {})})
    if started is not None:
        started.append(p)
    return p


def wait_for(cond, what: str, procs=(), timeout=240.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for p, log in procs:
            assert p.poll() is None, f"{what}: {p.args[:6]} exited {p.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def family(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def kill(p: subprocess.Popen) -> None:
    """kill -9 of the process and everything it started (torchrun, its ranks, their loader workers)."""
    for pid in family(p.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(30)


def test_train_follows_an_extraction_through_kills_exactly_once(tmp_path):
    started: list[subprocess.Popen] = []
    try:
        scenario(tmp_path, started)
    finally:
        for p in started:
            if p.poll() is None:
                kill(p)


def scenario(tmp_path: Path, started: list) -> None:
    store, run, control = tmp_path / "store", tmp_path / "run", tmp_path / "control"
    control.mkdir()
    extract = ["extract", "--model", str(trained_target_dir()), "--input", str(trained_files() / "conversations.jsonl"),
               "--out", str(store), "--device", "cpu", "-q", "--shard-mb", "0.5", "--codec", "zstd"]
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "hsstore",
             "train", "--store", str(store), "--out", str(run), "--follow", "--epochs", "2", "--workers", "2",
             "--draft-layers", "1", "--block-size", "8", "--anchors", "8", "--token-budget", "600",
             "--save-every", "3", "--log-every", "1", "--log-samples", "--device", "cpu", "-q"]
    metrics = run / "metrics.jsonl"

    # the extractor holds after its 16th shard (~48 samples) until the trainer's first step, hangs after its 40th
    e1_log, t1_log = tmp_path / "extract1.log", tmp_path / "train1.log"
    e1 = start([sys.executable, "tests/follow_extract.py", str(control), "--", *extract], e1_log,
               {"FOLLOW_HOLD": f"16:{metrics}", "FOLLOW_PAUSE": "40"}, started)
    t1 = start(train, t1_log, started=started)  # started with the extraction: it waits for the store's first shard
    procs = [(e1, e1_log), (t1, t1_log)]
    wait_for(lambda: (control / "released").exists(), "the trainer's first step", procs)
    assert int((control / "released").read_text()) < SAMPLES // 4  # the first step came before a quarter was in

    # kill -9 of the extractor: the trainer names the dead writer and waits
    wait_for(lambda: (control / "paused").exists(), "the extractor's 40th shard", procs)
    kill(e1)
    wait_for(lambda: "no heartbeat for" in t1_log.read_text(), "the dead writer's report", [(t1, t1_log)])
    assert "rank00000" in t1_log.read_text() and "re-run its job" in t1_log.read_text()
    wait_for(lambda: any((run / "checkpoints").glob("step_*/trainer.json")), "a checkpoint", [(t1, t1_log)])
    time.sleep(1.0)
    assert t1.poll() is None  # still waiting for the rest of epoch 0

    # kill -9 of the trainer mid epoch 0; the same command resumes, and a re-run extraction completes the store
    kill(t1)
    t2_log, e2_log = tmp_path / "train2.log", tmp_path / "extract2.log"
    t2 = start(train, t2_log, started=started)
    e2 = start([sys.executable, "-m", "hsstore", *extract], e2_log, started=started)
    assert e2.wait(300) == 0, e2_log.read_text()[-3000:]
    assert t2.wait(300) == 0, t2_log.read_text()[-3000:]
    assert "resumed from" in t2_log.read_text()

    finished = hsstore.open(str(store))
    everything = set(finished.sample_ids())
    assert len(everything) == SAMPLES
    logs = [[json.loads(line) for line in (run / f"samples.rank{r:05d}.jsonl").read_text().splitlines()]
            for r in range(2)]
    assert [x["step"] for x in logs[0]] == [x["step"] for x in logs[1]]  # lockstep, through the resume
    epoch0 = collections.Counter(s for rank in logs for row in rank if row["epoch"] == 0 for s in row["samples"])
    assert set(epoch0) == everything and set(epoch0.values()) == {1}, epoch0.most_common(3)

    # epoch 1 is an ordinary epoch of the finished store: each rank's samples, each worker's in its planned order
    for r, rank in enumerate(logs):
        got = [s for row in rank if row["epoch"] == 1 for s in row["samples"]]
        ordinary = HiddenStateDataset(str(store), world=World(r, 2), planning=Planning(seed=0))
        planned = [ordinary.planned_ids(1, ordinary.world.at(r, k, 2)) for k in range(2)]
        assert sorted(got) == sorted(planned[0] + planned[1])
        for order in planned:
            mine = set(order)
            assert [s for s in got if s in mine] == order

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rows[0]["arrived_samples"] < SAMPLES and rows[-1]["arrived_samples"] == SAMPLES
    assert rows[-1]["arrival_done"] and all(r["loss"] is not None for r in rows)
    from hsstore.ops.html_report import run_html

    assert 'data-chart="arrivals"' in run_html(run)  # hsstore report shows the arrival beside the loss


def test_an_unhealthy_arrival_stops_training_with_one_line_and_a_checkpoint(tiny_dir, small_input, tmp_path,
                                                                             monkeypatch):  # noqa: F811
    """A shard of all-zero features commits while the trainer follows: every step before it is trained and kept
    (a checkpoint at the step it stopped), and the error is one line naming the shard and the feature."""
    import threading

    import torch

    from hsstore.extract.job import ExtractSettings, run_extract
    from hsstore.loader.follow import FollowStopped
    from hsstore.app.schema import build
    from hsstore.store.writer import StoreWriter
    from hsstore.train.trainer import TrainSettings, train

    monkeypatch.setenv("HSSTORE_FOLLOW_POLL_S", "0.2")
    store, run = str(tmp_path / "store"), tmp_path / "run"
    run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(small_input)], out=store, device="cpu",
                      progress=False))
    m = hsstore.open(store).manifest
    late = StoreWriter(store, m, writer_tag="late")  # an open writer: epoch 0 waits for it
    errors: list = []

    def trainer():
        try:
            train(build(TrainSettings, store=[store], out=str(run), epochs=2, follow=True, save_every=1000,
                        **FAST))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    metrics = run / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, "the first steps")
    T = 40
    late.add("zeros", torch.randint(0, 100, (T,)), torch.ones(T, dtype=torch.bool),
             torch.zeros(T, len(m.layers), m.hidden_size, dtype=torch.bfloat16))
    late.close()
    t.join(120)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], FollowStopped), errors
    line = str(errors[0])
    shard = [n for n in (Path(store) / "commits").iterdir() if n.name.startswith("late-")][0].stem
    assert "\n" not in line and shard in line and "'zeros', layer" in line and "all zero" in line
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert (run / "checkpoints" / f"step_{steps[-1]:08d}" / "trainer.json").exists()  # what was trained is kept


def test_a_resume_on_fewer_ranks_truncates_the_departed_ranks_logs_and_leaves_its_own_ranks_logs_to_them(tmp_path):
    """Resumed at step 2 on one rank after a run of three: rank 0 drops the steps after 2 from the logs of ranks 1
    and 2, which no rank of this run writes (their epoch-0 ids would be counted twice at the end otherwise), and
    never rewrites its own rank's log, which its MetricsLog truncates (one writer a file)."""
    from hsstore.train.follow import Following, TrainedIds

    def line(step, ids):
        return json.dumps({"step": step, "epoch": 0, "samples": ids}) + "\n"

    for r in range(3):
        (tmp_path / f"samples.rank{r:05d}.jsonl").write_text("".join(line(s, [f"r{r}s{s}"]) for s in (1, 2, 3)))
    own = tmp_path / "samples.rank00000.jsonl"
    before = own.stat().st_ino
    following = Following(journal=None, options=None, leader=None, trained=TrainedIds(tmp_path))
    following.resumed_at(2, 0, rank=0, world=1)
    assert own.stat().st_ino == before and "r0s3" in own.read_text()  # its own rank's: left to MetricsLog
    counts = following.trained.counts()
    assert counts["r1s2"] == counts["r2s2"] == 1 and counts["r1s3"] == counts["r2s3"] == 0
    following.resumed_at(2, 0, rank=1, world=1)  # only rank 0 truncates
    assert "r0s3" in own.read_text()


# lines no run stopped at step 2 of epoch 0 wrote, each naming a sample it would count as trained in epoch 0
FORGED_SAMPLES_LINES = [{"step": -1, "epoch": 0, "samples": ["forged-a"]}, {"step": 0, "epoch": 0, "samples": ["s1"]},
                        {"step": "1", "epoch": 0, "samples": ["forged-b"]}, {"step": 1.0, "epoch": 0, "samples": ["s1"]},
                        {"step": True, "epoch": 0, "samples": ["s1"]}, {"step": 1, "epoch": -1, "samples": ["s1"]},
                        {"step": 2, "epoch": 1, "samples": ["s1"]}, {"step": 1, "epoch": "0", "samples": ["s1"]},
                        {"step": 2, "epoch": 0, "samples": [7]}, {"step": 2, "epoch": 0, "samples": "s1"}]


def test_a_resume_drops_samples_log_lines_no_step_before_it_wrote(tmp_path, caplog):
    """A departed rank's samples log holding, beside its own lines (step 2 twice: --grad-accum logs a line per
    micro-batch), lines with a step below 1 or not an int, an epoch out of 0..the checkpoint's or not an int, or
    sample ids that are not strings: the resume at step 2 of epoch 0 keeps the run's own lines and drops the others
    with one warning that counts them and names the file, so the tally never counts them."""
    from hsstore.train.follow import Following, TrainedIds

    own = [{"step": 1, "epoch": 0, "samples": ["s0"]}, {"step": 2, "epoch": 0, "samples": ["s1"]},
           {"step": 2, "epoch": 0, "samples": ["s2"]}, {"step": 3, "epoch": 0, "samples": ["s3"]}]
    log = tmp_path / "samples.rank00001.jsonl"
    log.write_text("".join(json.dumps(x) + "\n" for x in own[:2] + FORGED_SAMPLES_LINES + own[2:]))
    following = Following(journal=None, options=None, leader=None, trained=TrainedIds(tmp_path))
    with caplog.at_level("WARNING"):
        following.resumed_at(2, 0, rank=0, world=1)
    assert [json.loads(ln) for ln in log.read_text().splitlines()] == own[:3]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [f"{log}: {len(FORGED_SAMPLES_LINES)} line(s) that are not a step's log line dropped"], warned
    assert following.trained.counts() == {"s0": 1, "s1": 1, "s2": 1}


def test_the_tally_counts_only_ids_the_stores_hold(tmp_path, caplog):
    """Ids in the samples logs that no store holds (a line not the trainer's) are named in a warning and never
    counted as trained: one in the place of a sample never trained does not make the count come out right."""
    import collections

    from hsstore.testing.stores import make_manifest, make_samples, write_samples
    from hsstore.train.follow import tally

    url = str(tmp_path / "s")
    write_samples(url, make_manifest(), make_samples(3))
    with caplog.at_level("WARNING"):
        t = tally(collections.Counter({"s0": 1, "s1": 1, "forged": 1}), [url], None, None)
    assert (t.trained, t.held, t.items, t.never, t.twice) == (2, 3, 2, ["s2"], []) and t.differs
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "1 sample id(s)" in warned[0] and "'forged'" in warned[0], warned
