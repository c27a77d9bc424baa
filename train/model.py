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
  into one query sequence [A*S] and a single attention mask (masks.py) enforces the rules above.
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

from hsstore.format.taps import default_taps

from .settings import CHECKPOINT_POLICIES
from .masks import attend, layer_mask, plan_key_lengths
from .pointwise import apply_rope, rms_norm, swiglu


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


default_target_layers = default_taps  # the DFlash default spacing, shared with extraction (hsstore/format/taps.py)


# ----------------------------------------------------------------------------------------------
# building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype):
    """cos/sin [..., head_dim] for integer positions [...] (Qwen3 / rotate-half convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq  # [..., head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


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

    def forward(self, x, ctx, rope_blk, rope_ctx, mask, recompute_mlp: bool = False):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_blk, rope_ctx, mask)
        if recompute_mlp:  # the [rows, ffn] activations are most of the layer's bytes, the cheapest to redo
            return x + torch.utils.checkpoint.checkpoint(self._mlp_block, x, use_reentrant=False)
        return x + self._mlp_block(x)

    def _mlp_block(self, x):
        return self.mlp(self.post_attention_layernorm(x))


def checkpoint_policy(value) -> str:
    """``checkpoint_layers`` as one of ``CHECKPOINT_POLICIES``. A bool is refused: ``True`` meant the whole layer
    before there were policies, while the bare flag and a config file's ``true`` now mean "mlp"; a caller says
    which."""
    if isinstance(value, bool):
        raise ValueError(f"checkpoint_layers {value!r}: name a policy, one of {', '.join(CHECKPOINT_POLICIES)} "
                         f"(True was the whole-layer recompute, now \"full\"; the bare --checkpoint-layers is \"mlp\")")
    if value not in CHECKPOINT_POLICIES:
        raise ValueError(f"checkpoint_layers {value!r}: expected one of {', '.join(CHECKPOINT_POLICIES)}")
    return value


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
        # a training setting, not the model's (trainer --checkpoint-layers): what each draft layer recomputes in
        # backward instead of keeping (torch.utils.checkpoint). "full": the whole layer, only its input stays;
        # "mlp": its MLP half (norm, gate/up, SwiGLU, down), the attention half's activations stay; "off"
        self.checkpoint_layers = "off"
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

    def key_lengths(self, anchors: torch.Tensor, T: int) -> dict[int | None, list[int]] | None:
        """``draft_hidden``'s ``key_lengths`` for these anchors (on the CPU, before the batch crosses to the
        GPU): the block plans' key counts per window, so that building the plans never waits for the device.
        None unless ``attn_impl`` is "blocks"."""
        c = self.config
        if c.attn_impl != "blocks":
            return None
        windows = {c.window(i) for i in range(len(self.layers))}
        return {w: plan_key_lengths(anchors, T, c.block_size, w) for w in windows}

    def draft_hidden(self, hidden_states, input_ids, anchors, attention_mask=None,
                     key_lengths: dict[int | None, list[int]] | None = None) -> torch.Tensor:
        """Final-normed drafter states [B, A, S, H]; logits = this @ lm_head.T.

        hidden_states [B, T, L, H]; input_ids [B, T] long; anchors [B, A] long (-1 = padding);
        attention_mask [B, T] bool, False on (right) padding; None = all valid. ``key_lengths``: from
        ``key_lengths`` (the same anchors), or None to work them out here (a wait for the device per plan).
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
        # in the dtype fc computes in: under autocast with fp32 weights, no fp32 copy of [B, T, L*H]
        amp = torch.is_autocast_enabled(dev.type)
        feats = hidden_states.reshape(B, T, -1).to(torch.get_autocast_dtype(dev.type) if amp else self.fc.weight.dtype)
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

        masks = {}  # one mask per distinct window (masks.py)
        for i, layer in enumerate(self.layers):
            w = c.window(i)
            if w not in masks:
                masks[w] = layer_mask(c.attn_impl, anchors, valid, S, w, c.sliding_causal,
                                      None if key_lengths is None else key_lengths[w])
            policy = checkpoint_policy(self.checkpoint_layers) if torch.is_grad_enabled() else "off"
            if policy == "full":
                x = torch.utils.checkpoint.checkpoint(layer, x, ctx, rope_blk, rope_ctx, masks[w], use_reentrant=False)
            else:
                x = layer(x, ctx, rope_blk, rope_ctx, masks[w], recompute_mlp=policy == "mlp")
        return self.norm(x).view(B, A, S, -1)

    def forward(self, hidden_states, input_ids, anchors, attention_mask=None) -> torch.Tensor:
        """Logits [B, A, S, V]. Output k of block a predicts input_ids[anchors[a] + k]; k = 0 is unused."""
        h = self.draft_hidden(hidden_states, input_ids, anchors, attention_mask)
        return F.linear(h.to(self.lm_head.dtype), self.lm_head)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
