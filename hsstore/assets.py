"""Store assets: what a trainer needs instead of the target.

The drafter uses the target's input embedding and lm_head (frozen), its config and its tokenizer.
Extraction copies them into ``<store>/assets/`` so training never touches the target's weights; every
tensor file is safetensors (no pickle), and ``assets/index.json`` lists each file with size and CRC32C.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from . import codec, storage
from .errors import CorruptionError, StoreError

ASSETS_DIR = "assets"
INDEX = "index.json"
EMBED = "embed_tokens.safetensors"
LM_HEAD = "lm_head.safetensors"
CONFIG = "config.json"
TOKENIZER_DIR = "tokenizer"


def _index(fs, root: str) -> dict[str, Any]:
    try:
        return json.loads(fs.cat_file(storage.join(root, ASSETS_DIR, INDEX)))
    except FileNotFoundError:
        return {"files": {}}


def has_assets(fs, root: str) -> bool:
    return bool(_index(fs, root)["files"])


def asset_names(fs, root: str) -> list[str]:
    """The asset files the store's index lists (empty: a store without assets)."""
    return list(_index(fs, root)["files"])


def write_assets(fs, root: str, files: dict[str, bytes]) -> None:
    """Write asset files (store-relative names under ``assets/``), then the index that lists them."""
    for name, data in files.items():
        storage.put_atomic(fs, storage.join(root, ASSETS_DIR, name), data)
    index = _index(fs, root)
    index["files"].update({n: {"size": len(d), "crc32c": codec.crc32c(d)} for n, d in files.items()})
    storage.put_atomic(fs, storage.join(root, ASSETS_DIR, INDEX), json.dumps(index, indent=1).encode())


def tensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return st_save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})


def read_asset(fs, root: str, name: str, url: str = "") -> bytes:
    entry = _index(fs, root)["files"].get(name)
    if entry is None:
        raise StoreError(f"store {url or root!r} has no asset {name!r} (was it written by `hsstore extract`?)")
    data = fs.cat_file(storage.join(root, ASSETS_DIR, name))
    if len(data) != entry["size"] or codec.crc32c(data) != entry["crc32c"]:
        raise CorruptionError(f"store {url or root!r}: asset {name!r} does not match its checksum")
    return data


def load_tensors(fs, root: str, name: str, url: str = "") -> dict[str, torch.Tensor]:
    return st_load(read_asset(fs, root, name, url))


def download_dir(fs, root: str, prefix: str, dest: str, url: str = "") -> str:
    """Copy every asset under ``prefix`` (e.g. the tokenizer files) into a local folder; returns it."""
    os.makedirs(dest, exist_ok=True)
    for name in _index(fs, root)["files"]:
        if name.startswith(prefix + "/"):
            with open(os.path.join(dest, name[len(prefix) + 1:]), "wb") as f:
                f.write(read_asset(fs, root, name, url))
    return dest


def copy_assets(src_fs, src_root: str, dst_fs, dst_root: str, url: str = "") -> None:
    """Copy every asset of one store into another (each checked against its CRC32C on the way)."""
    names = asset_names(src_fs, src_root)
    write_assets(dst_fs, dst_root, {n: read_asset(src_fs, src_root, n, url) for n in names})
