"""The GPU estimate bounds sequences per batch by the stores' own sample lengths (issue #28): checked against the
batches the real loader makes of real tiny stores, and against the plan for an 80 GiB GPU."""

from __future__ import annotations


import pytest

import hsstore
from hsstore import HiddenStateDataset, Planning, TokenBatches
from hsstore.app.schema import build
from hsstore.train.budget import ASSUMED_MIN_SEQUENCE, step_bytes, max_sequences, plan_gpu_step, store_lengths
from hsstore.train.settings import TrainSettings
from hsstore.train.model import DrafterConfig


def _store(tmp_path, name, lengths, write, new_manifest, new_samples):
    samples = []
    for i, T in enumerate(lengths):
        (s,) = new_samples(1, seed=i, min_len=T, max_len=T + 1, prefix=f"{name}{i}-")
        samples.append(s)
    url = str(tmp_path / name)
    write(url, new_manifest(), samples)
    return hsstore.open(url)


def _largest_batch(store, token_budget, seeds=range(12)) -> int:
    """The most samples in one batch the loader made, over several shuffles."""
    most = 0
    for seed in seeds:
        ds = HiddenStateDataset(store, planning=Planning(seed=seed))
        most = max(most, max(len(b["sample_id"]) for b in TokenBatches(ds, token_budget=token_budget)))
    return most


def test_bound_is_what_the_loader_reaches_and_never_exceeds(tmp_path, write, new_manifest, new_samples):
    even = _store(tmp_path, "even", [40] * 9, write, new_manifest, new_samples)
    mixed = _store(tmp_path, "mixed", [10, 20, 30, 50, 90, 90, 12], write, new_manifest, new_samples)
    assert sorted(store_lengths([even]).tolist()) == [40] * 9
    assert sorted(store_lengths([even, mixed]).tolist()) == sorted([40] * 9 + [10, 20, 30, 50, 90, 90, 12])
    # equal lengths: every full batch holds budget // length samples, and the bound is exactly that
    assert max_sequences(store_lengths([even]), 160) == _largest_batch(even, 160) == 4
    # mixed: 10, 12, 20, 30 -> four cost 4 x 30 = 120 <= 130; five would cost 5 x 50
    bound = max_sequences(store_lengths([mixed]), 130)
    assert bound == 4
    assert _largest_batch(mixed, 130, seeds=range(40)) <= bound
    assert max_sequences([], 160) is None
    assert max_sequences([500], 160) == 1  # over the budget: a batch of its own


PUBLISHED = DrafterConfig(hidden_size=5120, intermediate_size=17408, vocab_size=248320,
                          target_layers=[1, 16, 31, 46, 61], mask_token_id=0, num_heads=32, num_kv_heads=8,
                          head_dim=128, num_layers=5, block_size=16, sliding_window=[2048] * 4 + [None])
PARAMS, FROZEN = 1_250_000_000, 2 * 248320 * 5120


def _cfg(**kw):
    return build(TrainSettings, store=["x"], out="x", **{"token_budget": 16384, "anchors": 512, **kw})


def test_80gib_plan_from_lengths_keeps_more_anchors(tmp_path, write, new_manifest, new_samples):
    store = _store(tmp_path, "long", [4096] * 4, write, new_manifest, new_samples)
    have = int(80 * 2**30 * 0.93)
    off = _cfg(checkpoint_layers="off")  # no recompute asked: anchors are what gives
    with pytest.warns(UserWarning, match="lowering anchors"):
        assumed = plan_gpu_step(PUBLISHED, off, PARAMS, FROZEN, have)
    with pytest.warns(UserWarning, match="lowering anchors"):
        known = plan_gpu_step(PUBLISHED, off, PARAMS, FROZEN, have, [store])
    assert assumed.sequences is None and known.sequences == 4 < 16384 // ASSUMED_MIN_SEQUENCE
    assert known.anchors > assumed.anchors and known.estimate <= have and assumed.estimate <= have
    # the estimate is the one for four sequences (the shape measured on the H200: 4 x 4096, 512 anchors each)
    assert known.estimate == step_bytes(PUBLISHED, 16384, known.anchors, PARAMS, FROZEN, sequences=4)
    # with checkpointing all 512 fit either way, and no warning
    assert plan_gpu_step(PUBLISHED, _cfg(checkpoint_layers="full"), PARAMS, FROZEN, have, [store]).anchors == 512


def test_a_sample_over_the_budget_is_planned_for(tmp_path, write, new_manifest, new_samples):
    store = _store(tmp_path, "over", [1000, 1000, 3000], write, new_manifest, new_samples)
    cfg = _cfg(token_budget=2048, checkpoint_layers="full")
    plan = plan_gpu_step(PUBLISHED, cfg, PARAMS, FROZEN, 1 << 50, [store])
    need, seqs = plan.estimate, plan.sequences
    assert seqs == 2  # the two of 1000 tokens fit one batch (2 x 1000 <= 2048); the one of 3000 is a batch alone
    assert need == max(step_bytes(PUBLISHED, 2048, 512, PARAMS, FROZEN, sequences=2, checkpoint_layers="full"),
                       step_bytes(PUBLISHED, 3000, 512, PARAMS, FROZEN, sequences=1, checkpoint_layers="full"))
