"""The block-sparse attention path ("blocks") against the dense reference mask ("sdpa").

The plan must name exactly the keys the dense mask allows (no more, none twice, none missing), and the
drafter's loss and gradients must be those of the dense path on the same batch: padded rows, padding
anchors, anchors at the sequence's start and end, sliding and full layers, causal and not, chunks that
split the anchors unevenly. Tiny dimensions, CPU, float32 (and float64 for the exact mask check).
"""

import pytest
import torch

from hsstore.train.masks import block_attention_mask, block_plan
from hsstore.train.model import DFlashDrafter, DrafterConfig
from hsstore.train.objective import batch_anchors, dflash_loss

H, L, V, MASK = 32, 3, 100, 99


def plan_as_dense(plan, B, T, N):
    """Count, per (query row, key) of the dense layout [context T | blocks N], how often the plan lets the
    row see that key (0 or 1 when the plan is right)."""
    Np = max(plan.padded_rows, N)
    seen = torch.zeros(B, Np, T + Np, dtype=torch.long)
    for r0, _, idx, mask in plan.groups:
        R = mask.shape[2]
        for c in range(mask.shape[1]):
            rows = torch.arange(r0 + c * R, r0 + (c + 1) * R)[:, None].expand(-1, idx.shape[-1])
            for b in range(B):
                cols = idx[b, c][None].expand(R, -1)
                seen[b].index_put_((rows, cols), mask[b, c].long(), accumulate=True)
    return seen


def random_case(g):
    B = int(torch.randint(1, 4, (1,), generator=g))
    T = int(torch.randint(1, 40, (1,), generator=g))
    S = int(torch.randint(2, 6, (1,), generator=g))
    A = int(torch.randint(0, 9, (1,), generator=g))
    anchors = torch.randint(-1, T, (B, A), generator=g)
    valid = torch.arange(T)[None] < torch.randint(1, T + 1, (B, 1), generator=g)
    return anchors, valid, S


def test_plan_sees_exactly_the_dense_mask():
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        anchors, valid, S = random_case(g)
        if trial % 2:
            anchors = anchors.sort(-1).values  # sorted (as sampled) and unsorted anchors
        B, A = anchors.shape
        T, N = valid.shape[1], A * S
        for w in (None, 1, 3, 7):
            for causal in (True, False):
                dense = block_attention_mask(anchors, valid, S, w, causal).long()
                for rows, groups in ((S, 1), (2 * S, 3), (3 * S + 1, 2), (64, None)):
                    seen = plan_as_dense(block_plan(anchors, valid, S, w, causal, rows, groups), B, T, N)
                    got = torch.cat([seen[:, :N, :T], seen[:, :N, T:T + N]], dim=-1)
                    assert torch.equal(got, dense), (trial, w, causal, rows, groups)
                    assert not seen[:, :N, T + N:].any()  # real rows never see the padding blocks


def test_plan_spans_follow_the_window():
    """A sliding layer's chunk gathers about W + the chunk's extent keys, not the whole context."""
    T, S, W = 4096, 16, 256
    anchors = torch.arange(1000, 1000 + 64 * 8, 8)[None]  # 64 sorted anchors, 8 apart
    plan = block_plan(anchors, torch.ones(1, T, dtype=torch.bool), S, W, chunk_rows=256)
    (_, _, idx, mask), = plan.groups
    assert idx.shape[-1] <= W + 16 * 8 + 256 + 16  # window + chunk extent + own blocks + alignment
    full = block_plan(anchors, torch.ones(1, T, dtype=torch.bool), S, None, chunk_rows=256)
    assert max(i.shape[-1] for _, _, i, _ in full.groups) >= 1000  # a full layer sees the prefix


def make(attn_impl, sliding_window, sliding_causal=True, block_size=4, seed=0):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, vocab_size=V, target_layers=[1, 2, 3],
                        mask_token_id=MASK, num_heads=4, num_kv_heads=2, head_dim=8,
                        num_layers=len(sliding_window), block_size=block_size, sliding_window=sliding_window,
                        sliding_causal=sliding_causal, max_position=4096, attn_impl=attn_impl)
    return DFlashDrafter(cfg, torch.randn(V, H), torch.randn(V, H))


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss, metrics = dflash_loss(model, batch, gamma=4.0)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, metrics


CASES = [  # (lengths of the rows, anchors per row, block size, windows per layer, causal)
    ([40], 6, 4, [3, None], True),
    ([40, 27, 9], 8, 4, [5, None], True),  # right padding, rows with fewer anchors (-1 padding)
    ([40, 27], 8, 4, [5, 5], False),
    ([33, 31], 12, 4, [None, None], True),
    ([64], 64, 4, [10, None], True),  # every candidate: anchors at the first and last positions
    ([50, 12], 5, 8, [2, 20, None], True),  # window smaller than the block; 3 layers
]


@pytest.mark.parametrize("lengths,n_anchors,S,windows,causal", CASES)
def test_blocks_loss_and_gradients_equal_dense(lengths, n_anchors, S, windows, causal):
    g = torch.Generator().manual_seed(len(lengths) * 100 + n_anchors)
    B, T = len(lengths), max(lengths)
    valid = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    loss_mask = valid & (torch.rand(B, T, generator=g) > 0.15)
    loss_mask[:, :2] = True  # an anchor candidate at position 0
    hs = torch.randn(B, T, L, H, generator=g)
    hs[~valid] = float("nan")  # padding garbage must not matter on either path
    batch = dict(input_ids=torch.randint(0, V - 1, (B, T), generator=g), loss_mask=loss_mask & valid,
                 attention_mask=valid, hidden_states=hs,
                 anchors=batch_anchors(loss_mask & valid, n_anchors, torch.Generator().manual_seed(3)))
    if n_anchors == 64:
        assert batch["anchors"][0, 0] == 0 and batch["anchors"][0, -1] >= T - 3
    ref = make("sdpa", windows, causal, S)
    blocks = make("blocks", windows, causal, S)
    blocks.load_state_dict(ref.state_dict())
    l1, g1, m1 = loss_and_grads(ref, batch)
    l2, g2, m2 = loss_and_grads(blocks, batch)
    assert torch.isfinite(l1) and torch.allclose(l1, l2, rtol=1e-5, atol=1e-6)
    for n in g1:
        assert torch.allclose(g1[n], g2[n], rtol=1e-4, atol=1e-6), n
    assert torch.equal(m1["hits_k"], m2["hits_k"])


def test_blocks_outputs_equal_dense_with_small_chunks(monkeypatch):
    """Chunks of one block each and of several blocks, one group or many: the same drafter states."""
    from hsstore.train import masks

    g = torch.Generator().manual_seed(5)
    B, T = 2, 30
    hs, ids = torch.randn(B, T, L, H, generator=g), torch.randint(0, V - 1, (B, T), generator=g)
    valid = torch.arange(T)[None] < torch.tensor([[30], [19]])
    anchors = torch.tensor([[0, 3, 11, 12, 20, 28, 29], [1, 5, 9, 17, 18, -1, -1]])
    ref = make("sdpa", [4, None]).eval()
    blocks = make("blocks", [4, None]).eval()
    blocks.load_state_dict(ref.state_dict())
    with torch.no_grad():
        want = ref.draft_hidden(hs, ids, anchors, valid)
        for rows, groups in ((4, 1), (8, 3), (12, 2), (1000, 1)):
            monkeypatch.setattr(masks, "ATTN_CHUNK_ROWS", rows)
            monkeypatch.setattr(masks, "FULL_LAYER_GROUPS", groups)
            got = blocks.draft_hidden(hs, ids, anchors, valid)
            assert torch.allclose(got, want, atol=1e-5), (rows, groups)


def test_blocks_path_catches_a_leaky_rule(monkeypatch):
    """The equality above can fail: a context rule with j <= p changes the blocks path's outputs."""
    from hsstore.train import masks

    real = masks.context_visible

    def leaky(p, realm, j, valid_j, block_size, window=None):
        return real(p + 1, realm, j, valid_j, block_size, window)

    g = torch.Generator().manual_seed(6)
    hs, ids = torch.randn(1, 20, L, H, generator=g), torch.randint(0, V - 1, (1, 20), generator=g)
    anchors = torch.tensor([[2, 9, 15]])
    model = make("blocks", [None]).eval()
    with torch.no_grad():
        want = model.draft_hidden(hs, ids, anchors)
        monkeypatch.setattr(masks, "context_visible", leaky)
        assert not torch.allclose(model.draft_hidden(hs, ids, anchors), want, atol=1e-5)


def spaced_batch(T, A, seed=0):
    """One sequence of T tokens with A anchors evenly spaced (so every chunk spans the same extent)."""
    g = torch.Generator().manual_seed(seed)
    anchors = torch.arange(A)[None] * (T // A) + T // (2 * A)
    return dict(input_ids=torch.randint(0, V - 1, (1, T), generator=g), loss_mask=torch.ones(1, T, dtype=torch.bool),
                hidden_states=torch.randn(1, T, L, H, generator=g), anchors=anchors)


def kept_bytes(model, batch):
    from hsstore.train.budget import saved_activation_bytes

    n, _ = saved_activation_bytes(lambda: dflash_loss(model, batch, gamma=4.0),
                                  exclude=[*model.parameters(), *model.buffers()])
    return n


def test_sliding_attention_memory_per_context_token_does_not_grow_with_queries():
    """Activations kept for backward, sliding layers (W = 64, block 16): going from 1024 to 2048 context tokens
    costs the blocks path the same whether 16 or 64 anchors (256 or 1024 query rows) attend; the dense path
    pays per query row and context token (its mask), so its cost per context token grows with the queries."""
    def per_token(impl, A):
        model = make(impl, [64, 64], block_size=16)
        return (kept_bytes(model, spaced_batch(2048, A)) - kept_bytes(model, spaced_batch(1024, A))) / 1024

    few, many = per_token("blocks", 16), per_token("blocks", 64)
    assert abs(many - few) < 0.05 * few, (few, many)
    dense_few, dense_many = per_token("sdpa", 16), per_token("sdpa", 64)
    assert dense_many > 1.5 * dense_few, (dense_few, dense_many)


def test_full_layer_gathers_each_prefix_once_per_group():
    """A full layer's chunks all see a prefix of the context: the plan gathers it once per group of chunks (about
    groups x T keys in all, plus the blocks), not once per chunk (chunks x T)."""
    from hsstore.train import masks

    T, A, S = 4096, 256, 16  # 16 chunks of 256 rows, 4 groups
    anchors = torch.arange(A)[None] * (T // A) + 8
    plan = block_plan(anchors, torch.ones(1, T, dtype=torch.bool), S, None, chunk_rows=256)
    gathered = sum(idx.shape[1] * idx.shape[2] for _, _, idx, _ in plan.groups)
    assert gathered <= masks.FULL_LAYER_GROUPS * T + A * S, gathered


def test_layers_of_one_window_share_one_attention_mask():
    """SDPA keeps its mask for backward: the layers of one window get the same additive mask (kept once), so a
    third sliding layer adds less than the second one did plus that layer's mask."""
    batch = spaced_batch(1024, 32)
    one, two, three = (kept_bytes(make("blocks", [64] * n, block_size=16), batch) for n in (1, 2, 3))
    plan = block_plan(batch["anchors"], torch.ones(1, 1024, dtype=torch.bool), 16, 64)
    mask_bytes = sum(plan.bias(i, torch.float32, 2).nbytes for i in range(len(plan.groups)))
    assert two - one == three - two  # every layer after the first adds the same
    assert (two - one) + mask_bytes <= one  # and not its own mask: the first layer's mask is kept once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_equals_indexing_and_its_gradient(dtype):
    """The keys' gather: the values of x[b, rows], and a gradient that sums every place a row was gathered (rows
    repeat across chunks), as autograd's indexing gives."""
    from hsstore.train.masks import gather_rows

    g = torch.Generator().manual_seed(5)
    B, Lk, n, K, h, d = 2, 11, 3, 7, 2, 4
    x = torch.randn(B, Lk, h, d, generator=g).to(dtype)
    rows = torch.randint(0, Lk, (B, n, K), generator=g)
    rows[0, 1] = rows[0, 0]  # a whole chunk gathered twice
    up = torch.randn(B, n, K, h, d, generator=g).to(dtype)
    b = torch.arange(B)[:, None, None]
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = gather_rows(x1, rows)
    (got * up).sum().backward()
    (x2[b, rows] * up).sum().backward()
    assert torch.equal(got, x[b, rows])
    want = torch.zeros(B, Lk, h, d, dtype=torch.float64)
    for bi in range(B):
        for c in range(n):
            for j in range(K):
                want[bi, rows[bi, c, j]] += up[bi, c, j].double()
    assert x1.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2 ** -6  # bf16 on CPU: each repeat's sum rounded
    assert torch.allclose(x1.grad.double(), want, rtol=tol, atol=1e-7)
    assert torch.allclose(x1.grad.double(), x2.grad.double(), rtol=tol, atol=1e-7)
    untouched = torch.ones(B, Lk, dtype=torch.bool)
    untouched[b.expand_as(rows), rows] = False
    assert (x1.grad[untouched] == 0).all() and (x1.grad[~untouched] != 0).any()
