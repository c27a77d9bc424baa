"""``hsstore import``: the peers' one-file-per-sample hidden states -> a store.

Two layouts are read (docs/FORMAT.md, "Importing"):

* **SpecForge** -- a folder of ``torch.save`` files (``.ckpt``, optionally gzip-compressed), one per sample,
  each a dict with ``input_ids`` [T], ``loss_mask`` [T] and the tapped layers' features under exactly one
  of ``hidden_states`` / ``aux_hidden_state`` / ``aux_hidden_states``, shaped [T, L, H] or, concatenated
  along the hidden dim, [T, L*H] (a leading batch dim of 1 is accepted). ``hidden_state`` (EAGLE-3) /
  ``target_last_hidden_states`` (DSpark), the final-norm output, is kept as the store's ``final_hidden``
  feature. SpecForge right-pads every row to its batch's longest with token 0 and saves no length: the
  trailing padding is trimmed (:func:`trailing_padding`). Files are opened with
  ``torch.load(weights_only=True)`` only: a file that needs real unpickling is refused.
* **speculators** -- an Arrow dataset (``datasets.save_to_disk`` or plain ``.arrow``) with ``input_ids`` and
  ``loss_mask`` per row, and ``hidden_states/hs_{i}.safetensors`` for row ``i`` holding ``hidden_states``
  [T, L, H] (and ``token_ids``, checked against the row when present). Its slots are vLLM ids (see
  :mod:`.peer_layers`); the last one, vLLM id ``N``, is the last decoder layer's output *before* the final
  norm (speculators' trainer applies the norm itself), so it is stored as layer ``N - 1``, not as
  ``final_hidden``.

The peers' files record neither the model, the tokenizer nor the tapped layers, so the identity comes
from the command line: ``--model DIR`` hashes a local model's config and tokenizer exactly as ``extract``
does (no weights are loaded), or the hashes are given as flags. Every sample goes through
:class:`StoreWriter` (shape, dtype and NaN checks); a bad file stops the import naming the file, before the
shard holding it is committed. Re-running resumes: sample ids already committed are skipped.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import stat
import warnings
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsstore.io import door
from hsstore.format import values
from hsstore.format.manifest import Manifest, TargetIdentity, TokenizerIdentity
from hsstore.io.tensorfiles import load_beneath
from hsstore.store.writer import StoreWriter
from hsstore.errors import SampleError
from hsstore.store.reader import committed_ids, refuse_lookalikes

from .target import identity_from_model_dir

log = logging.getLogger(__name__)

FORMATS = ("specforge", "speculators")
FEATURE_KEYS = ("hidden_states", "aux_hidden_state", "aux_hidden_states")
# the final-norm output (what the lm_head reads): EAGLE-3's ``hidden_state``, DSpark's ``target_last_hidden_states``
TARGET_KEYS = ("hidden_state", "target_last_hidden_states", "target")
PAD_TOKEN_ID = 0  # SpecForge's collator pads input_ids (and loss_mask, attention_mask) with zeros
PAD_AMBIGUOUS = "padding_ambiguous"  # sample flag: trailing pad-id tokens that may be real (see trailing_padding)
CKPT_SUFFIXES = (".ckpt", ".ckpt.gz")
HS_DIR = "hidden_states"
# a peer's folder comes from elsewhere: every file through the door, each bounded
SAMPLE_CAP = 16 << 30  # one sample file (32K tokens x 5 taps x 8192 x bf16 is 2.7 GB)
GZIP_EXPANSION = 16  # a gzip'd sample decompresses to at most this times its size (hidden states: ~1.2x) ...
GZIP_FLOOR = 64 << 20  # ... or this, whichever is larger


@dataclass
class PeerSample:
    sample_id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_states: torch.Tensor  # [T, L, H]
    source: str
    final_hidden: torch.Tensor | None = None  # [T, H]: the final-norm output, when the file carries it
    pad_tokens: int = 0  # trailing batch padding trimmed off
    pad_ambiguous: str | None = None  # why the padding could not be told from real tokens, or None


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
    if values.dtype_name(x) not in values.FLOAT_DTYPES:  # what a file's header claims, integers or bool: no features
        raise SampleError(f"{where}: '{key}' holds {values.dtype_name(x)} values, expected features of "
                          f"{' or '.join(values.FLOAT_DTYPES)}")
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
                    obj = torch.load(io.BytesIO(gunzip_bounded(data, where)), map_location="cpu", weights_only=True)
                else:  # mapped: the tensors are copied once, into the writer's shard buffer
                    obj = torch.load(name, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(name))
    except door.Refused as e:
        raise SampleError(str(e)) from None
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
    if not isinstance(x, torch.Tensor):
        raise SampleError(f"{where}: '{key}' is a {type(x).__name__}, expected a tensor")
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


def _natural(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]


def sample_files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Every file under ``root`` whose name ends with one of ``suffixes``, in natural order, found without following
    a link: a link among them (or a folder that is a link) is refused in one line naming it, never imported."""
    found = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            p = Path(folder) / name
            if stat.S_ISLNK(os.lstat(p).st_mode) and (name in dirs or name.endswith(suffixes)):
                raise ValueError(f"{p}: a symbolic link in the folder imported (links in a peer's folder are never "
                                 "followed: copy the files themselves)")
        found += [Path(folder) / n for n in files if n.endswith(suffixes)]
    return sorted(found, key=_natural)


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


def speculators_sample(path: Path, sample_id: str, record, n_layers: int, hidden: int, source: str) -> PeerSample:
    where = str(path)
    try:
        d = load_beneath(path.parent, path.name, bound=SAMPLE_CAP)
    except (ValueError, OSError) as e:
        raise SampleError(str(e) if isinstance(e, ValueError) else f"{where}: not a readable safetensors file "
                          f"({type(e).__name__}: {e})") from None
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
                      missing: list[str], ids: list[str] | None = None) -> list[PeerFile]:
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
        sid = id_prefix + (ids[i] if ids is not None and i < len(ids) else f"hs_{i}")
        path = hs_dir / f"hs_{i}.safetensors"
        if not door.is_file_beneath(hs_dir, path.name):
            missing.append(sid)
            continue
        out.append(PeerFile(sid, path, lambda p=path, s=sid, r=rec: speculators_sample(p, s, r, n_layers, hidden,
                                                                                       source)))
    return out


# -- identity --------------------------------------------------------------------------------------------------
def import_manifest(fmt: str, layers: str | None = None, *, peer_layers: str | None = None,
                    hsstore_ids: bool = False, path: str | None = None, final_hidden: bool = True,
                    dtype: str = "bfloat16", codec: str = "none",
                    model: str | None = None, model_name: str | None = None, num_layers: int | None = None,
                    hidden_size: int | None = None, config_hash: str | None = None,
                    tokenizer_hash: str | None = None, tokenizer_name: str | None = None,
                    chat_template_hash: str | None = None) -> Manifest:
    """The manifest of an import: identity from a local ``model`` folder (hashed as extract hashes it) or from
    the given values, which the peers' files cannot supply. Layer ids: ``layers`` (hsstore's) or ``peer_layers``
    (the peer's own), see :func:`import_layers`. ``final_hidden``: a SpecForge folder at ``path`` whose files
    carry the final-norm output (``hidden_state``) gives a store with the ``final_hidden`` feature."""
    from .export import export_sidecar

    need = {"--model-name": model_name, "--num-layers": num_layers, "--hidden-size": hidden_size,
            "--config-hash": config_hash, "--tokenizer-hash": tokenizer_hash}
    sidecar = export_sidecar(Path(path)) if path else None
    if model:
        target, tokenizer = identity_from_model_dir(model)
        if hidden_size is not None and hidden_size != target.hidden_size:
            raise ValueError(f"--hidden-size {hidden_size} contradicts {model} (hidden size {target.hidden_size})")
    elif sidecar is not None and all(v is None for v in need.values()):  # hsstore's own export says it all
        try:
            target, tokenizer = TargetIdentity(**sidecar["target"]), TokenizerIdentity(**sidecar["tokenizer"])
        except TypeError as e:
            raise ValueError(f"{path}/hsstore_export.json: its target or tokenizer is not an identity ({e})") from None
        log.info("%s: target and tokenizer identity from its %s (store %s)", path, "hsstore_export.json",
                 sidecar.get("store"))
    else:
        absent = [k for k, v in need.items() if v is None]
        if absent:
            raise ValueError(f"give --model DIR, or the identity flags ({', '.join(absent)} missing)")
        target = TargetIdentity(name=model_name, num_layers=num_layers, hidden_size=hidden_size,
                                config_hash=config_hash)
        tokenizer = TokenizerIdentity(name=tokenizer_name or model_name, vocab_hash=tokenizer_hash,
                                      chat_template_hash=chat_template_hash)
    if sidecar is not None and layers is None and peer_layers is None:  # the export's taps, in hsstore's ids
        layers, hsstore_ids = ",".join(map(str, sidecar["layers"])), True
    ids, extra = import_layers(fmt, layers, peer_layers, target.num_layers, hsstore_ids=hsstore_ids)
    final = fmt == "specforge" and final_hidden and path is not None and first_file_has_final_hidden(Path(path))
    return Manifest(target=target, tokenizer=tokenizer, layers=tuple(ids), dtype=dtype, codec=codec,
                    features=("final_hidden",) if final else (), extra={"imported_from": fmt, **extra})


# -- layer ids ---------------------------------------------------------------------------------------------------
def import_layers(fmt: str, layers: str | None, peer_layers: str | None, num_layers: int, *,
                  hsstore_ids: bool = False) -> tuple[list[int], dict]:
    """(hsstore layer ids, manifest extra) from ``--layers`` (hsstore ids) or ``--peer-layers`` (the peer's).
    A ``--layers`` list that reads like the peer's own ids is refused unless ``hsstore_ids`` says it is meant."""
    from . import peer_layers as pl

    if (layers is None) == (peer_layers is None):
        raise ValueError("give exactly one of --layers (hsstore ids) and --peer-layers (the peer's own ids)")
    if peer_layers is not None:
        ids = pl.parse_ids(peer_layers, "--peer-layers")
        out = pl.to_hsstore(fmt, ids, num_layers)
    else:
        out = pl.parse_ids(layers, "--layers")
        why = None if hsstore_ids else pl.ambiguity(fmt, out, num_layers)
        if why:
            as_peer = [i - pl.PEER_OFFSET[fmt] for i in out]
            raise ValueError(f"--layers {out} may be {fmt}'s own layer ids, not hsstore's: {why}. If they are the "
                             f"ids given to the peer, pass --peer-layers {','.join(map(str, out))} (hsstore ids "
                             f"{as_peer}); if they are hsstore ids (output of decoder layer l), add --hsstore-ids")
        ids = pl.from_hsstore(fmt, out)
    extra = {"peer_layers": {"convention": pl.PEER_CONVENTION[fmt], "ids": ids, "hsstore_ids": out}}
    return out, extra


# -- the import ------------------------------------------------------------------------------------------------
@dataclass
class ImportResult:
    samples: int = 0
    tokens: int = 0
    already: int = 0
    missing: int = 0
    bytes_written: int = 0
    padded_rows: int = 0  # rows whose trailing batch padding was trimmed
    pad_tokens: int = 0
    pad_ambiguous: list[str] = field(default_factory=list)  # ids of rows whose padding could not be told apart
    unhealthy: list = field(default_factory=list)  # health.Unhealthy of samples with a zero or non-finite feature


def import_files(files: list[PeerFile], url: str, manifest: Manifest, *, storage_options: dict | None = None,
                 shard_bytes: int = 1 << 30, missing: list[str] | None = None, progress: bool = True,
                 keep_unhealthy: bool = False) -> ImportResult:
    """Write ``files`` into the store at ``url`` through a StoreWriter, skipping ids already committed. The store
    is created at the first good sample, so an import that fails on its first file leaves nothing behind. A
    sample with an all-zero feature (and loss tokens) or a non-finite value (``health``) is left out and named
    in ``result.unhealthy``, or with ``keep_unhealthy`` written flagged ``feature_zero`` / ``feature_nonfinite``."""
    from hsstore.io import destination, storage

    options = storage_options or {}
    destination.refuse_anonymous_write(url, options)
    fs, root = storage.resolve(url, options)
    with destination.hold_lock(fs, root, url, "import"):  # one copying command at a time into a destination
        return _import(files, url, manifest, options, shard_bytes, missing, progress, keep_unhealthy)


def _import(files: list[PeerFile], url: str, manifest: Manifest, options: dict, shard_bytes: int,
            missing: list[str] | None, progress: bool, keep_unhealthy: bool) -> ImportResult:
    from tqdm import tqdm

    done = committed_ids(url, options)
    todo = [f for f in files if f.sample_id not in done]
    refuse_lookalikes([f.sample_id for f in todo], done, url)
    result = ImportResult(already=len(files) - len(todo), missing=len(missing or []))
    writer: StoreWriter | None = None
    bar = tqdm(total=len(todo), unit="sample", desc="import", disable=not progress)
    try:
        for f in todo:
            s = f.load()
            if writer is None:
                writer = StoreWriter(url, manifest, writer_tag="import", storage_options=options,
                                     shard_bytes=shard_bytes, check_finite=not keep_unhealthy)
                if missing:
                    writer.note_skipped("no_hidden_states", missing)
            if s.pad_ambiguous:
                log.warning("%s (%s): %s; trimmed, flagged %s", s.sample_id, f.path, s.pad_ambiguous, PAD_AMBIGUOUS)
                result.pad_ambiguous.append(s.sample_id)
            result.padded_rows += bool(s.pad_tokens)
            result.pad_tokens += s.pad_tokens
            extra = {"final_hidden": s.final_hidden} if manifest.features else {}
            stats, sick = _health(s, manifest)
            result.unhealthy += sick
            if sick and not keep_unhealthy:
                bar.update(1)
                continue
            flags = ([PAD_AMBIGUOUS] if s.pad_ambiguous else []) + sorted({f"feature_{u.why}" for u in sick})
            writer.add(s.sample_id, s.input_ids, s.loss_mask, s.hidden_states, source=s.source, flags=flags or None,
                       feature_stats=stats, **extra)
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


def _health(s, manifest: Manifest):
    """(the sample's ``[features, 5]`` statistics, its ``health.Unhealthy`` features) of one peer sample."""
    from hsstore.format import health

    stats = health.sample_stats(s.hidden_states)  # then final_hidden's row: no copy of the features together
    if manifest.features:
        stats = np.concatenate([stats, health.sample_stats(torch.as_tensor(s.final_hidden)[:, None])])
    T, loss = int(s.input_ids.shape[0]), int(torch.as_tensor(s.loss_mask).sum())
    sick = []
    for j, f in enumerate(manifest.all_features):
        sick += health.problems_of("(import)", [s.sample_id], [T], [loss], manifest.hidden_size,
                                   health.feature_key(f), [stats[j, 3]], [stats[j, 4]])
    return stats, sick


def peer_files(fmt: str, path: str, *, n_layers: int, hidden: int, id_prefix: str = "", source: str | None = None,
               hs_dir: str | None = None, missing: list[str] | None = None, pad_id: int | None = PAD_TOKEN_ID,
               final_hidden: bool = False, num_rows: int | None = None) -> list[PeerFile]:
    from .export import exported_ids

    root = Path(path)
    src = source or root.name
    ids = exported_ids(root)  # files of ``hsstore export``: the store's sample ids back, and no padding to find
    if ids is not None:
        log.info("%s was written by hsstore export: sample ids from its %s, no padding detection", root,
                 "hsstore_export.json")
        pad_id = None
    if fmt == "specforge":
        return specforge_files(root, id_prefix, src, n_layers, hidden, pad_id=pad_id, final_hidden=final_hidden,
                               num_rows=num_rows, missing=missing, ids=ids)
    if fmt == "speculators":
        return speculators_files(root, Path(hs_dir) if hs_dir else None, id_prefix, source or "", n_layers, hidden,
                                 missing if missing is not None else [], ids=ids)
    raise ValueError(f"unknown peer format {fmt!r} (one of {FORMATS})")
