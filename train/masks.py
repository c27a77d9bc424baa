"""Which keys each block row may see, and attention under that rule.

The rule (see ``model.py``'s module doc for the picture): row i of the block at anchor p (position p + i)
sees context j < p (strictly), in a sliding layer only j >= p + i - (W - 1); and rows of its own block only
(causal inside the block in a sliding layer unless ``causal=False``). ``context_visible`` and
``own_block_visible`` are the one place it is written; three ways of applying it, by ``attn_impl``:

* ``sdpa``: ``block_attention_mask``, one dense bool mask [A*S, T + A*S] (the reference);
* ``blocks``: ``block_plan``, each chunk of anchors attends to only the keys it may see (memory and time
  follow the visible keys), run by ``attend_blocks``;
* ``flex``: ``_flex_block_mask``, a flex_attention BlockMask.

``layer_mask`` builds the one a drafter layer needs, ``attend`` runs attention with any of them.
It imports only torch: the model builds on it, never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def context_visible(p: torch.Tensor, real: torch.Tensor, j: torch.Tensor, valid_j: torch.Tensor,
                    block_size: int, window: int | None = None) -> torch.Tensor:
    """Which context keys the rows of each block see: bool [..., A, S, K] ([..., A, 1, K] without a window).

    p, real [..., A]: anchor positions and whether the anchor is real (not padding); j, valid_j [..., K]:
    the positions of the candidate keys and whether they are real tokens. Row i of the block at p sees
    j iff j < p (strictly), valid_j and real, and in a sliding layer j >= p + i - (window - 1). The one
    place this rule is written: the dense mask and the block plan both evaluate it.
    """
    p, real = p[..., :, None, None], real[..., :, None, None]
    j, valid_j = j[..., None, None, :], valid_j[..., None, None, :]
    vis = (j < p) & valid_j & real
    if window is not None:
        i = torch.arange(block_size, device=p.device)[:, None]
        vis = vis & (j >= p + i - (window - 1))
    return vis


def own_block_visible(block_size: int, window: int | None = None, causal: bool = True, device=None) -> torch.Tensor:
    """[S, S] bool: block row i sees block row i' of its own block (all; in a sliding layer causal and
    i - i' <= window - 1, or |i - i'| <= window - 1 when not ``causal``)."""
    own = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    if window is not None:
        i = torch.arange(block_size, device=device)
        d = i[:, None] - i[None, :]  # query offset - key offset
        own = (d >= 0) & (d <= window - 1) if causal else d.abs() <= window - 1
    return own


def blocks_visible(num_blocks: int, block_size: int, window: int | None = None, causal: bool = True,
                   device=None) -> torch.Tensor:
    """[A*S, A*S] bool over the concatenated blocks: own block only, by ``own_block_visible``."""
    S = block_size
    own = own_block_visible(S, window, causal, device)
    n = torch.arange(num_blocks * S, device=device)
    return (n[:, None] // S == n[None, :] // S) & own[n[:, None] % S, n[None, :] % S]


def block_attention_mask(anchors: torch.Tensor, valid: torch.Tensor, block_size: int,
                         window: int | None = None, causal: bool = True) -> torch.Tensor:
    """Boolean mask [B, A*S, T + A*S] (True = may attend) for SDPA; keys are [context T | blocks A*S].

    anchors [B, A] (positions, -1 = padding); valid [B, T] bool (False on right padding). Query row
    a*S + i (row i of block a, anchor p, position p + i) may see
      * context key j        iff  j < p and valid[j]                      -- strictly <, never <=
                                  and, in a sliding layer, j >= p + i - (window - 1)
      * block key b*S + i'   iff  b == a                                  -- own block only
                                  and, in a sliding layer, i' <= i and i - i' <= window - 1 (causal)
                                  or |i - i'| <= window - 1 (``causal=False``)
    ``causal`` matters only with a window: full-attention layers are non-causal inside the block.
    Padding anchors see their own block only; every row sees at least itself, so none is fully masked
    (no NaN).
    """
    B, A = anchors.shape
    T = valid.shape[1]
    S = block_size
    j = torch.arange(T, device=anchors.device)
    ctx = context_visible(anchors.clamp(min=0), anchors >= 0, j[None], valid, S, window)  # [B, A, S|1, T]
    ctx = ctx.expand(B, A, S, T).reshape(B, A * S, T)
    blk = blocks_visible(A, S, window, causal, anchors.device).expand(B, -1, -1)
    return torch.cat([ctx, blk], dim=-1)


# Block-sparse attention ("blocks"): the dense mask above is [A*S, T + A*S] per sequence, but a block row
# sees at most p context keys (W - 1 in a sliding layer) plus its own S block keys. The plan splits the
# anchors into chunks of consecutive anchors (``chunk_rows`` query rows each) and attends each chunk to only
# the keys it may see, gathered by index, under the same rule on that small mask. Anchors are sorted
# (``sample_anchors``), so spans are short; unsorted anchors stay correct, only slower.
# * Sliding layer: a chunk's keys are the context span its anchors can see, [min p - (W - 1), max p), plus its
#   own blocks' keys; all chunks share one key length (about W + the chunk's extent) and run as one batched
#   SDPA call. Keys gathered: chunks x (W + extent), about A*S*W/chunk_rows + T, not the context per chunk.
# * Full layer: every chunk sees a prefix [0, max p) of the context, so chunks are not gathered one by one
#   (that copies the prefix once per chunk: chunks x T keys); the anchors split into FULL_LAYER_GROUPS groups
#   of consecutive chunks, and all of a group's rows attend, in one call, to the group's prefix (gathered
#   once) plus the group's own blocks (block-diagonal mask). Short prefixes are not padded to the whole
#   sequence, and the keys gathered are about groups x T / 2.
# Every group's boolean mask becomes SDPA's additive mask once per plan and dtype (``BlockPlan.bias``), shared
# by the layers of one window: SDPA keeps the mask it is given for its backward, once, not once per layer.

ATTN_CHUNK_ROWS = 256  # query rows per chunk (16 anchors of 16): small enough to keep spans tight
FULL_LAYER_GROUPS = 4  # batched SDPA calls for a full-attention layer
_KEY_ALIGN = 16  # gathered key counts are padded to a multiple of this (fused kernels' mask alignment)


@dataclass
class BlockPlan:
    """Which keys each chunk of query rows attends to, for ``attend``: per group, the query rows
    [r0, r1) = n chunks of R rows, the indices of their keys in [context T | blocks (padded to whole
    chunks)] and their bool mask."""

    rows: int  # A*S query rows (before padding to whole chunks)
    chunk_rows: int  # C*S, the rows of one chunk of anchors
    groups: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (r0, r1, idx [B, n, K], mask [B, n, R, K])

    def __post_init__(self):
        self._bias = {}

    @property
    def padded_rows(self) -> int:
        return self.groups[-1][1] if self.groups else 0

    def bias(self, group: int, dtype: torch.dtype, fold: int) -> torch.Tensor:
        """Group ``group``'s mask as SDPA's additive mask [B*n, 1, fold*R, K] (0 / -inf, ``dtype``), rows
        repeated ``fold`` times (the query heads of a KV group folded into the rows); made once per plan."""
        key = (group, dtype, fold)
        if key not in self._bias:
            mask = self.groups[group][3]
            B, n, R, K = mask.shape
            m = mask.reshape(B * n, 1, R, K).repeat(1, 1, fold, 1)
            self._bias[key] = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
        return self._bias[key]


def _chunk_spans(anchors: torch.Tensor, T: int, S: int, window: int | None, chunk_rows: int | None):
    """Anchors [B, A] in chunks of C consecutive anchors: (C, n, p [B, n, C], real [B, n, C], lo, hi [B, n]),
    [lo, hi) the context span the chunk's rows may see (empty for a chunk without a real anchor)."""
    B, A = anchors.shape
    C = max(1, (chunk_rows or ATTN_CHUNK_ROWS) // S)
    n = -(-A // C)
    anchors = F.pad(anchors, (0, n * C - A), value=-1).view(B, n, C)
    real = anchors >= 0
    p = anchors.clamp(min=0)
    first = torch.zeros_like(p) if window is None else (p - (window - 1)).clamp(min=0)  # widest row: i = 0
    lo = torch.where(real, first, T).amin(-1)  # [B, n]: no real anchor -> empty span
    hi = torch.where(real, p, 0).amax(-1)
    return C, n, p, real, torch.minimum(lo, hi), hi


def _group_bounds(n: int, window: int | None, groups: int | None) -> list[tuple[int, int]]:
    """The non-empty chunk ranges [c0, c1) of the batched SDPA calls."""
    n_groups = max(1, min(n, groups or (1 if window is not None else FULL_LAYER_GROUPS)))
    bounds = [round(g * n / n_groups) for g in range(n_groups + 1)]
    return [(c0, c1) for c0, c1 in zip(bounds[:-1], bounds[1:]) if c0 != c1]


def _group_span(lo, hi, c0: int, c1: int, window: int | None, C: int, S: int):
    """(g_lo, g_hi [B, ch], ch, ng, R): a group's context spans, its chunks, anchors per chunk and rows per
    chunk. A full layer's group is one wide chunk (the prefix once, then the group's blocks)."""
    if window is None:
        ng = (c1 - c0) * C
        return lo[:, c0:c1].amin(-1, keepdim=True), hi[:, c0:c1].amax(-1, keepdim=True), 1, ng, ng * S
    return lo[:, c0:c1], hi[:, c0:c1], c1 - c0, C, C * S


def _context_keys(g_lo, g_hi, R: int) -> int:
    """Context keys gathered per chunk: the widest span, padded so that with the R block keys the count is a
    multiple of the alignment. A Python int: on a GPU this waits for the device (``plan_key_lengths`` gives
    them beforehand, from the anchors on the CPU)."""
    K = int((g_hi - g_lo).max()) + R
    return -(-K // _KEY_ALIGN) * _KEY_ALIGN - R


def plan_key_lengths(anchors: torch.Tensor, T: int, block_size: int, window: int | None = None,
                     chunk_rows: int | None = None, groups: int | None = None) -> list[int]:
    """The context-key count of each group of ``block_plan`` (same arguments), computed where ``anchors``
    are: on the CPU, before the batch crosses to the GPU, it spares the step a wait for the device per group
    (``block_plan(..., key_lengths=)``)."""
    C, n, _, _, lo, hi = _chunk_spans(anchors, T, block_size, window, chunk_rows)
    out = []
    for c0, c1 in _group_bounds(n, window, groups):
        g_lo, g_hi, _, _, R = _group_span(lo, hi, c0, c1, window, C, block_size)
        out.append(_context_keys(g_lo, g_hi, R))
    return out


def block_plan(anchors: torch.Tensor, valid: torch.Tensor, block_size: int, window: int | None = None,
               causal: bool = True, chunk_rows: int | None = None, groups: int | None = None,
               key_lengths: list[int] | None = None) -> BlockPlan:
    """The block-sparse equivalent of ``block_attention_mask`` (same rule, same visible keys).

    ``chunk_rows``: query rows per chunk (default ATTN_CHUNK_ROWS); ``groups``: batched SDPA calls (default 1
    for a sliding layer, FULL_LAYER_GROUPS for a full one). Both defaults are read at the call.
    ``key_lengths``: ``plan_key_lengths`` of the same arguments, so that nothing here waits for the device.
    """
    B, A = anchors.shape
    T = valid.shape[1]
    S = block_size
    dev = anchors.device
    C, n, p, real, lo, hi = _chunk_spans(anchors, T, S, window, chunk_rows)
    if n == 0:
        return BlockPlan(0, C * S, [])
    bounds = _group_bounds(n, window, groups)
    if key_lengths is not None and len(key_lengths) != len(bounds):
        raise ValueError(f"key_lengths has {len(key_lengths)} entries for {len(bounds)} groups")
    out = []
    for g, (c0, c1) in enumerate(bounds):
        g_lo, g_hi, ch, ng, R = _group_span(lo, hi, c0, c1, window, C, S)
        K = _context_keys(g_lo, g_hi, R) if key_lengths is None else key_lengths[g]
        j = (g_lo[..., None] + torch.arange(K, device=dev)).clamp(max=T - 1)  # [B, ch, K]; beyond hi: unseen
        pa, ra = p[:, c0:c1].reshape(B, ch, ng), real[:, c0:c1].reshape(B, ch, ng)
        ctx = context_visible(pa, ra, j, torch.gather(valid, 1, j.flatten(1)).view_as(j), S, window)
        ctx = ctx.expand(B, ch, ng, S, K).reshape(B, ch, R, K)  # [B, ch, ng, S|1, K] -> rows
        own = T + (torch.arange(ch, device=dev)[:, None] * R + c0 * C * S + torch.arange(R, device=dev))
        idx = torch.cat([j, own.expand(B, ch, R)], dim=-1)
        blk = blocks_visible(ng, S, window, causal, dev)  # [R, R], the same for every chunk
        mask = torch.cat([ctx, blk.expand(B, ch, R, R)], dim=-1)
        out.append((c0 * C * S, c1 * C * S, idx, mask))
    return BlockPlan(A * S, C * S, out)


class _GatherRows(torch.autograd.Function):
    """``x[b, rows]`` for x [B, L, ...] and rows [B, ...] (each sequence's rows by index), as one ``index_select``
    of the flattened rows: faster than autograd's advanced indexing (docs/PERFORMANCE.md, "Training step").
    Backward is what autograd's is, the sort-based ``index_put_`` that sums the gradient of a row gathered more
    than once (rows repeat across chunks) in fp32 and rounds it once: fp32 ``index_add_`` atomics are slower."""

    @staticmethod
    def forward(ctx, x, rows):
        B, L = x.shape[:2]
        base = torch.arange(B, device=rows.device).view(B, *[1] * (rows.dim() - 1)) * L
        flat = (rows + base).reshape(-1)
        ctx.save_for_backward(flat)
        ctx.x_shape = x.shape
        return x.reshape(B * L, *x.shape[2:]).index_select(0, flat).view(*rows.shape, *x.shape[2:])

    @staticmethod
    def backward(ctx, grad):
        (flat,) = ctx.saved_tensors
        B, L, *rest = ctx.x_shape
        acc = grad.new_zeros((B * L, *rest))
        acc.index_put_((flat,), grad.reshape(-1, *rest), accumulate=True)
        return acc.view(ctx.x_shape), None


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[arange(B)[:, None, ...], rows]``: [B, L, *rest] by rows [B, *idx] -> [B, *idx, *rest]."""
    return _GatherRows.apply(x, rows)


def attend_blocks(q, k, v, plan: BlockPlan):
    """``attend`` for a BlockPlan: q [B, nh, N, hd], k/v [B, nkv, T+N, hd] -> [B, nh, N, hd].

    Query heads of one KV group are folded into the query rows ([B*n, nkv, g*R, hd]), so SDPA sees plain
    multi-head attention with a mask: the fused CPU/CUDA kernels take that, while ``enable_gqa`` with a
    mask falls back to the math kernel (all scores in memory). Nothing is padded but the last group's queries
    (to whole chunks): the padded rows' own keys are any real key (only padded rows see them, and their outputs
    are dropped, so no gradient reaches those keys from them), and one group's output is not concatenated."""
    B, nh, N, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    if not plan.groups:
        return q.new_zeros(B, nh, N, hd)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # token-major: [B, rows, heads, hd]
    outs = []
    for gi, (r0, r1, idx, mask) in enumerate(plan.groups):
        n, R, K = mask.shape[1], mask.shape[2], idx.shape[-1]
        qs = q[:, r0:min(r1, N)]
        if r1 > N:  # the last chunk's rows past the last anchor
            qs = F.pad(qs, (0, 0, 0, 0, 0, r1 - max(r0, N)))
        qg = qs.reshape(B, n, R, nkv, g, hd).permute(0, 1, 3, 4, 2, 5).reshape(B * n, nkv, g * R, hd)
        rows = idx.clamp(max=k.shape[1] - 1)
        kg = gather_rows(k, rows).permute(0, 1, 3, 2, 4).reshape(B * n, nkv, K, hd)  # [B, n, K, nkv, hd]: heads first
        vg = gather_rows(v, rows).permute(0, 1, 3, 2, 4).reshape(B * n, nkv, K, hd)
        bias = plan.bias(gi, q.dtype, g)  # row r*R + i of the fold is query row i
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=bias)  # [B*n, nkv, g*R, hd]
        outs.append(o.view(B, n, nkv, g, R, hd).permute(0, 1, 4, 2, 3, 5).reshape(B, n * R, nh, hd))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out[:, :N].transpose(1, 2)


def _flex_block_mask(anchors, valid, block_size, window, causal=True):
    """Same rule as ``block_attention_mask`` as a flex_attention BlockMask (skips empty tiles)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, A = anchors.shape
    T = valid.shape[1]
    S = block_size
    p = anchors.clamp(min=0)
    real = anchors >= 0

    def mask_mod(b, h, q_idx, kv_idx):
        a, i = q_idx // S, q_idx % S
        pa = p[b, a]
        in_ctx = (kv_idx < T) & (kv_idx < pa) & real[b, a] & valid[b, kv_idx.clamp(max=T - 1)]
        kb = (kv_idx - T).clamp(min=0)
        in_blk = (kv_idx >= T) & (kb // S == a)
        if window is not None:
            in_ctx = in_ctx & (kv_idx >= pa + i - (window - 1))
            d = i - kb % S
            in_blk = in_blk & (d <= window - 1) & ((d >= 0) if causal else (d >= 1 - window))
        return in_ctx | in_blk

    return create_block_mask(mask_mod, B, None, A * S, T + A * S, device=anchors.device,
                             _compile=anchors.is_cuda)


_compiled_flex = None


def attend(q, k, v, mask):
    """q [B, nh, N, hd], k/v [B, nkv, T+N, hd]; mask is a bool tensor [B, N, T+N], a BlockPlan or a BlockMask."""
    if isinstance(mask, BlockPlan):
        return attend_blocks(q, k, v, mask)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        return _compiled_flex(q, k, v, block_mask=mask, enable_gqa=True)
    return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)  # eager: slow, for tests only


def layer_mask(attn_impl: str, anchors: torch.Tensor, valid: torch.Tensor, block_size: int,
               window: int | None, causal: bool = True, key_lengths: list[int] | None = None):
    """The mask ``attend`` takes for one window of a drafter with ``attn_impl`` (``DrafterConfig.attn_impl``);
    ``key_lengths``: ``block_plan``'s, computed beforehand (``plan_key_lengths``)."""
    if attn_impl == "blocks":
        return block_plan(anchors, valid, block_size, window, causal, key_lengths=key_lengths)
    if attn_impl == "flex":
        return _flex_block_mask(anchors, valid, block_size, window, causal)
    return block_attention_mask(anchors, valid, block_size, window, causal)
