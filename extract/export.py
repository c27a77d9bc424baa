"""``hsstore export``: a store -> the peers' one-file-per-sample layouts, so their trainers read it as their own.

* **specforge** -- what ``scripts/prepare_hidden_states.py`` writes: ``rows_{g}-{g+2000}/data_{i}.ckpt``, one
  ``torch.save`` dict per sample: ``input_ids`` [T] int64, ``loss_mask`` [T] int64, then the layout ``--layout``
  names: ``dflash`` (the default) ``hidden_states`` [1, T, L*H], every tap; ``eagle3`` ``aux_hidden_state``
  [1, T, 3*H], the three taps SpecForge's EAGLE-3 model takes, + ``hidden_state`` [1, T, H], the final-norm output
  (the store must hold ``final_hidden``). No padding (one row per batch). SpecForge's offline DFlash reader
  refuses a sample without two consecutive supervised tokens: such samples are left out, counted, and named in
  the sidecar.
* **speculators** -- what ``prepare_data.py`` + ``data_generation_offline.py`` write: an Arrow dataset as
  ``datasets.save_to_disk`` lays it out (``input_ids``/``loss_mask`` int64 lists, ``seq_len``; torch format) and
  ``hidden_states/hs_{i}.safetensors`` with ``hidden_states`` [T, L, H] and ``token_ids`` [T] int64. Its trainer
  splits the last slot off as the verifier's last hidden state (vLLM id N, before the final norm), so the store
  must hold layer N - 1; the slots are the store's layers in order, vLLM ids = hsstore ids + 1.

File ``i`` is the ``i``-th exported sample. ``hsstore_export.json`` beside the files (ignored by both peers, who
only list their own suffixes) records the store, the exported layers in both conventions, the sample ids and
the ids left out, so ``hsstore import`` of an export gives back the same ids and skips padding detection (an
export holds none). OUT must not exist, be empty, or hold an earlier export of the same samples in the same format
(``MARKER``, written first): a re-run resumes it, writing only the files not there yet (each file is renamed into
place whole, so one at its name is complete); anything else is refused and nothing is overwritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hsstore.io import destination, door, sinks
from hsstore.store.reader import Store
from hsstore.format.serving import TAP_TENSOR, serving
from hsstore.redaction import recordable_url
from hsstore.io.tensorfiles import save_safetensors

from . import peer_layers

log = logging.getLogger(__name__)

SIDECAR = "hsstore_export.json"
MARKER = ".hsstore-export.json"  # written first: what OUT is an export of (the peers list only their own files)
SIDECAR_CAP = 256 << 20  # its sample ids: ~30 bytes each
FILE_GROUP_SIZE = 2000  # SpecForge's default --file-group-size
ARROW_FILE = "data-00000-of-00001.arrow"


@dataclass
class ExportResult:
    samples: int = 0
    tokens: int = 0
    bytes_written: int = 0
    layout: str = ""
    skipped: int = 0  # samples left out: the peer's loader would refuse them
    already: int = 0  # files an earlier run of the same export had written (resumed)
    notes: list[str] = field(default_factory=list)


def export_plan(fmt: str, store: Store, layout: str, layers: list[int]) -> dict:
    """What an export is of: the format and layout, the store's layers taken, and its samples in order (a digest
    of their ids: file ``i`` is the ``i``-th, so a store that has changed since cannot be resumed into)."""
    ids = hashlib.sha256("\n".join(store.sample_ids()).encode()).hexdigest()
    return {"format": fmt, "layout": layout, "store": recordable_url(store.url), "layers": list(layers),
            "samples": len(store), "sample_ids_sha256": ids}


def _out_dir(out: str, plan: dict) -> Path:
    """OUT made, or an earlier run of this same export (``plan``) to resume; anything else refused in one line,
    nothing written."""
    p = Path(out)
    destination.check_output_folder(p, (MARKER,), "export OUT")
    if door.is_file_beneath(p, MARKER):
        earlier = door.read_json_beneath(p, MARKER, bound=door.JSON_CAP, where=str(p))
        if earlier != plan:
            differ = sorted(k for k in plan if not isinstance(earlier, dict) or earlier.get(k) != plan[k])
            raise destination.DestinationError(
                f"export OUT {p}: holds an earlier export of other samples or in another form (its "
                f"{', '.join(differ)} differ{'s' if len(differ) == 1 else ''}); give a new folder (nothing was "
                "written)")
        log.info("export OUT %s: resuming the earlier run of this export", p)
        return p
    p.mkdir(parents=True, exist_ok=True)
    sinks.write_atomic(p, MARKER, json.dumps(plan, indent=1).encode(), what=f"export OUT {p}")
    return p


def _written(folder: Path, name: str) -> bool:
    """A file an earlier run renamed into place (whole): a regular file, never a link."""
    return door.is_file_beneath(folder, name)


def _sidecar(out: Path, fmt: str, store: Store, layout: str, layers: list[int], ids: list[str], extra: dict,
             ) -> None:
    m = store.manifest
    doc = {"format": fmt, "layout": layout, "store": recordable_url(store.url), "layers": list(layers),
           "features": list(m.features) if layout == "eagle3" else [], "tap_tensor": TAP_TENSOR,
           "peer_layer_ids": peer_layers.from_hsstore(fmt, list(layers)),
           "target": m.target.__dict__, "tokenizer": m.tokenizer.__dict__, "sample_ids": ids,
           "encoding": m.encoding, **extra}  # the store's: peers get its values decoded into the manifest dtype
    (out / SIDECAR).write_text(json.dumps(doc, indent=1))


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
    return peer_layers.eagle3_taps(list(m.layers), m.target.num_layers, layers)


def export_specforge(url: str, out: str, *, storage_options: dict | None = None, progress: bool = True,
                     file_group_size: int = FILE_GROUP_SIZE, layout: str | None = None,
                     layers: list[int] | None = None) -> ExportResult:
    from hsstore.progress import progress_bar

    store = Store(url, storage_options or {})
    store.admit()  # the admission's store-wide rules, before a file is written
    store.check_manifest()
    layout = layout or "dflash"
    taps, chosen = specforge_taps(store, layout, layers)
    pick = [list(store.manifest.layers).index(l) for l in taps]
    root = _out_dir(out, export_plan("specforge", store, layout, taps))
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
        if _written(root, f"{sub.name}/{path.name}"):  # an earlier run's
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
    _sidecar(root, "specforge", store, layout, taps, ids,
             {"file_group_size": file_group_size, "skipped": {"no_consecutive_loss": left_out}})
    return r


def export_speculators(url: str, out: str, *, storage_options: dict | None = None, progress: bool = True,
                       layout: str | None = None, layers: list[int] | None = None) -> ExportResult:
    from hsstore.progress import progress_bar

    if layout is not None or layers is not None:
        raise ValueError("--layout and --layers choose among SpecForge's layouts; speculators has one (every tap, "
                         "the last as the verifier's hidden state)")
    store = Store(url, storage_options or {})
    store.admit()  # the admission's store-wide rules, before a file is written
    store.check_manifest()
    m = store.manifest
    n = m.target.num_layers
    if m.layers[-1] != n - 1 or not serving(m.layers, n).serves("speculators"):
        raise ValueError(f"store {url!r} has layers {list(m.layers)}: speculators' trainer takes the last slot as "
                         f"the verifier's last hidden state (vLLM id {n}, hsstore layer {n - 1}, the last decoder "
                         f"layer's output before the norm), which the store does not hold (extract with --serve "
                         "speculators to store it)")
    root = _out_dir(out, export_plan("speculators", store, "speculators", list(m.layers)))
    hs_dir = root / "hidden_states"
    hs_dir.mkdir(exist_ok=True)
    r = ExportResult(layout="speculators")
    if m.features:
        r.notes.append("final_hidden not exported: speculators stores the last layer before the norm (its "
                       "trainer applies the verifier's norm)")
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    ids = []
    for i, item in enumerate(progress_bar(store.iter_windows([w for s in range(len(store.commits))
                                                               for w in store.windows(s, store.layers)], store.layers),
                                          total=len(store), unit="sample", desc="export", disable=not progress)):
        T = int(item["input_ids"].shape[0])
        path = hs_dir / f"hs_{i}.safetensors"
        if _written(root, f"{hs_dir.name}/{path.name}"):  # an earlier run's
            r.already += 1
        else:
            save_safetensors({"hidden_states": item["hidden_states"].contiguous(),
                              "token_ids": item["input_ids"].clone()}, path)
            r.bytes_written += path.stat().st_size
        rows["input_ids"].append(item["input_ids"].numpy())
        rows["loss_mask"].append(item["loss_mask"].numpy().astype(np.int64))
        rows["seq_len"].append(T)
        ids.append(item["sample_id"])
        r.samples += 1
        r.tokens += T
    _write_arrow_dataset(root, rows)
    aux = peer_layers.from_hsstore("speculators", list(m.layers))
    _sidecar(root, "speculators", store, r.layout, list(m.layers), ids, {"target_layer_ids": aux[:-1]})
    r.notes.append(f"train with the aux layer ids {aux[:-1]} (vLLM ids; the last slot, {aux[-1]}, is the verifier's "
                   "last hidden state)")
    return r


def _write_arrow_dataset(root: Path, rows: dict[str, list]) -> None:
    """The files ``datasets.save_to_disk`` writes for speculators' prepared data (one shard, torch format)."""
    import pyarrow as pa

    ints = pa.list_(pa.int64())
    table = pa.table({"input_ids": pa.array([list(map(int, x)) for x in rows["input_ids"]], type=ints),
                      "loss_mask": pa.array([list(map(int, x)) for x in rows["loss_mask"]], type=ints),
                      "seq_len": pa.array(rows["seq_len"], type=pa.int64())})
    with pa.OSFile(str(root / ARROW_FILE), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    seq = {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"}
    info = {"citation": "", "description": "", "homepage": "", "license": "",
            "features": {"input_ids": seq, "loss_mask": seq, "seq_len": {"dtype": "int64", "_type": "Value"}}}
    (root / "dataset_info.json").write_text(json.dumps(info, indent=2))
    state = {"_data_files": [{"filename": ARROW_FILE}], "_fingerprint": uuid.uuid4().hex[:16],
             "_format_columns": None, "_format_kwargs": {}, "_format_type": "torch", "_output_all_columns": False,
             "_split": None}
    (root / "state.json").write_text(json.dumps(state, indent=2))


def export_store(fmt: str, url: str, out: str, **kw) -> ExportResult:
    if fmt == "specforge":
        return export_specforge(url, out, **kw)
    if fmt == "speculators":
        return export_speculators(url, out, **kw)
    raise ValueError(f"unknown peer format {fmt!r} (specforge or speculators)")


def export_sidecar(root: Path) -> dict | None:
    """What ``hsstore export`` recorded beside its files (store, layers, identity, sample ids), or None for the
    peers' own files."""
    if not door.is_file_beneath(root, SIDECAR):
        return None
    d = door.read_json_beneath(root, SIDECAR, bound=SIDECAR_CAP)  # a folder from elsewhere: through the door
    ok = (isinstance(d, dict) and isinstance(d.get("sample_ids"), list) and all(isinstance(x, str) for x in d["sample_ids"])
          and all(isinstance(d.get(k), dict) for k in ("target", "tokenizer"))
          and isinstance(d.get("layers"), list) and all(type(x) is int for x in d["layers"]))
    if not ok:
        raise ValueError(f"{root / SIDECAR}: not an hsstore export record (sample_ids, layers, target, tokenizer)")
    return d


def exported_ids(root: Path) -> list[str] | None:
    """The store's sample ids of an ``hsstore export`` folder (its sidecar), or None for the peers' own files."""
    sidecar = export_sidecar(root)
    return None if sidecar is None else list(sidecar["sample_ids"])
