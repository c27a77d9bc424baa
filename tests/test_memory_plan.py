"""The trainer's memory plan keeps the recipe's objective: where a step does not fit, recompute (mlp, then full) and,
with several ranks, the optimizer's states sharded are chosen before anchors are lowered, said in one line; the
estimate covers the whole step, AdamW's moments included."""

from __future__ import annotations

import logging
import warnings

import pytest

from hsstore.app.schema import build
from hsstore.train import budget
from hsstore.train.budget import (GPU_USABLE, MOMENT_BYTES, check_cpu_memory, plan_step, step_bytes,
                                  step_options)
from hsstore.train.settings import TrainSettings
from hsstore.train.model import DrafterConfig

# the published Qwen3.6-27B drafter (5 layers; 1.73e9 trainable parameters) and its frozen embedding and head
PUBLISHED = DrafterConfig(hidden_size=5120, intermediate_size=17408, vocab_size=248320,
                          target_layers=[1, 16, 31, 46, 61], mask_token_id=0, num_heads=32, num_kv_heads=8,
                          head_dim=128, num_layers=5, block_size=16, sliding_window=[2048] * 4 + [None])
PARAMS = 5 * 5120 * 5120 + 5 * (5120 * 4096 * 2 + 5120 * 1024 * 2 + 3 * 5120 * 17408 + 2 * 5120 + 2 * 128) + 5120
FROZEN = 2 * 248320 * 5120
GPU_80 = int(79.0 * 2**30 * GPU_USABLE)  # what the trainer plans an 80 GB H100 for (the memory it reports)
RECIPE = dict(token_budget=16384, anchors=512, sequences=4)  # 4 x 4,096 tokens, 512 anchors each


def plan(have=GPU_80, **kw) -> budget.StepPlan:
    args = {**RECIPE, **kw}
    return plan_step(PUBLISHED, args.pop("token_budget"), args.pop("anchors"), PARAMS, FROZEN, have=have, **args)


def test_the_estimate_holds_the_optimizers_moments_and_sharding_divides_them():
    assert 1.72e9 < PARAMS < 1.74e9
    whole = step_bytes(PUBLISHED, 16384, 512, PARAMS, FROZEN, sequences=4, checkpoint_layers="mlp")
    assert whole - step_bytes(PUBLISHED, 16384, 512, 0, FROZEN, sequences=4, checkpoint_layers="mlp") == 16 * PARAMS
    sharded = step_bytes(PUBLISHED, 16384, 512, PARAMS, FROZEN, sequences=4, checkpoint_layers="mlp", world=8,
                         shard_optimizer=True)
    assert whole - sharded == pytest.approx(MOMENT_BYTES * PARAMS * 7 / 8, abs=1)
    # without sharding, more ranks change nothing a rank holds
    assert step_bytes(PUBLISHED, 16384, 512, PARAMS, FROZEN, sequences=4, checkpoint_layers="mlp", world=8) == whole


def test_one_80gb_gpu_keeps_512_anchors_by_recomputing_and_says_so_in_one_line():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no anchors given up: no warning
        p = plan()
    assert (p.anchors, p.checkpoint_layers, p.shard_optimizer) == (512, "full", False)
    assert p.estimate <= GPU_80 < plan(have=1 << 50, checkpoint_layers="mlp").estimate
    assert "\n" not in p.change and "--checkpoint-layers full" in p.change and "with all 512 anchors" in p.change
    # where the MLP halves suffice, they are what is recomputed
    mlp = plan(have=1 << 50, checkpoint_layers="mlp").estimate
    assert plan(have=mlp).checkpoint_layers == "mlp" and plan(have=mlp).anchors == 512
    # where it all fits, nothing changes and nothing is said
    roomy = plan(have=1 << 50)
    assert (roomy.anchors, roomy.checkpoint_layers, roomy.change) == (512, "off", "")


def test_an_explicit_policy_is_kept_and_anchors_give_instead():
    with pytest.warns(UserWarning, match="lowering anchors"):
        p = plan(checkpoint_layers="off")
    assert p.checkpoint_layers == "off" and p.anchors < 512


def test_eight_ranks_of_80gb_keep_512_anchors_with_mlp_by_sharding_the_optimizer():
    p = plan(world=8)
    assert (p.anchors, p.checkpoint_layers, p.shard_optimizer) == (512, "mlp", True)
    assert p.estimate == step_bytes(PUBLISHED, 16384, 512, PARAMS, FROZEN, sequences=4, checkpoint_layers="mlp",
                                    world=8, shard_optimizer=True) <= GPU_80
    assert "--shard-optimizer on" in p.change and "--checkpoint-layers mlp" in p.change
    # unsharded, the same ranks would recompute whole layers
    assert plan(world=8, shard_optimizer="off").checkpoint_layers == "full"
    # sharding is tried before more recompute at each level, and only with several ranks
    assert step_options("auto", "auto", 8)[:3] == [("off", False), ("off", True), ("mlp", False)]
    assert step_options("auto", "auto", 1) == [("off", False), ("mlp", False), ("full", False)]


def test_a_cpu_step_recomputes_before_it_is_refused(monkeypatch, caplog):
    cfg = DrafterConfig(hidden_size=64, intermediate_size=256, vocab_size=500, target_layers=[0, 1], mask_token_id=0,
                        num_heads=4, num_kv_heads=2, head_dim=16, num_layers=3, block_size=8)
    settings = build(TrainSettings, store=["x"], out="x", token_budget=4096, anchors=64)
    need = {p: step_bytes(cfg, 4096, 64, 10**6, 10**5, checkpoint_layers=p, device="cpu") for p in ("off", "mlp")}
    monkeypatch.setattr(budget, "available_bytes", lambda: (need["off"] + need["mlp"]) // 2)
    with caplog.at_level(logging.INFO, logger="hsstore.train"):
        chosen = check_cpu_memory(cfg, settings, 10**6, 10**5)
    assert chosen.memory.checkpoint_layers == "mlp" and chosen.batch.anchors == 64
    assert chosen.memory.shard_optimizer == "off"
    assert "--checkpoint-layers mlp" in caplog.text
    with pytest.raises(ValueError, match="GiB available"):  # explicit off: refused, as before
        check_cpu_memory(cfg, build(TrainSettings, store=["x"], out="x", token_budget=4096, anchors=64,
                                    checkpoint_layers="off"), 10**6, 10**5)
