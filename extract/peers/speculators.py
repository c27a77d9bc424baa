"""speculators: its prepared data and hidden-state files, written by ``hsstore export speculators`` and read by
``hsstore import speculators``, and how it (with vLLM) numbers the taps.

* **export** -- what ``prepare_data.py`` + ``data_generation_offline.py`` write: an Arrow dataset as
  ``datasets.save_to_disk`` lays it out (``input_ids``/``loss_mask`` int64 lists, ``seq_len``; torch format) and
  ``hidden_states/hs_{i}.safetensors`` with ``hidden_states`` [T, L, H] and ``token_ids`` [T] int64. Its trainer
  splits the last slot off as the verifier's last hidden state (vLLM id N, before the final norm), so the store
  must hold layer N - 1; the slots are the store's layers in order, vLLM ids = hsstore ids + 1.
* **import** -- an Arrow dataset (``datasets.save_to_disk`` or plain ``.arrow``) with ``input_ids`` and
  ``loss_mask`` per row, and ``hidden_states/hs_{i}.safetensors`` for row ``i`` holding ``hidden_states``
  [T, L, H] (and ``token_ids``, checked against the row when present). The last slot, vLLM id ``N``, is the last
  decoder layer's output *before* the final norm (speculators' trainer applies the norm itself), so it is stored
  as layer ``N - 1``, not as ``final_hidden``.
* **layer ids** -- speculators / vLLM (``eagle_aux_hidden_state_layer_ids``): id ``i`` is the residual stream
  *entering* decoder layer ``i``, i.e. after layer ``i - 1`` (id 0 is the embedding output, id ``N`` the last
  layer's output before the final norm). ``launch_vllm.py`` defaults to ``[2, N//2, N-3]`` plus ``N`` (the slot
  its trainer splits off as ``verifier_last_hidden_states``). hsstore id = vLLM id - 1. A ``--layers`` list that
  reads like these ids (its launch defaults, or the id ``N`` that only the peer has) is refused unless the user
  says which is meant.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import torch

from hsstore.errors import SampleError
from hsstore.format.serving import serving
from hsstore.io import door
from hsstore.io.tensorfiles import load_beneath, save_safetensors
from hsstore.store.reader import Store

from .base import ExportResult, LayerConvention, PeerFile, PeerSample
from .exporting import export_plan, out_dir, sidecar, written
from .importing import SAMPLE_CAP, features

NAME = "speculators"
LAYERS = LayerConvention(1, "vllm (residual stream entering decoder layer i = output of layer i-1)",
                         zero_note="vLLM id 0 is the embedding output, not a layer's")
ARROW_FILE = "data-00000-of-00001.arrow"
HS_DIR = "hidden_states"


def vllm_launch_ids(num_layers: int, include_last: bool = True) -> list[int]:
    """speculators' ``launch_vllm.py`` default: ``[2, N//2, N-3]`` and, with ``--include-last-layer`` (its
    default), ``N``."""
    n = num_layers
    return [2, n // 2, n - 3] + ([n] if include_last else [])


def ambiguity(layers: list[int], num_layers: int) -> str | None:
    """Why a ``--layers`` list (meant as hsstore ids) may well be vLLM's ids, or None."""
    n = num_layers
    if n in layers:
        return (f"it holds {n}, vLLM's id of the last layer's output: hsstore ids stop at {n - 1} "
                f"(that same layer)")
    if layers[:3] == vllm_launch_ids(n, include_last=False):
        return (f"it starts with {vllm_launch_ids(n, False)}, speculators' default vLLM launch ids for a {n}-layer "
                f"target (hsstore ids {LAYERS.to_hsstore(NAME, vllm_launch_ids(n, False), n)})")
    return None


# -- export ----------------------------------------------------------------------------------------------------
def export(url: str, out: str, *, storage_options: dict | None = None, progress: bool = True,
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
    if m.layers[-1] != n - 1 or not serving(m.layers, n).serves(NAME):
        raise ValueError(f"store {url!r} has layers {list(m.layers)}: speculators' trainer takes the last slot as "
                         f"the verifier's last hidden state (vLLM id {n}, hsstore layer {n - 1}, the last decoder "
                         f"layer's output before the norm), which the store does not hold (extract with --serve "
                         "speculators to store it)")
    root = out_dir(out, export_plan(NAME, store, NAME, list(m.layers)))
    hs_dir = root / "hidden_states"
    hs_dir.mkdir(exist_ok=True)
    r = ExportResult(layout=NAME)
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
        if written(root, f"{hs_dir.name}/{path.name}"):  # an earlier run's
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
    write_arrow_dataset(root, rows)
    aux = LAYERS.from_hsstore(list(m.layers))
    sidecar(root, NAME, LAYERS, store, r.layout, list(m.layers), ids, {"target_layer_ids": aux[:-1]})
    r.notes.append(f"train with the aux layer ids {aux[:-1]} (vLLM ids; the last slot, {aux[-1]}, is the verifier's "
                   "last hidden state)")
    return r


def write_arrow_dataset(root: Path, rows: dict[str, list]) -> None:
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



# -- import ----------------------------------------------------------------------------------------------------
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
    from ..readers import TokenRecord, read_dataset_folder

    if hs_dir is None:  # the folder's own: beneath it, never through a link planted there (--hidden-states-dir may be)
        try:
            hs_dir = Path(door.folder_beneath(root, HS_DIR, where=str(root)))
        except door.Refused as e:
            raise ValueError(str(e)) from None
        except OSError:
            hs_dir = root / HS_DIR
    if not hs_dir.is_dir():
        raise FileNotFoundError(f"speculators hidden-state folder not found: {hs_dir}")
    out = []
    for i, rec in enumerate(read_dataset_folder(root)):
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


def keeps_final_hidden(root: Path) -> bool:
    """Never: speculators' last slot is the last layer before the norm, stored as that layer."""
    return False


def files(root: Path, *, ids: list[str] | None, id_prefix: str, source: str | None, n_layers: int, hidden: int,
          hs_dir: str | None, missing: list[str], pad_id: int | None, final_hidden: bool,
          num_rows: int | None) -> list[PeerFile]:
    """The protocol's import (``pad_id``, ``final_hidden`` and ``num_rows`` are SpecForge's):
    :func:`speculators_files`."""
    return speculators_files(root, Path(hs_dir) if hs_dir else None, id_prefix, source or "", n_layers, hidden,
                             missing, ids=ids)
