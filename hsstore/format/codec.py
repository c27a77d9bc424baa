"""Feature dtypes and chunk codecs.

bf16 is not a Zarr data type, so features are stored as their raw bits (uint16) and the manifest
records the real dtype; reading views the bits back, so values are bit-exact. Every chunk ends in
a CRC32C (Zarr's ``crc32c`` codec) so a flipped byte fails the read that touches it.

The default codec is ``none`` (bytes + crc32c): lossless compressors gain little on bf16 features but decode
several times slower than a raw read on a few cores (docs/PERFORMANCE.md, "Design choices"), and the trainer must
never wait on decode.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import google_crc32c
import numcodecs
import numpy as np
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

try:  # releases the GIL on buffers of 32 KiB and more; google_crc32c holds it (see crc32c below)
    import crc32c as _crc32c_nogil
except ImportError:  # a platform without its wheel: the same values, with the GIL held
    _crc32c_nogil = None

from . import encodings
from .encodings import STORAGE_DTYPE
from ..errors import CorruptionError, StoreError

if TYPE_CHECKING:
    import torch

assert sys.byteorder == "little", "hsstore writes little-endian chunks by direct encoding"

CODECS = ("none", "zstd", "blosc-zstd", "lz4")


def storage_dtype(dtype: str, encoding: str = "raw") -> np.dtype:
    """The numpy dtype of a layer array's elements: the dtype's bits for ``raw``, uint8 for the others."""
    return encodings.get(encoding).storage_dtype(dtype)


def row_width(hidden: int, encoding: str = "raw") -> int:
    """Elements of the storage dtype per row (token) of a layer array: ``hidden``, or a block encoding's bytes."""
    return encodings.get(encoding).width(hidden)


def token_bytes(dtype: str, encoding: str, n_layers: int, hidden: int) -> int:
    """Stored bytes of one token of ``n_layers`` layers, scales included (fp8: values plus one float32 scale per
    layer; block encodings: their rows)."""
    return n_layers * encodings.get(encoding).row_bytes(hidden, dtype)


@functools.cache
def _torch_dtypes() -> dict:
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@functools.cache
def _dtype_names() -> dict:
    return {v: k for k, v in _torch_dtypes().items()}


def __getattr__(name: str):
    """``TORCH_DTYPE`` (manifest name -> torch dtype) and ``DTYPE_NAME`` (its inverse), made on first use:
    commands that only read metadata (info, verify, index, ...) never import torch."""
    if name == "TORCH_DTYPE":
        return _torch_dtypes()
    if name == "DTYPE_NAME":
        return _dtype_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(x: torch.Tensor | np.ndarray) -> str:
    """The manifest dtype name of a tensor or array ('bfloat16', 'float16', 'float32')."""
    torch = sys.modules.get("torch")  # a torch tensor exists only once torch is imported
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dtype not in _dtype_names():
            raise StoreError(f"unsupported feature dtype {x.dtype}")
        return _dtype_names()[x.dtype]
    if x.dtype == np.float16:
        return "float16"
    if x.dtype == np.float32:
        return "float32"
    raise StoreError(f"unsupported feature dtype {x.dtype} (numpy has no bfloat16: pass a torch tensor)")


def from_storage(a: np.ndarray, dtype: str) -> torch.Tensor:
    """A torch tensor in the manifest dtype viewing stored bits (bit-exact)."""
    import torch

    t = torch.from_numpy(a)
    if dtype == "bfloat16":
        return t.view(torch.bfloat16)
    return t


# Signed integer views of each dtype's bits, and the exponent
# mask: a value is NaN/Inf exactly when all its exponent bits are set.
BITS_NUMPY = {"bfloat16": np.int16, "float16": np.int16, "float32": np.int32}
EXPONENT_MASK = {"bfloat16": 0x7F80, "float16": 0x7C00, "float32": 0x7F800000}


def bits_view(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A CPU torch view of features' raw bits as a signed integer tensor (no copy when already on CPU)."""
    import torch

    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    x = x.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


def first_nonfinite_row(a: np.ndarray, dtype: str) -> int | None:
    """Row of the first NaN/Inf (an all-ones exponent) in storage-dtype features, or None."""
    exp = EXPONENT_MASK[dtype]
    hit = np.bitwise_and(a.view(BITS_NUMPY[dtype]), exp) == exp
    rows = np.nonzero(hit.reshape(hit.shape[0], -1).any(axis=1))[0]
    return int(rows[0]) if rows.size else None


def crc32c(data, crc: int | None = None) -> int:
    """CRC32C of bytes or a contiguous numpy buffer (hardware accelerated); with ``crc``, the
    checksum of the bytes that ``crc`` covers followed by ``data`` (objects checked in parts).

    The loader checks every chunk it reads on its threads, beside a training thread that needs the GIL to
    launch kernels. google_crc32c holds the GIL while it computes (most of the loader's GIL time under
    ``py-spy record --gil``); the ``crc32c`` package computes the same values without holding it."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if _crc32c_nogil is not None:
        return int(_crc32c_nogil.crc32c(data) if crc is None else _crc32c_nogil.crc32c(data, crc))
    if isinstance(data, (bytes, bytearray)):
        view = bytes(data)
    else:
        view = data.view() if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
        view.flags.writeable = False  # google_crc32c takes read-only buffers only
    return int(google_crc32c.value(view) if crc is None else google_crc32c.extend(crc, view))


# A chunk object that is valid but holds other data than its commit record lists for its path.
MISPLACED = ("a valid chunk, but not the one the commit record lists for this path (swapped, copied from "
             "another shard or store, or stale)")


# The CRC32C of any valid chunk object (payload + the payload's CRC32C) is this one constant, CRC-32C's
# residue: what commit records of format version 1 list for every chunk.
CHUNK_RESIDUE = crc32c(np.uint32(crc32c(b"")).tobytes())


def chunk_tail(blob) -> int:
    """The CRC32C a chunk object ends with: its payload's checksum, which commit records of format version 2
    list for the object (the whole object's CRC32C is one constant for every valid chunk)."""
    return int.from_bytes(bytes(blob[-4:]), "little")


def chunk_ok(blob: bytes, expect: int | None = None) -> bool:
    """Whether a chunk object's trailing CRC32C matches its payload and, with ``expect``, is that checksum."""
    if len(blob) < 4:
        return False
    return payload_problem(np.frombuffer(blob, np.uint8, count=len(blob) - 4), chunk_tail(blob), expect) is None


def payload_problem(payload, tail: int, expect: int | None = None) -> str | None:
    """What is wrong with a chunk whose payload and 4-byte tail (its CRC32C) were read apart, or None:
    the tail must be the payload's CRC32C and, with ``expect`` (the commit record's value), that value."""
    return checksum_problem(crc32c(payload), tail, expect)


def checksum_problem(crc: int, tail: int, expect: int | None = None) -> str | None:
    """``payload_problem`` of a payload whose CRC32C ``crc`` was computed as it was read (``memory.pread_fold``)."""
    if crc != tail:
        return "checksum mismatch (corrupted chunk)"
    return MISPLACED if expect is not None and tail != expect else None


def _parse(spec: str) -> tuple[str, int]:
    """``name[:level]`` -> (name, level); level 1 by default."""
    name, _, level = spec.partition(":")
    if name not in CODECS:
        raise StoreError(f"unknown codec {spec!r} (one of {', '.join(CODECS)}, with optional :level)")
    return name, int(level) if level else 1


@functools.lru_cache(maxsize=None)
def _numcodec(spec: str):
    """The numcodecs compressor Zarr uses for the spec (None for ``none``), built once per spec."""
    name, level = _parse(spec)
    if name == "none":
        return None
    if name == "zstd":
        return numcodecs.Zstd(level=level)
    return numcodecs.Blosc(cname="zstd" if name == "blosc-zstd" else "lz4", clevel=level,
                           shuffle=numcodecs.Blosc.SHUFFLE, typesize=2)


@dataclass(frozen=True)
class EncodedChunk:
    """A chunk object as parts (payload view + 4-byte CRC32C), so local writes need no joining copy.
    ``crc32c`` is the payload's checksum (the tail), as the commit record lists it: it identifies the data."""

    payload: np.ndarray
    tail: bytes
    crc32c: int

    def __len__(self) -> int:
        return self.payload.nbytes + len(self.tail)

    def parts(self) -> tuple[memoryview, bytes]:
        return memoryview(self.payload), self.tail

    def tobytes(self) -> bytes:
        return b"".join(self.parts())


@dataclass(frozen=True)
class ChunkCodec:
    """Encodes one chunk exactly as Zarr v3 would with ``[bytes(little), <compressor>, crc32c]``.

    hsstore writes and reads chunk objects itself (one copy, no per-chunk event-loop round trips);
    Zarr metadata describes the same codec chain, so zarr-python or tensorstore read the arrays too.
    """

    spec: str = "none"

    def _numcodec(self):
        return _numcodec(self.spec)

    def zarr_compressors(self) -> list:
        """The same chain as Zarr metadata: ``[<compressor>?, crc32c]`` (after the ``bytes`` serializer)."""
        name, level = _parse(self.spec)
        if name == "none":
            codecs: list = []
        elif name == "zstd":
            codecs = [ZstdCodec(level=level)]
        else:  # byte shuffle groups the exponent bytes together: helps bf16 most
            codecs = [BloscCodec(cname="zstd" if name == "blosc-zstd" else "lz4", clevel=level, shuffle="shuffle",
                                 typesize=2)]
        return codecs + [Crc32cCodec()]

    def encode(self, chunk: np.ndarray) -> "EncodedChunk":
        c = self._numcodec()
        payload = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8) if c is None else np.frombuffer(
            c.encode(np.ascontiguousarray(chunk)), np.uint8)
        inner = crc32c(payload)
        return EncodedChunk(payload, np.uint32(inner).tobytes(), inner)

    def decode(self, blob: bytes, dtype: np.dtype, count: int, where: str, expect: int | None = None,
               ) -> np.ndarray:
        """The chunk's values (a read-only view when uncompressed); CorruptionError naming ``where``.
        ``expect``: the payload CRC32C the commit record lists (None: a record that lists none)."""
        if len(blob) < 4:
            raise CorruptionError(f"{where}: chunk of {len(blob)} bytes is truncated")
        payload = np.frombuffer(blob, np.uint8, count=len(blob) - 4)
        problem = payload_problem(payload, chunk_tail(blob), expect)
        if problem:
            raise CorruptionError(f"{where}: {problem}")
        c = self._numcodec()
        nbytes = count * dtype.itemsize
        if c is None:
            if payload.nbytes != nbytes:
                raise CorruptionError(f"{where}: chunk holds {payload.nbytes} bytes, expected {nbytes}")
            return payload.view(dtype)
        return decode_bounded(c, payload, nbytes, where).view(dtype)


def zstd_content_size(frame) -> int | None:
    """The decoded size a zstd frame declares in its header (RFC 8878, 3.1.1.1), or None when it declares none
    or is no zstd frame: what a decoder would allocate, known before allocating."""
    b = bytes(frame[:18])
    if len(b) < 5 or b[:4] != b"\x28\xb5\x2f\xfd":
        return None
    fhd = b[4]
    fcs_flag, single, did_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[did_flag]
    size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if size == 0 or len(b) < pos + size:
        return None
    value = int.from_bytes(b[pos:pos + size], "little")
    return value + 256 if size == 2 else value


def blosc_content_size(frame) -> int | None:
    """The decoded size a blosc frame declares (its header's ``nbytes``, bytes 4-8), or None when too short."""
    b = bytes(frame[:16])
    return int.from_bytes(b[4:8], "little") if len(b) >= 16 else None


def decode_bounded(c, payload, nbytes: int, where: str) -> np.ndarray:
    """``payload`` decoded by numcodecs compressor ``c`` into exactly ``nbytes`` bytes (what the manifest and
    record allow), refused before any allocation when the frame declares another size: a few kB of hostile
    zstd declare gigabytes, which the decoder would allocate first."""
    declared = (blosc_content_size(payload) if isinstance(c, numcodecs.Blosc) else zstd_content_size(payload))
    if declared != nbytes:
        said = "no decoded size" if declared is None else f"{declared:,} decoded bytes"
        raise CorruptionError(f"{where}: {len(payload):,} compressed bytes that declare {said}, expected {nbytes:,} "
                              "(corrupted or forged)")
    out = np.empty(nbytes, np.uint8)
    try:
        c.decode(payload, out=out)
    except Exception as e:
        raise CorruptionError(f"{where}: does not decode ({type(e).__name__}: {e})") from None
    return out
