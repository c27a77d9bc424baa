"""A verified block's accepted prefix kept in a hybrid target's cache, without a second forward.

A verification forward advances the target's cache over all S block tokens; when only the first ``a`` are
accepted the cache must hold the state after those ``a``. Attention keys and values are cut back; a Gated
DeltaNet layer's conv state is the last ``K`` inputs of its causal convolution, so it is the window ending at
the ``a``-th block token of [the state before the block, the block's inputs]; its recurrent state cannot be
un-applied, and serving engines (SGLang's and vLLM's verify paths for Mamba/GDN layers) keep each draft
position's state instead of recomputing. Here, while the block is verified, each GDN layer's delta-rule inputs
(q, k, v, g, beta and the state it started from) are kept; once the verdict is known the layer's delta rule runs
once more over the same S-token block with the tokens after ``a`` switched off (beta = 0: nothing written,
g = 0: nothing decayed), whose final state is exactly the state after ``a`` tokens. That is one delta-rule call
for all GDN layers (stacked along the batch), no projections, MLPs or attention, and always the block's shape
(no new kernel shapes to compile); it replaces the copy of the whole cache before every verification and the
second, shorter forward after every rejection. On a GPU the verified block (and so its replay) runs the delta rule
token by token in one call (``RECURRENT_BLOCKS``): one fused kernel per layer, the one one-token decoding runs,
where the chunked form launches several for a block of a few tokens.

It works on the layout transformers' Qwen3.5/3.6 (Qwen3-Next-style) cache has from 5.x: ``cache.layers[i]``
holding ``conv_states[0]`` / ``recurrent_states[0]`` for a linear-attention layer and ``keys`` / ``values`` for a
full-attention one. :func:`for_model` returns None for any other model or cache (the caller then copies the cache
and runs the accepted tokens again, the general path).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass

import torch
from torch import nn

# the delta-rule functions a Gated DeltaNet mixer calls over several tokens (its module's globals): the
# chunked form (transformers' torch fallback or fla's kernel behind transformers' wrapper)
CHUNK_CALLS = ("chunk_gated_delta_rule",)
# its token-by-token form, in the same module: a verified block takes it on these devices. On a GPU fla's fused
# recurrent kernel is one launch per layer where the chunked form is several (a verification is launch-bound), and
# it is the kernel the target's own one-token decoding runs; on a CPU the torch chunked form is the faster
RECURRENT_CALLS = ("recurrent_gated_delta_rule",)
RECURRENT_BLOCKS = ("cuda",)
MIXER_KINDS = ("GatedDeltaNet",)


@dataclass
class LayerBlock:
    """What one GDN layer saw while a block was verified."""

    conv_before: torch.Tensor  # [B, C, K]: its conv state before the block
    conv_inputs: torch.Tensor | None = None  # [B, S, C]: the block's inputs to the convolution
    call: tuple | None = None  # (fn, args, kwargs) of its delta-rule call, initial state cloned


class BlockStates:
    """Records what the target's GDN layers need during a verification forward (:meth:`recording`) and then
    brings the cache back to the block's first ``a`` tokens (:meth:`keep`)."""

    def __init__(self, model: nn.Module, mixers: list[nn.Module]):
        self.model = model
        self.mixers = mixers
        self.layers: dict[int, LayerBlock] = {}
        self.block = 0  # tokens of the block being verified
        self._current: int | None = None  # the layer whose mixer runs now

    @contextlib.contextmanager
    def recording(self, cache, block: int):
        """Around the verification forward of ``block`` tokens with ``cache``."""
        self.layers, self.block = {}, block
        hooks = []
        for m in self.mixers:
            hooks.append(m.register_forward_pre_hook(functools.partial(self._enter, cache)))
            hooks.append(m.in_proj_qkv.register_forward_hook(self._conv_inputs))
        patched = []
        for scope in {id(s): s for s in (_scope(m) for m in self.mixers)}.values():
            recurrent = next((fn for name, fn in scope.items() if callable(fn) and "chunk" not in name
                              and any(c in name for c in RECURRENT_CALLS)), None)
            for name, fn in list(scope.items()):
                if callable(fn) and any(c in name for c in CHUNK_CALLS):
                    scope[name] = self._recorder(fn, recurrent)
                    patched.append((scope, name, fn))
        try:
            yield self
        finally:
            for scope, name, fn in patched:
                scope[name] = fn
            for h in hooks:
                h.remove()
            self._current = None

    def _enter(self, cache, module, args):
        i = module.layer_idx
        self._current = i
        self.layers[i] = LayerBlock(conv_before=cache.layers[i].conv_states[0].clone())

    def _conv_inputs(self, module, args, out):
        if self._current is not None:
            self.layers[self._current].conv_inputs = out

    def _recorder(self, fn, recurrent=None):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            use = fn
            if recurrent is not None and args and args[0].device.type in RECURRENT_BLOCKS:
                use = recurrent  # the block token by token, in one call (RECURRENT_BLOCKS)
                kwargs.pop("chunk_size", None)
            elif args and args[0].device.type == "cpu" and "chunk_size" not in kwargs:
                kwargs["chunk_size"] = _chunk(self.block)  # the torch delta rule's chunk: see _chunk
            layer = self.layers.get(self._current) if self._current is not None else None
            if layer is not None:
                state = kwargs.get("initial_state")
                kept = dict(kwargs, initial_state=None if state is None else state.clone())
                layer.call = (use, args, kept)
            return use(*args, **kwargs)
        return call

    def complete(self) -> bool:
        """Whether every GDN layer's block was recorded (else the caller takes the general path)."""
        return (len(self.layers) == len(self.mixers)
                and all(b.conv_inputs is not None and b.call is not None and len(b.call[1]) >= 3
                        and {"g", "beta", "initial_state"} <= b.call[2].keys() for b in self.layers.values()))

    @torch.inference_mode()
    def keep(self, cache, a: int) -> None:
        """Cut ``cache`` back from the whole verified block to its first ``a`` tokens."""
        drop = self.block - a
        if drop <= 0:
            return
        for i, layer in enumerate(cache.layers):
            block = self.layers.get(i)
            if block is None:
                layer.crop(-drop)  # attention keys and values
                continue
            window = block.conv_before.shape[-1]
            inputs = torch.cat([block.conv_before, block.conv_inputs.transpose(1, 2).to(block.conv_before.dtype)],
                               dim=-1)
            layer.conv_states[0].copy_(inputs[..., a:a + window])
            if hasattr(layer, "cumulative_length_linear"):  # the layer's own token count (transformers >= 5.2x)
                layer.cumulative_length_linear.sub_(drop)
        for members in _replay_groups(self.layers).values():
            states = _replay([self.layers[i].call for i in members], a)
            for i, state in zip(members, states):
                cache.layers[i].recurrent_states[0].copy_(state)
        self.layers = {}


def _replay_groups(layers: dict[int, LayerBlock]) -> dict[tuple, list[int]]:
    """Layers whose delta-rule calls can run as one batched call (same function, shapes and other arguments;
    a call with tensors beyond q, k, v, g, beta and the state runs alone)."""
    groups: dict[tuple, list[int]] = {}
    for i, block in layers.items():
        fn, args, kwargs = block.call
        tensors = {k for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        if len(args) != 3 or tensors - {"g", "beta", "initial_state"} or kwargs["initial_state"] is None:
            key: tuple = ("alone", i)
        else:
            rest = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in tensors))
            key = (id(fn), tuple(t.shape for t in args), kwargs["g"].shape, kwargs["initial_state"].shape, rest)
        groups.setdefault(key, []).append(i)
    return groups


def _replay(calls: list[tuple], a: int) -> list[torch.Tensor]:
    """The recurrent state after the first ``a`` block tokens of each recorded call, from one call of its
    delta rule over the whole block (the calls stacked along the batch) with the later tokens switched off."""
    fn, args, kwargs = calls[0]
    if len(calls) > 1:
        args = tuple(torch.cat([c[1][j] for c in calls]) for j in range(3))
        kwargs = dict(kwargs, **{k: torch.cat([c[2][k] for c in calls]) for k in ("g", "beta", "initial_state")})
    g, beta = kwargs["g"], kwargs["beta"]
    on = (torch.arange(g.shape[1], device=g.device) < a).view(1, -1, *([1] * (g.dim() - 2)))
    # g = 0 after the a-th token: no decay; beta = 0: nothing written
    _, state = fn(*args, **dict(kwargs, g=g * on, beta=beta * on, output_final_state=True))
    return list(state.split(kwargs["initial_state"].shape[0] // len(calls)))


def _chunk(block: int) -> int:
    """The torch delta rule's chunk for a verified block on the CPU (the CPU only ever runs transformers' torch
    path): the block rounded up to 16 tokens, where its default, 64, pads a 16-token block fourfold."""
    return -(-block // 16) * 16


def _scope(module: nn.Module) -> dict:
    return vars(sys.modules[type(module).__module__])


def gdn_mixers(model: nn.Module) -> list[nn.Module]:
    """The model's Gated DeltaNet mixers (modules whose class name ends with ``GatedDeltaNet``)."""
    return [m for m in model.modules() if type(m).__name__.endswith(MIXER_KINDS)]


def for_model(model: nn.Module, cache) -> BlockStates | None:
    """A :class:`BlockStates` for ``model`` decoding with ``cache`` (after its prefill), or None when either is
    not of the layout described in the module doc: no GDN mixer, a mixer without ``layer_idx`` or
    ``in_proj_qkv``, a cache without ``layers``, a linear layer without conv and recurrent states, or another
    layer that cannot ``crop`` (a sliding window, a static cache)."""
    mixers = gdn_mixers(model)
    layers = getattr(cache, "layers", None)
    if not mixers or layers is None:
        return None
    linear = {getattr(m, "layer_idx", None) for m in mixers}
    if None in linear or not all(isinstance(getattr(m, "in_proj_qkv", None), nn.Linear) for m in mixers):
        return None
    for i, layer in enumerate(layers):
        if i in linear:
            conv, rec = getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})
            if not isinstance(conv.get(0), torch.Tensor) or not isinstance(rec.get(0), torch.Tensor):
                return None
        elif type(layer).__name__ != "DynamicLayer":
            return None
    if len(layers) <= max(linear):
        return None
    return BlockStates(model, mixers)
