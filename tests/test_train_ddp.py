"""DDP on CPU: two gloo ranks under torchrun, each reading its own share of the store; every sample is
trained exactly once per epoch even though the ranks' batch counts differ."""

import json
import subprocess
import sys
from collections import Counter

import hsstore
from train.data import StoreBatches

from train_helpers import REPO, small_input, store32  # noqa: F401  (fixtures)


def test_torchrun_two_ranks_see_every_sample_once_per_epoch(store32, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "hsstore",
           "train", "--store", store32, "--out", str(out), "--epochs", "2", "--draft-layers", "1", "--block-size", "8",
           "--anchors", "16", "--max-tokens", "600", "--log-every", "1", "--log-samples", "--device", "cpu",
           "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]

    everything = set(hsstore.open(store32).sample_ids())
    logs = [[json.loads(line) for line in (out / f"samples.rank{r:05d}.jsonl").read_text().splitlines()]
            for r in range(2)]
    assert [r["step"] for r in logs[0]] == [r["step"] for r in logs[1]]  # lockstep
    for epoch in (0, 1):
        seen = Counter(s for rank in logs for row in rank if row["epoch"] == epoch for s in row["samples"])
        assert set(seen) == everything and set(seen.values()) == {1}, seen
        per_rank = [{s for row in rank if row["epoch"] == epoch for s in row["samples"]} for rank in logs]
        assert per_rank[0] and per_rank[1] and not per_rank[0] & per_rank[1]  # both ranks trained, disjoint

    # the schedule's length was planned from metadata alone and matches the steps the ranks really ran
    planned = StoreBatches([store32], layers=hsstore.open(store32).layers, max_tokens=600, seed=0, rank=0,
                           world_size=2).planned_steps(2)
    assert planned == len(logs[0])

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == len(logs[0]) and all(m["loss"] is not None for m in metrics)
    assert sum(m["samples"] for m in metrics) == 2 * len(everything)  # the log line covers both ranks
    assert (out / "drafter" / "model.safetensors").exists()
    assert "trained" in proc.stdout and "2 epoch(s)" in proc.stdout
