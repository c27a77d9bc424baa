"""``hsstore import``: the peers' one-file-per-sample hidden states -> a store.

Two layouts are read (docs/FORMAT.md, "Importing"):

* **SpecForge** -- a folder of ``torch.save`` files (``.ckpt``, optionally gzip-compressed), one per sample,
  each a dict with ``input_ids`` [T], ``loss_mask`` [T] and the tapped layers' features under exactly one
  of ``hidden_states`` / ``aux_hidden_state`` / ``aux_hidden_states``, shaped [T, L, H] or, concatenated
  along the hidden dim, [T, L*H] (a leading batch dim of 1 is accepted). ``hidden_state`` / ``target``
  (the final layer's output an EAGLE-3 trainer uses as target) is not a tapped layer and is ignored.
  Files are opened with ``torch.load(weights_only=True)`` only: a file that needs real unpickling is refused.
* **speculators** -- an Arrow dataset (``datasets.save_to_disk`` or plain ``.arrow``) with ``input_ids`` and
  ``loss_mask`` per row, and ``hidden_states/hs_{i}.safetensors`` for row ``i`` holding ``hidden_states``
  [T, L, H] (and ``token_ids``, checked against the row when present).

The peers' files record neither the model, the tokenizer nor the tapped layers, so the identity comes
from the command line: ``--model DIR`` hashes a local model's config and tokenizer exactly as ``extract``
does (no weights are loaded), or the hashes are given as flags. Every sample goes through
:class:`StoreWriter` (shape, dtype and NaN checks); a bad file stops the import naming the file, before the
shard holding it is committed. Re-running resumes: sample ids already committed are skipped.
"""

from __future__ import annotations

import gzip
import io
import logging
import pickle
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsstore import Manifest, StoreWriter, TargetIdentity, TokenizerIdentity
from hsstore.errors import SampleError
from hsstore.reader import committed_ids

from .target import identity_from_model_dir

log = logging.getLogger(__name__)

FORMATS = ("specforge", "speculators")
FEATURE_KEYS = ("hidden_states", "aux_hidden_state", "aux_hidden_states")
TARGET_KEYS = ("hidden_state", "target")  # the final layer's output: not a tapped layer, not stored
CKPT_SUFFIXES = (".ckpt", ".ckpt.gz")
HS_DIR = "hidden_states"


@dataclass
class PeerSample:
    sample_id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_states: torch.Tensor  # [T, L, H]
    source: str


@dataclass
class PeerFile:
    """One sample of a peer's layout, not read yet: ``load()`` reads and checks it."""

    sample_id: str
    path: Path
    load: Callable[[], PeerSample] = field(repr=False)


def _as_1d(x: Any, where: str, name: str) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(x)) if not isinstance(x, torch.Tensor) else x
    if t.ndim == 2 and t.shape[0] == 1:  # a batch dim of 1
        t = t[0]
    if t.ndim != 1:
        raise SampleError(f"{where}: '{name}' has shape {tuple(t.shape)}, expected [tokens]")
    return t


def features(x: Any, T: int, n_layers: int, hidden: int, where: str, key: str) -> torch.Tensor:
    """``[T, n_layers, hidden]`` from the peer layouts' shapes: [T, L, H], [T, L*H] (layers concatenated along
    the hidden dim, in tap order), each optionally with a leading batch dim of 1."""
    if not isinstance(x, torch.Tensor):
        raise SampleError(f"{where}: '{key}' is a {type(x).__name__}, expected a tensor")
    want = f"[{T}, {n_layers}, {hidden}] or [{T}, {n_layers * hidden}] (tokens, --layers x --hidden-size)"
    if x.ndim in (3, 4) and x.shape[0] == 1 and tuple(x.shape) != (T, n_layers, hidden):
        x = x[0]
    if x.ndim == 2 and x.shape[1] == n_layers * hidden:
        x = x.reshape(x.shape[0], n_layers, hidden)
    if x.ndim != 3 or tuple(x.shape[1:]) != (n_layers, hidden):
        raise SampleError(f"{where}: '{key}' has shape {tuple(x.shape)}, expected {want}")
    if x.shape[0] != T:
        raise SampleError(f"{where}: '{key}' holds {x.shape[0]} tokens, input_ids has {T}")
    return x


def load_ckpt(path: Path) -> dict:
    """A SpecForge sample file, through ``torch.load(weights_only=True)`` only (gzip allowed)."""
    where = str(path)
    try:
        with open(path, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
        if gzipped:
            obj = torch.load(io.BytesIO(gzip.decompress(path.read_bytes())), map_location="cpu", weights_only=True)
        else:  # mapped: the tensors are copied once, into the writer's shard buffer
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise SampleError(f"{where}: refused by torch.load(weights_only=True): it holds objects other than "
                          f"tensors and plain containers, and is never unpickled here ({first})") from None
    except (RuntimeError, EOFError, OSError, gzip.BadGzipFile, ValueError) as e:
        raise SampleError(f"{where}: not a readable torch.save file ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:200]})") from None
    if not isinstance(obj, dict):
        raise SampleError(f"{where}: holds a {type(obj).__name__}, expected a dict of tensors")
    return obj


def specforge_sample(path: Path, sample_id: str, source: str, n_layers: int, hidden: int) -> PeerSample:
    d, where = load_ckpt(path), str(path)
    missing = [repr(k) for k in ("input_ids", "loss_mask") if k not in d]
    present = [k for k in FEATURE_KEYS if k in d]
    if not present:
        only_target = [k for k in TARGET_KEYS if k in d]
        hint = (f" ('{only_target[0]}' is the final layer's output, not the tapped layers: SpecForge without "
                "aux hidden states)") if only_target else ""
        missing.append(" or ".join(repr(k) for k in FEATURE_KEYS) + hint)
    if missing:
        raise SampleError(f"{where}: missing {', '.join(missing)} (keys present: {sorted(map(str, d))})")
    if len(present) > 1:
        raise SampleError(f"{where}: holds both {present[0]!r} and {present[1]!r}; which are the tapped layers "
                          "is ambiguous")
    ids = _as_1d(d["input_ids"], where, "input_ids")
    mask = _as_1d(d["loss_mask"], where, "loss_mask")
    if mask.shape[0] != ids.shape[0]:
        raise SampleError(f"{where}: loss_mask has {mask.shape[0]} tokens, input_ids has {ids.shape[0]}")
    hs = features(d[present[0]], ids.shape[0], n_layers, hidden, where, present[0])
    return PeerSample(sample_id, ids, mask, hs, source)


def _natural(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]


def specforge_files(root: Path, id_prefix: str, source: str, n_layers: int, hidden: int) -> list[PeerFile]:
    """Every ``.ckpt`` under ``root`` (SpecForge groups them in ``rows_A-B/`` folders), in index order; the
    sample id is the file name without suffix (``data_17``), prefixed."""
    if not root.is_dir():
        raise FileNotFoundError(f"SpecForge input folder not found: {root}")
    paths = sorted((p for p in root.rglob("*") if p.is_file() and p.name.endswith(CKPT_SUFFIXES)), key=_natural)
    if not paths:
        raise ValueError(f"{root}: no {' or '.join(CKPT_SUFFIXES)} files found")
    out, seen = [], {}
    for p in paths:
        sid = id_prefix + p.name.split(".", 1)[0]
        if sid in seen:
            raise ValueError(f"{p} and {seen[sid]} give the same sample id {sid!r}")
        seen[sid] = p
        out.append(PeerFile(sid, p, lambda p=p, sid=sid: specforge_sample(p, sid, source, n_layers, hidden)))
    return out


def speculators_sample(path: Path, sample_id: str, record, n_layers: int, hidden: int, source: str) -> PeerSample:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    where = str(path)
    try:
        d = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise SampleError(f"{where}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if "hidden_states" not in d:
        raise SampleError(f"{where}: missing 'hidden_states' (keys present: {sorted(d)})")
    if "hidden_states_scales" in d:
        raise SampleError(f"{where}: fp8-encoded hidden states (hidden_states_scales) cannot be imported as raw "
                          "features")
    ids = torch.from_numpy(record.input_ids.astype(np.int64))
    mask = torch.from_numpy(record.loss_mask.astype(np.uint8))
    if "token_ids" in d and not torch.equal(d["token_ids"].reshape(-1).to(torch.int64), ids):
        raise SampleError(f"{where}: token_ids differ from input_ids of {record.where} (the file belongs to "
                          "another row or dataset)")
    hs = features(d["hidden_states"], ids.shape[0], n_layers, hidden, where, "hidden_states")
    return PeerSample(sample_id, ids, mask, hs, source or record.source)


def speculators_files(root: Path, hs_dir: Path | None, id_prefix: str, source: str, n_layers: int, hidden: int,
                      missing: list[str]) -> list[PeerFile]:
    """Row ``i`` of the Arrow dataset at ``root`` with ``hs_dir/hs_{i}.safetensors``; the sample id is
    ``hs_{i}``, prefixed. Rows whose file does not exist (generation not finished) are listed in ``missing``."""
    from .readers import TokenRecord, read_records

    hs_dir = hs_dir or root / HS_DIR
    if not hs_dir.is_dir():
        raise FileNotFoundError(f"speculators hidden-state folder not found: {hs_dir}")
    out = []
    for i, rec in enumerate(read_records(root)):
        if not isinstance(rec, TokenRecord):
            raise ValueError(f"{rec.where}: not a pre-tokenized row (needs input_ids and loss_mask)")
        sid, path = f"{id_prefix}hs_{i}", hs_dir / f"hs_{i}.safetensors"
        if not path.exists():
            missing.append(sid)
            continue
        out.append(PeerFile(sid, path, lambda p=path, s=sid, r=rec: speculators_sample(p, s, r, n_layers, hidden,
                                                                                       source)))
    return out


# -- identity --------------------------------------------------------------------------------------------------
def import_manifest(fmt: str, layers: list[int], *, dtype: str = "bfloat16", codec: str = "none",
                    model: str | None = None, model_name: str | None = None, num_layers: int | None = None,
                    hidden_size: int | None = None, config_hash: str | None = None,
                    tokenizer_hash: str | None = None, tokenizer_name: str | None = None,
                    chat_template_hash: str | None = None) -> Manifest:
    """The manifest of an import: identity from a local ``model`` folder (hashed as extract hashes it) or from
    the given values, which the peers' files cannot supply."""
    if model:
        target, tokenizer = identity_from_model_dir(model)
        if hidden_size is not None and hidden_size != target.hidden_size:
            raise ValueError(f"--hidden-size {hidden_size} contradicts {model} (hidden size {target.hidden_size})")
    else:
        need = {"--model-name": model_name, "--num-layers": num_layers, "--hidden-size": hidden_size,
                "--config-hash": config_hash, "--tokenizer-hash": tokenizer_hash}
        absent = [k for k, v in need.items() if v is None]
        if absent:
            raise ValueError(f"give --model DIR, or the identity flags ({', '.join(absent)} missing)")
        target = TargetIdentity(name=model_name, num_layers=num_layers, hidden_size=hidden_size,
                                config_hash=config_hash)
        tokenizer = TokenizerIdentity(name=tokenizer_name or model_name, vocab_hash=tokenizer_hash,
                                      chat_template_hash=chat_template_hash)
    return Manifest(target=target, tokenizer=tokenizer, layers=tuple(layers), dtype=dtype, codec=codec,
                    extra={"imported_from": fmt})


# -- the import ------------------------------------------------------------------------------------------------
@dataclass
class ImportResult:
    samples: int = 0
    tokens: int = 0
    already: int = 0
    missing: int = 0
    bytes_written: int = 0


def import_files(files: list[PeerFile], url: str, manifest: Manifest, *, storage_options: dict | None = None,
                 shard_bytes: int = 1 << 30, missing: list[str] | None = None, progress: bool = True,
                 ) -> ImportResult:
    """Write ``files`` into the store at ``url`` through a StoreWriter, skipping ids already committed. The store
    is created at the first good sample, so an import that fails on its first file leaves nothing behind."""
    from tqdm import tqdm

    options = storage_options or {}
    done = committed_ids(url, options)
    todo = [f for f in files if f.sample_id not in done]
    result = ImportResult(already=len(files) - len(todo), missing=len(missing or []))
    writer: StoreWriter | None = None
    bar = tqdm(total=len(todo), unit="sample", desc="import", disable=not progress)
    try:
        for f in todo:
            s = f.load()
            if writer is None:
                writer = StoreWriter(url, manifest, writer_tag="import", storage_options=options,
                                     shard_bytes=shard_bytes)
                if missing:
                    writer.note_skipped("no_hidden_states", missing)
            writer.add(s.sample_id, s.input_ids, s.loss_mask, s.hidden_states, source=s.source)
            result.samples += 1
            result.tokens += int(s.input_ids.shape[0])
            bar.update(1)
        if writer is not None:
            writer.close()
            result.bytes_written = writer.bytes_written
    except BaseException:
        if writer is not None:
            writer.close(commit=False)
        raise
    finally:
        bar.close()
    return result


def peer_files(fmt: str, path: str, *, n_layers: int, hidden: int, id_prefix: str = "", source: str | None = None,
               hs_dir: str | None = None, missing: list[str] | None = None) -> list[PeerFile]:
    root = Path(path)
    src = source or root.name
    if fmt == "specforge":
        return specforge_files(root, id_prefix, src, n_layers, hidden)
    if fmt == "speculators":
        return speculators_files(root, Path(hs_dir) if hs_dir else None, id_prefix, source or "", n_layers, hidden,
                                 missing if missing is not None else [])
    raise ValueError(f"unknown peer format {fmt!r} (one of {FORMATS})")
