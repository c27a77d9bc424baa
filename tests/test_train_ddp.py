"""DDP on CPU: two gloo ranks under torchrun, each reading its own share of the store; every sample is
trained exactly once per epoch even though the ranks' batch counts differ."""

import gc
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore.train.data import StoreBatches

from train_helpers import REPO, small_input, store32  # noqa: F401  (fixtures)


def test_torchrun_two_ranks_see_every_sample_once_per_epoch(store32, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "hsstore",
           "train", "--store", store32, "--out", str(out), "--epochs", "2", "--draft-layers", "1", "--block-size", "8",
           "--anchors", "16", "--token-budget", "600", "--log-every", "1", "--log-samples", "--device", "cpu",
           "-q"]
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
    planned = StoreBatches([store32], layers=hsstore.open(store32).layers, token_budget=600, seed=0, rank=0,
                           world_size=2).planned_steps(2)
    assert planned == len(logs[0])

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == len(logs[0]) and all(m["loss"] is not None for m in metrics)
    assert sum(m["samples"] for m in metrics) == 2 * len(everything)  # the log line covers both ranks
    assert (out / "drafter" / "model.safetensors").exists()
    assert "trained" in proc.stdout and "2 epoch(s)" in proc.stdout


def test_ctrl_c_under_torchrun_stops_every_rank_at_one_step_with_a_checkpoint(store32, tmp_path):  # noqa: F811
    """Ctrl-C in the terminal reaches torchrun and both ranks (one process group), and torchrun forwards it to
    the ranks again: they agree on one step, write its checkpoint together, and the same command resumes."""
    import os
    import signal
    import time

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "hsstore",
           "train", "--store", store32, "--out", str(out), "--steps", "400", "--save-every", "1000",
           "--draft-layers", "1", "--block-size", "8", "--anchors", "8", "--token-budget", "600", "--log-every", "1",
           "--log-samples", "--device", "cpu", "-q"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    _, err = proc.communicate(timeout=120)
    assert err.count("stopped at step") == 2, err[-3000:]  # both ranks
    steps = {int(part.split(":")[0]) for part in err.split("stopped at step ")[1:]}
    assert len(steps) == 1, steps  # ... at the same step
    (step,) = steps
    assert 3 <= step < 400 and (out / "checkpoints" / f"step_{step:08d}").is_dir()
    for r in range(2):  # each rank's loader state is in the checkpoint: an exact resume needs both
        assert (out / "checkpoints" / f"step_{step:08d}" / f"loader.rank{r:05d}.json").is_file(), r
    logs = [[json.loads(x)["step"] for x in (out / f"samples.rank{r:05d}.jsonl").read_text().splitlines()]
            for r in range(2)]
    assert logs[0] == logs[1] == list(range(1, step + 1))
    resume = cmd[:cmd.index("--steps") + 1] + [str(step + 2)] + cmd[cmd.index("--steps") + 2:]
    rc = subprocess.run(resume, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert rc.returncode == 0, rc.stderr[-3000:]
    assert f"step_{step:08d}" in rc.stdout + rc.stderr


# ---------------------------------------------------------------------------------------------- global loss


GRAD_S, GRAD_GAMMA, GRAD_ANCHORS = 8, 4.0, 6
# rank 0: one short sample, a short response; rank 1: three samples, long responses: their loss weights differ
GRAD_SHARDS = [[("a", 24, 16)], [("b", 40, 8), ("c", 55, 10), ("d", 31, 4)]]  # (sample id, length, prompt length)


def grad_items(shard):
    from hsstore.loader.batching import collate_padded

    items = []
    for sid, n, prompt in shard:
        g = torch.Generator().manual_seed(sum(map(ord, sid)))
        mask = torch.arange(n) >= prompt
        items.append({"sample_id": sid, "input_ids": torch.randint(0, 99, (n,), generator=g), "loss_mask": mask,
                      "hidden_states": torch.randn(n, 3, 32, generator=g)})
    return collate_padded(items)


def grad_setup(world: int):
    """The trainer's loss module (DraftLoss) around a small drafter, identical in every process."""
    from hsstore.train.model import DFlashDrafter, DrafterConfig
    from hsstore.train.build import DraftLoss

    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, vocab_size=100, target_layers=[1, 2, 3],
                        mask_token_id=99, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=2,
                        block_size=GRAD_S, sliding_window=[12, None], max_position=256)
    g = torch.Generator().manual_seed(7)
    embed, head = torch.randn(100, 32, generator=g), torch.randn(100, 32, generator=g)
    torch.manual_seed(0)
    return DraftLoss(DFlashDrafter(cfg, embed, head), GRAD_GAMMA, 16, world)


def grad_step(model, batch, world, per_rank: bool = False):
    """What the trainer does with one batch, up to the gradients: lockstep (the global weight sum), the
    loss and backward, and the logged metrics (all-reduced). ``per_rank``: the old rule, each rank's loss
    divided by its own weight sum."""
    from hsstore.train.data import add_anchors, lockstep
    from hsstore.train.metrics import Meter

    batch = add_anchors(batch, 0, 0, GRAD_ANCHORS, GRAD_S, GRAD_GAMMA)
    [(batch, _)] = list(lockstep([(batch, None)], world))
    if per_rank:
        batch.pop("global_weight_sum")
    loss, m = model(batch)
    loss.backward()
    meter = Meter(GRAD_S)
    meter.add(m, batch["label_counts"], batch["tokens"], len(batch["sample_id"]), batch["num_anchors"])
    return batch, meter.summary(world, None)


def grads_of(loss_fn):
    return {n: p.grad.detach().clone() for n, p in loss_fn.drafter.named_parameters()}


def ddp_grad_worker(rank: int, world: int, init: str, out: str):
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        results = {}
        for rule in ("global", "per-rank"):
            loss_fn = grad_setup(world)
            DDP._set_params_and_buffers_to_ignore_for_model(loss_fn, ["drafter.embed_tokens", "drafter.lm_head"])
            model = DDP(loss_fn)
            batch = grad_items(GRAD_SHARDS[rank])
            if rule == "per-rank":  # the old rule: each rank divides by its own weight sum
                loss_fn.world = 1
            _, summary = grad_step(model, batch, world, per_rank=rule == "per-rank")
            results[rule] = (grads_of(loss_fn), summary)
            del model  # its reducer holds the process group: gone before the group is destroyed
        if rank == 0:
            save_file({f"{rule}/{n}": g for rule, (gr, _) in results.items() for n, g in gr.items()}, out + ".st")
            Path(out + ".json").write_text(json.dumps({rule: s for rule, (_, s) in results.items()}))
        dist.barrier()  # both ranks leave together (a rank tearing gloo down alone has aborted its peer)
    finally:
        gc.collect()
        dist.destroy_process_group()


def test_two_ranks_take_the_step_of_one_process_on_the_union(tmp_path):
    """Gloo, 2 processes, batches of different loss weight: the gradients equal one process's on the union
    of the batches (the per-rank normalisation, also run here, does not), and the logged loss/acc are the
    union's."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    out = str(tmp_path / "ranks")
    mp.spawn(ddp_grad_worker, args=(2, f"file://{tmp_path / 'pg'}", out), nprocs=2, join=True)
    got, logged = load_file(out + ".st"), json.loads(Path(out + ".json").read_text())

    torch.set_num_threads(1)
    union = grad_setup(1)
    batch, summary = grad_step(union, grad_items(GRAD_SHARDS[0] + GRAD_SHARDS[1]), 1)
    ref = grads_of(union)
    w = [grad_weight(s) for s in GRAD_SHARDS]
    assert abs(w[0] - w[1]) > 0.5 * max(w)  # the ranks' weight sums really differ

    scale = max(g.abs().max().item() for g in ref.values())
    diff = {rule: max((got[f"{rule}/{n}"] - g).abs().max().item() for n, g in ref.items()) / scale
            for rule in ("global", "per-rank")}
    print(f"max |grad(2 ranks) - grad(union)| / max |grad|: {diff}")
    assert diff["global"] < 1e-5, diff
    assert diff["per-rank"] > 1e-2, diff  # the test can tell the two rules apart
    for key in ("loss", "acc", "tau"):
        assert logged["global"][key] == pytest.approx(summary[key], rel=1e-5), key
    assert logged["global"]["acc_k"] == pytest.approx(summary["acc_k"], rel=1e-6, nan_ok=True)


def grad_weight(shard) -> float:
    from hsstore.train.data import add_anchors

    return add_anchors(grad_items(shard), 0, 0, GRAD_ANCHORS, GRAD_S, GRAD_GAMMA)["weight_sum"]
