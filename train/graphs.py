"""The drafter's decoding step in buffers of fixed shape, replayed as one CUDA graph on a GPU.

A decoding step of a small drafter is launch-bound: ``DraftContext`` runs a few dozen small kernels per draft
layer (projections, norms, RoPE, the mask, attention, the MLP), each launched by Python, then waits for its
argmax on the host. Here every tensor of a step lives in a buffer whose shape does not change from step to step,
so the whole step (adding the positions accepted since the last one to the drafter's keys and values, the block's
forward, the argmax) is captured once with ``torch.cuda.CUDAGraph`` and replayed with one launch; its drafts stay
on the device, where the target's verification reads them without a wait.

The fixed shapes: the accepted positions arrive as ``S`` feature rows (a step accepts 1 .. S tokens; the rows past
them are written to key positions the mask hides, and overwritten by the next step's); each draft layer's keys and
values sit in buffers of ``capacity`` positions, the block's own keys written at its positions ``p .. p + S - 1``;
attention runs over the whole buffer under a mask computed on the device from ``p`` (the rule of
``masks.context_visible`` and ``masks.own_block_visible``, the training mask's), so a key that is not visible
weighs exactly nothing. A longer context grows the buffers (doubling; the graph is captured again).

The same code runs eagerly where there is no CUDA (``graphs=False``): tests compare it, token for token, with
``DraftContext`` on a CPU, and the graph with the eager step on a GPU (tests/test_draft_graphs.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from .masks import attend, context_visible, own_block_visible
from .model import rope_cos_sin
from .pointwise import apply_rope

log = logging.getLogger(__name__)

MIN_CAPACITY = 1024  # key positions held at first (the buffers double past it)
WARMUP_STEPS = 2  # eager runs on a side stream before capture (allocator and library handles settle)


class StaticDraft:
    """A Proposer (``speculative.Proposer``) from a DFlash drafter whose steps run in fixed-shape buffers: on a CUDA
    device one captured graph per step (``graphs``: None = on CUDA), elsewhere the same code eagerly. Returns the
    S - 1 drafts as a tensor on the drafter's device."""

    def __init__(self, drafter, graphs: bool | None = None):
        self.drafter = drafter
        c = drafter.config
        self.device = drafter.lm_head.device
        self.graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
        self.dtype = drafter.fc.weight.dtype
        S = c.block_size
        self.capacity = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.start = torch.zeros((), dtype=torch.long, device=self.device)  # position of the first feature row
        self.p = torch.zeros((), dtype=torch.long, device=self.device)  # the anchor's position
        self.anchor = torch.zeros((), dtype=torch.long, device=self.device)  # the anchor's token
        self.rows = torch.arange(S, device=self.device)
        self.drafts = torch.zeros(S - 1, dtype=torch.long, device=self.device)
        self.feats: torch.Tensor | None = None  # [S, taps, H]: the rows accepted since the last step
        self.own = {w: own_block_visible(S, w, c.sliding_causal, self.device)
                    for w in {c.window(i) for i in range(c.num_layers)}}
        self.reset()

    def reset(self) -> None:
        """Before each generation: no context held (the buffers' old values stay, hidden by the mask)."""
        self.n = 0

    # -------------------------------------------------------------------------------- the buffers

    def reserve(self, positions: int, feats: torch.Tensor) -> None:
        """Buffers for ``positions`` context positions plus a block and a step's rows past them, of ``feats``'
        dtype and row shape; grown (doubling, the keys held kept, the graph dropped) when they are smaller."""
        need = positions + 2 * self.drafter.config.block_size
        if self.feats is None:
            self.feats = feats.new_zeros((self.drafter.config.block_size, *feats.shape[1:]))
        if need <= self.capacity:
            return
        c = self.drafter.config
        capacity = max(MIN_CAPACITY, self.capacity)
        while capacity < need:
            capacity *= 2
        shape = (1, capacity, c.num_kv_heads, c.head_dim)
        old = getattr(self, "keys", None), getattr(self, "values", None)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(c.num_layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(c.num_layers)]
        if old[0] is not None:
            for mine, was in zip(self.keys + self.values, old[0] + old[1]):
                mine[:, :was.shape[1]] = was
        self.j = torch.arange(capacity, device=self.device)
        self.capacity, self.graph = capacity, None

    # -------------------------------------------------------------------------------- one step

    @torch.inference_mode()
    def __call__(self, ctx: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        """``ctx`` the features of positions < p (those not yet held are added), ``seq`` the tokens on the host
        with the anchor last."""
        S = self.drafter.config.block_size
        p = seq.shape[0] - 1
        if ctx.shape[0] != p or self.n > p:
            raise ValueError(f"drafter context: {ctx.shape[0]} feature rows for anchor {p}, {self.n} held "
                             "(call reset() between generations)")
        self.reserve(p, ctx)
        if p - self.n > S:  # a prompt: its positions added outside the step (once per generation)
            self.add(ctx[self.n:p], self.n)
            self.n = p
        self.feats[:p - self.n] = ctx[self.n:p]
        self.start.fill_(self.n)
        self.p.fill_(p)
        self.anchor.fill_(int(seq[-1]))
        self.run()
        self.n = p
        return self.drafts

    def run(self) -> None:
        if self.graphs and self.graph is None:
            try:
                self.graph = self.capture()
            except RuntimeError as e:  # a kernel that cannot be captured here: the same steps, launched one by one
                log.warning("eval: the drafter's step could not be captured as a CUDA graph (%s); it runs eagerly",
                            (str(e).splitlines() or [""])[0][:200])
                self.graphs = False
        if not self.graphs:
            self.step()
            return
        self.graph.replay()

    def capture(self) -> torch.cuda.CUDAGraph:
        """The step captured (after eager runs on a side stream: they write only what a step writes)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        return graph

    def add(self, feats: torch.Tensor, start: int) -> None:
        """The keys and values of ``feats`` [t, taps, H] at positions ``start ..`` (a prompt, eagerly)."""
        for i, (k, v) in enumerate(self.project(feats, torch.arange(start, start + feats.shape[0],
                                                                     device=self.device))):
            self.keys[i][:, start:start + feats.shape[0]] = k
            self.values[i][:, start:start + feats.shape[0]] = v

    def project(self, feats: torch.Tensor, positions: torch.Tensor):
        """Per draft layer, (keys with RoPE, values) [1, t, kv heads, hd] of context features [t, taps, H]."""
        d, c = self.drafter, self.drafter.config
        t = feats.shape[0]
        ctx = d.context(feats[None])
        rope = rope_cos_sin(positions[None], c.head_dim, c.rope_theta, ctx.dtype)
        for layer in d.layers:
            a = layer.self_attn
            yield (apply_rope(a.k_norm(a.k_proj(ctx).view(1, t, c.num_kv_heads, c.head_dim)), *rope),
                   a.v_proj(ctx).view(1, t, c.num_kv_heads, c.head_dim))

    def step(self) -> None:
        """One step, reading and writing buffers only: the S feature rows added at ``start``, the block of
        ``anchor`` at ``p`` drafted into ``drafts``."""
        d, c = self.drafter, self.drafter.config
        S, nh, nkv, hd = c.block_size, c.num_heads, c.num_kv_heads, c.head_dim
        for i, (k, v) in enumerate(self.project(self.feats, self.start + self.rows)):
            self.keys[i].index_copy_(1, self.start + self.rows, k)
            self.values[i].index_copy_(1, self.start + self.rows, v)
        block = self.p + self.rows
        ids = torch.where(self.rows == 0, self.anchor, c.mask_token_id)[None]
        x = F.embedding(ids, d.embed_tokens).to(self.dtype)
        rope = rope_cos_sin(block[None], hd, c.rope_theta, x.dtype)
        masks = {w: self.mask(w) for w in self.own}
        for i, layer in enumerate(d.layers):
            a, h = layer.self_attn, layer.input_layernorm(x)
            q = apply_rope(a.q_norm(a.q_proj(h).view(1, S, nh, hd)), *rope)
            self.keys[i].index_copy_(1, block, apply_rope(a.k_norm(a.k_proj(h).view(1, S, nkv, hd)), *rope))
            self.values[i].index_copy_(1, block, a.v_proj(h).view(1, S, nkv, hd))
            o = attend(q.transpose(1, 2), self.keys[i].transpose(1, 2), self.values[i].transpose(1, 2),
                       masks[c.window(i)])
            x = x + a.o_proj(o.transpose(1, 2).reshape(1, S, nh * hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = d.norm(x)[0, 1:]
        self.drafts.copy_(F.linear(h.to(d.lm_head.dtype), d.lm_head).argmax(-1))

    def mask(self, window: int | None) -> torch.Tensor:
        """[1, S, capacity] bool: block row i (position p + i) sees context key j < p (in its window) and its own
        block's keys at p .. p + S - 1 (by ``own_block_visible``); nothing else in the buffer."""
        S = self.drafter.config.block_size
        ctx = context_visible(self.p.view(1), self.p.new_ones(1, dtype=torch.bool), self.j,
                              torch.ones_like(self.j, dtype=torch.bool), S, window)[0]  # [S|1, capacity]
        rel = self.j - self.p
        mine = (rel >= 0) & (rel < S)
        blk = self.own[window][:, rel.clamp(0, S - 1)] & mine
        return (ctx | blk)[None]
