"""What ``reader.open_shared`` sends from the group's first rank to the others: a store's manifest, index use and
records, framed as a length, JSON, then the records as an index segment (columns and the records' bytes,
checksummed; never pickle), and moved as one uint8 tensor."""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import TYPE_CHECKING

from ..errors import StoreError
from ..format import index
from ..format.manifest import Manifest
from ..format.records import RecordTable
from ..io.storage import MANIFEST_FILE

if TYPE_CHECKING:  # torch is imported where the bytes are moved: metadata commands never load it
    import torch


def _frame(body: dict, tail: bytes) -> bytes:
    head = json.dumps(body, separators=(",", ":")).encode()
    return struct.pack("<I", len(head)) + head + tail


def encode(manifest: Manifest, use: index.IndexUse, table: RecordTable) -> bytes:
    """The manifest and index use as JSON, then the records as an index segment."""
    return _frame({"manifest": manifest.to_json(), "use": dataclasses.asdict(use)},
                  index.encode_segment("shared", "open_shared", table, repack=False))


def encode_error(e: Exception) -> bytes:
    """What the first rank sends when it could not open the store: the others raise it, naming that rank."""
    return _frame({"error": f"{type(e).__name__}: {e}"}, b"")


def decode(data: bytes, url: str, src: int) -> tuple[Manifest, RecordTable, index.IndexUse]:
    """What rank ``src`` sent for the store at ``url``, checked as a manifest and an index segment read from the
    store would be; its error raised here."""
    (n,) = struct.unpack("<I", data[:4])
    body = json.loads(data[4:4 + n])
    if "error" in body:
        raise StoreError(f"opening store {url!r} failed on rank {src}: {body['error']}")
    manifest = Manifest.from_json(body["manifest"].encode(), where=f"{url}/{MANIFEST_FILE} (from rank {src})")
    table = index.decode_segment(f"(records from rank {src})", data[4 + n:]).table
    return manifest, table, index.IndexUse(**body["use"])


def broadcast_bytes(data: bytes | None, src: int, group, device: torch.device) -> bytes:
    """``data`` from rank ``src`` to every rank of ``group`` (a length, then a uint8 tensor)."""
    import torch

    dist = torch.distributed
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(n, src, group=group)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data is not None
           else torch.empty(int(n.item()), dtype=torch.uint8, device=device))
    dist.broadcast(buf, src, group=group)
    return data if data is not None else buf.cpu().numpy().tobytes()
