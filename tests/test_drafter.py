"""DFlash drafter and objective: the mask, the labels, the weights, the frozen head, the schedule.

Tiny dimensions (H=32, L=3, V=100), CPU, float64 where exact equality of "unchanged" outputs matters.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from hsstore.train import masks
from hsstore.train.masks import block_attention_mask
from hsstore.train.model import DFlashDrafter, DrafterConfig, default_target_layers
from hsstore.train.objective import IGNORE, batch_anchors, block_targets, chunked_cross_entropy, default_gamma, dflash_loss, sample_anchors
from hsstore.train.optim import build_optimizer, build_scheduler, clip_grad, lr_factor

H, L, V, MASK = 32, 3, 100, 99


def make_model(num_layers=2, block_size=8, sliding_window=None, dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, vocab_size=V, target_layers=[1, 2, 3],
                        mask_token_id=MASK, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=num_layers,
                        block_size=block_size, sliding_window=sliding_window, max_position=512, **kw)
    embed = torch.randn(V, H)
    head = torch.randn(V, H)
    return DFlashDrafter(cfg, embed, head).to(dtype).eval()


def make_inputs(B=1, T=24, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(B, T, L, H, generator=g, dtype=dtype)
    ids = torch.randint(0, V - 1, (B, T), generator=g)
    return hs, ids


def changed(a, b):
    return not torch.allclose(a, b, atol=1e-9, rtol=0)


# ---------------------------------------------------------------------------------------------- mask


def anchor_sees_features_at_or_after_p(model):
    """True if a block's output depends on the context feature at its anchor p or later (a leak)."""
    hs, ids = make_inputs(T=24)
    anchors = torch.tensor([[3, 9, 15]])
    with torch.no_grad():
        ref = model(hs, ids, anchors)
        for p_idx, p in enumerate([3, 9, 15]):
            for j in (p, p + 1, 23):
                hs2 = hs.clone()
                hs2[:, j] += 5.0
                if changed(model(hs2, ids, anchors)[:, p_idx], ref[:, p_idx]):
                    return True
    return False


def test_block_does_not_see_features_at_or_after_anchor():
    model = make_model()
    assert not anchor_sees_features_at_or_after_p(model)


def test_block_sees_feature_just_before_anchor_and_other_blocks_unaffected():
    model = make_model()
    hs, ids = make_inputs(T=24)
    anchors = torch.tensor([[3, 9, 15]])
    with torch.no_grad():
        ref = model(hs, ids, anchors)
        hs2 = hs.clone()
        hs2[:, 8] += 5.0  # p - 1 for the anchor at 9
        out = model(hs2, ids, anchors)
    assert changed(out[:, 1], ref[:, 1])  # anchor 9 sees position 8
    assert changed(out[:, 2], ref[:, 2])  # anchor 15 sees position 8 too
    assert not changed(out[:, 0], ref[:, 0])  # anchor 3 does not


def test_leak_detector_catches_less_equal(monkeypatch):
    """The check above fails for a mask written with `j <= p`: it would catch that bug."""
    def leaky(anchors, valid, block_size, window=None, causal=True):
        m = block_attention_mask(anchors, valid, block_size, window, causal)
        T = valid.shape[1]
        p = anchors.clamp(min=0).repeat_interleave(block_size, dim=1)  # [B, A*S]
        m[:, :, :T] |= torch.arange(T) == p[:, :, None]  # also allow j == p
        return m

    monkeypatch.setattr(masks, "block_attention_mask", leaky)
    assert anchor_sees_features_at_or_after_p(make_model())


def test_mask_matrix_small_case():
    m = block_attention_mask(torch.tensor([[2, -1]]), torch.ones(1, 5, dtype=torch.bool), block_size=2)
    # keys: 5 context positions then 2 blocks x 2 tokens
    expect = torch.tensor([
        [1, 1, 0, 0, 0, 1, 1, 0, 0],  # block 0 (anchor 2), token 0: context 0,1 and own block
        [1, 1, 0, 0, 0, 1, 1, 0, 0],  # block 0, token 1 (same: non-causal)
        [0, 0, 0, 0, 0, 0, 0, 1, 1],  # padding anchor: own block only, no context
        [0, 0, 0, 0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(m[0], expect)


def table(rows: str) -> torch.Tensor:
    """A mask written out by hand: one line per query row of 0/1 cells ('|' separates context and blocks);
    a comment may follow after three spaces."""
    cells = [line.strip().split("   ")[0].replace("|", "").split() for line in rows.strip().splitlines()]
    return torch.tensor([[c == "1" for c in row] for row in cells])


# Hand-derived from the reference rule (SpecForge create_dflash_sdpa_mask; SGLang/vLLM windows of W-1 to
# the left of each query): block row i at position q = p + i sees context j < p with q - j <= W - 1 and,
# in a causal sliding layer, block rows i' <= i with i - i' <= W - 1. Columns: context 0..T-1 | blocks.


def test_mask_table_sliding_causal_two_anchors():
    m = block_attention_mask(torch.tensor([[4, 1]]), torch.ones(1, 6, dtype=torch.bool), block_size=3, window=3)
    expect = table("""
        0 0 1 1 0 0 | 1 0 0 | 0 0 0     anchor 4, row 0 (q=4): j in [2, 4)
        0 0 0 1 0 0 | 1 1 0 | 0 0 0     row 1 (q=5): j in [3, 4); block rows 0-1
        0 0 0 0 0 0 | 1 1 1 | 0 0 0     row 2 (q=6): no context left in the window
        1 0 0 0 0 0 | 0 0 0 | 1 0 0     anchor 1, row 0 (q=1): j in [-1, 1)
        1 0 0 0 0 0 | 0 0 0 | 1 1 0     row 1 (q=2): j in [0, 1)
        0 0 0 0 0 0 | 0 0 0 | 1 1 1     row 2 (q=3): j in [1, 1): none
    """)
    assert torch.equal(m[0], expect)


def test_mask_table_window_smaller_than_block():
    """W = 2 < S = 3: the window also cuts the block itself (as the engines' flash-attention window does)."""
    anchors, valid = torch.tensor([[3]]), torch.ones(1, 4, dtype=torch.bool)
    causal = table("""
        0 0 1 0 | 1 0 0
        0 0 0 0 | 1 1 0
        0 0 0 0 | 0 1 1
    """)
    noncausal = table("""
        0 0 1 0 | 1 1 0
        0 0 0 0 | 1 1 1
        0 0 0 0 | 0 1 1
    """)
    full = table("""
        1 1 1 0 | 1 1 1
        1 1 1 0 | 1 1 1
        1 1 1 0 | 1 1 1
    """)
    assert torch.equal(block_attention_mask(anchors, valid, 3, window=2)[0], causal)
    assert torch.equal(block_attention_mask(anchors, valid, 3, window=2, causal=False)[0], noncausal)
    assert torch.equal(block_attention_mask(anchors, valid, 3)[0], full)
    assert torch.equal(block_attention_mask(anchors, valid, 3, causal=False)[0], full)  # full layers: never causal


def test_mask_table_noncausal_sliding():
    m = block_attention_mask(torch.tensor([[5]]), torch.ones(1, 7, dtype=torch.bool), block_size=4, window=4,
                             causal=False)
    expect = table("""
        0 0 1 1 1 0 0 | 1 1 1 1     q=5: j in [2, 5); the whole block
        0 0 0 1 1 0 0 | 1 1 1 1     q=6: j in [3, 5)
        0 0 0 0 1 0 0 | 1 1 1 1     q=7: j in [4, 5)
        0 0 0 0 0 0 0 | 1 1 1 1     q=8: none
    """)
    assert torch.equal(m[0], expect)


def test_mask_table_padding_and_padding_anchors():
    """Batch of two: row 1 is right-padded after 3 tokens; its second anchor is padding (-1)."""
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    anchors = torch.tensor([[4, 2], [5, -1]])
    full = block_attention_mask(anchors, valid, block_size=2)
    assert torch.equal(full[0], table("""
        1 1 1 1 0 0 | 1 1 | 0 0
        1 1 1 1 0 0 | 1 1 | 0 0
        1 1 0 0 0 0 | 0 0 | 1 1
        1 1 0 0 0 0 | 0 0 | 1 1
    """))
    assert torch.equal(full[1], table("""
        1 1 1 0 0 0 | 1 1 | 0 0      anchor 5: j < 5 but only the 3 valid positions
        1 1 1 0 0 0 | 1 1 | 0 0
        0 0 0 0 0 0 | 0 0 | 1 1      padding anchor: its own block only, no context
        0 0 0 0 0 0 | 0 0 | 1 1
    """))
    sliding = block_attention_mask(anchors, valid, block_size=2, window=3)
    assert torch.equal(sliding[0], table("""
        0 0 1 1 0 0 | 1 0 | 0 0      anchor 4, q=4: j in [2, 4)
        0 0 0 1 0 0 | 1 1 | 0 0      q=5: j in [3, 4)
        1 1 0 0 0 0 | 0 0 | 1 0      anchor 2, q=2: j in [0, 2)
        0 1 0 0 0 0 | 0 0 | 1 1      q=3: j in [1, 2)
    """))
    assert torch.equal(sliding[1], table("""
        0 0 0 0 0 0 | 1 0 | 0 0      anchor 5, q=5: j in [3, 5) is all padding
        0 0 0 0 0 0 | 1 1 | 0 0
        0 0 0 0 0 0 | 0 0 | 1 0      padding anchor, causal: row 0 sees itself
        0 0 0 0 0 0 | 0 0 | 1 1
    """))


def test_no_mask_row_is_empty():
    """Every query row may attend somewhere, whatever the anchors and padding (a fully masked row is NaN)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        B, A, S, T = 2, 4, 4, 10
        anchors = torch.randint(-1, T, (B, A), generator=g)
        valid = torch.arange(T)[None] < torch.randint(1, T + 1, (B, 1), generator=g)
        for w in (None, 1, 2, 5):
            for causal in (True, False):
                assert block_attention_mask(anchors, valid, S, w, causal).any(-1).all()


def test_flex_mask_equals_sdpa_mask():
    """The BlockMask's rule, evaluated on every (query, key) pair, is the boolean SDPA mask."""
    import warnings

    pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(1)
    B, A, S, T = 2, 3, 4, 9
    b, q, kv = torch.arange(B)[:, None, None], torch.arange(A * S)[None, :, None], torch.arange(T + A * S)[None, None]
    for _ in range(3):
        anchors = torch.randint(-1, T, (B, A), generator=g)
        valid = torch.arange(T)[None] < torch.tensor([[T], [6]])
        for w in (None, 2, 3, 6):
            for causal in (True, False):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    bm = masks._flex_block_mask(anchors, valid, S, w, causal)
                dense = block_attention_mask(anchors, valid, S, w, causal)
                assert torch.equal(bm.mask_mod(b, 0, q, kv).expand_as(dense), dense), (w, causal)


def test_sliding_window_moves_with_the_row():
    """Row i sees context j >= p + i - (W - 1): row 0 sees p - W + 1 (not p - W), row 1 does not."""
    w = 3
    model = make_model(num_layers=1, sliding_window=[w])
    hs, ids = make_inputs(T=24)
    p = 10
    anchors = torch.tensor([[p]])
    with torch.no_grad():
        ref = model(hs, ids, anchors)
        far, near = hs.clone(), hs.clone()
        far[:, p - w] += 5.0  # q - j = W for row 0: outside every row's window
        near[:, p - w + 1] += 5.0  # q - j = W - 1 for row 0: inside; row 1 is one further: outside
        assert not changed(model(far, ids, anchors), ref)
        out = model(near, ids, anchors)
    assert changed(out[0, 0, 0], ref[0, 0, 0])
    assert not changed(out[0, 0, 1:], ref[0, 0, 1:])


def test_sliding_layer_is_causal_inside_the_block_unless_asked():
    hs, ids = make_inputs(T=24)
    anchors = torch.tensor([[3, 9]])

    def perturb(row):
        def hook(module, args):
            x = args[0].clone()
            x[:, row] += 1.0
            return (x,) + args[1:]
        return hook

    for causal in (True, False):
        model = make_model(num_layers=1, sliding_window=[64], sliding_causal=causal)
        with torch.no_grad():
            ref = model(hs, ids, anchors)
            handle = model.layers[0].register_forward_pre_hook(perturb(2))  # row 2 of block 0
            out = model(hs, ids, anchors)
            handle.remove()
        assert changed(out[0, 0, 2:], ref[0, 0, 2:])  # the row itself and later rows
        assert changed(out[0, 0, :2], ref[0, 0, :2]) is not causal  # earlier rows only when non-causal
        assert not changed(out[0, 1], ref[0, 1])


def test_blocks_do_not_see_each_other():
    model = make_model()
    hs, ids = make_inputs(T=24)
    anchors = torch.tensor([[3, 9, 15]])
    with torch.no_grad():
        ref = model(hs, ids, anchors)
        ids2 = ids.clone()
        ids2[0, 9] = (ids[0, 9] + 1) % (V - 1)  # the anchor token of block 1
        out = model(hs, ids2, anchors)
    assert changed(out[:, 1], ref[:, 1])
    assert not changed(out[:, 0], ref[:, 0])
    assert not changed(out[:, 2], ref[:, 2])


def test_attention_within_block_is_not_causal():
    model = make_model(num_layers=1)
    hs, ids = make_inputs(T=24)
    anchors = torch.tensor([[3, 9]])
    S = model.config.block_size
    last_of_block0 = S - 1

    def perturb_last_token(module, args):
        x = args[0].clone()
        x[:, last_of_block0] += 1.0
        return (x,) + args[1:]

    with torch.no_grad():
        ref = model(hs, ids, anchors)
        handle = model.layers[0].register_forward_pre_hook(perturb_last_token)
        out = model(hs, ids, anchors)
        handle.remove()
    assert changed(out[0, 0, 0], ref[0, 0, 0])  # first token of block 0 sees its last token
    assert not changed(out[0, 1], ref[0, 1])  # block 1 does not


def test_right_padding_and_padding_anchors_change_nothing():
    model = make_model(sliding_window=[None, 4])
    hs, ids = make_inputs(B=2, T=20)
    lens = [20, 13]
    attn = torch.arange(20)[None] < torch.tensor(lens)[:, None]
    hs[1, 13:] = float("nan")  # garbage in the padding must not matter
    anchors = torch.tensor([[2, 7, 17], [4, 10, -1]])
    with torch.no_grad():
        both = model(hs, ids, anchors, attn)
        alone = model(hs[1:, :13], ids[1:, :13], anchors[1:, :2])
    assert torch.isfinite(both).all()
    assert torch.allclose(both[1, :2], alone[0], atol=1e-10)


@pytest.mark.parametrize("sliding_causal", [True, False])
def test_flex_path_matches_sdpa(sliding_causal):
    import warnings

    pytest.importorskip("torch.nn.attention.flex_attention")

    kw = dict(sliding_window=[None, 4], dtype=torch.float32, sliding_causal=sliding_causal)
    sdpa = make_model(**kw)
    flex = make_model(**kw, attn_impl="flex")
    flex.load_state_dict(sdpa.state_dict())
    flex.embed_tokens.copy_(sdpa.embed_tokens)
    flex.lm_head.copy_(sdpa.lm_head)
    hs, ids = make_inputs(B=2, T=20, dtype=torch.float32)
    attn = torch.arange(20)[None] < torch.tensor([[20], [13]])
    anchors = torch.tensor([[0, 7, 17], [4, 10, -1]])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = sdpa(hs, ids, anchors, attn)
        b = flex(hs, ids, anchors, attn)
    assert torch.isfinite(a).all() and torch.allclose(a, b, atol=1e-4)


# ---------------------------------------------------------------------------------------------- anchors


def test_sample_anchors_rules():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        T = 50
        lm = torch.rand(T, generator=g) < 0.7
        a = sample_anchors(lm, n_max=10, generator=torch.Generator().manual_seed(trial))
        cand = {p for p in range(T - 1) if lm[p] and lm[p + 1]}
        assert len(a) == min(10, len(cand))
        assert len(set(a.tolist())) == len(a)  # no duplicates
        assert set(a.tolist()) <= cand  # loss_mask[p] and loss_mask[p+1], p+1 < T
        assert a.tolist() == sorted(a.tolist())
    lm = torch.tensor([0, 1, 1, 0, 1, 1, 1])
    assert sample_anchors(lm, n_max=512).tolist() == [1, 4, 5]  # all of them; 6 is last, never
    assert sample_anchors(torch.tensor([1, 0, 1, 0])).numel() == 0


def test_sample_anchors_deterministic_and_uniform():
    lm = torch.ones(200, dtype=torch.bool)
    a1 = sample_anchors(lm, 16, torch.Generator().manual_seed(5))
    a2 = sample_anchors(lm, 16, torch.Generator().manual_seed(5))
    a3 = sample_anchors(lm, 16, torch.Generator().manual_seed(6))
    assert torch.equal(a1, a2) and not torch.equal(a1, a3)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(10)
    for _ in range(2000):
        counts[sample_anchors(torch.ones(11), 3, g)] += 1
    assert counts.min() > 500 and counts.max() < 700  # expected 600 each


def test_batch_anchors_pads_with_minus_one():
    lm = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 0, 0]])
    a = batch_anchors(lm, n_max=512)
    assert a.tolist() == [[0, 1, 2], [1, -1, -1]]


# ---------------------------------------------------------------------------------------------- labels, weights, loss


def test_gamma_defaults():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7, 5, 4)
    with pytest.raises(ValueError):
        default_gamma(12)


def test_labels_same_position_and_weights_decay():
    T, S, gamma = 12, 4, 7.0
    ids = torch.arange(T)[None] + 10
    lm = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1]])
    anchors = torch.tensor([[2, 9, -1]])
    labels, w = block_targets(ids, lm, anchors, S, gamma)
    # anchor 2: outputs k=1..3 predict tokens at 3, 4, 5 (not 4, 5, 6)
    assert labels[0, 0].tolist() == [IGNORE, 13, 14, 15]
    assert torch.allclose(w[0, 0], torch.tensor([0, 1, math.exp(-1 / 7), math.exp(-2 / 7)]))
    # anchor 9: 10, 11 exist, 12 is past the end
    assert labels[0, 1].tolist() == [IGNORE, 20, 21, IGNORE]
    assert torch.allclose(w[0, 1], torch.tensor([0, 1, math.exp(-1 / 7), 0]))
    assert (labels[0, 2] == IGNORE).all() and (w[0, 2] == 0).all()
    # loss_mask[p+k] = 0 zeroes the weight
    _, w2 = block_targets(ids, lm, torch.tensor([[4]]), S, gamma)
    assert torch.allclose(w2[0, 0], torch.tensor([0, 1, 0, math.exp(-2 / 7)]))


def hand_loss(logits, ids, lm, anchors, S, gamma, shift=0):
    num = den = 0.0
    for b in range(ids.shape[0]):
        for a, p in enumerate(anchors[b].tolist()):
            if p < 0:
                continue
            for k in range(1, S):
                t = p + k + shift
                if t >= ids.shape[1] or not lm[b, t]:
                    continue
                w = math.exp(-(k - 1) / gamma)
                ce = -torch.log_softmax(logits[b, a, k], -1)[ids[b, t]].item()
                num, den = num + w * ce, den + w
    return num / den


def test_loss_matches_hand_computed_weighted_ce():
    model = make_model(block_size=8)
    hs, ids = make_inputs(B=2, T=20)
    lm = torch.zeros(2, 20, dtype=torch.bool)
    lm[0, 4:] = True
    lm[1, 6:15] = True
    anchors = torch.tensor([[4, 11, 18], [6, 12, -1]])
    batch = dict(input_ids=ids, loss_mask=lm, hidden_states=hs, anchors=anchors)
    loss, metrics = dflash_loss(model, batch, ce_chunk=5)
    with torch.no_grad():
        logits = model(hs, ids, anchors)
    expect = hand_loss(logits, ids, lm, anchors, 8, 4.0)
    assert loss.item() == pytest.approx(expect, rel=1e-6)
    # a shifted-label objective gives a different number, so this test would catch it
    assert hand_loss(logits, ids, lm, anchors, 8, 4.0, shift=1) != pytest.approx(expect, rel=1e-3)
    # per-position accuracy
    pred = logits.argmax(-1)
    for k in range(1, 8):
        hits = n = 0
        for b in range(2):
            for a, p in enumerate(anchors[b].tolist()):
                if p >= 0 and p + k < 20 and lm[b, p + k]:
                    n += 1
                    hits += int(pred[b, a, k] == ids[b, p + k])
        got = metrics["acc_k"][k - 1].item()
        assert (math.isnan(got) and n == 0) or got == pytest.approx(hits / n)
    assert metrics["num_anchors"].item() == 5


def test_loss_learns_same_position_labels():
    """A drafter can learn a fixed sequence only if its labels are the tokens at p+k."""
    model = make_model(num_layers=1, block_size=4, dtype=torch.float32)
    torch.manual_seed(0)
    T = 24
    ids = torch.randint(0, V - 1, (2, T))
    hs = torch.randn(2, T, L, H)
    batch = dict(input_ids=ids, loss_mask=torch.ones(2, T, dtype=torch.bool), hidden_states=hs)
    opt = build_optimizer(model, lr=1e-2)
    sched = build_scheduler(opt, total_steps=60)
    model.train()
    g = torch.Generator().manual_seed(0)
    first = None
    for _ in range(60):
        loss, m = dflash_loss(model, batch, anchors_per_seq=16, generator=g, gamma=4.0)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        clip_grad(model, 1.0)
        opt.step()
        sched.step()
    assert loss.item() < 0.5 * first
    assert m["acc"].item() > 0.5


def test_no_anchors_gives_zero_loss_with_grad():
    model = make_model(dtype=torch.float32)
    hs, ids = make_inputs(B=1, T=10, dtype=torch.float32)
    batch = dict(input_ids=ids, loss_mask=torch.tensor([[0, 1, 0, 1, 0, 0, 0, 0, 0, 1]]), hidden_states=hs)
    loss, m = dflash_loss(model, batch)
    loss.backward()
    assert loss.item() == 0.0 and m["num_anchors"].item() == 0


def test_chunked_cross_entropy_matches_full():
    torch.manual_seed(0)
    h = torch.randn(37, H, requires_grad=True)
    w = torch.randn(V, H)
    y = torch.randint(0, V, (37,))
    ce, pred = chunked_cross_entropy(h, w, y, chunk=8)
    (ce * torch.arange(37)).sum().backward()
    g1 = h.grad.clone()
    h.grad = None
    logits = h @ w.T
    ref = F.cross_entropy(logits, y, reduction="none")
    (ref * torch.arange(37)).sum().backward()
    assert torch.allclose(ce, ref, atol=1e-5) and torch.equal(pred, logits.argmax(-1))
    assert torch.allclose(g1, h.grad, atol=1e-5)


# ---------------------------------------------------------------------------------------------- frozen head, optim


def test_embedding_and_lm_head_frozen():
    model = make_model(dtype=torch.float32).train()
    embed0, head0 = model.embed_tokens.clone(), model.lm_head.clone()
    names = {n for n, _ in model.named_parameters()}
    assert "embed_tokens" not in names and "lm_head" not in names
    assert not model.embed_tokens.requires_grad and not model.lm_head.requires_grad
    assert "embed_tokens" not in model.state_dict() and "lm_head" not in model.state_dict()
    opt = build_optimizer(model)
    in_opt = {id(p) for grp in opt.param_groups for p in grp["params"]}
    assert id(model.embed_tokens) not in in_opt and id(model.lm_head) not in in_opt
    hs, ids = make_inputs(B=1, T=16, dtype=torch.float32)
    batch = dict(input_ids=ids, loss_mask=torch.ones(1, 16), hidden_states=hs)
    loss, _ = dflash_loss(model, batch)
    loss.backward()
    assert model.embed_tokens.grad is None and model.lm_head.grad is None
    assert model.fc.weight.grad is not None and model.layers[0].self_attn.k_proj.weight.grad is not None
    opt.step()
    assert torch.equal(model.embed_tokens, embed0) and torch.equal(model.lm_head, head0)


def test_lr_schedule_and_clip():
    total = 100  # warmup = 4 steps
    f = [lr_factor(s, total) for s in range(total)]
    assert f[0] == pytest.approx(0.25) and f[3] == pytest.approx(1.0)
    assert f[4] == pytest.approx(1.0) and f[52] == pytest.approx(0.5)
    assert all(a >= b for a, b in zip(f[3:], f[4:])) and f[-1] < 1e-3
    p = torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer(torch.nn.ParameterList([p]))
    assert opt.defaults["lr"] == 6e-4 and opt.defaults["weight_decay"] == 0.0
    sched = build_scheduler(opt, total)
    assert opt.param_groups[0]["lr"] == pytest.approx(6e-4 * 0.25)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(6e-4 * 0.5)
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    assert clip_grad([p], 1.0).item() == pytest.approx(5.0)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


# ---------------------------------------------------------------------------------------------- config, weights


def test_default_target_layers_and_config_from_target():
    assert default_target_layers(64) == [1, 16, 31, 46, 61]
    assert default_target_layers(36) == [1, 9, 17, 25, 33]
    from transformers import Qwen3Config

    tc = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=36, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=300)
    cfg = DrafterConfig.from_target_config(tc, mask_token_id=299, num_layers=2, block_size=8)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.target_layers == [1, 9, 17, 25, 33] and cfg.block_size == 8 and cfg.num_layers == 2
    assert cfg.rope_theta == tc.rope_parameters["rope_theta"]
    with pytest.raises(ValueError):
        DrafterConfig(**{**cfg.__dict__, "sliding_window": [None]})
