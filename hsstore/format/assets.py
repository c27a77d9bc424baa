"""Store assets: what a trainer needs instead of the target.

The drafter uses the target's input embedding and lm_head (frozen), its config and its tokenizer.
Extraction copies them into ``<store>/assets/`` so training never touches the target's weights; every
tensor file is safetensors (no pickle), and ``assets/index.json`` lists each file with size and CRC32C.
"""

from __future__ import annotations

import json
import os
from typing import Any

from typing import TYPE_CHECKING

import fsspec

from . import codec, names
from ..io import door, memory, storage, transfer
from ..io.backends import backend_for
from ..errors import CorruptionError, StoreError

if TYPE_CHECKING:
    import torch

ASSETS_DIR = "assets"
INDEX = "index.json"
EMBED = "embed_tokens.safetensors"
LM_HEAD = "lm_head.safetensors"
CONFIG = "config.json"
TOKENIZER_DIR = "tokenizer"


def _index(fs, root: str, url: str = "") -> dict[str, Any]:
    """``assets/index.json`` (through the door: at most ``door.JSON_CAP`` bytes), every entry checked: a name
    string, an integer size and CRC32C."""
    where = f"store {url or root!r}, {ASSETS_DIR}/{INDEX}"
    try:
        index = door.read_json(fs, root, f"{ASSETS_DIR}/{INDEX}", where=where)
    except FileNotFoundError:
        return {"files": {}}
    files = index.get("files") if isinstance(index, dict) else None
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and _is_int(e.get("size")) and _is_int(e.get("crc32c")) for e in files.values()):
        raise CorruptionError(f"{where}: malformed (expected files: {{name: {{size, crc32c}}}})")
    return index


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def has_assets(fs, root: str, url: str = "") -> bool:
    return bool(_index(fs, root, url)["files"])


def asset_names(fs, root: str, url: str = "") -> list[str]:
    """The asset files the store's index lists (empty: a store without assets)."""
    return list(_index(fs, root, url)["files"])


def asset_path(fs, root: str, name, url: str = "") -> str:
    """The path of asset ``name`` under ``<root>/assets/`` (``names.path``: never outside it)."""
    where = f"store {url or root!r}, {ASSETS_DIR}/{INDEX}"
    names.key(name, "asset name", where)
    if name == INDEX:
        raise StoreError(f"{where}: asset name {name!r} refused (the index itself)")
    p = names.path(fs, storage.join(root, ASSETS_DIR), name, "asset name", where)
    if backend_for(fs).local_paths:
        names.contained(root, p, "asset name", name, where)
    return p


def write_assets(fs, root: str, files: dict[str, bytes], url: str = "") -> None:
    """Write asset files (store-relative names under ``assets/``), then the index that lists them."""
    for name, data in files.items():
        transfer.put_atomic(fs, asset_path(fs, root, name, url), data, root)
    index = _index(fs, root)
    index["files"].update({n: {"size": len(d), "crc32c": codec.crc32c(d)} for n, d in files.items()})
    transfer.put_atomic(fs, storage.join(root, ASSETS_DIR, INDEX), json.dumps(index, indent=1).encode(), root)


def check_asset(fs, root: str, name: str, url: str = "") -> int:
    """``verify``'s check of one asset: its name, bound and size, and its CRC32C, a tensor file's computed in one
    streaming pass (an embedding of gigabytes is never held whole); returns its size. Raises as ``read_asset``
    does (which checks the other, small, files: their content too)."""
    if not name.endswith(".safetensors"):
        return len(read_asset(fs, root, name, url))
    entry = _entry(fs, root, name, url)
    crc = None
    with door.stream(fs, root, f"{ASSETS_DIR}/{name}", size=entry["size"], where=f"store {url or root!r}") as f:
        n = 0
        while n < entry["size"]:
            piece = f.read(min(16 << 20, entry["size"] - n))
            if not piece:
                break
            crc, n = codec.crc32c(piece, crc), n + len(piece)
    if n != entry["size"] or (crc if crc is not None else codec.crc32c(b"")) != entry["crc32c"]:
        raise CorruptionError(f"store {url or root!r}: asset {name!r} does not match its checksum")
    return n


def tensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save as st_save  # torch only where tensors are (de)serialised

    return st_save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})


def asset_bound(name: str) -> int:
    """The most bytes asset ``name`` may hold, by its kind: a tensor file ``door.ASSET_CAP``, a tokenizer file
    ``door.TOKENIZER_ASSET_CAP``, anything else (the config) ``door.OTHER_ASSET_CAP``."""
    if name.endswith(".safetensors"):
        return door.ASSET_CAP
    return door.TOKENIZER_ASSET_CAP if name.startswith(TOKENIZER_DIR + "/") else door.OTHER_ASSET_CAP


def _entry(fs, root: str, name: str, url: str) -> dict[str, int]:
    """The index entry of asset ``name``, its name checked, and its listed size within its bound and this
    machine's memory (one line naming the file, before anything is read or allocated)."""
    entry = _index(fs, root, url)["files"].get(name)
    if entry is None:
        raise StoreError(f"store {url or root!r} has no asset {name!r} (was it written by `hsstore extract`?)")
    asset_path(fs, root, name, url)  # the name's rules (never the index, never outside assets/)
    refuse_code(name, url or root)
    if entry["size"] > asset_bound(name):
        raise door.Refused(f"store {url or root!r}", f"{ASSETS_DIR}/{name}", f"{entry['size']:,} bytes listed in "
                           f"{ASSETS_DIR}/{INDEX}, larger than its bound of {asset_bound(name):,}")
    return entry


def read_asset(fs, root: str, name: str, url: str = "") -> bytes:
    entry = _entry(fs, root, name, url)
    memory.check_fits(entry["size"], f"store {url or root!r}, asset {name!r}")
    data = door.read(fs, root, f"{ASSETS_DIR}/{name}", bound=asset_bound(name), size=entry["size"],
                     where=f"store {url or root!r}")  # missing: FileNotFoundError, as before
    refuse_code(name, url or root, data)
    if len(data) != entry["size"] or codec.crc32c(data) != entry["crc32c"]:
        raise CorruptionError(f"store {url or root!r}: asset {name!r} does not match its checksum")
    return data


# what may never come out of a store's assets: code (Python modules, extension libraries) and pickles. A
# tokenizer or config that names its own code (``auto_map``) would have transformers offer to run it.
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".so", ".dll", ".dylib", ".pkl", ".pickle", ".pt", ".pth", ".bin", ".ckpt",
                 ".joblib", ".npy", ".npz")


def refuse_code(name: str, where: str, data: bytes | None = None) -> None:
    """Refuse (one line naming the file) an asset that is code or a pickle, by its name, and (``data``: its
    bytes) a JSON asset that names code for transformers to load (``auto_map``)."""
    if name.lower().endswith(CODE_SUFFIXES):
        raise StoreError(f"store {where!r}: asset {name!r} refused (code or a pickle; a store's assets are "
                         "safetensors, JSON and tokenizer files only)")
    if data is not None and name.lower().endswith(".json") and b"auto_map" in data:
        try:
            doc = door.load_json(data, f"store {where!r}, asset {name!r}")
        except CorruptionError:
            doc = None
        if _names_code(doc):
            raise StoreError(f"store {where!r}: asset {name!r} refused (its auto_map names code to run; hsstore "
                             "never loads code from a store)")


def _names_code(doc: Any) -> bool:
    todo = [doc]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            if "auto_map" in d:
                return True
            todo.extend(d.values())
        elif isinstance(d, list):
            todo.extend(d)
    return False


def load_tensors(fs, root: str, name: str, url: str = "") -> dict[str, torch.Tensor]:
    """The tensors of asset file ``name``; bytes safetensors cannot read are one ``CorruptionError`` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load as st_load

    data = read_asset(fs, root, name, url)
    try:
        return st_load(data)
    except (SafetensorError, RuntimeError, ValueError) as e:
        raise CorruptionError(f"store {url or root!r}: asset {name!r} is not a readable safetensors file "
                              f"({(str(e).splitlines() or [''])[0][:200]})") from None


def download_dir(fs, root: str, prefix: str, dest: str, url: str = "") -> str:
    """Copy every asset under ``prefix`` (e.g. the tokenizer files) into a local folder; returns it."""
    os.makedirs(dest, exist_ok=True)
    for name in _index(fs, root, url)["files"]:
        if isinstance(name, str) and name.startswith(prefix + "/"):
            data = read_asset(fs, root, name, url)  # the name checked first, under the store's assets/
            rel = name[len(prefix) + 1:]
            out = names.path(fsspec.filesystem("file"), dest, rel, "asset name", f"store {url or root!r}, "
                                                                                 f"{ASSETS_DIR}/{INDEX}")
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "wb") as f:
                f.write(data)
    return dest


# what a trainer takes from a store's assets (the values it trains with) and so what two stores mixed must agree on;
# the tokenizer files are the manifest's tokenizer identity's to compare
TRAINER_ASSETS = (EMBED, LM_HEAD, CONFIG)
# keys of the config that name the writer's software or the file's origin, not the model
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_commit_hash")


def differing_asset(a_fs, a_root: str, a_url: str, b_fs, b_root: str, b_url: str) -> str | None:
    """The first of ``TRAINER_ASSETS`` both stores hold whose contents differ (None: none): the tensor files by their
    index entries (size and CRC32C: nothing else read), the config by its JSON without ``VOLATILE_CONFIG_KEYS``."""
    a, b = _index(a_fs, a_root, a_url)["files"], _index(b_fs, b_root, b_url)["files"]
    for name in TRAINER_ASSETS:
        if name not in a or name not in b:
            continue
        if name != CONFIG:
            if (a[name]["size"], a[name]["crc32c"]) != (b[name]["size"], b[name]["crc32c"]):
                return name
        elif _model_config(a_fs, a_root, a_url) != _model_config(b_fs, b_root, b_url):
            return name
    return None


def _model_config(fs, root: str, url: str) -> Any:
    doc = door.load_json(read_asset(fs, root, CONFIG, url), f"store {url or root!r}, {ASSETS_DIR}/{CONFIG}")
    return {k: v for k, v in doc.items() if k not in VOLATILE_CONFIG_KEYS} if isinstance(doc, dict) else doc


def copy_assets(src_fs, src_root: str, dst_fs, dst_root: str, url: str = "") -> None:
    """Copy every asset of one store into another (each checked against its CRC32C on the way)."""
    write_assets(dst_fs, dst_root, {n: read_asset(src_fs, src_root, n, url) for n in asset_names(src_fs, src_root)},
                 url=url)
