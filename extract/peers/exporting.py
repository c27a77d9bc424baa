"""What every peer's export shares: ``hsstore export``'s folder, its resume and its sidecar.

File ``i`` of an export is the ``i``-th exported sample. ``hsstore_export.json`` beside the files (ignored by the
peers, who only list their own suffixes) records the store, the exported layers in both conventions, the sample
ids and the ids left out, so ``hsstore import`` of an export gives back the same ids and skips padding detection
(an export holds none). OUT must not exist, be empty, or hold an earlier export of the same samples in the same
format (``MARKER``, written first): a re-run resumes it, writing only the files not there yet (each file is
renamed into place whole, so one at its name is complete); anything else is refused and nothing is overwritten.
What each peer's files hold is its module's (``specforge``, ``speculators``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from hsstore.io import destination, door, sinks
from hsstore.store.reader import Store
from hsstore.format.serving import TAP_TENSOR
from hsstore.redaction import recordable_url

from .base import LayerConvention

log = logging.getLogger(__name__)

SIDECAR = "hsstore_export.json"
MARKER = ".hsstore-export.json"  # written first: what OUT is an export of (the peers list only their own files)
SIDECAR_CAP = 256 << 20  # its sample ids: ~30 bytes each


def export_plan(fmt: str, store: Store, layout: str, layers: list[int]) -> dict:
    """What an export is of: the format and layout, the store's layers taken, and its samples in order (a digest
    of their ids: file ``i`` is the ``i``-th, so a store that has changed since cannot be resumed into)."""
    ids = hashlib.sha256("\n".join(store.sample_ids()).encode()).hexdigest()
    return {"format": fmt, "layout": layout, "store": recordable_url(store.url), "layers": list(layers),
            "samples": len(store), "sample_ids_sha256": ids}


def out_dir(out: str, plan: dict) -> Path:
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


def written(folder: Path, name: str) -> bool:
    """A file an earlier run renamed into place (whole): a regular file, never a link."""
    return door.is_file_beneath(folder, name)


def sidecar(out: Path, peer: str, convention: LayerConvention, store: Store, layout: str, layers: list[int],
            ids: list[str], extra: dict, features: tuple[str, ...] = ()) -> None:
    """``SIDECAR``, written last: what the export holds (``features``: the store features it carries)."""
    m = store.manifest
    doc = {"format": peer, "layout": layout, "store": recordable_url(store.url), "layers": list(layers),
           "features": list(features), "tap_tensor": TAP_TENSOR,
           "peer_layer_ids": convention.from_hsstore(list(layers)),
           "target": m.target.__dict__, "tokenizer": m.tokenizer.__dict__, "sample_ids": ids,
           "encoding": m.encoding, **extra}  # the store's: peers get its values decoded into the manifest dtype
    (out / SIDECAR).write_text(json.dumps(doc, indent=1))


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
