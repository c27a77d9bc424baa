"""The training benchmarks go through the trainer's own memory plan, and their synthetic store trains with
`hsstore train` as it is, nothing unsaid to pass (tools/bench_train.py)."""

import json
import subprocess
import sys

import pytest

from hsstore.app.cli import main

from train_helpers import REPO

pytestmark = pytest.mark.slow


def bench_train(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.bench_train", "--dir", str(tmp_path), "--tiny",
                           "--device", "cpu", *flags], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_bench_plans_its_step_as_train_does(tmp_path):
    proc = bench_train(tmp_path, "--rounds", "1", "--steps", "1", "--warmup", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert result["asked"] == {"anchors": 32, "checkpoint_layers": "auto"}
    assert result["checkpoint_layers"] == "off" and result["anchors"] == 32  # a tiny step fits: nothing given up
    assert result["estimate_gib"] > 0
    assert "plan: 32 anchors per sequence (asked 32), --checkpoint-layers off (asked auto)" in proc.stderr


def test_the_store_only_store_trains_without_a_mask_token_flag(tmp_path):
    proc = bench_train(tmp_path, "--store-only")
    assert proc.returncode == 0, proc.stderr[-2000:]
    store = proc.stdout.strip().splitlines()[-1]
    out = tmp_path / "run"
    assert main(["train", "--store", store, "--out", str(out), "--steps", "1", "--device", "cpu", "--draft-layers",
                 "1", "--token-budget", "512", "--anchors", "8", "-q"]) == 0
    # the row past the tokenizer's vocabulary: the mask token the bench's own drafter uses (vocab - 1)
    assert json.loads((out / "drafter" / "config.json").read_text())["dflash_config"]["mask_token_id"] == 999
