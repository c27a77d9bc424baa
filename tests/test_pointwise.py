"""The draft layer's pointwise functions, compiled (train/pointwise.py): the same loss and gradients as eager, one
graph for every batch shape, and eager again (said once) when compiling fails. CPU runs the compiled path through
dynamo and AOTAutograd with ``aot_eager`` (no C compiler needed); the H200 runs inductor (tools/bench_attention)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from hsstore.train import pointwise
from hsstore.train.model import DFlashDrafter, DrafterConfig
from hsstore.train.objective import batch_anchors, dflash_loss
from hsstore.train.optim import build_optimizer

H, V, L = 32, 97, 3


@pytest.fixture
def on_cpu(monkeypatch):
    """The compiled path on CPU tensors, with dynamo's caches and counters fresh."""
    monkeypatch.setattr(pointwise, "DEVICES", ("cpu",))
    monkeypatch.setattr(pointwise, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    pointwise.reset()
    yield
    torch._dynamo.reset()
    pointwise.reset()


def tiny():
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, vocab_size=V, target_layers=[1, 2, 3], mask_token_id=V - 1,
                        num_heads=4, num_kv_heads=2, head_dim=8, num_layers=2, block_size=4,
                        sliding_window=[8, None], max_position=4096, attn_impl="blocks")
    return DFlashDrafter(cfg, torch.randn(V, H), torch.randn(V, H))


def batch(T, B=2, A=6):
    g = torch.Generator().manual_seed(T)
    mask = torch.ones(B, T, dtype=torch.bool)
    return dict(input_ids=torch.randint(0, V - 1, (B, T), generator=g), loss_mask=mask,
                hidden_states=torch.randn(B, T, L, H, generator=g),
                anchors=batch_anchors(mask, A, torch.Generator().manual_seed(4)))


def loss_and_grads(model, b):
    model.zero_grad(set_to_none=True)
    loss, _ = dflash_loss(model, b, gamma=4.0)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compiled_pointwise_gives_the_eager_loss_and_gradients(on_cpu, monkeypatch):
    model, b = tiny(), batch(64)
    monkeypatch.setattr(pointwise, "FUSE", False)
    l0, g0 = loss_and_grads(model, b)
    monkeypatch.setattr(pointwise, "FUSE", True)
    l1, g1 = loss_and_grads(model, b)
    assert set(pointwise._compiled) == {"_rms_norm", "_rope", "_swiglu", "_softmax_grad"}  # the compiled path ran
    assert all(pointwise._compiled.values())
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)


def test_a_new_batch_shape_compiles_nothing_new(on_cpu):
    model = tiny()
    loss_and_grads(model, batch(64))
    frames = dict(torch._dynamo.utils.counters["frames"])
    assert frames.get("ok", 0) > 0
    loss_and_grads(model, batch(96, A=9))  # other T and anchor count: the dynamic graphs serve it
    assert dict(torch._dynamo.utils.counters["frames"]) == frames


def test_evaluation_without_gradients_stays_eager(on_cpu):
    x, w = torch.randn(4, 16), torch.rand(16)
    with torch.no_grad():
        pointwise.rms_norm(x, w, 1e-6)
    assert pointwise._compiled == {}
    pointwise.rms_norm(x, w, 1e-6)
    assert set(pointwise._compiled) == {"_rms_norm"}


def test_the_reference_math():
    """Expected values written out here, not taken from the module: Qwen3's RMSNorm, rotate-half RoPE, SwiGLU."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 8, generator=g)
    w = torch.randn(8, generator=g)
    rms = torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(pointwise.rms_norm(x, w, 1e-6), x / rms * w)
    cos, sin = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    rot = torch.cat([-x[..., 4:], x[..., :4]], dim=-1)
    torch.testing.assert_close(pointwise.apply_rope(x, cos, sin), x * cos[:, :, None] + rot * sin[:, :, None])
    a, u = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    torch.testing.assert_close(pointwise.swiglu(a, u), a * torch.sigmoid(a) * u)
    # bf16 input, fp32 weight (autocast with fp32 masters): normalised in fp32, rounded to bf16, scaled in fp32
    xb = x.bfloat16()
    ref = w * (xb.float() / torch.sqrt((xb.float() ** 2).mean(-1, keepdim=True) + 1e-6)).bfloat16().float()
    out = pointwise.rms_norm(xb, w, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref)


def test_a_failing_compile_falls_back_to_eager_once(on_cpu, monkeypatch, caplog):
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(pointwise, "BACKEND", broken)
    x, w = torch.randn(4, 16), torch.rand(16)
    with caplog.at_level(logging.WARNING, logger="hsstore.train.pointwise"):
        first = pointwise.rms_norm(x, w, 1e-6)
        second = pointwise.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(first, pointwise._rms_norm.eager(x, w, 1e-6))
    torch.testing.assert_close(second, first)
    warnings = [r for r in caplog.records if "_rms_norm: compiling failed" in r.getMessage()]
    assert len(warnings) == 1 and "no compiler here" in warnings[0].getMessage()
    assert pointwise._compiled["_rms_norm"] is None


def test_adamw_is_fused_only_where_all_parameters_are_on_cuda():
    model = torch.nn.Linear(4, 4)
    assert not build_optimizer(model).defaults.get("fused")
    assert build_optimizer(model, fused=False).defaults["fused"] is False
    if torch.cuda.is_available():
        assert build_optimizer(model.cuda()).defaults["fused"] is True


def test_silu_is_the_one_in_the_reference():
    a = torch.linspace(-4, 4, 9)
    torch.testing.assert_close(pointwise.swiglu(a, torch.ones_like(a)), F.silu(a))
