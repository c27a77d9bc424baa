"""`hsstore train --report-to tensorboard,wandb,mlflow`: every backend written for real and read back with its
own reader (TensorBoard's EventAccumulator, wandb's offline run file through wandb's protobuf Record, the mlflow
client on a local file store), compared with metrics.jsonl."""

import glob
import json
import struct
import sys
from pathlib import Path

import pytest

from hsstore.app.cli import main
from train_helpers import small_input, store32  # noqa: F401  (fixtures)

pytest.importorskip("tensorboard", reason="needs hsstore[track] (installed by .ci/run through the test extra)")
pytest.importorskip("wandb", reason="needs hsstore[track] (installed by .ci/run through the test extra)")
pytest.importorskip("mlflow", reason="needs hsstore[track] (installed by .ci/run through the test extra)")

FAST_FLAGS = ["--token-budget", "1024", "--draft-layers", "1", "--block-size", "8", "--anchors", "32",
              "--log-every", "1", "--device", "cpu", "-q"]


def wandb_records(path):
    """The records of a .wandb file: wandb's LevelDB-style log (7-byte ':W&B' header, 32 KiB blocks of chunks
    with a 7-byte header crc32/length/type; FULL=1, FIRST=2, MIDDLE=3, LAST=4), each a wandb protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            raw, buf = buf + chunk, b""
            r = wandb_internal_pb2.Record()
            r.ParseFromString(raw)
            yield r
        else:
            buf += chunk


@pytest.fixture(scope="module")
def tracked_run(store32, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("tracked") / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT"):
        mp.delenv(k, raising=False)
    try:
        assert main(["train", "--store", store32, "--out", str(out), "--steps", "3", "--val-store", store32,
                     "--val-every", "2", "--report-to", "tensorboard,wandb,mlflow", *FAST_FLAGS]) == 0
    finally:
        mp.undo()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, rows


def test_tensorboard_events(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, rows = tracked_run
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {"train/loss", "train/acc", "train/tau", "train/lr", "train/grad_norm", "train/acc_k/1", "train/acc_k/7",
            "perf/tokens_per_s", "perf/wait_frac", "val/loss", "val/tau", "val/acceptance/1", "val/acceptance/7"}
    assert want <= tags, sorted(want - tags)
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in rows]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    val = acc.Scalars("val/tau")
    assert [(e.step, round(e.value, 5)) for e in val] == [(r["step"], round(r["val_tau"], 5)) for r in rows
                                                          if "val_tau" in r]
    assert "settings/text_summary" in acc.Tags()["tensors"]


def test_wandb_offline_run_file(tracked_run):
    out, rows = tracked_run
    files = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    history, config = [], {}
    for r in wandb_records(files[0]):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in r.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in r.config.update})
    assert [h["_step"] for h in history] == [r["step"] for r in rows]
    assert [h["train/loss"] for h in history] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert history[1]["val/tau"] == pytest.approx(rows[1]["val_tau"])
    assert config["training.lr"] == 6e-4 and config["batch.anchors"] == 32


def test_mlflow_file_store(tracked_run):
    from mlflow import MlflowClient

    out, rows = tracked_run
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("hsstore")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["training.seed"] == "0"
    hist = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in hist] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/tau")] == [
        r["step"] for r in rows if "val_tau" in r]


def test_missing_backend_is_one_line(store32, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an absent package looks like to importlib
    rc = main(["train", "--store", store32, "--out", str(tmp_path / "r"), "--steps", "1", "--report-to", "wandb",
               *FAST_FLAGS])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "wandb" in err[0] and "hsstore[track]" in err[0]
    assert not (tmp_path / "r").exists()  # refused before anything was written
    rc = main(["train", "--store", store32, "--out", str(tmp_path / "r"), "--steps", "1", "--report-to", "neptune",
               *FAST_FLAGS])
    assert rc == 2 and "neptune" in capsys.readouterr().err
