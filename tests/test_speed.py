"""The compiled target forward (extract/speed.py) gives the eager forward's features on a real tiny Qwen3.5 model.

On the CPU in fp32 the two agree to float rounding; the GPU figures (bf16, 27B scale) are in the #18 note and
``tools/bench_extract.py --compile``, which compares per tap with the eager forward's own shape-to-shape spread.
"""

from __future__ import annotations

import pytest
import torch

from hsstore.extract.capture import run_tapped
from hsstore.app.target import decoder_layers
from hsstore.extract.speed import compile_forward, compiled_parts

pytestmark = pytest.mark.slow  # compiles the tiny target's forward


@pytest.fixture(scope="module")
def model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def test_only_dense_parts_are_compiled(model):
    parts = compiled_parts(model)
    kinds = {type(p).__name__ for p in parts}
    assert kinds == {"Qwen3_5RMSNorm", "Qwen3_5RMSNormGated", "Qwen3_5MLP", "Qwen3_5Attention"}, kinds
    for layer in decoder_layers(model):  # the Gated DeltaNet mixer (custom kernels, cache logic) stays eager
        assert layer not in parts and getattr(layer, "linear_attn", None) not in parts
    attn = [p for p in parts if type(p).__name__ == "Qwen3_5Attention"]
    inner = {id(m) for a in attn for m in a.modules() if m is not a}
    assert attn and not any(id(p) in inner for p in parts)  # an attention block's q/k norms are not compiled twice


def test_no_padding_mask_gives_the_same_real_token_features(model):
    """Extraction passes no mask: under a causal decoder a right pad never reaches a real token. A left pad would
    (the second check shows the comparison can fail)."""
    g = torch.Generator().manual_seed(1)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(3, vocab, (3, 48), generator=g)
    mask = torch.ones(3, 48, dtype=torch.long)
    mask[1, 30:] = 0
    mask[2, 9:] = 0
    taps = list(range(len(decoder_layers(model))))
    with torch.inference_mode():
        ref = run_tapped(model, taps, ids, mask)
        out = run_tapped(model, taps, ids, None)
        keep = mask.bool()
        assert torch.allclose(out[keep], ref[keep], rtol=1e-5, atol=1e-6), (out[keep] - ref[keep]).abs().max()
        left = torch.flip(mask, [1])  # the same rows left-padded: without the mask the pads leak into real tokens
        ref_left = run_tapped(model, taps, ids, left)
        out_left = run_tapped(model, taps, ids, None)
        assert not torch.allclose(out_left[left.bool()], ref_left[left.bool()], rtol=1e-5, atol=1e-6)


def test_compiled_features_equal_eager(model):
    g = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    batches = []
    for b, t in ((2, 40), (3, 64), (1, 17)):  # three shapes: recompiles or dynamic shapes must both be right
        ids = torch.randint(3, vocab, (b, t), generator=g)
        mask = torch.ones(b, t, dtype=torch.long)
        mask[-1, t // 2:] = 0  # right padding, as extraction batches
        batches.append((ids, mask))
    taps = list(range(len(decoder_layers(model))))
    eager = [run_tapped(model, taps, ids, mask) for ids, mask in batches]
    report = compile_forward(model, mixers=True)  # what `hsstore extract --compile` runs
    parts = compiled_parts(model, mixers=True)
    assert report.modules == len(parts)
    assert {type(p).__name__ for p in parts} == {"Qwen3_5RMSNorm", "Qwen3_5MLP", "Qwen3_5Attention",
                                                 "Qwen3_5GatedDeltaNet"}  # a mixer's gated norm is traced with it
    for (ids, mask), ref in zip(batches, eager):
        out = run_tapped(model, taps, ids, None)  # as extraction calls it: no padding mask
        keep = mask.bool()
        assert torch.allclose(out[keep], ref[keep], rtol=1e-4, atol=1e-5), (out[keep] - ref[keep]).abs().max()
