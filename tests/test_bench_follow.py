"""The train-while-extracting benchmark on the 27B-shaped random target, at a toy size: its kept store is one a
follower can start on at once (assets and the writer's plan before the first shard), and both modes run to the
end, the follower's epoch 0 training every sample once (tools/bench_follow.py, tools/bench_extract.py --keep)."""

import json
import os
import subprocess
import sys

import pytest

import hsstore

from train_helpers import REPO

pytestmark = pytest.mark.slow

TOY = ["--layers-total", "8", "--hidden", "64", "--ffn", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
       "--linear-v-heads", "4", "--linear-k-heads", "2", "--vocab", "512", "--min-len", "64", "--max-len", "96"]


def run_tool(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HSSTORE_WRITER_HEARTBEAT_S": "1"}  # a follower believes an end two beats after it
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_kept_store_has_its_assets_and_its_plan_before_its_first_shard(tmp_path):
    store = tmp_path / "kept"
    proc = run_tool("tools.bench_extract", "--modes", "", "--device", "cpu", "--samples", "6", "--shard-mb", "0.02",
                    *TOY, "--keep", str(store))
    assert proc.returncode == 0, proc.stderr[-2000:]
    held = hsstore.open(str(store))
    assert len(held) == 6
    first_shard = min(p.stat().st_mtime_ns for p in (store / "commits").iterdir())
    assert (store / "assets" / "index.json").stat().st_mtime_ns <= first_shard
    [session] = [p for p in (store / "writers").glob("bench-rank0-*.json") if not p.name.endswith(".end.json")]
    record = json.loads(session.read_text())
    assert record["expects"] == ["bench-rank0"]
    assert (record["planned_samples"], record["planned_tokens"]) == (6, held.num_tokens)


def test_both_modes_run_the_bench_target_to_the_end(tmp_path):
    proc = run_tool("tools.bench_follow", "--dir", str(tmp_path), "--device", "cpu", "--target", "bench",
                    "--epochs", "1", "--shard-mb", "0.05", "--samples", "8", *TOY, "--json")
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    rows = json.loads(proc.stdout)
    assert [r["mode"] for r in rows] == ["sequential", "follow"]
    for r in rows:
        assert r["samples"] == 8 and r["steps"] >= 1 and r["store_gb"] > 0
        assert r["first_step_share"] == pytest.approx(r["first_step_s"] / r["extract_done_s"], abs=0.01)
    # what train --follow counts at its end (exit 1 otherwise): every sample the store holds, once
    log = (tmp_path / "follow" / "train.log").read_text()
    assert "--follow: epoch 0 trained 8 sample(s), all the stores hold" in log
