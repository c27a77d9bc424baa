"""The optimizer's states sharded over two gloo ranks under torchrun (``--shard-optimizer on``): the same weights
after the same steps as the unsharded run, and a sharded run's checkpoint (the whole optimizer state, gathered
on rank 0) resumes, sharded or not."""

import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file

from train_helpers import REPO, small_input, store32  # noqa: F401  (fixtures)

STEPS = 4


def torchrun_train(store: str, out, shard: str, *extra: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "hsstore",
           "train", "--store", store, "--out", str(out), "--steps", str(STEPS), "--save-every", "2",
           "--draft-layers", "1", "--block-size", "8", "--anchors", "16", "--token-budget", "600", "--log-every", "1",
           "--device", "cpu", "--shard-optimizer", shard, *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def master(out, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / f"step_{step:08d}" / "master_weights.safetensors"))


def optimizer(out, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / f"step_{step:08d}" / "optimizer.safetensors"))


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_sharded_optimizer_trains_the_same_weights_and_its_checkpoints_resume(store32, tmp_path):  # noqa: F811
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    torchrun_train(store32, plain, "off")
    log = torchrun_train(store32, sharded, "on")
    assert "sharded over 2 ranks" in log  # the plan's line names it
    before = master(plain, 2)
    assert_close(master(sharded, STEPS), master(plain, STEPS))
    assert not all(torch.equal(before[k], master(plain, STEPS)[k]) for k in before)  # the steps trained something
    # the checkpoint holds the whole optimizer state, as the unsharded run's (rank 0 gathered every rank's share)
    assert_close(optimizer(sharded, STEPS), optimizer(plain, STEPS))

    # resumed from the sharded run's step 2, sharded and unsharded: both end where the straight runs end
    for shard in ("on", "off"):
        again = tmp_path / f"again-{shard}"
        shutil.copytree(sharded, again)
        shutil.rmtree(again / "checkpoints" / f"step_{STEPS:08d}")
        shutil.rmtree(again / "drafter")
        log = torchrun_train(store32, again, shard)
        assert "resumed from" in log and "step 2" in log, log[-2000:]
        assert_close(master(again, STEPS), master(plain, STEPS))
