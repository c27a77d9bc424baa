"""DFlash drafter: a small Qwen3-style decoder that drafts a whole block of tokens in one pass.

How it works, in one picture (block_size S = 4, anchor p = 5):

    target features  f0 f1 f2 f3 f4 | f5 f6 ...     (hidden states of the tapped target layers)
                     '-- context --'                 positions j < p only (strictly: never f5)
    block tokens     x5  M  M  M                     anchor token + S-1 mask tokens
    positions        5   6  7  8                     absolute RoPE positions p .. p+S-1
    outputs          -   x6 x7 x8                    output k predicts the token at p+k (same position)

* The tapped features [T, L*H] are projected by ``fc`` (L*H -> H) and RMS-normalized: this is the
  *context*. Every draft layer turns the context into extra keys/values with its own k_proj/v_proj and
  puts them in front of the block tokens' own keys/values.
* Which keys a block row sees (row i of the block at anchor p sits at position q = p + i):
  - full-attention layer: every row of its own block (non-causal) and context j < p;
  - sliding-window layer, window W (the engines' default, SpecForge's training mask): block rows
    i' <= i (causal) and context j < p with q - j <= W - 1, i.e. j >= p + i - (W - 1). W counts the
    query's own position, as Hugging Face's ``sliding_window`` does (SGLang stores W - 1 as
    window_left; vLLM's flash-attention window is (W - 1, 0));
  - sliding, non-causal (``sliding_causal=False``, exported as ``is_causal: false``, which SGLang
    and vLLM read): every row of the block within |i - i'| <= W - 1 and the same context as above.
  Never another block, never a feature at position >= p: at inference the anchor x_p is the token
  the target just emitted, the target has not run on it yet, so features at >= p do not exist.
  Training with them is the classic "98% train accuracy, 10% acceptance" leak.
* Training processes many anchors per sequence at once: all blocks of a sequence are concatenated
  into one query sequence [A*S] and a single attention mask enforces the rules above.
* ``embed_tokens`` and ``lm_head`` are the target's own weights, frozen. They are stored as
  non-persistent buffers: not parameters (so never in the optimizer, never get a gradient) and not in
  ``state_dict()`` (checkpoints hold only the trainable drafter weights, under the names the
  reference DFlash model uses: fc, hidden_norm, layers.N.*, norm).

``forward`` returns logits [B, A, S, V]. With a real vocabulary (248K) that tensor is huge, so the
training objective (train/objective.py) calls ``draft_hidden`` instead and computes the cross
entropy chunk by chunk, only at the positions that carry weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from hsstore.taps import default_taps


ATTN_IMPLS = ("sdpa", "blocks", "flex")


@dataclass
class DrafterConfig:
    hidden_size: int  # H, equal to the target's hidden size
    intermediate_size: int  # SwiGLU width
    vocab_size: int  # V, the target's vocabulary
    target_layers: list[int]  # tapped target layer ids (layer l = HF hidden_states[l + 1]); L = len
    mask_token_id: int  # token id used for the S-1 mask positions of a block
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int = 1
    block_size: int = 16  # S: anchor + S-1 mask tokens
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # full rotary (the drafter never rotates only part of a head)
    # per draft layer: None = full attention, int W = sliding window of W positions counting the query's
    # own (context j visible to block row i iff j >= p + i - (W - 1)). None for the whole list = all full.
    sliding_window: list[int | None] | None = None
    # sliding layers causal inside the block (the engines' default); False = non-causal (is_causal: false)
    sliding_causal: bool = True
    max_position: int = 40960  # largest absolute position (context length + block) the drafter accepts
    num_target_layers: int | None = None  # decoder layers of the target (exported for the engines)
    # "sdpa": dense boolean mask (the reference, any device); "blocks": each chunk of blocks attends to only
    # the keys it may see (``block_plan``; memory and time follow the visible keys); "flex": BlockMask
    attn_impl: str = "sdpa"

    def __post_init__(self):
        self.target_layers = [int(x) for x in self.target_layers]
        if not self.target_layers:
            raise ValueError("target_layers must not be empty")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary halves), not {self.head_dim}")
        if self.block_size < 2:
            raise ValueError("block_size must be >= 2 (anchor + at least one mask token)")
        if self.sliding_window is not None:
            self.sliding_window = list(self.sliding_window)
            if len(self.sliding_window) != self.num_layers:
                raise ValueError(
                    f"sliding_window has {len(self.sliding_window)} entries for {self.num_layers} layers"
                )
            if any(w is not None and w < 1 for w in self.sliding_window):
                raise ValueError(f"sliding windows must be >= 1, got {self.sliding_window}")
            if all(w is None for w in self.sliding_window):
                self.sliding_window = None
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, not {self.attn_impl!r}")

    @property
    def num_taps(self) -> int:
        return len(self.target_layers)

    def window(self, layer: int) -> int | None:
        return None if self.sliding_window is None else self.sliding_window[layer]

    @classmethod
    def from_target_config(cls, target_config, *, mask_token_id: int, target_layers=None,
                           num_layers: int = 1, **overrides) -> "DrafterConfig":
        """Sizes from a transformers config of the target (only the config, never the model).

        Hidden size, FFN width, vocabulary, RoPE base and context length are the target's; the attention
        shape follows ``reference_attention_shape``; partial-rotary settings are never copied (the
        drafter rotates whole heads). Works for multimodal configs too (``get_text_config()``).
        ``overrides`` win.
        """
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        rope = getattr(tc, "rope_parameters", None) or {}
        n_target = tc.num_hidden_layers
        heads = tc.num_attention_heads
        num_heads, num_kv_heads, head_dim = reference_attention_shape(
            heads, getattr(tc, "num_key_value_heads", None) or heads,
            getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            **{k: overrides.pop(k) for k in ("num_heads", "num_kv_heads", "head_dim") if k in overrides})
        kw = dict(
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            vocab_size=tc.vocab_size,
            target_layers=list(target_layers) if target_layers is not None else default_target_layers(n_target),
            mask_token_id=mask_token_id,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_layers=num_layers,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", getattr(tc, "rope_theta", 1_000_000.0)),
            max_position=getattr(tc, "max_position_embeddings", 40960),
            num_target_layers=n_target,
        )
        kw.update(overrides)
        return cls(**kw)


# The published DFlash drafters (SpecForge configs/*-dflash.json) use at most 32 heads of 128 and 8 KV
# heads, whatever the target's own attention: Qwen3.6-27B (24 x 256, 4 KV) -> 32 x 128, 8 KV; Qwen3-8B
# and Qwen3-4B (32 x 128, 8 KV) -> the same; Qwen2.5-0.5B (14 x 64, 2 KV) -> the same; the Qwen3.5
# drafters (targets with 256-wide heads) are 32 x 128 too.
MAX_HEAD_DIM, MAX_HEADS, MAX_KV_HEADS = 128, 32, 8


def reference_attention_shape(target_heads: int, target_kv_heads: int, target_head_dim: int, *,
                              num_heads: int | None = None, num_kv_heads: int | None = None,
                              head_dim: int | None = None) -> tuple[int, int, int]:
    """(num_heads, num_kv_heads, head_dim) of the drafter for a target attention of that shape.

    head_dim = min(target's, 128); heads and KV heads keep the target's query and KV widths at that
    head_dim, capped at 32 and 8 (and KV heads divide heads). This reproduces every published config
    listed above, and leaves targets that are already within the caps (the tiny test target) unchanged.
    A value given as a keyword is kept and the others follow it.
    """
    hd = head_dim or min(target_head_dim, MAX_HEAD_DIM)
    nh = num_heads or max(1, min(MAX_HEADS, target_heads * target_head_dim // hd))
    nkv = num_kv_heads or math.gcd(nh, max(1, min(MAX_KV_HEADS, target_kv_heads * target_head_dim // hd, nh)))
    return nh, nkv, hd


default_target_layers = default_taps  # the DFlash default spacing, shared with extraction (hsstore/taps.py)


# ----------------------------------------------------------------------------------------------
# building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype):
    """cos/sin [..., head_dim] for integer positions [...] (Qwen3 / rotate-half convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq  # [..., head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x [B, N, heads, hd]; cos/sin [B, N, hd]."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Qwen3 attention (per-head RMSNorm on q and k before RoPE, GQA), with the context's K/V in front."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, nh * hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x, ctx, rope_blk, rope_ctx, mask):
        """x [B, N, H] block tokens (N = A*S); ctx [B, T, H] context; mask: see ``attend``."""
        B, N, _ = x.shape
        T = ctx.shape[1]
        nh, nkv, hd = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        q = self.q_norm(self.q_proj(x).view(B, N, nh, hd))
        k_blk = self.k_norm(self.k_proj(x).view(B, N, nkv, hd))
        k_ctx = self.k_norm(self.k_proj(ctx).view(B, T, nkv, hd))
        v_blk = self.v_proj(x).view(B, N, nkv, hd)
        v_ctx = self.v_proj(ctx).view(B, T, nkv, hd)
        q = apply_rope(q, *rope_blk)
        k = torch.cat([apply_rope(k_ctx, *rope_ctx), apply_rope(k_blk, *rope_blk)], dim=1)  # [B, T+N, nkv, hd]
        v = torch.cat([v_ctx, v_blk], dim=1)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)  # [B, nh, N, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, N, nh * hd))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, ctx, rope_blk, rope_ctx, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_blk, rope_ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------------------------
# the attention mask


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


def block_plan(anchors: torch.Tensor, valid: torch.Tensor, block_size: int, window: int | None = None,
               causal: bool = True, chunk_rows: int = ATTN_CHUNK_ROWS, groups: int | None = None) -> BlockPlan:
    """The block-sparse equivalent of ``block_attention_mask`` (same rule, same visible keys).

    ``groups``: batched SDPA calls (default 1 for a sliding layer, FULL_LAYER_GROUPS for a full one).
    """
    B, A = anchors.shape
    T = valid.shape[1]
    S = block_size
    dev = anchors.device
    C = max(1, chunk_rows // S)
    n = -(-A // C)
    if n == 0:
        return BlockPlan(0, C * S, [])
    anchors = F.pad(anchors, (0, n * C - A), value=-1).view(B, n, C)
    real = anchors >= 0
    p = anchors.clamp(min=0)
    first = torch.zeros_like(p) if window is None else (p - (window - 1)).clamp(min=0)  # widest row: i = 0
    lo = torch.where(real, first, T).amin(-1)  # [B, n]: no real anchor -> empty span
    hi = torch.where(real, p, 0).amax(-1)
    lo = torch.minimum(lo, hi)
    n_groups = max(1, min(n, groups or (1 if window is not None else FULL_LAYER_GROUPS)))
    bounds = [round(g * n / n_groups) for g in range(n_groups + 1)]
    out = []
    for c0, c1 in zip(bounds[:-1], bounds[1:]):
        if c0 == c1:
            continue
        if window is None:  # one wide chunk per group: the prefix [0, max p) once, then the group's blocks
            g_lo, g_hi = lo[:, c0:c1].amin(-1, keepdim=True), hi[:, c0:c1].amax(-1, keepdim=True)  # [B, 1]
            ch, ng, R = 1, (c1 - c0) * C, (c1 - c0) * C * S
        else:
            g_lo, g_hi = lo[:, c0:c1], hi[:, c0:c1]  # [B, ng]
            ch, ng, R = c1 - c0, C, C * S
        K = int((g_hi - g_lo).max()) + R
        K = -(-K // _KEY_ALIGN) * _KEY_ALIGN - R  # context keys; with the R block keys a multiple of the alignment
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


def attend_blocks(q, k, v, plan: BlockPlan):
    """``attend`` for a BlockPlan: q [B, nh, N, hd], k/v [B, nkv, T+N, hd] -> [B, nh, N, hd].

    Query heads of one KV group are folded into the query rows ([B*n, nkv, g*R, hd]), so SDPA sees plain
    multi-head attention with a mask: the fused CPU/CUDA kernels take that, while ``enable_gqa`` with a
    mask falls back to the math kernel (all scores in memory)."""
    B, nh, N, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    if not plan.groups:
        return q.new_zeros(B, nh, N, hd)
    Np = plan.padded_rows
    q = F.pad(q, (0, 0, 0, Np - N)).transpose(1, 2)  # [B, N', nh, hd]
    k = F.pad(k, (0, 0, 0, Np - N)).transpose(1, 2)  # [B, T+N', nkv, hd]
    v = F.pad(v, (0, 0, 0, Np - N)).transpose(1, 2)
    b = torch.arange(B, device=q.device)[:, None, None]
    outs = []
    for gi, (r0, r1, idx, mask) in enumerate(plan.groups):
        n, R, K = mask.shape[1], mask.shape[2], idx.shape[-1]
        qg = q[:, r0:r1].reshape(B, n, R, nkv, g, hd).permute(0, 1, 3, 4, 2, 5)
        qg = qg.reshape(B * n, nkv, g * R, hd)
        kg = k[b, idx].permute(0, 1, 3, 2, 4).reshape(B * n, nkv, K, hd)  # [B, n, K, nkv, hd] -> heads first
        vg = v[b, idx].permute(0, 1, 3, 2, 4).reshape(B * n, nkv, K, hd)
        bias = plan.bias(gi, q.dtype, g)  # row r*R + i of the fold is query row i
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=bias)  # [B*n, nkv, g*R, hd]
        outs.append(o.view(B, n, nkv, g, R, hd).permute(0, 1, 4, 2, 3, 5).reshape(B, n * R, nh, hd))
    return torch.cat(outs, dim=1)[:, :N].transpose(1, 2)


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


# ----------------------------------------------------------------------------------------------
# the drafter


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig, embed_tokens: torch.Tensor, lm_head: torch.Tensor):
        """embed_tokens [V, H] and lm_head [V, H] are the target's weights; they stay frozen."""
        super().__init__()
        c = config
        for name, w in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(w.shape) != (c.vocab_size, c.hidden_size):
                raise ValueError(f"{name} has shape {tuple(w.shape)}, expected ({c.vocab_size}, {c.hidden_size})")
        self.config = c
        # a training setting, not the model's: recompute each draft layer in backward instead of keeping its
        # activations (torch.utils.checkpoint); only each layer's input stays (trainer --checkpoint-layers)
        self.checkpoint_layers = False
        self.fc = nn.Linear(c.num_taps * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.apply(self._init_weights)
        # frozen, not parameters, not saved in state_dict()
        self.register_buffer("embed_tokens", embed_tokens.detach(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def context(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, T, L, H] (or already flat [B, T, L*H]) tapped features -> context [B, T, H]."""
        B, T = hidden_states.shape[:2]
        x = hidden_states.reshape(B, T, -1)
        if not torch.is_autocast_enabled(x.device.type):  # under autocast fc casts itself: no fp32 copy
            x = x.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(x))

    def draft_hidden(self, hidden_states, input_ids, anchors, attention_mask=None) -> torch.Tensor:
        """Final-normed drafter states [B, A, S, H]; logits = this @ lm_head.T.

        hidden_states [B, T, L, H]; input_ids [B, T] long; anchors [B, A] long (-1 = padding);
        attention_mask [B, T] bool, False on (right) padding; None = all valid.
        """
        c = self.config
        S = c.block_size
        B, T = input_ids.shape
        A = anchors.shape[1]
        if hidden_states.shape[:2] != (B, T):
            raise ValueError(f"hidden_states {tuple(hidden_states.shape)} does not match input_ids {(B, T)}")
        if T + S > c.max_position:
            raise ValueError(f"sequence length {T} + block {S} exceeds max_position {c.max_position}")
        dev = input_ids.device
        valid = torch.ones(B, T, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.bool()
        anchors = anchors.to(dev)
        p = anchors.clamp(min=0)  # padding anchors run as harmless dummies at position 0

        # padding features are never attended, but 0 * NaN = NaN (forward and backward): zero them
        feats = hidden_states.reshape(B, T, -1).to(self.fc.weight.dtype)
        if feats.shape[-1] != c.num_taps * c.hidden_size:
            raise ValueError(f"hidden_states {tuple(hidden_states.shape)}: expected L*H = "
                             f"{c.num_taps} x {c.hidden_size} features per position")
        feats = torch.where(valid[..., None], feats, feats.new_zeros(()))
        ctx = self.context(feats)  # [B, T, H]

        # block tokens: [x_p, MASK, ..., MASK] at positions p .. p+S-1
        ids = torch.full((B, A, S), c.mask_token_id, dtype=torch.long, device=dev)
        ids[:, :, 0] = torch.gather(input_ids, 1, p)
        pos_blk = (p[:, :, None] + torch.arange(S, device=dev)).reshape(B, A * S)
        pos_ctx = torch.arange(T, device=dev).expand(B, T)
        x = F.embedding(ids.reshape(B, A * S), self.embed_tokens).to(ctx.dtype)

        rope_blk = rope_cos_sin(pos_blk, c.head_dim, c.rope_theta, ctx.dtype)
        rope_ctx = rope_cos_sin(pos_ctx, c.head_dim, c.rope_theta, ctx.dtype)

        masks = {}  # one mask per distinct window
        for i, layer in enumerate(self.layers):
            w = c.window(i)
            if w not in masks:
                if c.attn_impl == "blocks":
                    masks[w] = block_plan(anchors, valid, S, w, c.sliding_causal)
                elif c.attn_impl == "flex":
                    masks[w] = _flex_block_mask(anchors, valid, S, w, c.sliding_causal)
                else:
                    masks[w] = block_attention_mask(anchors, valid, S, w, c.sliding_causal)
            if self.checkpoint_layers and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, ctx, rope_blk, rope_ctx, masks[w], use_reentrant=False)
            else:
                x = layer(x, ctx, rope_blk, rope_ctx, masks[w])
        return self.norm(x).view(B, A, S, -1)

    def forward(self, hidden_states, input_ids, anchors, attention_mask=None) -> torch.Tensor:
        """Logits [B, A, S, V]. Output k of block a predicts input_ids[anchors[a] + k]; k = 0 is unused."""
        h = self.draft_hidden(hidden_states, input_ids, anchors, attention_mask)
        return F.linear(h.to(self.lm_head.dtype), self.lm_head)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
