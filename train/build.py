"""Building the drafter from a store alone: its frozen head (the store's assets), its config (the flags, the
target's config, or ``--init``'s drafter), its weights, and the loss module the loop trains.

Choices worth knowing:
* **Mask token**: ``mask_token_id`` if given; else the first embedding row past the tokenizer's
  vocabulary (Qwen checkpoints pad their embedding: e.g. 248320 rows), an id no text can produce;
  else the target's ``pad_token_id`` (``<|endoftext|>`` for Qwen, never inside a chat sample).
* **Draft layers**: the published Qwen3.6-27B drafter by default: 5 Qwen3-style layers, all but the
  last with a sliding window of 2048 (causal inside the block, as the engines serve it); hidden size,
  FFN width, RoPE base and context length are the target's, the attention shape the published
  drafters' (``model.reference_attention_shape``: 32 heads x 128, 8 KV heads for Qwen3.6-27B). Flags
  override each. ``--init DIR`` starts from a drafter in the DFlash format instead (its shape, taps,
  mask token), after checking that it fits the store.
* **Precision**: fp32 master weights; on CUDA the frozen head stays in its stored dtype; on CPU everything
  is fp32 (so tests can compare exactly).
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace
from typing import Any

import torch

from hsstore.errors import StoreError
from hsstore.format import assets, values
from hsstore.io import door
from hsstore.redaction import recordable_url
from hsstore.format.manifest import Manifest
from hsstore.format.serving import serving
from hsstore.app.schema import replace
from hsstore.app.target import text_config
from hsstore.store.reader import Store
from hsstore.version import __version__

from . import checkpoint as ckpt
from .budget import check_cpu_memory, check_gpu_memory
from .drafter_format import check_bounds
from .settings import TrainSettings
from .model import DFlashDrafter, DrafterConfig
from .objective import dflash_loss

log = logging.getLogger(__name__)


def load_frozen(store: Store, device="cpu", dtype: torch.dtype | None = None):
    """(target config dict, embedding [V, H], lm_head [V, H]) from the store's assets, each held to the value check
    (``hsstore.format.values``) before anything is built from it: the tensors floating point, [V, H] with H the
    store's hidden size, finite and not all zero; the config's numbers bounded and equal to the tensors'. A
    refusal is one line naming the store and the asset."""
    where = f"store {recordable_url(store.url)!r}, {assets.ASSETS_DIR}/"
    cfg = door.load_json(assets.read_asset(store.fs, store.root, assets.CONFIG, store.url),
                         where + assets.CONFIG, error=StoreError)
    embed = frozen_tensor(store, assets.EMBED, where).to(device)  # its values counted where that is fastest
    head = frozen_tensor(store, assets.LM_HEAD, where).to(device)
    hidden = store.manifest.hidden_size
    for name, t in ((assets.EMBED, embed), (assets.LM_HEAD, head)):
        values.check_tensors({"weight": t}, where + name, shapes={"weight": (embed.shape[0], hidden)}, nonzero=True,
                             error=StoreError)
    values.check_target_config(cfg, {"hidden_size": (hidden, "the store's features have"),
                                     "vocab_size": (embed.shape[0], f"{assets.EMBED} has rows"),
                                     "num_hidden_layers": (store.manifest.target.num_layers,
                                                           "the store's target has layers")},
                               where + assets.CONFIG, error=StoreError)
    if dtype is not None:
        embed, head = embed.to(dtype), head.to(dtype)
    return cfg, embed, head


def frozen_tensor(store: Store, name: str, where: str) -> torch.Tensor:
    """The one tensor (``weight``) of an asset file, a 2-D tensor (its dtype and values checked by the caller)."""
    tensors = assets.load_tensors(store.fs, store.root, name, store.url)
    t = tensors.get("weight")
    if t is None or t.ndim != 2:
        raise StoreError(f"{where}{name}: holds {sorted(tensors)[:4]} with shapes "
                         f"{[list(v.shape) for v in list(tensors.values())[:4]]}, not one 2-D tensor 'weight'")
    return t


def pick_mask_token(target_cfg: dict[str, Any], manifest: Manifest, vocab_rows: int,
                    requested: int | None = None) -> int:
    """See the module doc: requested > first unused embedding row > pad token."""
    if requested is not None:
        if not 0 <= requested < vocab_rows:
            raise ValueError(f"mask token id {requested} outside the embedding (0..{vocab_rows - 1})")
        return int(requested)
    used = manifest.tokenizer.vocab_size
    if used is not None and used < vocab_rows:
        return int(used)
    pad = text_config(target_cfg).get("pad_token_id", target_cfg.get("pad_token_id"))
    if pad is not None:
        return int(pad)
    raise ValueError("cannot choose a mask token: the embedding has no unused row and the target config no "
                     "pad_token_id; pass --mask-token-id")


def drafter_config(manifest: Manifest, target_cfg: dict[str, Any], vocab_rows: int, settings: TrainSettings,
                   device: torch.device) -> DrafterConfig:
    tc = text_config(target_cfg)
    if tc.get("hidden_size") != manifest.hidden_size:
        raise ValueError(f"store assets' config has hidden_size {tc.get('hidden_size')}, the store's features "
                         f"{manifest.hidden_size}")
    attn = settings.schedule.attn
    attn = attn if attn != "auto" else "blocks"  # equal to sdpa, faster (tests/test_attention_blocks.py)
    drafter = settings.drafter
    if drafter.init is not None:
        return init_config(drafter.init, manifest, vocab_rows, settings, attn)
    window = drafter.sliding_window or None
    windows = [window] * (drafter.draft_layers - 1) + [None] if window else None
    shape = {k: getattr(settings.shape, k) for k in SHAPE_KEYS if getattr(settings.shape, k) is not None}
    dcfg = DrafterConfig.from_target_config(
        SimpleNamespace(**{**tc, "vocab_size": vocab_rows}),
        mask_token_id=pick_mask_token(target_cfg, manifest, vocab_rows, drafter.mask_token_id),
        target_layers=list(manifest.layers), num_layers=drafter.draft_layers, block_size=drafter.block_size,
        sliding_window=windows, sliding_causal=drafter.sliding_causal, attn_impl=attn,
        num_target_layers=manifest.target.num_layers, **shape)
    check_bounds(dcfg, "the drafter's config (the store's assets/config.json and the flags)")  # before it is built
    return dcfg


SHAPE_KEYS = ("num_heads", "num_kv_heads", "head_dim", "intermediate_size", "rope_theta")


def init_config(path: str, manifest: Manifest, vocab_rows: int, settings: TrainSettings,
                attn: str) -> DrafterConfig:
    """The config of the drafter at ``path`` (``--init``), refused in one line when it does not fit the store:
    its taps must be among the store's layers, its hidden size, vocabulary, target depth and block size
    those of the store and flags; explicit shape flags must agree with it."""
    dcfg, _ = ckpt.read_drafter_config(path)
    drafter, shape = settings.drafter, settings.shape
    problems = []
    missing = [t for t in dcfg.target_layers if t not in manifest.layers]
    if missing:
        problems.append(f"taps {dcfg.target_layers} need layers {missing} the store lacks (it has "
                        f"{list(manifest.layers)})")
    if dcfg.num_target_layers is not None and dcfg.num_target_layers != manifest.target.num_layers:
        problems.append(f"it was made for a {dcfg.num_target_layers}-layer target, the store's has "
                        f"{manifest.target.num_layers}")
    if dcfg.hidden_size != manifest.hidden_size:
        problems.append(f"hidden size {dcfg.hidden_size} != the store's {manifest.hidden_size}")
    if dcfg.vocab_size != vocab_rows:
        problems.append(f"vocabulary {dcfg.vocab_size} != the store's embedding rows {vocab_rows}")
    if dcfg.block_size != drafter.block_size:
        problems.append(f"block size {dcfg.block_size} != --block-size {drafter.block_size}")
    if drafter.mask_token_id is not None and drafter.mask_token_id != dcfg.mask_token_id:
        problems.append(f"mask token {dcfg.mask_token_id} != --mask-token-id {drafter.mask_token_id}")
    mine = {"num_heads": dcfg.num_heads, "num_kv_heads": dcfg.num_kv_heads, "head_dim": dcfg.head_dim,
            "intermediate_size": dcfg.intermediate_size, "rope_theta": dcfg.rope_theta}
    problems += [f"{k} {mine[k]} != --{k.replace('_', '-')} {getattr(shape, k)}" for k in SHAPE_KEYS
                 if getattr(shape, k) is not None and getattr(shape, k) != mine[k]]
    if problems:
        raise ValueError(f"--init {path} does not fit: {'; '.join(problems)}")
    ckpt.check_weights_file(path, dcfg)  # its config describes its weights: checked before any is built
    if dcfg.num_layers != drafter.draft_layers or dcfg.sliding_window != (
            [drafter.sliding_window] * (drafter.draft_layers - 1) + [None] if drafter.sliding_window else None):
        log.info("--init %s: %d layers, windows %s (its own; --draft-layers/--sliding-window do not apply)",
                 path, dcfg.num_layers, dcfg.sliding_window)
    return dataclasses.replace(dcfg, attn_impl=attn, num_target_layers=manifest.target.num_layers)


class DraftLoss(torch.nn.Module):
    """The drafter plus its objective as one module: DDP must wrap the call that produces the loss
    (the drafter's own forward would build [B, A, S, V] logits).

    Global normalisation: with ``batch["global_weight_sum"]`` (``data.lockstep``: the loss weights summed
    over all ranks' batches, W) each rank's loss is ``world * sum(w * CE) / W``. DDP averages gradients
    over the ``world`` ranks, so the step follows the gradient of ``sum over ranks (w * CE) / W``: exactly
    one process's step on the union of the batches, whatever each rank's share of the weights."""

    def __init__(self, drafter: DFlashDrafter, gamma: float, ce_chunk: int, world: int = 1, ce_impl: str = "fused"):
        super().__init__()
        self.drafter, self.gamma, self.ce_chunk, self.world, self.ce_impl = drafter, gamma, ce_chunk, world, ce_impl

    def forward(self, batch):
        total = batch.get("global_weight_sum")
        return dflash_loss(self.drafter, batch, gamma=self.gamma, ce_chunk=self.ce_chunk, ce_impl=self.ce_impl,
                           weight_total=None if not total else total / self.world)


def check_healthy(stores: list[Store], allow: bool) -> None:
    """Refuse (one line) a store ``verify`` would fail for its values: a sample with a non-finite or all-zero
    feature, by the records' statistics (``hsstore.format.health``); ``--allow-unhealthy`` trains anyway."""
    from hsstore.format import health
    from hsstore.redaction import recordable_url

    for store in stores:
        bad = health.unhealthy(store)
        if not bad:
            continue
        msg = (f"store {recordable_url(store.url)!r}: {len(bad)} sample feature(s) that train nothing (first: {bad[0]}); "
               "`hsstore verify` names them, `hsstore subset --exclude-unhealthy` drops them, --allow-unhealthy "
               "trains anyway")
        if not allow:
            raise StoreError(msg)
        log.warning("%s (training anyway: --allow-unhealthy)", msg)


def build_drafter(stores: list[Store], settings: TrainSettings, device: torch.device, rank: int = 0):
    """(drafter on ``device``, settings): seeded random weights or ``--init``'s, its frozen head from the first
    store; refused before step 1 when the step would not fit the device's memory (on a GPU the anchors per
    sequence may be lowered to fit, planned from the stores' sample lengths: the returned settings says so)."""
    store = stores[0]
    head_dtype = None if device.type == "cuda" else torch.float32
    target_cfg, embed, head = load_frozen(store, device, head_dtype)
    dcfg = drafter_config(store.manifest, target_cfg, embed.shape[0], settings, device)
    torch.manual_seed(settings.schedule.seed)
    drafter = DFlashDrafter(dcfg, embed, head).to(device)
    if settings.drafter.init is not None:  # a resumed run then loads its checkpoint over these
        drafter.load_state_dict(ckpt.read_weights(settings.drafter.init, dcfg))
        log.info("rank %d: drafter initialised from %s", rank, settings.drafter.init)
    params, frozen = drafter.num_trainable_parameters(), embed.numel() + head.numel()
    if device.type == "cpu":  # past the memory there, the kernel kills the process without a word
        settings = check_cpu_memory(dcfg, settings, params, frozen)
    elif device.type == "cuda":  # an out-of-memory at step 1 (or hours in, at a batch of short rows): decide now
        settings = check_gpu_memory(dcfg, settings, params, frozen, device, stores)
    elif "auto" in (settings.memory.checkpoint_layers, settings.memory.shard_optimizer):  # no memory model here
        settings = replace(settings, checkpoint_layers=settings.memory.checkpoint_layers.replace("auto", "off"),
                           shard_optimizer=settings.memory.shard_optimizer.replace("auto", "off"))
    drafter.checkpoint_layers = settings.memory.checkpoint_layers  # as planned
    return drafter, settings


def drafter_meta(manifest: Manifest) -> dict[str, Any]:
    """What every saved drafter of a run records of its store: target, taps, tokenizer, version."""
    return {"target": dataclasses.asdict(manifest.target), "taps": list(manifest.layers),
            "tokenizer": dataclasses.asdict(manifest.tokenizer), "hsstore_version": __version__}


def serving_warnings(taps, num_target_layers: int | None) -> list[str]:
    """One line per drafter tap that an engine cannot serve, with the engines that can
    (``hsstore.format.serving``); none for a drafter that does not say its target's depth."""
    return [] if num_target_layers is None else serving(list(taps), int(num_target_layers)).engine_warnings()


def wrap_ddp(loss_fn: "DraftLoss", world: int, device: torch.device) -> torch.nn.Module:
    """``loss_fn`` itself in one process; under torchrun, wrapped in DDP (the frozen head, identical on every
    rank since it comes from the store, is never broadcast). The gradients are views of DDP's all-reduce buckets:
    one fp32 copy of them, not two (the memory plan counts one)."""
    if world == 1:
        return loss_fn
    from torch.nn.parallel import DistributedDataParallel as DDP

    DDP._set_params_and_buffers_to_ignore_for_model(loss_fn, ["drafter.embed_tokens", "drafter.lm_head"])
    return DDP(loss_fn, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)


def settings_line(dcfg: DrafterConfig, settings: TrainSettings, device, world: int, params: int) -> str:
    """What this run will do, in one line at its start: device, drafter shape, batch and schedule."""
    windows = sorted({w for w in (dcfg.sliding_window or [None])}, key=lambda w: (w is None, w or 0))
    kind = ", ".join("full" if w is None else f"window {w}" for w in windows)
    run, batch = settings.run, settings.batch
    steps = f"{run.steps} steps" if run.steps is not None else f"{run.epochs} epochs"
    return (f"training on {device} x {world}: drafter {dcfg.num_layers} layers ({kind}), {dcfg.num_heads} heads x "
            f"{dcfg.head_dim}, {dcfg.num_kv_heads} KV heads, FFN {dcfg.intermediate_size}, {params / 1e6:.1f}M "
            f"trainable parameters, block {dcfg.block_size}, taps {dcfg.target_layers}; {batch.token_budget:,} "
            f"tokens per batch and rank, {batch.anchors} anchors per sequence, {steps}, lr "
            f"{settings.schedule.lr:g}, attention {dcfg.attn_impl}" + optimizer_words(settings.schedule)
            + {"mlp": ", MLP halves recomputed in backward", "full": ", draft layers recomputed in backward"}.get(
                settings.memory.checkpoint_layers, "")
            + (f", the optimizer's states sharded over {world} ranks"
               if settings.memory.shard_optimizer == "on" and world > 1 else ""))


def optimizer_words(schedule) -> str:
    """What the settings line adds for accumulation and weight decay, where they are asked for."""
    return ((f", {schedule.grad_accum} micro-batches per step" if schedule.grad_accum > 1 else "")
            + (f", weight decay {schedule.weight_decay:g}" if schedule.weight_decay else ""))
