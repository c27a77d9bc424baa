"""Checkpoints and the exported drafter, without pickle: safetensors for tensors, JSON for the rest.

A *drafter directory* is what SGLang, vLLM and z-lab's ``dflash`` load (``--speculative-draft-model-path``,
``"method": "dflash"``), in the format of SpecForge's and z-lab's released drafters:

    config.json                   Qwen3-style config: architectures ["DFlashDraftModel"], model_type qwen3,
                                  layer_types, sliding_window + use_sliding_window, block_size,
                                  num_target_layers, dflash_config {target_layer_ids, mask_token_id}, rope_theta
    model.safetensors             bf16 drafter weights: fc, hidden_norm, layers.N.*, norm (no embedding, no
                                  lm_head: the engines use the target's)
    model.safetensors.index.json  lists model.safetensors only, so engines skip any other *.safetensors here
    hsstore_drafter.json          this project's metadata: store/target identity, taps, tokenizer, attn_impl

    OUT/checkpoints/step_00001000/   a drafter directory, plus what resuming needs:
        master_weights.safetensors   the fp32 trainable weights (resume continues from these, bit-exact)
        optimizer.safetensors        AdamW moments and step counts
        trainer.json                 step, epoch, scheduler, training config, optimizer param groups, Python RNG
        rank00000.safetensors        this rank's torch CPU/CUDA and numpy RNG states
        loader.rank00000.json        this rank's loader position (hsstore loader state)
    OUT/checkpoints/best             with --val-store: a small JSON file naming the checkpoint with the best
                                     val_tau (kept whatever --keep says); export-drafter and eval follow it
    OUT/drafter/                     the final drafter directory

Directories written before this format (config.json ``{"architecture": "DFlashDrafter", "drafter": {...}}``
with fp32 model.safetensors) still load, resume and export (``hsstore export-drafter``).

Pickle-free means a checkpoint from an untrusted place cannot run code when loaded. A checkpoint is
written to a hidden temporary directory and renamed into place, so a crash mid-write leaves the
previous one as the latest. The frozen embedding / lm_head are not saved: they are the target's, and
come from the store's assets (``build.load_frozen``).

``Checkpointer`` writes a run's checkpoints (every rank its part, rank 0 the rest) and ``resume`` continues a
run from one, refusing settings (``config.RESUME_KEYS``) or a drafter that would not continue the same run.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import random
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from .config import LEGACY_RESUME_VALUES, RESUME_KEYS, TrainSettings, recordable_config, saved_config, recordable_stores
from .model import DFlashDrafter, DrafterConfig

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
DRAFTER_DIR = "drafter"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
META = "hsstore_drafter.json"
MASTER = "master_weights.safetensors"
ARCHITECTURE = "DFlashDraftModel"
LEGACY_ARCHITECTURE = "DFlashDrafter"  # this project's format before the DFlash HF one
FULL, SLIDING = "full_attention", "sliding_attention"
_STEP_RE = re.compile(r"^step_(\d+)$")
BEST = "best"  # OUT/checkpoints/best: names the checkpoint with the best val_tau
BEST_FORMAT = "hsstore-best-checkpoint"


# ---------------------------------------------------------------------------------------------- the drafter


def hf_config(cfg: DrafterConfig) -> dict[str, Any]:
    """The DFlash config.json of a drafter: the fields of SpecForge's configs/qwen3.6-27b-dflash.json."""
    windows = sorted({w for w in cfg.sliding_window or [] if w is not None})
    if len(windows) > 1:
        raise ValueError(f"the DFlash format has one sliding_window for all sliding layers, not {windows}")
    window = windows[0] if windows else None
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "dtype": "bfloat16",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "layer_types": [FULL if cfg.window(i) is None else SLIDING for i in range(cfg.num_layers)],
        # transformers' Qwen3Config drops sliding_window unless use_sliding_window is true
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": cfg.num_layers,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"target_layer_ids": list(cfg.target_layers), "mask_token_id": cfg.mask_token_id},
    }
    if window is not None and not cfg.sliding_causal:
        out["is_causal"] = False  # SGLang and vLLM then run every layer non-causally (their default: sliding causal)
    return out


def config_from_hf(d: dict[str, Any], attn_impl: str = "sdpa", source: str = CONFIG) -> DrafterConfig:
    """The DrafterConfig of a DFlash config.json (ours, SpecForge's or z-lab's); refuses what this drafter
    cannot run exactly as the engines would."""
    def refuse(why):
        raise ValueError(f"{source}: {why}")

    if ARCHITECTURE not in (d.get("architectures") or []):
        refuse(f"not a DFlash drafter (architectures {d.get('architectures')!r}, expected [{ARCHITECTURE!r}])")
    if d.get("attention_bias"):
        refuse("attention_bias is true; this drafter has no attention biases")
    if d.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {d['hidden_act']!r}; this drafter's MLP is SwiGLU (silu)")
    rope = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default" or scaling.get("rope_type", scaling.get("type", "default")) \
            not in ("default", None):
        refuse("RoPE scaling is not supported (rope_type must be default)")
    if (d.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0) != 1.0:
        refuse("partial rotary is not supported (the drafter rotates whole heads)")
    dflash = d.get("dflash_config") or {}
    for key in ("target_layer_ids", "mask_token_id"):
        if dflash.get(key) is None:
            refuse(f"dflash_config.{key} is missing")
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types") or [FULL] * n
    if len(types) != n or set(types) - {FULL, SLIDING}:
        refuse(f"layer_types {types} must hold {n} entries of {FULL!r} / {SLIDING!r}")
    window = d.get("sliding_window")
    if SLIDING in types and not (isinstance(window, int) and window > 0):
        refuse(f"sliding layers need a positive sliding_window (got {window!r})")
    causal = d.get("is_causal", dflash.get("causal"))
    if causal is True:
        refuse("is_causal: true (causal full-attention layers) is not supported")
    heads = int(d["num_attention_heads"])
    return DrafterConfig(
        hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
        vocab_size=int(d["vocab_size"]), target_layers=list(dflash["target_layer_ids"]),
        mask_token_id=int(dflash["mask_token_id"]), num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads), num_layers=n,
        block_size=int(dflash.get("block_size") or d.get("block_size") or 16),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(d.get("rope_theta") or rope.get("rope_theta") or 1_000_000.0),
        sliding_window=[window if t == SLIDING else None for t in types], sliding_causal=causal is not False,
        max_position=int(d.get("max_position_embeddings") or 40960), num_target_layers=d.get("num_target_layers"),
        attn_impl=attn_impl)


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a drafter of this config (built on the meta device: no memory)."""
    meta = torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta")
    with torch.device("meta"):
        model = DFlashDrafter(cfg, meta, meta)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_tensors(cfg: DrafterConfig, tensors: dict[str, Any], source: str) -> None:
    """ValueError naming the first few missing / unexpected / misshapen tensors of ``source`` (tensors, or
    their shapes)."""
    want = expected_shapes(cfg)
    have = {k: tuple(v) if isinstance(v, (tuple, list)) else tuple(v.shape) for k, v in tensors.items()}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    shapes = [f"{k} {have[k]} != {want[k]}" for k in sorted(set(want) & set(have)) if have[k] != want[k]]
    problems = [f"missing {missing[:3]}" if missing else "", f"unexpected {extra[:3]}" if extra else "",
                f"shape {shapes[:3]}" if shapes else ""]
    if any(problems):
        raise ValueError(f"{source} does not match its config: {'; '.join(x for x in problems if x)}")


SAFETENSORS_HEADER_MAX = 100 << 20  # the safetensors format's own limit on its JSON header


def file_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header alone (8-byte length, then JSON): what a config can
    be checked against before any weight is built or read."""
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= SAFETENSORS_HEADER_MAX:
            raise ValueError(f"{file}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
            return {k: tuple(int(x) for x in v["shape"]) for k, v in header.items() if k != "__metadata__"}
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{file}: malformed safetensors header ({type(e).__name__}: {e})") from None


def weights_file(path: str | os.PathLike) -> Path:
    """The file ``read_weights`` reads: a checkpoint's fp32 master weights, else the served model.safetensors."""
    path = resolve_drafter_dir(path)
    return path / MASTER if (path / MASTER).exists() else path / WEIGHTS


def check_weights_file(path: str | os.PathLike, cfg: DrafterConfig) -> None:
    """Refuse a drafter whose ``config.json`` does not describe its weights file, before anything is built: a
    config is data from elsewhere (``intermediate_size`` 4M would allocate gigabytes for a model whose file
    holds a small one)."""
    file = weights_file(path)
    check_tensors(cfg, file_shapes(file), f"{file} (its config {resolve_drafter_dir(path) / CONFIG})")


def write_drafter(path: str | os.PathLike, cfg: DrafterConfig, tensors: dict[str, torch.Tensor],
                  meta: dict[str, Any] | None = None) -> Path:
    """A drafter directory (see the module doc) from a config, its weights and this project's metadata."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    if cfg.num_target_layers is None and (meta.get("target") or {}).get("num_layers"):
        cfg = dataclasses.replace(cfg, num_target_layers=int(meta["target"]["num_layers"]))
    check_tensors(cfg, tensors, "drafter weights")
    bf16 = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in tensors.items()}
    save_file(bf16, str(path / WEIGHTS), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in bf16.values())},
             "weight_map": {k: WEIGHTS for k in sorted(bf16)}}
    (path / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))
    (path / META).write_text(json.dumps({"format": "hsstore-drafter", "attn_impl": cfg.attn_impl, **meta}, indent=2))
    (path / CONFIG).write_text(json.dumps(hf_config(cfg), indent=2))
    return path


def save_drafter(path: str | os.PathLike, model: DFlashDrafter, extra: dict[str, Any] | None = None) -> Path:
    """The drafter directory of a live model: everything ``load_drafter`` and the engines need."""
    return write_drafter(path, model.config, model.state_dict(), extra)


def read_drafter_config(path: str | os.PathLike) -> tuple[DrafterConfig, dict[str, Any]]:
    """(config, this project's metadata) of a drafter directory, a checkpoint or a run's OUT; reads the DFlash
    format (with or without hsstore_drafter.json: released drafters have none) and the legacy one."""
    path = resolve_drafter_dir(path)
    d = json.loads((path / CONFIG).read_text())
    if d.get("architecture") == LEGACY_ARCHITECTURE:  # sliding layers were trained non-causally then
        meta = {k: v for k, v in d.items() if k not in ("architecture", "drafter")}
        cfg = DrafterConfig(**{"sliding_causal": False, **d["drafter"]})
        if cfg.num_target_layers is None and (meta.get("target") or {}).get("num_layers"):
            cfg = dataclasses.replace(cfg, num_target_layers=int(meta["target"]["num_layers"]))
        return cfg, meta
    meta = json.loads((path / META).read_text()) if (path / META).exists() else {}
    meta.pop("format", None)
    return config_from_hf(d, meta.pop("attn_impl", "sdpa"), str(path / CONFIG)), meta


def load_drafter(path: str | os.PathLike, embed_tokens: torch.Tensor, lm_head: torch.Tensor,
                 **config_overrides) -> DFlashDrafter:
    """The drafter saved at ``path`` (a drafter dir, a checkpoint, or a training run's OUT) with the given
    frozen head; ``config_overrides`` e.g. ``attn_impl="sdpa"`` for a CPU. Weights as ``read_weights`` picks
    them, in the model's dtype (float32 parameters hold bf16 files exactly)."""
    path = resolve_drafter_dir(path)
    cfg, _ = read_drafter_config(path)
    cfg = dataclasses.replace(cfg, **config_overrides)
    check_weights_file(path, cfg)  # the config describes the file: checked before any weight is built
    model = DFlashDrafter(cfg, embed_tokens, lm_head)
    model.load_state_dict(read_weights(path, cfg), strict=True)
    return model


def read_weights(path: str | os.PathLike, cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """The weights of the drafter at ``path``, checked against ``cfg``: a checkpoint's fp32 master weights (exactly
    what was trained), else the served model.safetensors (bf16; fp32 in the legacy format)."""
    file = weights_file(path)
    tensors = load_file(str(file))
    check_tensors(cfg, tensors, str(file))
    return tensors


def export_drafter(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """``hsstore export-drafter``: any drafter directory, checkpoint or run (either format) into a new drafter
    directory in the DFlash format. Never writes into a non-empty ``out``."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory; choose a new OUT")
    src_dir = resolve_drafter_dir(src)
    cfg, meta = read_drafter_config(src_dir)
    tensors = read_weights(src_dir, cfg)
    tmp = out.parent / f".tmp-{out.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    write_drafter(tmp, cfg, tensors, meta)
    os.replace(tmp, out)  # onto nothing or an empty directory
    log.info("exported %s -> %s", src_dir, out)
    return out


def resolve_drafter_dir(path: str | os.PathLike) -> Path:
    """A drafter directory itself, OUT/drafter of a finished run, or else OUT's latest checkpoint."""
    path = Path(path)
    if path.is_file() and path.name == BEST:  # OUT/checkpoints/best: the checkpoint it names
        target = path.parent / read_pointer(path)["checkpoint"]
        if not (target / CONFIG).exists():
            raise FileNotFoundError(f"{path} names {target.name}, which is not there (removed?)")
        return target
    for cand in (path, path / DRAFTER_DIR):
        if (cand / CONFIG).exists() and (cand / WEIGHTS).exists():
            return cand
    latest = latest_checkpoint(path)
    if latest is not None:
        return latest
    raise FileNotFoundError(f"no drafter in {path} (expected {CONFIG} + {WEIGHTS}, "
                            f"{DRAFTER_DIR}/ or {CKPT_DIR}/step_*/)")


# ---------------------------------------------------------------------------------------------- optimizer, RNG


def optimizer_to_safetensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON-able rest) of ``opt.state_dict()``; tensors keyed ``"<param id>.<name>"``."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{pid}.{name}"] = v.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[name] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_safetensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    for pid, rest in meta["scalars"].items():
        state.setdefault(int(pid), {}).update(rest)
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_tensors(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["torch_cuda"] = torch.cuda.get_rng_state(device)
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    out["numpy_rest"] = torch.tensor([pos, has_gauss, gauss], dtype=torch.float64)
    return out


def set_rng(tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["torch_cuda"], device)
    pos, has_gauss, gauss = tensors["numpy_rest"].tolist()
    np.random.set_state(("MT19937", tensors["numpy_keys"].numpy().astype(np.uint32), int(pos), int(has_gauss), gauss))


def python_rng() -> list:
    version, state, gauss = random.getstate()
    return [version, list(state), gauss]


def set_python_rng(s: list) -> None:
    random.setstate((s[0], tuple(s[1]), s[2]))


# ---------------------------------------------------------------------------------------------- checkpoints


def checkpoint_dir(out: str | os.PathLike, step: int) -> Path:
    return Path(out) / CKPT_DIR / f"step_{step:08d}"


def list_checkpoints(out: str | os.PathLike) -> list[Path]:
    root = Path(out) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name))
             and (p / "trainer.json").exists()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(out)
    return ckpts[-1] if ckpts else None


def staging_dir(out: str | os.PathLike, step: int) -> Path:
    return Path(out) / CKPT_DIR / f".tmp-step_{step:08d}"


def write_rank_files(tmp: Path, rank: int, loader_state: dict[str, Any] | None, device: torch.device) -> None:
    """What every rank writes into the staging directory: its loader position and RNG states."""
    save_file(rng_tensors(device), str(tmp / f"rank{rank:05d}.safetensors"))
    (tmp / f"loader.rank{rank:05d}.json").write_text(json.dumps(loader_state))


def write_main_files(tmp: Path, model: DFlashDrafter, opt: torch.optim.Optimizer, sched, *, step: int,
                     epoch: int, config: dict[str, Any], world: list[int], extra: dict[str, Any]) -> None:
    """What rank 0 writes: drafter, fp32 master weights, optimizer, and ``trainer.json`` last (its presence
    marks the rest)."""
    save_drafter(tmp, model, extra)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp / MASTER),
              metadata={"format": "pt"})
    tensors, opt_meta = optimizer_to_safetensors(opt)
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    state = {"step": step, "epoch": epoch, "world": world, "scheduler": sched.state_dict(), "optimizer": opt_meta,
             "config": config, "python_rng": python_rng()}
    (tmp / "trainer.json").write_text(json.dumps(state))


def publish(tmp: Path, final: Path, keep: int, best: dict[str, Any] | None = None) -> None:
    """Rename the staging directory into place, point ``best`` at it when given (its validation metrics), and
    drop all but the newest ``keep`` checkpoints, never the best one."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    log.info("saved %s", final)
    out = final.parent.parent
    if best is not None:
        write_best(out, final.name, best)
    pointer = read_best(out)
    for old in list_checkpoints(out)[:-keep] if keep > 0 else []:
        if pointer is None or old.name != pointer["checkpoint"]:
            shutil.rmtree(old, ignore_errors=True)


def best_path(out: str | os.PathLike) -> Path:
    return Path(out) / CKPT_DIR / BEST


def write_best(out: str | os.PathLike, checkpoint: str, metrics: dict[str, Any]) -> None:
    """OUT/checkpoints/best: a small JSON file naming the checkpoint with the best validation tau (a file, not
    a link: it works the same on object stores and on file systems without links)."""
    path = best_path(out)
    tmp = path.with_name(f".tmp-{BEST}")
    tmp.write_text(json.dumps({"format": BEST_FORMAT, "checkpoint": checkpoint, **metrics}, indent=2) + "\n")
    os.replace(tmp, path)
    log.info("best checkpoint (val_tau %.4f): %s", metrics.get("val_tau", float("nan")), checkpoint)


def read_best(out: str | os.PathLike) -> dict[str, Any] | None:
    """The best pointer of a run (None when it has none); refuses one that names anything but a sibling
    ``step_N`` directory."""
    return read_pointer(best_path(out)) if best_path(out).is_file() else None


def read_pointer(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{path}: not a best-checkpoint pointer (JSON with format {BEST_FORMAT!r})") from None
    if not isinstance(d, dict) or d.get("format") != BEST_FORMAT or not _STEP_RE.match(str(d.get("checkpoint"))):
        raise ValueError(f"{path}: not a best-checkpoint pointer (format {BEST_FORMAT!r}, checkpoint step_N)")
    return d


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "trainer.json").read_text())


def restore(path: Path, model: DFlashDrafter, opt: torch.optim.Optimizer, sched, device: torch.device,
            rank: int) -> dict[str, Any]:
    """Load weights, optimizer, scheduler and this rank's RNG from a checkpoint; returns trainer.json."""
    state = read_trainer_state(path)
    master = path / MASTER if (path / MASTER).exists() else path / WEIGHTS  # legacy: fp32 model.safetensors
    model.load_state_dict(load_file(str(master), device=str(device)), strict=True)
    opt.load_state_dict(optimizer_from_safetensors(load_file(str(path / "optimizer.safetensors")), state["optimizer"]))
    sched.load_state_dict(state["scheduler"])
    set_python_rng(state["python_rng"])
    rng_file = path / f"rank{rank:05d}.safetensors"
    if rng_file.exists():
        set_rng(load_file(str(rng_file)), device)
    return state


def loader_states(path: Path) -> dict[int, dict[str, Any]]:
    """Every rank's saved loader state, by rank."""
    out = {}
    for f in sorted(path.glob("loader.rank*.json")):
        out[int(f.stem.split("rank")[-1])] = json.loads(f.read_text())
    return out


# ---------------------------------------------------------------------------------------------- a run's checkpoints


@dataclass(kw_only=True)
class Checkpointer:
    """What every checkpoint of one run writes besides its position: set up once, then ``save`` per checkpoint."""

    out: Path
    drafter: DFlashDrafter
    opt: Any
    sched: Any
    settings: TrainSettings
    config_json: dict[str, Any]  # the run's settings as saved (no storage options: they may hold secrets)
    extra: dict[str, Any]  # target, taps, tokenizer: written into the drafter's meta
    device: torch.device
    rank: int
    world: int

    def save(self, step: int, epoch: int, loader_state, best: dict[str, Any] | None = None) -> None:
        """All ranks write their loader/RNG files into a staging dir; rank 0 the rest, then publishes it (and
        points OUT/checkpoints/best at it when ``best``, its validation metrics, is given)."""
        rank, world = self.rank, self.world
        tmp, final = staging_dir(self.out, step), checkpoint_dir(self.out, step)
        if rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        if world > 1:
            dist.barrier()
        with checkpoint_errors(tmp, step):
            write_rank_files(tmp, rank, loader_state, self.device)
        if world > 1:
            dist.barrier()
        if rank == 0:
            with checkpoint_errors(tmp, step):
                write_main_files(tmp, self.drafter, self.opt, self.sched, step=step, epoch=epoch,
                                      config=self.config_json, world=[world, self.settings.data.workers], extra=self.extra)
                publish(tmp, final, self.settings.output.keep, best)
        if world > 1:
            dist.barrier()

    def resume_latest(self, source) -> tuple[int, int, Path | None]:
        """(step, epoch, checkpoint) to continue from: OUT's latest checkpoint (``resume``) unless the config
        says to start over; (0, 0, None) when there is none."""
        latest = latest_checkpoint(self.out) if self.settings.output.resume else None
        if latest is None:
            return 0, 0, None
        step, epoch = resume(latest, self.settings, self.drafter, self.opt, self.sched, source, self.device, self.rank,
                             self.world)
        log.info("rank %d: resumed from %s (step %d, epoch %d)", self.rank, latest, step, epoch)
        return step, epoch, latest


@contextmanager
def checkpoint_errors(tmp: Path, step: int):
    """A checkpoint that cannot be written (a full disk above all: safetensors raises its own ``SafetensorError``)
    as one ``OSError`` line saying so; the checkpoints published before stay as they were (a resume uses them)."""
    try:
        yield
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        full = isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left" in text or "StorageFull" in text
        why = "the disk is full" if full else text
        raise OSError(errno.ENOSPC if full else errno.EIO,
                      f"checkpoint of step {step} could not be written to {tmp}: {why}; the checkpoints published "
                      "before are kept (free space, then run the same command again to resume)") from e


def _length(steps: int | None, epochs: float | None) -> str:
    return f"--steps {steps}" if steps is not None else f"--epochs {epochs}" if epochs is not None else "the default"


def resume(path: Path, settings: TrainSettings, drafter, opt, sched, source, device, rank: int, world: int):
    """Restore from ``path``; returns (step, epoch). Refuses settings that would not continue the same run."""
    saved = read_trainer_state(path)
    now = recordable_config(settings)  # as it was saved
    before = {k: saved["config"].get(k, LEGACY_RESUME_VALUES.get(k)) for k in RESUME_KEYS}
    for key in ("stores", "val_stores"):  # runs recorded before paths were absolute: as if started from here
        if key in before and before[key]:
            before[key] = recordable_stores(before[key])
    diffs = [f"{k}: {before[k]!r} -> {now[k]!r}" for k in RESUME_KEYS if before[k] != now[k]]
    saved_cfg, _ = read_drafter_config(path)
    mine = dataclasses.replace(drafter.config, attn_impl=saved_cfg.attn_impl)
    diffs += [f"drafter {f.name}: {getattr(saved_cfg, f.name)!r} -> {getattr(mine, f.name)!r}"
              for f in dataclasses.fields(mine) if getattr(saved_cfg, f.name) != getattr(mine, f.name)]
    if diffs:
        raise ValueError(f"{settings.run.out} holds a run with other settings ({'; '.join(diffs)}): use another --out, "
                         "or --no-resume to start over")
    length = {k: saved["config"].get(k) for k in ("steps", "epochs")}
    if rank == 0 and length != {"steps": settings.run.steps, "epochs": settings.run.epochs}:  # allowed, but never silent
        log.warning("resuming %s with another length: %s before, %s now (the learning-rate schedule follows the "
                    "new length from here)", path, _length(**length), _length(settings.run.steps, settings.run.epochs))
    state = restore(path, drafter, opt, sched, device, rank)
    states = loader_states(path)
    if saved["world"] == [world, settings.data.workers] and rank in states:
        if states[rank] is not None:
            source.load_state_dict(states[rank])
    elif any(s is not None for s in states.values()):
        log.info("resuming a run of %s rank(s) x workers on %d x %d: re-cutting the rest of the epoch",
                 saved["world"], world, settings.data.workers)
        source.load_merged([s for s in states.values() if s is not None])
    return int(state["step"]), int(state["epoch"])
