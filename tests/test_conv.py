"""The Gated DeltaNet short convolution routed to a kernel of fla's calling convention (``hsstore/app/conv.py``).

fla's Triton kernel cannot run on this CPU machine, so the kernel here is a real function with fla's layout
(``[batch, time, dim]`` in, ``(y, final_state)`` out) written as shifted multiply-adds, not transformers' conv1d:
the features of a Qwen3.5 forward through the adapter must equal those of transformers' own PyTorch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hsstore import env
from hsstore.app.conv import conv_adapter, restore_conv, torch_conv, use_fla_conv


def fla_convention(x, weight, bias=None, activation=None, cu_seqlens=None, **kwargs):
    """A causal depthwise convolution in fla's convention: y[:, t] = sum_k w[:, k] * x[:, t - (W - 1) + k]."""
    assert cu_seqlens is None
    fla_convention.calls += 1
    B, T, D = x.shape
    W = weight.shape[1]
    assert weight.shape == (D, W), (weight.shape, x.shape)  # fails if the adapter hands over [B, D, T]
    padded = torch.cat([x.new_zeros(B, W - 1, D), x], dim=1).float()
    y = sum(padded[:, k:k + T] * weight[:, k].float() for k in range(W))
    y = y + bias.float() if bias is not None else y
    y = F.silu(y) if activation in ("silu", "swish") else y
    return y.to(x.dtype), None


fla_convention.calls = 0


def tiny_qwen35(seed: int = 0):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(cfg).eval()


@pytest.fixture
def model():
    m = tiny_qwen35()
    yield m
    torch_conv(m)  # the hook patches the modeling module for the process: leave it as found


def hidden(model, ids, mask=None):
    with torch.no_grad():
        return torch.stack(model(ids, attention_mask=mask, output_hidden_states=True).hidden_states)


@pytest.mark.parametrize("activation", ["silu", None])
def test_adapter_matches_transformers_torch_path(activation):
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    torch.manual_seed(1)
    proj = torch.randn(2, 37, 24)  # [batch, time, dim], as in_proj_qkv leaves it
    x = proj.transpose(1, 2)  # what the mixer hands over: [batch, dim, time], not contiguous
    weight, bias = torch.randn(24, 4), torch.randn(24)
    ref = modeling.causal_conv1d_fn(x, weight, bias, activation=activation)
    fn = conv_adapter(modeling.causal_conv1d_fn, fla_convention, devices=("cpu",))
    before = fla_convention.calls
    out = fn(x, weight, bias, activation=activation)
    assert fla_convention.calls == before + 1
    assert out.shape == ref.shape == (2, 24, 37)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fn(x=x, weight=weight, bias=bias, activation=activation), ref, rtol=1e-5, atol=1e-5)


def test_forward_through_the_hook_equals_the_torch_path(model):
    ids = torch.randint(0, 64, (2, 29))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0  # right padding, as extraction batches
    ref = hidden(model, ids, mask)
    assert use_fla_conv(model, torch.device("cpu"), kernel=fla_convention, devices=("cpu",)) == ["modeling_qwen3_5"]
    before = fla_convention.calls
    out = hidden(model, ids, mask)
    # one call per Gated DeltaNet layer: the mixer still reaches the module's global (5.25: via causal_conv1d_forward)
    assert fla_convention.calls - before == 3
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert use_fla_conv(model, torch.device("cpu"), kernel=fla_convention, devices=("cpu",)) == []  # once


def test_cpu_tensors_keep_the_torch_path(model):
    """Hooked for CUDA (the default), a CPU forward never reaches the kernel."""
    ids = torch.randint(0, 64, (1, 17))
    ref = hidden(model, ids)
    undone = torch_conv(model)
    assert undone == []
    assert use_fla_conv(model, torch.device("cpu"), kernel=fla_convention) == []  # a CPU target: nothing hooked
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    modeling_fn = modeling.causal_conv1d_fn
    try:
        modeling.causal_conv1d_fn = conv_adapter(modeling_fn, fla_convention)  # as on a CUDA target
        before = fla_convention.calls
        torch.testing.assert_close(hidden(model, ids), ref, rtol=0, atol=0)
        assert fla_convention.calls == before
    finally:
        modeling.causal_conv1d_fn = modeling_fn


def test_env_turns_it_off_and_torch_conv_undoes_it(model, monkeypatch):
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    original = modeling.causal_conv1d_fn
    monkeypatch.setenv(env.CONV.name, "torch")
    assert use_fla_conv(model, torch.device("cpu"), kernel=fla_convention, devices=("cpu",)) == []
    assert modeling.causal_conv1d_fn is original
    monkeypatch.delenv(env.CONV.name)
    assert use_fla_conv(model, torch.device("cpu"), kernel=fla_convention, devices=("cpu",))
    hooked = modeling.causal_conv1d_fn
    undone = torch_conv(model)
    assert modeling.causal_conv1d_fn is original
    restore_conv(undone)
    assert modeling.causal_conv1d_fn is hooked
