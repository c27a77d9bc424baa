"""The training step never waits for the GPU: what needs a value from the device (the block plans' key counts,
the weighted positions, the metrics' sums) is worked out on the CPU beforehand (``add_anchors``, on the
read-ahead thread) or read once per logging interval. Each wait would empty the GPU's queue until the launching
thread refilled it. CPU here; on the GPU ``tools/bench_train.py --sync-debug`` counts them with torch's sync
debug mode."""

import torch
from torch.overrides import TorchFunctionMode

from hsstore.train.build import DraftLoss
from hsstore.train.data import add_anchors
from hsstore.train.masks import block_plan, plan_key_lengths
from hsstore.train.metrics import Meter
from hsstore.train.objective import IGNORE, block_targets, dflash_loss, selected_positions

from test_loss_chunks import make, padded_batch


def random_anchors(g, B, A, T):
    rows = []
    for b in range(B):
        n = int(torch.randint(0, A + 1, (1,), generator=g))
        rows.append(torch.randperm(T - 1, generator=g)[:n].sort().values)
    out = torch.full((B, A), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, :r.numel()] = r
    return out


def test_plan_from_key_lengths_is_the_plan():
    """block_plan given plan_key_lengths (worked out beforehand) builds the same plan, index for index and
    mask for mask, as when it reads the key counts off the device itself: sliding and full layers, several
    chunk sizes and group counts, padding anchors and sequences without any anchor."""
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        B, T, S = 3, int(torch.randint(20, 120, (1,), generator=g)), 4
        anchors = random_anchors(g, B, 9, T)
        valid = torch.arange(T)[None] < torch.randint(T // 2, T + 1, (B, 1), generator=g)
        for window in (None, 3, 17):
            for chunk_rows in (4, 8, 20, 256):
                for groups in (None, 1, 3):
                    want = block_plan(anchors, valid, S, window, True, chunk_rows, groups)
                    hints = plan_key_lengths(anchors, T, S, window, chunk_rows, groups)
                    got = block_plan(anchors, valid, S, window, True, chunk_rows, groups, key_lengths=hints)
                    assert len(hints) == len(want.groups) == len(got.groups)
                    for (a0, a1, ai, am), (b0, b1, bi, bm), k in zip(want.groups, got.groups, hints):
                        assert (a0, a1) == (b0, b1) and torch.equal(ai, bi) and torch.equal(am, bm)
                        assert ai.shape[-1] == k + (a1 - a0) // ai.shape[1]  # context keys + the chunk's rows


def prepared(model, seed=0):
    batch = padded_batch(seed)
    del batch["anchors"]
    batch["sample_id"] = [f"s{i}" for i in range(batch["input_ids"].shape[0])]
    return add_anchors(batch, 0, 0, 7, model.config.block_size, 4.0, model.key_lengths)


def test_prepared_batch_gives_the_reference_loss():
    """With the CPU's weighted positions and key counts the loss, gradients and metrics are those of the same
    batch without them, and the loss is the weighted cross entropy of the full logits [B, A, S, V]."""
    for attn in ("blocks", "sdpa"):
        model = make(attn, [5, None])
        batch = prepared(model)
        assert batch["selected"].numel() > 0 and (attn != "blocks" or batch["key_lengths"])
        plain = {k: v for k, v in batch.items() if k not in ("selected", "key_lengths")}
        out = []
        for b in (batch, plain):
            model.zero_grad(set_to_none=True)
            loss, m = dflash_loss(model, b, gamma=4.0, ce_chunk=5)
            loss.backward()
            out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, m))
        (l0, g0, m0), (l1, g1, m1) = out
        assert torch.equal(l0, l1) and all(torch.equal(g0[n], g1[n]) for n in g0)
        for k in ("hits_k", "labels_k", "accept_k", "num_tokens", "num_anchors", "tau", "ce_sum", "weight_sum"):
            assert torch.equal(torch.as_tensor(m0[k]), torch.as_tensor(m1[k])), (attn, k)
        with torch.no_grad():  # the reference: every logit, CE where the weight is positive
            logits = model(batch["hidden_states"], batch["input_ids"], batch["anchors"], batch["attention_mask"])
            mask = batch["loss_mask"] & batch["attention_mask"]
            labels, w = block_targets(batch["input_ids"], mask, batch["anchors"], model.config.block_size, 4.0)
            ce = torch.nn.functional.cross_entropy(logits.flatten(0, 2).float(), labels.flatten(),
                                                   ignore_index=IGNORE, reduction="none")
            want = (w.flatten() * ce).sum() / w.sum()
            right = (logits.argmax(-1) == labels) & (w > 0)
        assert torch.allclose(l0, want, rtol=1e-5)
        assert m0["hits_k"].tolist() == right[:, :, 1:].sum((0, 1)).tolist()
        assert batch["num_anchors"] == int((batch["anchors"] >= 0).sum())
        assert torch.equal(batch["selected"], (w > 0).flatten().nonzero().squeeze(1))


class SyncCounter(TorchFunctionMode):
    """Counts the tensor operations that need a value from the device on the host: reading a scalar, a list or
    a bool, ``nonzero`` and indexing by a boolean mask (whose result's size depends on the values)."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
             torch.Tensor.masked_select, torch.masked_select, torch.Tensor.numpy, torch.Tensor.unique,
             torch.unique}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.READS:
            self.calls.append(func.__name__)
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
                      torch.Tensor.index_put):
            index = args[1] if len(args) > 1 else ()
            flat = index if isinstance(index, (tuple, list)) else (index,)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in flat):
                self.calls.append(f"{func.__name__}[bool mask]")
        return func(*args, **kwargs)


def test_the_step_never_waits_for_the_device():
    """Forward, backward, clipping and the meter of one step on a batch prepared by add_anchors: not one read
    of a device value (the optimizer's step counter lives on the CPU and is not looked at here)."""
    for attn in ("blocks", "sdpa"):
        drafter = make(attn, [5, None])
        loss_fn = DraftLoss(drafter, gamma=4.0, ce_chunk=5)
        batch = prepared(drafter)
        meter = Meter(drafter.config.block_size)
        with SyncCounter() as seen:
            loss, m = loss_fn(batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in drafter.parameters() if p.grad is not None], 1.0)
            meter.add(m, batch["label_counts"], batch["tokens"], len(batch["sample_id"]), batch["num_anchors"])
        assert seen.calls == [], (attn, seen.calls)
        with SyncCounter() as seen:  # the detector works: the same batch without the CPU's work waits
            dflash_loss(drafter, {k: v for k, v in batch.items() if k not in ("selected", "key_lengths")},
                        gamma=4.0)
        assert "nonzero" in seen.calls and (attn != "blocks" or "__int__" in seen.calls or "item" in seen.calls)
        s = meter.summary(1, None)  # read once per interval
        assert s["tokens"] == batch["tokens"] and abs(s["loss"] - float(m["ce_sum"] / m["weight_sum"])) < 1e-6
