"""The lm_head + cross entropy by chunks of query rows ("fused", "checkpoint") against all logits at once ("full").

Same loss, same gradients, same metrics, whatever the chunk size (dividing the rows or not, one row, more than all
rows), with padded rows, loss_mask holes and padding anchors, on both attention paths; and the point of it: the
chunked paths never hold all rows' logits. CPU, float32.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from hsstore.train import pointwise
from hsstore.train.model import DFlashDrafter, DrafterConfig
from hsstore.train.objective import CE_IMPLS, IGNORE, batch_anchors, chunked_cross_entropy, dflash_loss

H, L, V, MASK = 32, 3, 100, 99


@pytest.mark.parametrize("impl", ["fused", "checkpoint"])
@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 1000])
def test_chunked_ce_equals_reference(impl, chunk):
    """CE, predictions and the gradient of a weighted sum of the CEs equal F.cross_entropy on h @ w.T, with
    IGNORE rows (CE 0, no gradient), 37 rows in chunks that do and do not divide them."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g)
    y = torch.randint(0, V, (37,), generator=g)
    y[[3, 17, 36]] = IGNORE
    weight = torch.rand(37, generator=g) + 0.1  # per-row upstream gradients differ: backward must scale by row

    ce, pred = chunked_cross_entropy(h, w, y, chunk, impl)
    (ce * weight).sum().backward()
    got_grad, h.grad = h.grad.clone(), None

    logits = h @ w.T
    want = F.cross_entropy(logits, y, reduction="none", ignore_index=IGNORE)
    (want * weight).sum().backward()
    assert torch.allclose(ce, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(pred, logits.argmax(-1))
    assert (ce[[3, 17, 36]] == 0).all() and (got_grad[[3, 17, 36]] == 0).all()
    assert torch.allclose(got_grad, h.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_fused_ce_compiled_equals_eager_in_bf16(backend, monkeypatch):
    """Compiled (as on the GPU; here on CPU tensors), each chunk's one-pass math gives the eager loop's CE, top-1 and
    gradient on bf16 logits, IGNORE rows included, for chunks of two sizes (one graph for both: dynamic rows)."""
    torch._dynamo.reset()
    pointwise.reset()
    try:
        g = torch.Generator().manual_seed(2)
        h = torch.randn(45, H, generator=g).bfloat16().requires_grad_()
        w = torch.randn(V, H, generator=g).bfloat16()
        y = torch.randint(0, V, (45,), generator=g)
        y[[0, 20, 44]] = IGNORE
        out = {}
        for mode in ("eager", "compiled"):
            if mode == "compiled":
                monkeypatch.setattr(pointwise, "DEVICES", ("cpu",))
                monkeypatch.setattr(pointwise, "BACKEND", backend)
            ce, pred = chunked_cross_entropy(h, w, y, 16, "fused")  # chunks of 16, 16 and 13 rows
            ce.sum().backward()
            out[mode] = ce.detach(), pred, h.grad.clone()
            h.grad = None
            assert ("_softmax_grad" in pointwise._compiled) == (mode == "compiled")
        assert pointwise._compiled["_softmax_grad"] is not None  # compiled, not fallen back to eager
        (ce0, p0, g0), (ce1, p1, g1) = out["eager"], out["compiled"]
        assert torch.allclose(ce1, ce0, rtol=1e-5, atol=1e-5) and torch.equal(p1, p0)
        assert (ce1[[0, 20, 44]] == 0).all() and (g1[[0, 20, 44]] == 0).all()
        assert torch.allclose(g1.float(), g0.float(), rtol=2e-2, atol=1e-3)  # both rounded to bf16 once
        assert not torch.equal(g1, torch.zeros_like(g1))
    finally:
        torch._dynamo.reset()
        pointwise.reset()


def test_fused_ce_without_grad_and_refusals():
    g = torch.Generator().manual_seed(1)
    h, w, y = torch.randn(10, H, generator=g), torch.randn(V, H, generator=g), torch.randint(0, V, (10,), generator=g)
    with torch.no_grad():
        ce, pred = chunked_cross_entropy(h, w, y, 3, "fused")
    assert torch.allclose(ce, F.cross_entropy(h @ w.T, y, reduction="none"), rtol=1e-6)
    with pytest.raises(ValueError, match="frozen"):  # a trainable head would silently get no gradient
        chunked_cross_entropy(h.requires_grad_(), w.requires_grad_(), y, 3, "fused")
    with pytest.raises(ValueError, match="impl"):
        chunked_cross_entropy(h, w, y, 3, "bogus")


def make(attn_impl, windows):
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, vocab_size=V, target_layers=[1, 2, 3],
                        mask_token_id=MASK, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=len(windows),
                        block_size=4, sliding_window=windows, max_position=512, attn_impl=attn_impl)
    return DFlashDrafter(cfg, torch.randn(V, H), torch.randn(V, H))


def padded_batch(seed=0):
    """Three rows of 40, 27 and 9 real tokens (right padding, NaN features there), holes in loss_mask, fewer
    anchors in the shorter rows (-1 padding anchors)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([40, 27, 9])
    B, T = 3, 40
    valid = torch.arange(T)[None] < lengths[:, None]
    loss_mask = valid & (torch.rand(B, T, generator=g) > 0.2)
    hs = torch.randn(B, T, L, H, generator=g)
    hs[~valid] = float("nan")
    return dict(input_ids=torch.randint(0, V - 1, (B, T), generator=g), loss_mask=loss_mask, attention_mask=valid,
                hidden_states=hs, anchors=batch_anchors(loss_mask, 7, torch.Generator().manual_seed(3)))


def run(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    loss, metrics = dflash_loss(model, batch, gamma=4.0, **kw)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, metrics


@pytest.mark.parametrize("attn", ["sdpa", "blocks"])
def test_dflash_loss_same_for_every_ce_impl_and_chunk(attn):
    batch = padded_batch()
    assert (batch["anchors"] == -1).any() and not batch["loss_mask"][0].all()
    model = make(attn, [5, None])
    l0, g0, m0 = run(model, batch, ce_impl="full")
    assert torch.isfinite(l0)
    for impl in ("fused", "checkpoint"):
        for chunk in (1, 7, 64, 10_000):  # 7 and 64 divide no row count here; 10,000 > all rows
            loss, grads, m = run(model, batch, ce_impl=impl, ce_chunk=chunk)
            assert torch.allclose(loss, l0, rtol=1e-6, atol=0), (impl, chunk)
            for n in g0:
                assert torch.allclose(grads[n], g0[n], rtol=1e-5, atol=1e-7), (impl, chunk, n)
            for k in ("hits_k", "labels_k", "accept_k", "num_tokens", "num_anchors"):
                assert torch.equal(m[k], m0[k]), (impl, chunk, k)
            assert torch.allclose(m["tau"], m0["tau"]) and torch.allclose(m["ce_sum"], m0["ce_sum"], rtol=1e-6)
    with torch.no_grad():  # evaluation: no gradient kept, the same metrics
        _, m = dflash_loss(model, batch, gamma=4.0, ce_impl="fused", ce_chunk=7)
    assert torch.equal(m["hits_k"], m0["hits_k"]) and torch.allclose(m["ce_sum"], m0["ce_sum"], rtol=1e-6)


PEAK_SCRIPT = textwrap.dedent("""
    import sys, torch
    from hsstore.train.objective import chunked_cross_entropy

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    N, H, V = 4096, 64, 8000
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w, y = torch.randn(V, H, generator=g), torch.randint(0, V, (N,), generator=g)
    for impl in sys.argv[1:] * 2:  # the first round pays for lazy initialisations; the second one counts
        base = status("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")  # reset the RSS high-water mark
        ce, _ = chunked_cross_entropy(h, w, y, 256, impl)
        ce.sum().backward()
        print(impl, status("VmHWM") - base)
        del ce
        h.grad = None
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's clear_refs")
def test_chunked_paths_never_hold_all_logits():
    """Peak memory of forward + backward over 4096 rows x 8000 vocab (all logits: 125 MiB in fp32): the full
    path holds them (and their gradient); the chunked paths hold a 256-row chunk's worth at a time."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # freed blocks go back to the system at once
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, *CE_IMPLS], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    peak = {k: int(v) for k, v in (line.split() for line in out.splitlines())}
    all_logits = 4096 * 8000 * 4
    assert peak["full"] > all_logits
    assert peak["fused"] < all_logits / 4 and peak["checkpoint"] < all_logits, peak
