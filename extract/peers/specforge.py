"""SpecForge: its offline hidden-state files, written by ``hsstore export specforge`` and read by ``hsstore import
specforge``, and how it numbers the taps.

* **export** -- what ``scripts/prepare_hidden_states.py`` writes: ``rows_{g}-{g+2000}/data_{i}.ckpt``, one
  ``torch.save`` dict per sample: ``input_ids`` [T] int64, ``loss_mask`` [T] int64, then the layout ``--layout``
  names: ``dflash`` (the default) ``hidden_states`` [1, T, L*H], every tap; ``eagle3`` ``aux_hidden_state``
  [1, T, 3*H], the three taps SpecForge's EAGLE-3 model takes, + ``hidden_state`` [1, T, H], the final-norm output
  (the store must hold ``final_hidden``). No padding (one row per batch). SpecForge's offline DFlash reader
  refuses a sample without two consecutive supervised tokens: such samples are left out, counted, and named in
  the sidecar.
* **import** -- a folder of ``torch.save`` files (``.ckpt``, optionally gzip-compressed), one per sample, each a
  dict with ``input_ids`` [T], ``loss_mask`` [T] and the tapped layers' features under exactly one of
  ``hidden_states`` / ``aux_hidden_state`` / ``aux_hidden_states``, shaped [T, L, H] or, concatenated along the
  hidden dim, [T, L*H] (a leading batch dim of 1 is accepted). ``hidden_state`` (EAGLE-3) /
  ``target_last_hidden_states`` (DSpark), the final-norm output, is kept as the store's ``final_hidden``
  feature. SpecForge right-pads every row to its batch's longest with token 0 and saves no length: the
  trailing padding is trimmed (:func:`trailing_padding`). Files are opened with
  ``torch.load(weights_only=True)`` only: a file that needs real unpickling is refused.
* **layer ids** -- its ``aux_hidden_state_layer_ids`` / ``dflash_config.target_layer_ids`` name layer *outputs*
  as hsstore does (SGLang then captures at ``id + 1``, the residual entering the next layer, the same tensor):
  offset 0. Default EAGLE-3 taps ``[1, N//2 - 1, N - 4]`` (``hsstore.format.serving.specforge_eagle3_ids``).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import uuid
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsstore.errors import SampleError
from hsstore.format.serving import CONSUMERS
from hsstore.io import door
from hsstore.redaction import recordable_url
from hsstore.store.reader import Store

from .base import ExportResult, LayerConvention, PeerFile, PeerSample
from .exporting import SIDECAR, export_plan, out_dir, sidecar, written
from .importing import PAD_TOKEN_ID, SAMPLE_CAP, features, plain_tensor, sample_files

NAME = "specforge"
LAYERS = LayerConvention(0, "specforge (output of decoder layer k, as hsstore; SGLang captures at k+1)")
FILE_GROUP_SIZE = 2000  # SpecForge's default --file-group-size
FEATURE_KEYS = ("hidden_states", "aux_hidden_state", "aux_hidden_states")
# the final-norm output (what the lm_head reads): EAGLE-3's ``hidden_state``, DSpark's ``target_last_hidden_states``
TARGET_KEYS = ("hidden_state", "target_last_hidden_states", "target")
CKPT_SUFFIXES = (".ckpt", ".ckpt.gz")
GZIP_EXPANSION = 16  # a gzip'd sample decompresses to at most this times its size (hidden states: ~1.2x) ...
GZIP_FLOOR = 64 << 20  # ... or this, whichever is larger


def ambiguity(layers: list[int], num_layers: int) -> str | None:
    """SpecForge's ids are hsstore's: a ``--layers`` list cannot be mistaken."""
    return None


# -- layer ids: EAGLE-3's three taps -------------------------------------------------------------------------------
EAGLE3 = CONSUMERS["specforge-eagle3"]  # the registry's SpecForge EAGLE-3: its default taps, and their count
EAGLE3_TAPS = EAGLE3.min_taps  # its model concatenates exactly three target layers (fc takes 3 x hidden)


def eagle3_taps(store_layers: list[int], num_layers: int, chosen: list[int] | None = None,
                ) -> tuple[list[int], str | None]:
    """(the three store layers an EAGLE-3 export feeds SpecForge, a note saying which were chosen, or None).

    ``chosen`` (hsstore ids) must be three of the store's layers. Without it a store of exactly three gives them;
    one of more gives, for each of SpecForge's default capture layers ``[1, N//2 - 1, N - 4]`` in turn, the
    nearest store layer not taken yet (ties: the lower), and the note names them and the flag that chooses
    others."""
    if chosen is not None:
        chosen = list(chosen)
        if len(chosen) != EAGLE3_TAPS or len(set(chosen)) != EAGLE3_TAPS or set(chosen) - set(store_layers):
            raise ValueError(f"--layers {chosen}: EAGLE-3 takes exactly {EAGLE3_TAPS} distinct layers of the store "
                             f"({store_layers})")
        return sorted(chosen), None
    if len(store_layers) < EAGLE3_TAPS:
        raise ValueError(f"the store taps {store_layers}: SpecForge's EAGLE-3 model takes exactly {EAGLE3_TAPS} "
                         "target layers")
    if len(store_layers) == EAGLE3_TAPS:
        return list(store_layers), None
    default = EAGLE3.needs(num_layers)
    taps: list[int] = []
    for d in default:
        taps.append(min((l for l in store_layers if l not in taps), key=lambda l: (abs(l - d), l)))
    taps.sort()
    return taps, (f"EAGLE-3 takes 3 of the store's {len(store_layers)} taps {store_layers}: {taps} (nearest to "
                  f"SpecForge's defaults {default}; --layers A,B,C chooses others); train with "
                  f"aux_hidden_state_layer_ids {taps}")


# -- export ------------------------------------------------------------------------------------------------
SPECFORGE_LAYOUTS = ("dflash", "eagle3")


def consecutive_loss(loss_mask: torch.Tensor) -> bool:
    """Whether two neighbouring tokens are both in the loss: SpecForge's offline DFlash reader refuses a sample
    without (``has_consecutive_supervised_tokens``), as no DFlash anchor fits in it."""
    m = loss_mask.to(torch.bool)
    return bool((m[1:] & m[:-1]).any())


def specforge_taps(store: Store, layout: str, layers: list[int] | None) -> tuple[list[int], str | None]:
    """(the store layers a SpecForge ``layout`` export writes, a note naming a choice made for the user)."""
    m = store.manifest
    if layout not in SPECFORGE_LAYOUTS:
        raise ValueError(f"--layout {layout!r}: SpecForge's layouts are {', '.join(SPECFORGE_LAYOUTS)}")
    if layout == "dflash":
        if layers is not None and list(layers) != list(m.layers):
            raise ValueError("--layers chooses EAGLE-3's three taps; the dflash layout writes every tap of the store "
                             f"({list(m.layers)})")
        return list(m.layers), None
    if "final_hidden" not in m.features:
        raise ValueError(f"store {recordable_url(store.url)!r} holds no final_hidden: SpecForge's EAGLE-3 layout "
                         "needs the final norm's output as its target (extract --final-hidden), or use --layout dflash")
    return eagle3_taps(list(m.layers), m.target.num_layers, layers)


def export(url: str, out: str, *, storage_options: dict | None = None, progress: bool = True,
           layout: str | None = None, layers: list[int] | None = None,
           file_group_size: int = FILE_GROUP_SIZE) -> ExportResult:
    from hsstore.progress import progress_bar

    store = Store(url, storage_options or {})
    store.admit()  # the admission's store-wide rules, before a file is written
    store.check_manifest()
    layout = layout or "dflash"
    taps, chosen = specforge_taps(store, layout, layers)
    pick = [list(store.manifest.layers).index(l) for l in taps]
    root = out_dir(out, export_plan(NAME, store, layout, taps))
    r = ExportResult(layout=layout)
    if chosen:
        r.notes.append(chosen)
    if layout == "dflash" and store.manifest.features:
        r.notes.append("final_hidden not exported: the DFlash layout has no target state (--layout eagle3 writes "
                       "SpecForge's EAGLE-3 one)")
    ids, left_out = [], []
    for item in progress_bar(store, total=len(store), unit="sample", desc="export", disable=not progress):
        T = int(item["input_ids"].shape[0])
        if layout == "dflash" and not consecutive_loss(item["loss_mask"]):
            left_out.append(item["sample_id"])
            continue
        i = len(ids)
        g = i // file_group_size * file_group_size
        sub = root / f"rows_{g}-{g + file_group_size}"
        path = sub / f"data_{i}.ckpt"
        if written(root, f"{sub.name}/{path.name}"):  # an earlier run's
            ids.append(item["sample_id"])
            r.samples, r.tokens, r.already = r.samples + 1, r.tokens + T, r.already + 1
            continue
        hs = item["hidden_states"][:, pick].reshape(1, T, -1)  # taps concatenated along hidden, in tap order
        rec = {"input_ids": item["input_ids"].clone(), "loss_mask": item["loss_mask"].to(torch.int64)}
        if layout == "eagle3":
            rec["aux_hidden_state"] = hs.clone()
            rec["hidden_state"] = item["final_hidden"].reshape(1, T, -1).clone()
        else:
            rec["hidden_states"] = hs.clone()
        sub.mkdir(exist_ok=True)
        tmp = sub / f".{path.name}.{uuid.uuid4().hex[:8]}"
        torch.save(rec, tmp)  # SpecForge counts an existing file as done: never leave a partial one at the name
        os.replace(tmp, path)
        ids.append(item["sample_id"])
        r.samples += 1
        r.tokens += T
        r.bytes_written += path.stat().st_size
    if left_out:
        shown = ", ".join(left_out[:5]) + (f", ... ({len(left_out) - 5} more)" if len(left_out) > 5 else "")
        r.notes.append(f"{len(left_out)} samples left out: no two consecutive loss tokens, which SpecForge's offline "
                       f"DFlash reader refuses ({shown}; all listed in {SIDECAR})")
    r.skipped = len(left_out)
    sidecar(root, NAME, LAYERS, store, layout, taps, ids,
            {"file_group_size": file_group_size, "skipped": {"no_consecutive_loss": left_out}},
            features=tuple(store.manifest.features) if layout == "eagle3" else ())
    return r



# -- import ------------------------------------------------------------------------------------------------
def _as_1d(x: Any, where: str, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = plain_tensor(x, where, name)
    else:  # a list of ints (torch.load gives back what was saved): anything else is no token column
        try:
            t = torch.as_tensor(np.asarray(x))
        except (TypeError, ValueError, OverflowError, RuntimeError):
            raise SampleError(f"{where}: '{name}' is a {type(x).__name__} that is no list of integers") from None
    if t.ndim == 2 and t.shape[0] == 1:  # a batch dim of 1
        t = t[0]
    if t.ndim != 1:
        raise SampleError(f"{where}: '{name}' has shape {tuple(t.shape)}, expected [tokens]")
    return t


def gunzip_bounded(data: bytes, where: str) -> bytes:
    """gzip ``data`` decompressed, refused past ``GZIP_EXPANSION`` times its size (or ``GZIP_FLOOR``): a few MB of
    gzip can expand to gigabytes."""
    bound = max(GZIP_FLOOR, GZIP_EXPANSION * len(data))
    z = zlib.decompressobj(wbits=31)
    try:
        out = z.decompress(data, bound + 1)
    except zlib.error as e:
        raise SampleError(f"{where}: not a readable gzip file ({e})") from None
    if len(out) > bound or z.unconsumed_tail:
        raise SampleError(f"{where}: refused (gzip expanding past {bound:,} bytes, {GZIP_EXPANSION}x its "
                          f"{len(data):,}; a sample's hidden states compress ~1.2x)")
    if not z.eof:
        raise SampleError(f"{where}: not a readable gzip file (it ends early)")
    return out


def stored_only(archive: Any, where: str) -> None:
    """Refuse a torch.save zip archive (a path or a file object; anything else passes) holding a compressed entry:
    torch.save writes every entry stored, torch.load with ``mmap`` reads a compressed one's bytes as the tensor's
    values (features of garbage that may well be finite), and without it inflates an entry to whatever size its
    pickle declares, however small the file."""
    if not zipfile.is_zipfile(archive):
        return
    if hasattr(archive, "seek"):
        archive.seek(0)
    try:
        with zipfile.ZipFile(archive) as z:
            packed = [i.filename for i in z.infolist() if i.compress_type != zipfile.ZIP_STORED]
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise SampleError(f"{where}: not a readable torch.save file ({e})") from None
    finally:
        if hasattr(archive, "seek"):
            archive.seek(0)
    if packed:
        raise SampleError(f"{where}: refused (compressed zip entries such as {packed[0]!r}: torch.save stores "
                          "them uncompressed, and a compressed one is not read as its values; gzip the whole file "
                          "instead)")


def load_ckpt(path: Path, root: Path | None = None) -> dict:
    """A SpecForge sample file, through ``torch.load(weights_only=True)`` only (gzip allowed, bounded), opened
    through the door beneath ``root`` (the folder imported; default its own folder): a link, FIFO or device is
    refused, never read."""
    where = str(path)
    root = root if root is not None else path.parent
    try:
        with door.opened(str(root), path.relative_to(root).as_posix(), bound=SAMPLE_CAP, where=str(root)) as (fd, n):
            gzipped = os.pread(fd, 2, 0) == b"\x1f\x8b"
            proc = f"/proc/self/fd/{fd}"
            name = proc if os.path.exists(proc) else str(path)
            with warnings.catch_warnings():  # torch's notes on what it refuses are not this command's output
                warnings.simplefilter("ignore")
                if gzipped:
                    data = door.read_beneath(root, path.relative_to(root).as_posix(), bound=n, where=str(root))
                    inner = io.BytesIO(gunzip_bounded(data, where))
                    stored_only(inner, where)
                    obj = torch.load(inner, map_location="cpu", weights_only=True)
                else:  # mapped: the tensors are copied once, into the writer's shard buffer
                    mapped = zipfile.is_zipfile(name)
                    if mapped:
                        stored_only(name, where)
                    obj = torch.load(name, map_location="cpu", weights_only=True, mmap=mapped)
    except door.Refused as e:
        raise SampleError(str(e)) from None
    except SampleError:
        raise
    except pickle.UnpicklingError as e:  # (torch's own advice, to load it with weights_only=False, left out)
        found = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln), "")[:200]
        raise SampleError(f"{where}: refused by torch.load(weights_only=True): it holds objects other than "
                          f"tensors and plain containers, and is never unpickled here"
                          + (f" ({found})" if found else "")) from None
    except Exception as e:  # noqa: BLE001 (a damaged zip or pickle raises whatever its parser raises: one line)
        raise SampleError(f"{where}: not a readable torch.save file ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:200]})") from None
    if not isinstance(obj, dict):
        raise SampleError(f"{where}: holds a {type(obj).__name__}, expected a dict of tensors")
    return obj



def trailing_padding(ids: torch.Tensor, mask: torch.Tensor, pad_id: int, where: str) -> tuple[int, str | None]:
    """(tokens of trailing batch padding, why they may be real or None) of a SpecForge row.

    SpecForge's collator right-pads input_ids and loss_mask with zeros to the batch's longest row, the padded
    row runs through the target as it is, and no length is saved. Padding is the longest tail of tokens equal
    to ``pad_id`` with loss_mask 0 (a token in the loss is real). That is exact unless the real row itself
    ended in such tokens, which SpecForge's own data prep makes unlikely: the last assistant span runs to the
    end of the text with loss_mask 1. A row whose kept part ends outside the loss mask (truncated, or no
    final assistant turn) has no such anchor: its padding is trimmed all the same and the row is named."""
    is_pad = (ids == pad_id) & (mask == 0)
    real = torch.nonzero(~is_pad).reshape(-1)
    if real.numel() == 0:
        raise SampleError(f"{where}: every token is padding (token {pad_id} with loss_mask 0)")
    n = int(ids.shape[0]) - (int(real[-1]) + 1)
    if n and int(mask[-n - 1]) == 0:
        return n, (f"the {ids.shape[0] - n} tokens before its {n} pad tokens end outside the loss mask, so real "
                   f"trailing tokens equal to {pad_id} cannot be told from padding")
    return n, None


def _final_hidden(x: Any, T: int, hidden: int, where: str, key: str) -> torch.Tensor:
    """``[T, H]`` from [T, H] or [1, T, H]."""
    x = plain_tensor(x, where, key)
    if x.ndim == 3 and x.shape[0] == 1:
        x = x[0]
    if x.ndim != 2 or tuple(x.shape) != (T, hidden):
        raise SampleError(f"{where}: '{key}' (the final-norm output) has shape {tuple(x.shape)}, expected "
                          f"[{T}, {hidden}] or [1, {T}, {hidden}]")
    return x


def specforge_sample(path: Path, sample_id: str, source: str, n_layers: int, hidden: int, *,
                     pad_id: int | None = PAD_TOKEN_ID, final_hidden: bool = False,
                     root: Path | None = None) -> PeerSample:
    """One SpecForge file; ``pad_id`` None keeps trailing padding; ``final_hidden`` requires and keeps the
    final-norm output."""
    d, where = load_ckpt(path, root), str(path)
    missing = [repr(k) for k in ("input_ids", "loss_mask") if k not in d]
    present = [k for k in FEATURE_KEYS if k in d]
    targets = [k for k in TARGET_KEYS if k in d]
    if not present:
        hint = (f" ('{targets[0]}' is the final-norm output, not the tapped layers: SpecForge without "
                "aux hidden states)") if targets else ""
        missing.append(" or ".join(repr(k) for k in FEATURE_KEYS) + hint)
    if final_hidden and not targets:
        missing.append(" or ".join(repr(k) for k in TARGET_KEYS[:2]) + " (the final-norm output: the store holds "
                       "final_hidden)")
    if missing:
        raise SampleError(f"{where}: missing {', '.join(missing)} (keys present: {sorted(map(str, d))})")
    if len(present) > 1:
        raise SampleError(f"{where}: holds both {present[0]!r} and {present[1]!r}; which are the tapped layers "
                          "is ambiguous")
    ids = _as_1d(d["input_ids"], where, "input_ids")
    mask = _as_1d(d["loss_mask"], where, "loss_mask")
    if mask.shape[0] != ids.shape[0]:
        raise SampleError(f"{where}: loss_mask has {mask.shape[0]} tokens, input_ids has {ids.shape[0]}")
    T = ids.shape[0]
    hs = features(d[present[0]], T, n_layers, hidden, where, present[0])
    fh = _final_hidden(d[targets[0]], T, hidden, where, targets[0]) if final_hidden else None
    n_pad, why = trailing_padding(ids, mask, pad_id, where) if pad_id is not None else (0, None)
    if n_pad:
        keep = T - n_pad
        ids, mask, hs = ids[:keep], mask[:keep], hs[:keep]
        fh = fh[:keep] if fh is not None else None
    return PeerSample(sample_id, ids, mask, hs, source, final_hidden=fh, pad_tokens=n_pad, pad_ambiguous=why)



def specforge_files(root: Path, id_prefix: str, source: str, n_layers: int, hidden: int, *,
                    pad_id: int | None = PAD_TOKEN_ID, final_hidden: bool = False, num_rows: int | None = None,
                    missing: list[str] | None = None, ids: list[str] | None = None) -> list[PeerFile]:
    """Every ``.ckpt`` under ``root`` (SpecForge groups them in ``rows_A-B/`` folders), in index order; the
    sample id is the file name without suffix (``data_17``), prefixed.

    SpecForge writes no file for a row with a NaN feature, nor for the rows of the last partial batch
    (``drop_last``); a ``data_{i}`` missing below the largest index found (or below ``num_rows``, the input
    dataset's row count, when given) is listed in ``missing`` by the id it would have had."""
    if not root.is_dir():
        raise FileNotFoundError(f"SpecForge input folder not found: {root}")
    paths = sample_files(root, CKPT_SUFFIXES)
    if not paths:
        raise ValueError(f"{root}: no {' or '.join(CKPT_SUFFIXES)} files found")
    out, seen, indices = [], {}, set()
    for p in paths:
        stem = p.name.split(".", 1)[0]
        m = re.fullmatch(r"data_(\d+)", stem)
        sid = id_prefix + (ids[int(m.group(1))] if ids is not None and m and int(m.group(1)) < len(ids) else stem)
        if sid in seen:
            raise ValueError(f"{p} and {seen[sid]} give the same sample id {sid!r}")
        seen[sid] = p
        if m:
            indices.add(int(m.group(1)))
        out.append(PeerFile(sid, p, lambda p=p, sid=sid: specforge_sample(p, sid, source, n_layers, hidden,
                                                                          pad_id=pad_id, final_hidden=final_hidden,
                                                                          root=root)))
    if missing is not None and indices:
        end = max(max(indices) + 1, num_rows or 0)
        missing.extend(f"{id_prefix}data_{i}" for i in range(end) if i not in indices)
    return out


def first_file_has_final_hidden(path: Path) -> bool:
    """Whether the first SpecForge file carries the final-norm output (``hidden_state`` and kin)."""
    paths = sample_files(path, CKPT_SUFFIXES)
    return bool(paths) and any(k in load_ckpt(paths[0], path) for k in TARGET_KEYS)


def keeps_final_hidden(root: Path) -> bool:
    return first_file_has_final_hidden(root)


def files(root: Path, *, ids: list[str] | None, id_prefix: str, source: str | None, n_layers: int, hidden: int,
          hs_dir: str | None, missing: list[str], pad_id: int | None, final_hidden: bool,
          num_rows: int | None) -> list[PeerFile]:
    """The protocol's import (``hs_dir`` is speculators'): :func:`specforge_files`, its source the folder's name
    unless given."""
    return specforge_files(root, id_prefix, source or root.name, n_layers, hidden, pad_id=pad_id,
                           final_hidden=final_hidden, num_rows=num_rows, missing=missing, ids=ids)
