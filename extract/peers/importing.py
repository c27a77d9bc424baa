"""What every peer's import shares: ``hsstore import`` of a peer's per-sample files into a store.

A peer module (``specforge``, ``speculators``) lists its folder's samples as :class:`PeerFile` (each read and
checked by ``load()`` into a :class:`PeerSample`, features ``[T, L, H]``); this module writes them through
:class:`StoreWriter` (shape, dtype and NaN checks), a bad file stopping the import naming the file, before the
shard holding it is committed. Re-running resumes: sample ids already committed are skipped.

The peers' files record neither the model, the tokenizer nor the tapped layers, so the identity comes
from the command line: ``--model DIR`` hashes a local model's config and tokenizer exactly as ``extract``
does (no weights are loaded), or the hashes are given as flags; the taps are given in hsstore's ids or in the
peer's own (its ``LAYERS`` convention), and both are recorded. An ``hsstore export`` folder says all of it in its
sidecar (``exporting``).
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsstore.format import values
from hsstore.format.manifest import Manifest, TargetIdentity, TokenizerIdentity
from hsstore.store.writer import StoreWriter
from hsstore.errors import SampleError
from hsstore.store.reader import committed_ids, refuse_lookalikes

from ..target import identity_from_model_dir
from .base import Peer, PeerFile, parse_ids
from .exporting import export_sidecar, exported_ids

log = logging.getLogger(__name__)

PAD_TOKEN_ID = 0  # SpecForge's collator pads input_ids (and loss_mask, attention_mask) with zeros
PAD_AMBIGUOUS = "padding_ambiguous"  # sample flag: trailing pad-id tokens that may be real
# a peer's folder comes from elsewhere: every file through the door, each bounded
SAMPLE_CAP = 16 << 30  # one sample file (32K tokens x 5 taps x 8192 x bf16 is 2.7 GB)


def plain_tensor(x: Any, where: str, key: str) -> torch.Tensor:
    """``x`` when it is a dense tensor holding its values in memory: a file's sparse tensor (whose indices may
    point anywhere) or meta tensor (no values at all) is refused naming the file, before any value is copied."""
    if not isinstance(x, torch.Tensor):
        raise SampleError(f"{where}: '{key}' is a {type(x).__name__}, expected a tensor")
    if x.layout != torch.strided or x.device.type != "cpu":
        raise SampleError(f"{where}: '{key}' is a {str(x.layout).removeprefix('torch.')} tensor on {x.device.type}, "
                          "expected a dense tensor of values")
    return x


def features(x: Any, T: int, n_layers: int, hidden: int, where: str, key: str) -> torch.Tensor:
    """``[T, n_layers, hidden]`` from the peer layouts' shapes: [T, L, H], [T, L*H] (layers concatenated along
    the hidden dim, in tap order), each optionally with a leading batch dim of 1."""
    x = plain_tensor(x, where, key)
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


# -- identity --------------------------------------------------------------------------------------------------
def import_manifest(peer: Peer, layers: str | None = None, *, peer_layers: str | None = None,
                    hsstore_ids: bool = False, path: str | None = None, final_hidden: bool = True,
                    dtype: str = "bfloat16", codec: str = "none",
                    model: str | None = None, model_name: str | None = None, num_layers: int | None = None,
                    hidden_size: int | None = None, config_hash: str | None = None,
                    tokenizer_hash: str | None = None, tokenizer_name: str | None = None,
                    chat_template_hash: str | None = None) -> Manifest:
    """The manifest of an import: identity from a local ``model`` folder (hashed as extract hashes it) or from
    the given values, which the peers' files cannot supply. Layer ids: ``layers`` (hsstore's) or ``peer_layers``
    (the peer's own), see :func:`import_layers`. ``final_hidden``: a folder at ``path`` whose files carry the
    final-norm output (the peer's ``keeps_final_hidden``) gives a store with the ``final_hidden`` feature."""
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
    ids, extra = import_layers(peer, layers, peer_layers, target.num_layers, hsstore_ids=hsstore_ids)
    final = final_hidden and path is not None and peer.keeps_final_hidden(Path(path))
    return Manifest(target=target, tokenizer=tokenizer, layers=tuple(ids), dtype=dtype, codec=codec,
                    features=("final_hidden",) if final else (), extra={"imported_from": peer.NAME, **extra})


# -- layer ids ---------------------------------------------------------------------------------------------------
def import_layers(peer: Peer, layers: str | None, peer_layers: str | None, num_layers: int, *,
                  hsstore_ids: bool = False) -> tuple[list[int], dict]:
    """(hsstore layer ids, manifest extra) from ``--layers`` (hsstore ids) or ``--peer-layers`` (the peer's).
    A ``--layers`` list that reads like the peer's own ids is refused unless ``hsstore_ids`` says it is meant."""
    if (layers is None) == (peer_layers is None):
        raise ValueError("give exactly one of --layers (hsstore ids) and --peer-layers (the peer's own ids)")
    name, convention = peer.NAME, peer.LAYERS
    if peer_layers is not None:
        ids = parse_ids(peer_layers, "--peer-layers")
        out = convention.to_hsstore(name, ids, num_layers)
    else:
        out = parse_ids(layers, "--layers")
        why = None if hsstore_ids else peer.ambiguity(out, num_layers)
        if why:
            as_peer = [i - convention.offset for i in out]
            raise ValueError(f"--layers {out} may be {name}'s own layer ids, not hsstore's: {why}. If they are the "
                             f"ids given to the peer, pass --peer-layers {','.join(map(str, out))} (hsstore ids "
                             f"{as_peer}); if they are hsstore ids (output of decoder layer l), add --hsstore-ids")
        ids = convention.from_hsstore(out)
    extra = {"peer_layers": {"convention": convention.text, "ids": ids, "hsstore_ids": out}}
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
    from hsstore.progress import progress_bar

    done = committed_ids(url, options)
    todo = [f for f in files if f.sample_id not in done]
    refuse_lookalikes([f.sample_id for f in todo], done, url)
    result = ImportResult(already=len(files) - len(todo), missing=len(missing or []))
    writer: StoreWriter | None = None
    bar = progress_bar(total=len(todo), unit="sample", desc="import", disable=not progress)
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


def peer_files(peer: Peer, path: str, *, n_layers: int, hidden: int, id_prefix: str = "",
               source: str | None = None, hs_dir: str | None = None, missing: list[str] | None = None,
               pad_id: int | None = PAD_TOKEN_ID, final_hidden: bool = False,
               num_rows: int | None = None) -> list[PeerFile]:
    """Every sample of ``peer``'s folder at ``path`` (``peer.files``); an ``hsstore export`` folder gives the
    store's sample ids back and has no padding to find."""
    root = Path(path)
    ids = exported_ids(root)
    if ids is not None:
        log.info("%s was written by hsstore export: sample ids from its %s, no padding detection", root,
                 "hsstore_export.json")
        pad_id = None
    return peer.files(root, ids=ids, id_prefix=id_prefix, source=source, n_layers=n_layers, hidden=hidden,
                      hs_dir=hs_dir, missing=missing if missing is not None else [], pad_id=pad_id,
                      final_hidden=final_hidden, num_rows=num_rows)
