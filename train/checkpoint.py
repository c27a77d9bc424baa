"""A training run's checkpoints, and where its drafter is, without pickle: safetensors for tensors, JSON for
the rest. The drafter directory's own format (config.json, model.safetensors, ...): ``drafter_format.py``.

    OUT/checkpoints/step_00001000/   a drafter directory (``drafter_format``), plus what resuming needs:
        master_weights.safetensors   the fp32 trainable weights (resume continues from these, bit-exact)
        optimizer.safetensors        AdamW moments and step counts
        trainer.json                 step, epoch, scheduler, training config, optimizer param groups, Python RNG
        rank00000.safetensors        this rank's torch CPU/CUDA and numpy RNG states
        loader.rank00000.json        this rank's loader position (hsstore loader state)
    OUT/checkpoints/best             with --val-store: a small JSON file naming the checkpoint with the best
                                     val_tau (kept whatever --keep says); export-drafter and eval follow it
    OUT/drafter/                     the final drafter directory

Drafters and checkpoints in the format before the DFlash one still load, resume and export
(``hsstore export-drafter``).

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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hsstore.io import door, sinks
from hsstore.ops.html_report import metrics_row
from hsstore.loader.resume import LoaderStateError
from hsstore.io.tensorfiles import load_beneath, save_safetensors

from .settings import (LEGACY_RESUME_VALUES, LEGACY_VALUES, RESUME_KEYS, SEGMENT_KEYS, TrainSettings,
                     recordable_config, recordable_stores, saved_config)
from .drafter_format import (CONFIG, WEIGHTS, check_tensors, check_weights, file_shapes, read_config,
                             save_drafter, weights_bound, write_drafter, written_by_hsstore)
from .model import DFlashDrafter, DrafterConfig
from .optim import regrouped, resume_with
from .rundir import ResumeRecord
from .sharding import gather_for_save

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
DRAFTER_DIR = "drafter"
MASTER = "master_weights.safetensors"
_STEP_RE = re.compile(r"^step_(\d+)$")
BEST = "best"  # OUT/checkpoints/best: names the checkpoint with the best val_tau
BEST_FORMAT = "hsstore-best-checkpoint"
TRAINER = "trainer.json"
OPTIMIZER = "optimizer.safetensors"
# a run folder being resumed may come from elsewhere: what it holds is read through the door, each file bounded
STATE_CAP = 16 << 20  # trainer.json (a few kB: the optimizer's param groups, the Python RNG's 625 numbers)
LOADER_STATE_CAP = 64 << 20  # one loader.rankN.json (its bitmap of consumed entries: ~1 bit an entry, compressed)
RNG_CAP = 1 << 20  # one rankN.safetensors (the torch and numpy RNG states: ~10 kB)


# ---------------------------------------------------------------------------------------------- the drafter of a run


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


def read_drafter_config(path: str | os.PathLike) -> tuple[DrafterConfig, dict[str, Any]]:
    """(config, this project's metadata) of a drafter directory, a checkpoint or a run's OUT (either format)."""
    return read_config(resolve_drafter_dir(path))


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
    check_tensors(cfg, file_shapes(file), str(file))  # names and shapes from the header, before any byte of data
    tensors = load_tensors(file, weights_bound(cfg))
    check_tensors(cfg, tensors, str(file))
    check_weights(tensors, file, is_master=file.name == MASTER)  # dtype and values: an all-NaN drafter goes no further
    return tensors


def load_tensors(file: Path, bound: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A safetensors file of a drafter or checkpoint, through the door (``tensorfiles.load_beneath``)."""
    return load_beneath(file.parent, file.name, bound=bound, device=device)


def export_drafter(src: str | os.PathLike, out: str | os.PathLike, best: bool = False) -> Path:
    """``hsstore export-drafter``: any drafter directory, checkpoint or run (either format) into a new drafter
    directory in the DFlash format; with ``best``, a run's checkpoint with the best validation tau (the one
    OUT/checkpoints/best names) rather than its last step. ``out`` must be new, empty, or a drafter an earlier
    export wrote (only its files: replaced whole); anything else is refused, nothing written."""
    out = Path(out)
    earlier = out.is_dir() and not out.is_symlink() and written_by_hsstore(out)
    if out.exists() and not earlier and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory nor a drafter export-drafter wrote; "
                              "choose a new OUT (nothing was written)")
    src_dir = resolve_drafter_dir(best_pointer(src) if best else src)
    cfg, meta = read_drafter_config(src_dir)
    tensors = read_weights(src_dir, cfg)
    tmp = out.parent / f".tmp-{out.name}"
    sinks.remove_tree(out.parent, tmp.name)  # a link there is removed itself, never followed
    write_drafter(tmp, cfg, tensors, meta)
    if earlier:  # the earlier export set aside, the new one in its place, then the old one removed
        old = out.parent / f".old-{out.name}-{random.getrandbits(32):08x}"
        os.replace(out, old)
        os.replace(tmp, out)
        sinks.remove_tree(out.parent, old.name)
        log.info("exported %s -> %s (replacing the drafter exported there before)", src_dir, out)
        return out
    os.replace(tmp, out)  # onto nothing or an empty directory
    log.info("exported %s -> %s", src_dir, out)
    return out


def best_pointer(run: str | os.PathLike) -> Path:
    """A run's OUT/checkpoints/best (or that file itself), refused in one line where the run has none."""
    run = Path(run)
    path = run if run.is_file() and run.name == BEST else best_path(run)
    if not door.is_file_beneath(path.parent, path.name):
        raise FileNotFoundError(f"{run} has no {CKPT_DIR}/{BEST} (a run trained with --val-store has one: it names "
                                "the checkpoint with the best val_tau); without --best its last step is exported")
    return path


def resolve_drafter_dir(path: str | os.PathLike) -> Path:
    """A drafter directory itself, OUT/drafter of a finished run, or else OUT's latest checkpoint."""
    path = Path(path)
    if path.is_file() and path.name == BEST:  # OUT/checkpoints/best: the checkpoint it names
        target = path.parent / read_pointer(path)["checkpoint"]
        if not _is_drafter(path.parent, target.name, CONFIG):
            raise FileNotFoundError(f"{path} names {target.name}, which is not there (removed?)")
        return target
    for rel in ("", DRAFTER_DIR):
        if _is_drafter(path, rel, CONFIG, WEIGHTS):
            return path / rel if rel else path
    latest = latest_checkpoint(path)
    if latest is not None:
        return latest
    raise FileNotFoundError(f"no drafter in {path} (expected {CONFIG} + {WEIGHTS}, "
                            f"{DRAFTER_DIR}/ or {CKPT_DIR}/step_*/)")


# ---------------------------------------------------------------------------------------------- optimizer, RNG


def _is_drafter(root: Path, rel: str, *names: str) -> bool:
    """Whether folder ``rel`` below ``root`` holds ``names`` (as anything: a link or a FIFO there is refused when
    read, naming it); the folder itself refused (``door.Refused``) when it is a link planted below ``root``."""
    try:
        folder = door.folder_beneath(root, rel, where=str(root))
    except (FileNotFoundError, NotADirectoryError):
        return False
    except door.Refused as e:
        raise ValueError(str(e)) from None
    return all(door.is_file_beneath(folder, n) for n in names)


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
    """OUT's published checkpoints, oldest first; a link planted among them (or as ``checkpoints/``) is refused,
    never followed: a resumed run reads only what is its own."""
    try:
        root = Path(door.folder_beneath(out, CKPT_DIR, where=str(out)))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except door.Refused as e:
        raise ValueError(str(e)) from None
    found = []
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        if not m:
            continue
        if (root / name).is_symlink():
            raise ValueError(f"{root / name}: a symbolic link (links in a run folder are never followed: remove it, "
                             "or give another --out)")
        if (root / name).is_dir() and door.is_file_beneath(root / name, TRAINER):
            found.append((int(m.group(1)), root / name))
    return [p for _, p in sorted(found)]


def latest_checkpoint(out: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(out)
    return ckpts[-1] if ckpts else None


def staging_dir(out: str | os.PathLike, step: int) -> Path:
    return Path(out) / CKPT_DIR / f".tmp-step_{step:08d}"


def make_staging(out: Path, step: int) -> Path:
    """A fresh, empty staging folder of step ``step`` (whatever was at its name removed, a link itself rather than
    what it names), made beneath OUT without following a link."""
    tmp = staging_dir(out, step)
    rel = f"{CKPT_DIR}/{tmp.name}"
    sinks.remove_tree(out, rel)
    os.close(sinks.open_folder(out, rel, what=f"checkpoint of step {step}"))
    return tmp


def _write_json(folder: Path, name: str, value: Any, **dumps) -> None:
    sinks.write_atomic(folder, name, json.dumps(value, **dumps).encode(), what=f"writing {folder / name}",
                       durable=False)


def write_rank_files(tmp: Path, rank: int, loader_state: dict[str, Any] | None, device: torch.device) -> None:
    """What every rank writes into the staging directory: its loader position and RNG states."""
    save_safetensors(rng_tensors(device), tmp / f"rank{rank:05d}.safetensors")
    _write_json(tmp, f"loader.rank{rank:05d}.json", loader_state)


def write_main_files(tmp: Path, model: DFlashDrafter, opt: torch.optim.Optimizer, sched, *, step: int,
                     epoch: int, config: dict[str, Any], world: list[int], extra: dict[str, Any]) -> None:
    """What rank 0 writes: drafter, fp32 master weights, optimizer, and ``trainer.json`` last (its presence
    marks the rest)."""
    save_drafter(tmp, model, extra)
    save_safetensors({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, tmp / MASTER,
                     metadata={"format": "pt"})
    tensors, opt_meta = optimizer_to_safetensors(opt)
    save_safetensors(tensors, tmp / OPTIMIZER)
    state = {"step": step, "epoch": epoch, "world": world, "scheduler": sched.state_dict(), "optimizer": opt_meta,
             "config": config, "python_rng": python_rng()}
    _write_json(tmp, TRAINER, state)


def publish(tmp: Path, final: Path, keep: int, best: dict[str, Any] | None = None) -> None:
    """Rename the staging directory into place, point ``best`` at it when given (its validation metrics), and
    drop all but the newest ``keep`` checkpoints, never the best one. Every name is handled beneath OUT without
    following a link: a link planted at a checkpoint's name is removed itself, never what it names."""
    out = final.parent.parent
    sinks.remove_tree(out, f"{CKPT_DIR}/{final.name}")
    ck = sinks.open_folder(out, CKPT_DIR, create=False, what=f"publishing {final}")
    try:
        os.replace(tmp.name, final.name, src_dir_fd=ck, dst_dir_fd=ck)
    finally:
        os.close(ck)
    log.info("saved %s", final)
    if best is not None:
        write_best(out, final.name, best)
    pointer = read_best(out)
    for old in list_checkpoints(out)[:-keep] if keep > 0 else []:
        if pointer is None or old.name != pointer["checkpoint"]:
            sinks.remove_tree(out, f"{CKPT_DIR}/{old.name}")


def save_final_drafter(out: Path, model: DFlashDrafter, extra: dict[str, Any]) -> Path:
    """OUT/drafter: written into a fresh staging folder, then put in place of what was there (a link at its name
    removed itself, never written through)."""
    tmp = f".tmp-{DRAFTER_DIR}"
    sinks.remove_tree(out, tmp)
    os.close(sinks.open_folder(out, tmp, what=f"writing {out / DRAFTER_DIR}"))
    save_drafter(out / tmp, model, extra)
    sinks.remove_tree(out, DRAFTER_DIR)
    fd = sinks.open_folder(out, what=f"writing {out / DRAFTER_DIR}")
    try:
        os.replace(tmp, DRAFTER_DIR, src_dir_fd=fd, dst_dir_fd=fd)
    finally:
        os.close(fd)
    return out / DRAFTER_DIR


def best_path(out: str | os.PathLike) -> Path:
    return Path(out) / CKPT_DIR / BEST


def write_best(out: str | os.PathLike, checkpoint: str, metrics: dict[str, Any]) -> None:
    """OUT/checkpoints/best: a small JSON file naming the checkpoint with the best validation tau (a file, not
    a link: it works the same on object stores and on file systems without links)."""
    data = json.dumps({"format": BEST_FORMAT, "checkpoint": checkpoint, **metrics}, indent=2) + "\n"
    sinks.write_atomic(out, f"{CKPT_DIR}/{BEST}", data.encode(), what=f"writing {best_path(out)}")
    log.info("best checkpoint (val_tau %.4f): %s", metrics.get("val_tau", float("nan")), checkpoint)


def read_best(out: str | os.PathLike) -> dict[str, Any] | None:
    """The best pointer of a run (None when it has none); refuses one that names anything but a sibling
    ``step_N`` directory."""
    path = best_path(out)
    if not door.is_file_beneath(path.parent, BEST):
        return None
    try:
        door.folder_beneath(out, CKPT_DIR, where=str(out))
    except door.Refused as e:
        raise ValueError(str(e)) from None
    return read_pointer(path)


def read_pointer(path: Path) -> dict[str, Any]:
    try:
        d = door.read_json_beneath(path.parent, path.name, bound=door.JSON_CAP)
    except ValueError as e:
        if "refused" in str(e):
            raise
        raise ValueError(f"{path}: not a best-checkpoint pointer (JSON with format {BEST_FORMAT!r})") from None
    if not isinstance(d, dict) or d.get("format") != BEST_FORMAT or not _STEP_RE.match(str(d.get("checkpoint"))):
        raise ValueError(f"{path}: not a best-checkpoint pointer (format {BEST_FORMAT!r}, checkpoint step_N)")
    return {"format": BEST_FORMAT, "checkpoint": d["checkpoint"], **metrics_row(d, str(path), needs_step=False)}


def read_trainer_state(path: Path) -> dict[str, Any]:
    """A checkpoint's trainer.json, through the door and checked field by field: a forged one is one line naming
    it, never a traceback later."""
    d = door.read_json_beneath(path, TRAINER, bound=STATE_CAP)
    where = str(path / TRAINER)

    def bad(why: str):
        raise ValueError(f"{where}: not a trainer state of this project ({why})")

    if not isinstance(d, dict):
        bad(f"a JSON {type(d).__name__}, not an object")
    for key in ("step", "epoch"):
        v = d.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 53:
            bad(f"{key} {v!r} is not a count")
    named = _STEP_RE.match(path.name)
    if named and int(named.group(1)) != d["step"]:  # resumed, it would train steps again or skip them
        bad(f"step {d['step']} in the folder of step {int(named.group(1))}")
    w = d.get("world")
    if not (isinstance(w, list) and len(w) == 2 and all(type(x) is int and 0 <= x < 1 << 20 for x in w)):
        bad(f"world {w!r} is not [ranks, workers]")
    for key in ("scheduler", "optimizer", "config"):
        if not isinstance(d.get(key), dict):
            bad(f"{key} is not an object")
    if not isinstance(d["optimizer"].get("param_groups"), list) or not isinstance(d["optimizer"].get("scalars"), dict):
        bad("optimizer holds no param_groups list and scalars object")
    rng = d.get("python_rng")
    if not (isinstance(rng, list) and len(rng) == 3 and isinstance(rng[1], list)):
        bad("python_rng is not [version, state, gauss]")
    return d


def _same_keys(saved: dict[str, Any], ours: dict[str, Any], what: str, where: str) -> None:
    """A state dict from a file has exactly the keys of the live object's, each value of the same kind, lists of the
    same length and kinds (a scheduler's ``load_state_dict`` sets whatever it is given as attributes, and a learning
    rate that is a string fails the first step, mid-run)."""
    def kind(v: Any) -> str:
        return ("number" if isinstance(v, (int, float)) and not isinstance(v, bool) else "list"
                if isinstance(v, (list, tuple)) else type(v).__name__)

    def odd(a: Any, b: Any) -> bool:
        if b is None:
            return False
        if kind(a) != kind(b):
            return True
        if isinstance(b, (list, tuple)):
            return len(a) != len(b) or any(odd(x, y) for x, y in zip(a, b))
        if isinstance(b, dict):
            return set(a) != set(b) or any(odd(a[k], b[k]) for k in b)
        return False

    if set(saved) != set(ours):
        raise ValueError(f"{where}: {what} keys {sorted(saved)[:8]} differ from this run's {sorted(ours)[:8]}")
    wrong = [k for k in ours if odd(saved[k], ours[k])]
    if wrong:
        raise ValueError(f"{where}: {what} entries {wrong[:4]} are not of this run's kind")


def restore(path: Path, model: DFlashDrafter, opt: torch.optim.Optimizer, sched, device: torch.device,
            rank: int) -> dict[str, Any]:
    """Load weights, optimizer, scheduler and this rank's RNG from a checkpoint; returns trainer.json. Every file
    comes through the door, bounded by what this run's drafter holds; anything that does not fit the run is one
    ``ValueError`` naming the checkpoint."""
    state = read_trainer_state(path)
    where = str(path)
    master = path / MASTER if door.is_file_beneath(path, MASTER) else path / WEIGHTS  # legacy: fp32 model.safetensors
    bound = weights_bound(model.config)
    weights = load_tensors(master, bound, device=str(device))
    check_weights(weights, master, is_master=master.name == MASTER)
    moments = load_tensors(path / OPTIMIZER, 2 * bound + RNG_CAP)
    rng_file = path / f"rank{rank:05d}.safetensors"
    rng = load_tensors(rng_file, RNG_CAP) if door.is_file_beneath(path, rng_file.name) else None
    _same_keys(state["scheduler"], sched.state_dict(), "scheduler", f"{where}/{TRAINER}")
    try:
        check_tensors(model.config, weights, str(master))
        model.load_state_dict(weights, strict=True)
        saved = optimizer_from_safetensors(moments, state["optimizer"])
        opt.load_state_dict({**saved, "param_groups": regrouped(saved["param_groups"], model, opt)})
        check_moments(opt, where)
        sched.load_state_dict(state["scheduler"])
        set_python_rng(state["python_rng"])
        if rng is not None:
            set_rng(rng, device)
    except (KeyError, TypeError, IndexError, AttributeError, RuntimeError, OverflowError, ValueError) as e:
        raise ValueError(f"{where}: its optimizer, scheduler or RNG state does not fit this run "
                         f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})") from None
    return state


def check_moments(opt: torch.optim.Optimizer, where: str) -> None:
    """Every optimizer state tensor loaded has its parameter's shape (or is a scalar): ``load_state_dict`` does not
    check, and a forged moment would fail the first step, mid-run."""
    for group in opt.param_groups:
        for p in group["params"]:
            for name, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.ndim and v.shape != p.shape:
                    raise ValueError(f"{where}/{OPTIMIZER}: {name} of shape {tuple(v.shape)} for a parameter of "
                                     f"{tuple(p.shape)}")


_LOADER_RE = re.compile(r"^loader\.rank(\d{1,9})\.json$")


def loader_states(path: Path) -> dict[int, dict[str, Any]]:
    """Every rank's saved loader state, by rank (each file through the door, bounded)."""
    out = {}
    for name in sorted(os.listdir(path)):
        m = _LOADER_RE.match(name)
        if m:
            state = door.read_json_beneath(path, name, bound=LOADER_STATE_CAP)
            if state is not None and not isinstance(state, dict):
                raise LoaderStateError(f"{path / name}: not a loader state (a JSON {type(state).__name__})")
            out[int(m.group(1))] = state
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
            with checkpoint_errors(tmp, step):
                make_staging(self.out, step)
        if world > 1:
            dist.barrier()
        with checkpoint_errors(tmp, step):
            write_rank_files(tmp, rank, loader_state, self.device)
        if world > 1:
            dist.barrier()
        gather_for_save(self.opt)  # every rank: a sharded optimizer's shares to rank 0, which writes them all
        if rank == 0:
            with checkpoint_errors(tmp, step):
                write_main_files(tmp, self.drafter, self.opt, self.sched, step=step, epoch=epoch,
                                 config=self.config_json, world=[world, self.settings.data.workers], extra=self.extra)
                publish(tmp, final, self.settings.output.keep, best)
        if world > 1:
            dist.barrier()

    def resume_at(self, point: Path | None, source) -> tuple[int, int, ResumeRecord | None]:
        """(step, epoch, the resume as recorded) to continue from checkpoint ``point`` (``resume_point``);
        (0, 0, None) without one."""
        if point is None:
            return 0, 0, None
        step, epoch, changed = resume(point, self.settings, self.drafter, self.opt, self.sched, source, self.device,
                                      self.rank, self.world)
        # the peak lr and weight decay given now, not the checkpoint's, from the first resumed step on
        resume_with(self.opt, self.sched, self.settings.schedule.lr, self.settings.schedule.weight_decay)
        log.info("rank %d: resumed from %s (step %d, epoch %d)", self.rank, point, step, epoch)
        return step, epoch, ResumeRecord(step, os.path.abspath(point), changed)


def resume_point(out: Path, settings: TrainSettings) -> Path | None:
    """The checkpoint this run continues from: ``--resume-from``'s (a checkpoint folder, or a run's
    ``checkpoints/best``), else OUT's latest unless ``--no-resume``; None: it starts at step 0. A checkpoint of
    OUT with later ones beside it, or one of another run while OUT holds checkpoints of its own, is refused: the run
    would overwrite them as it goes (a new --out branches from it)."""
    asked = settings.output.resume_from
    if asked is None:
        return latest_checkpoint(out) if settings.output.resume else None
    point = Path(asked)
    if point.is_file() and point.name == BEST:
        point = resolve_drafter_dir(point)
    if not (point.is_dir() and door.is_file_beneath(point, TRAINER)):
        raise FileNotFoundError(f"--resume-from {asked}: not a checkpoint (a folder such as OUT/{CKPT_DIR}/step_N "
                                f"holding {TRAINER}, or OUT/{CKPT_DIR}/{BEST})")
    step = read_trainer_state(point)["step"]
    own = list_checkpoints(out)
    mine = point.resolve().parent == (out / CKPT_DIR).resolve()
    later = [p.name for p in own if int(_STEP_RE.match(p.name).group(1)) > step] if mine else [p.name for p in own]
    if later:
        why = f"holds later checkpoints ({', '.join(later[:3])})" if mine else f"holds a run of its own ({later[-1]})"
        raise FileExistsError(f"--resume-from {asked}: {out} {why}, which this run would overwrite; give a new --out "
                              f"to branch from step {step} (nothing was changed)")
    return point


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
        # freeing space helps a full disk only (weights gone non-finite come back at the same step on a resume)
        then = " (free space, then run the same command again to resume)" if full else ""
        raise OSError(errno.ENOSPC if full else errno.EIO,
                      f"checkpoint of step {step} could not be written to {tmp}: {why}; the checkpoints published "
                      f"before are kept{then}") from e


def _length(steps: int | None, epochs: float | None) -> str:
    return f"--steps {steps}" if steps is not None else f"--epochs {epochs}" if epochs is not None else "the default"


def changed_settings(recorded: dict[str, Any], now: dict[str, Any]) -> dict[str, list[Any]]:
    """{key: [recorded, now]} of the settings a resumed run may change (not ``RESUME_KEYS``, not what every segment
    gives anew: ``SEGMENT_KEYS``) that differ from those its checkpoint was saved with; a key the checkpoint does
    not record is compared with what a run did before it existed (``LEGACY_VALUES``)."""
    out = {}
    for key, value in now.items():
        if key in RESUME_KEYS or key in SEGMENT_KEYS or (key not in recorded and key not in LEGACY_VALUES):
            continue
        before = recorded.get(key, LEGACY_VALUES.get(key))
        if before != value:
            out[key] = [before, value]
    return out


def resume(path: Path, settings: TrainSettings, drafter, opt, sched, source, device, rank: int, world: int):
    """Restore from ``path``; returns (step, epoch, the settings changed). Refuses settings that would not continue
    the same run, and names the others that differ from the checkpoint's (they apply from here)."""
    saved = read_trainer_state(path)
    now = recordable_config(settings)  # as it was saved
    try:
        recorded = saved_config(saved["config"])  # by today's names (max_tokens: token_budget)
        before = {k: recorded.get(k, LEGACY_RESUME_VALUES.get(k)) for k in RESUME_KEYS}
        for key in ("store", "val_store"):  # runs recorded before paths were absolute: as if started from here
            if key in before and before[key]:
                before[key] = recordable_stores(before[key])
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"{path / TRAINER}: its config is not a run's settings ({type(e).__name__}: "
                         f"{str(e)[:200]})") from None
    diffs = [f"{k}: {before[k]!r} -> {now[k]!r}" for k in RESUME_KEYS if before[k] != now[k]]
    saved_cfg, _ = read_drafter_config(path)
    mine = dataclasses.replace(drafter.config, attn_impl=saved_cfg.attn_impl)
    diffs += [f"drafter {f.name}: {getattr(saved_cfg, f.name)!r} -> {getattr(mine, f.name)!r}"
              for f in dataclasses.fields(mine) if getattr(saved_cfg, f.name) != getattr(mine, f.name)]
    if diffs:
        raise ValueError(f"{settings.run.out} holds a run with other settings ({'; '.join(diffs)}): use another "
                         "--out, or --no-resume to start over")
    length, run = {k: recorded.get(k) for k in ("steps", "epochs")}, settings.run
    if rank == 0 and length != {"steps": run.steps, "epochs": run.epochs}:  # allowed, but never silent
        log.warning("resuming %s with another length: %s before, %s now (the learning-rate schedule follows the "
                    "new length from here)", path, _length(**length), _length(run.steps, run.epochs))
    changed = changed_settings(recorded, now)
    if rank == 0 and changed:  # allowed, but never silent
        log.warning("resuming %s with settings other than the checkpoint's: %s (they apply from here; "
                    "OUT/resumes.jsonl records each resume's settings)", path,
                    ", ".join(f"{k} {a!r:.80} -> {b!r:.80}" for k, (a, b) in changed.items()))
    state = restore(path, drafter, opt, sched, device, rank)
    states = loader_states(path)
    try:
        if saved["world"] == [world, settings.data.workers] and rank in states:
            if states[rank] is not None:
                source.load_state_dict(states[rank])
        elif any(s is not None for s in states.values()):
            log.info("resuming a run of %s rank(s) x workers on %d x %d: re-cutting the rest of the epoch",
                     saved["world"], world, settings.data.workers)
            source.load_merged([s for s in states.values() if s is not None])
    except LoaderStateError as e:  # said of the files it came from
        raise LoaderStateError(f"{path}/loader.rank*.json: {e}") from None
    return int(state["step"]), int(state["epoch"]), changed


# names that lived here before the drafter directory's format got its own module: they keep working, with a
# warning, for a release (the ones this module imports, e.g. write_drafter, import as before)
