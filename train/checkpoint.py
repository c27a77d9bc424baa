"""Checkpoints and the exported drafter, without pickle: safetensors for tensors, JSON for the rest.

    OUT/checkpoints/step_00001000/
        config.json             DrafterConfig (+ the store's target identity)  } a drafter directory:
        model.safetensors       trainable drafter weights                       } `hsstore eval --drafter` loads it
        optimizer.safetensors   AdamW moments and step counts
        trainer.json            step, epoch, scheduler, training config, optimizer param groups, Python RNG
        rank00000.safetensors   this rank's torch CPU/CUDA and numpy RNG states
        loader.rank00000.json   this rank's loader position (hsstore loader state)
    OUT/drafter/                the final drafter directory (config.json + model.safetensors)

Pickle-free means a checkpoint from an untrusted place cannot run code when loaded. A checkpoint is
written to a hidden temporary directory and renamed into place, so a crash mid-write leaves the
previous one as the latest. The frozen embedding / lm_head are not saved: they are the target's, and
come from the store's assets (``train.trainer.load_frozen``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .model import DFlashDrafter, DrafterConfig

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
DRAFTER_DIR = "drafter"
_STEP_RE = re.compile(r"^step_(\d+)$")


# ---------------------------------------------------------------------------------------------- the drafter


def save_drafter(path: str | os.PathLike, model: DFlashDrafter, extra: dict[str, Any] | None = None) -> Path:
    """config.json + model.safetensors: everything ``load_drafter`` needs besides the frozen head."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {"architecture": "DFlashDrafter", "drafter": dataclasses.asdict(model.config), **(extra or {})}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def read_drafter_config(path: str | os.PathLike) -> tuple[DrafterConfig, dict[str, Any]]:
    meta = json.loads((resolve_drafter_dir(path) / "config.json").read_text())
    return DrafterConfig(**meta["drafter"]), meta


def load_drafter(path: str | os.PathLike, embed_tokens: torch.Tensor, lm_head: torch.Tensor,
                 **config_overrides) -> DFlashDrafter:
    """The drafter saved at ``path`` (a drafter dir, a checkpoint, or a training run's OUT) with the given
    frozen head; ``config_overrides`` e.g. ``attn_impl="sdpa"`` for a CPU."""
    path = resolve_drafter_dir(path)
    cfg, _ = read_drafter_config(path)
    cfg = dataclasses.replace(cfg, **config_overrides)
    model = DFlashDrafter(cfg, embed_tokens, lm_head)
    model.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    return model


def resolve_drafter_dir(path: str | os.PathLike) -> Path:
    """A drafter directory itself, OUT/drafter of a finished run, or else OUT's latest checkpoint."""
    path = Path(path)
    for cand in (path, path / DRAFTER_DIR):
        if (cand / "config.json").exists() and (cand / "model.safetensors").exists():
            return cand
    latest = latest_checkpoint(path)
    if latest is not None:
        return latest
    raise FileNotFoundError(f"no drafter in {path} (expected config.json + model.safetensors, "
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
    """What rank 0 writes: drafter, optimizer, and ``trainer.json`` last (its presence marks the rest)."""
    save_drafter(tmp, model, extra)
    tensors, opt_meta = optimizer_to_safetensors(opt)
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    state = {"step": step, "epoch": epoch, "world": world, "scheduler": sched.state_dict(), "optimizer": opt_meta,
             "config": config, "python_rng": python_rng()}
    (tmp / "trainer.json").write_text(json.dumps(state))


def publish(tmp: Path, final: Path, keep: int) -> None:
    """Rename the staging directory into place and drop all but the newest ``keep`` checkpoints."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    log.info("saved %s", final)
    for old in list_checkpoints(final.parent.parent)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "trainer.json").read_text())


def restore(path: Path, model: DFlashDrafter, opt: torch.optim.Optimizer, sched, device: torch.device,
            rank: int) -> dict[str, Any]:
    """Load weights, optimizer, scheduler and this rank's RNG from a checkpoint; returns trainer.json."""
    state = read_trainer_state(path)
    model.load_state_dict(load_file(str(path / "model.safetensors"), device=str(device)), strict=True)
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
