"""Activation checkpointing of draft layers (issue #28: the published recipe on an 80 GB GPU): the same loss and
gradients, bit for bit, with fewer bytes kept for backward; and the GPU budget that decides before step 1."""

from __future__ import annotations

import pytest
import torch

from hsstore.train.budget import fit_gpu_step, step_bytes, saved_activation_bytes
from hsstore.train.model import DFlashDrafter, DrafterConfig
from hsstore.train.objective import batch_anchors, dflash_loss

H, V, L = 32, 97, 3


def tiny(impl="blocks"):
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, vocab_size=V, target_layers=[1, 2, 3], mask_token_id=V - 1,
                        num_heads=4, num_kv_heads=2, head_dim=8, num_layers=3, block_size=4,
                        sliding_window=[8, 8, None], max_position=4096, attn_impl=impl)
    return DFlashDrafter(cfg, torch.randn(V, H), torch.randn(V, H))


def batch(T=96, B=2, A=12):
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(B, T, dtype=torch.bool)
    return dict(input_ids=torch.randint(0, V - 1, (B, T), generator=g), loss_mask=mask,
                hidden_states=torch.randn(B, T, L, H, generator=g),
                anchors=batch_anchors(mask, A, torch.Generator().manual_seed(4)))


@pytest.mark.parametrize("policy", ["full", "mlp"])
@pytest.mark.parametrize("impl", ["blocks", "sdpa"])
def test_checkpointed_layers_give_the_same_loss_and_gradients(impl, policy):
    model, b = tiny(impl), batch()
    out = []
    for on in ("off", policy):
        model.checkpoint_layers = on
        model.zero_grad(set_to_none=True)
        loss, _ = dflash_loss(model, b, gamma=4.0)
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = out
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)


def test_checkpointed_layers_keep_less_for_backward():
    model, b = tiny(), batch()

    def kept():
        n, out = saved_activation_bytes(lambda: dflash_loss(model, b, gamma=4.0),
                                        exclude=[*model.parameters(), *model.buffers()])
        return n

    full = kept()
    model.checkpoint_layers = "mlp"
    mlp = kept()
    model.checkpoint_layers = "full"
    ckpt = kept()
    # the MLP half's own saved tensors, counted here: per layer and query row, the norm's input and output (fp32:
    # H each), gate and up outputs and SwiGLU's product (I each; silu's output is recomputed inside the fused
    # function or kept by eager: at least 3 I); "mlp" keeps none of them but the block's input
    rows = b["input_ids"].shape[0] * 12 * 4
    I = model.config.intermediate_size
    assert mlp <= full - model.config.num_layers * rows * (3 * I + H) * 4, (mlp, full)
    assert ckpt < mlp
    # what checkpointing still holds outside autograd's saved tensors: each layer's input and the shared context
    B, T = b["input_ids"].shape
    inputs = model.config.num_layers * B * 12 * 4 * H * 4 + B * T * H * 4
    assert ckpt + inputs < full / 2, (ckpt, inputs, full)


@pytest.mark.parametrize("policy", ["off", "mlp", "full"])
def test_the_one_memory_model_holds_a_cpu_steps_activations(policy):
    """The CPU's refusal and the GPU's fit use one model (``step_bytes``): on a CPU (fp32, attention keeping its
    scores) it bounds what autograd keeps of a step, measured, under each checkpointing policy; the same shape
    under bf16 autocast on a GPU is estimated smaller."""
    model, b = tiny(), batch()
    model.checkpoint_layers = policy
    kept, _ = saved_activation_bytes(lambda: dflash_loss(model, b, gamma=4.0),
                                     exclude=[*model.parameters(), *model.buffers()])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad) + sum(
        x.numel() for x in model.buffers())
    B, T = b["input_ids"].shape
    args = (model.config, B * T, 12, trainable, frozen)
    cpu = step_bytes(*args, sequences=B, ce_chunk=1024, checkpoint_layers=policy, device="cpu")
    assert cpu >= 16 * trainable + kept, (cpu, kept)
    assert step_bytes(*args, sequences=B, ce_chunk=1024, checkpoint_layers=policy, device="cuda") < cpu


def test_gpu_budget_refuses_or_lowers_anchors_and_says_so():
    cfg = DrafterConfig(hidden_size=5120, intermediate_size=17408, vocab_size=248320, target_layers=[1, 16, 31, 46, 61],
                        mask_token_id=0, num_heads=32, num_kv_heads=8, head_dim=128, num_layers=5, block_size=16,
                        sliding_window=[2048] * 4 + [None])
    params, frozen = 1_250_000_000, 2 * 248320 * 5120
    big = step_bytes(cfg, 16384, 512, params, frozen, sequences=4)
    small = step_bytes(cfg, 16384, 512, params, frozen, sequences=4, checkpoint_layers="full")
    assert small < big
    mlp = step_bytes(cfg, 16384, 512, params, frozen, sequences=4, checkpoint_layers="mlp")
    assert small < mlp < big
    # what "mlp" saves over no recompute: each layer but one keeps no MLP half ([rows, 2 H + 3 I] bf16 x slack)
    rows, slack = 4 * 512 * 16, 2.85
    assert big - mlp == pytest.approx(4 * rows * slack * 2 * (2 * 5120 + 3 * 17408) - 5 * rows * 2 * 5120, rel=1e-6)
    with pytest.raises(ValueError, match="checkpoint_layers 'some'"):
        step_bytes(cfg, 16384, 512, params, frozen, checkpoint_layers="some")
    # a bool meant the whole layer before there were policies and "mlp" for the bare flag now: refused, named
    for flag in (True, False):
        with pytest.raises(ValueError, match=rf"checkpoint_layers {flag}: name a policy, one of off, mlp, full"):
            step_bytes(cfg, 16384, 512, params, frozen, checkpoint_layers=flag)
    # fits as asked: unchanged
    assert fit_gpu_step(cfg, 16384, 512, params, frozen, have=big * 2, sequences=4) == (512, big)
    # too big: anchors halved until it fits, with the reason and the way out in the message
    with pytest.warns(UserWarning, match="anchors"):
        anchors, need = fit_gpu_step(cfg, 16384, 512, params, frozen, have=(big + small) // 2, sequences=4)
    assert anchors < 512 and need <= (big + small) // 2
    with pytest.raises(ValueError, match="--checkpoint-layers"):
        fit_gpu_step(cfg, 16384, 512, params, frozen, have=16 * params, sequences=4)
