"""Feature encodings: how one row (one token of one tapped layer) is stored, and read back as values.

The manifest's ``encoding`` names one of ``ENCODINGS``; everything that writes, reads, checks or converts features
asks the entry here (``get``) rather than testing names: its width in the layer array, its stored bytes per row,
how it encodes (on the extraction GPU, or the host) and decodes (on the training GPU, or the host, numpy only for
the commands that never load torch), which rows no reader may serve, and the audit's floor for its rounding.

``raw`` stores values as computed (the dtype's bits); ``fp8`` e4m3 values with a float32 scale per row in an array
of its own (``format/fp8.py``); ``mxfp6``, ``nvfp4`` and ``mxfp4`` 6- or 4-bit values with block scales and outlier
channels inside the row (``format/microscaling.py``). docs/FORMAT.md describes each byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from . import fp8, microscaling

if TYPE_CHECKING:
    import torch

STORAGE_DTYPE = {"bfloat16": np.dtype("<u2"), "float16": np.dtype("<f2"), "float32": np.dtype("<f4")}
BYTES = np.dtype("|u1")


class Encoded(NamedTuple):
    """Encoded features: ``values`` ``[..., width]`` (fp8: float8_e4m3fn; block encodings: uint8 bytes) and, for an
    encoding with a row scale (fp8), ``scales`` ``[...]`` float32, else None."""

    values: Any
    scales: Any = None

    def cpu(self) -> "Encoded":
        """The same features in host memory (encoded on a GPU, handed to a writer, which takes host tensors)."""
        return Encoded(*(None if t is None else t.cpu() for t in self))


@dataclass(frozen=True)
class Encoding:
    """``raw``: values as computed, bit-exact. The base of the others: ``row_scale``: a float32 scale per row, kept
    in its own array (``scale_<LLL>``); ``floor``: the audit's ``1 - cosine`` floor for this encoding's rounding
    (None: the dtype's own, extract/compare.py), ``rounding`` what it allows for."""

    name: str
    help: str
    floor: float | None = None
    row_scale: bool = False
    rounding: str = ""  # what the encoding's rounding is, for the audit's bound: "<rounding> on bfloat16 rounding"

    @property
    def quantised(self) -> bool:
        return self.floor is not None

    def width(self, hidden: int) -> int:
        """Elements of the storage dtype per row in a layer array."""
        return hidden

    def storage_dtype(self, dtype: str) -> np.dtype:
        return STORAGE_DTYPE[dtype]

    def row_bytes(self, hidden: int, dtype: str) -> int:
        """Stored bytes of one row, its scales (and padding) included."""
        return self.width(hidden) * self.storage_dtype(dtype).itemsize + (fp8.SCALE_DTYPE.itemsize if self.row_scale
                                                                         else 0)

    def refusal(self, hidden: int) -> str | None:
        """Why a manifest with this encoding may not have ``hidden`` (None: it may)."""
        return None

    def encode(self, x: torch.Tensor) -> Encoded:
        raise ValueError(f"encoding {self.name!r} stores values as computed")

    def decode(self, values: torch.Tensor, scales: torch.Tensor | None, hidden: int, dtype=None) -> torch.Tensor:
        """Values ``[..., hidden]`` in ``dtype`` of stored ``values`` ``[..., width]``, on their device."""
        return values

    def decode_numpy(self, values: np.ndarray, scales: np.ndarray | None, hidden: int) -> np.ndarray:
        """float32 values of stored rows, numpy only (no torch)."""
        raise ValueError(f"encoding {self.name!r}: decode stored bits with the dtype")

    def bad_rows(self, values: np.ndarray, scales: np.ndarray | None, hidden: int) -> np.ndarray:
        """Per row: whether it holds what no writer writes (a NaN, a scale not finite and positive, an outlier index
        out of its row): refused by writers, named by ``verify``."""
        return np.zeros(values.shape[:-1], bool)


@dataclass(frozen=True)
class Fp8(Encoding):
    """e4m3fn values with a float32 scale per row (``format/fp8.py``)."""

    def storage_dtype(self, dtype: str) -> np.dtype:
        return fp8.VALUE_DTYPE

    def encode(self, x: torch.Tensor) -> Encoded:
        return Encoded(*fp8.quantise(x))

    def decode(self, values, scales, hidden, dtype=None):
        return fp8.dequantise(values, scales, dtype)

    def decode_numpy(self, values, scales, hidden):
        return fp8.dequantise_numpy(values, scales)

    def bad_rows(self, values, scales, hidden):
        bad = (np.bitwise_and(values, 0x7F) == 0x7F).any(axis=-1)
        return bad | ~(np.isfinite(scales) & (scales > 0))


@dataclass(frozen=True)
class BlockScaled(Encoding):
    """Small floats with a scale per block and outlier channels in the row (``format/microscaling.py``)."""

    fmt: microscaling.BlockFormat = microscaling.NVFP4

    def width(self, hidden: int) -> int:
        return self.fmt.width(hidden)

    def storage_dtype(self, dtype: str) -> np.dtype:
        return BYTES

    def refusal(self, hidden: int) -> str | None:
        if self.fmt.outliers(hidden) and hidden > 1 << 16:
            return f"encoding {self.name!r} indexes channels with 16 bits: hidden_size {hidden:,} is over 65,536"
        return None

    def encode(self, x):
        return Encoded(microscaling.encode(x, self.fmt))

    def decode(self, values, scales, hidden, dtype=None):
        return microscaling.decode(values, hidden, self.fmt, dtype)

    def decode_numpy(self, values, scales, hidden):
        return microscaling.decode_numpy(values, hidden, self.fmt)

    def bad_rows(self, values, scales, hidden):
        return microscaling.bad_rows(values, hidden, self.fmt)


RAW = Encoding("raw", "values as computed, bit-exact in --dtype")
# floors: the encoding's own rounding (1 - cosine) at most, measured on the demo's target and at the seeds' shape with
# planted outlier channels (docs/PERFORMANCE.md, "Encodings below fp8"), with a margin of 3
ENCODINGS: dict[str, Encoding] = {e.name: e for e in (
    RAW,
    Fp8("fp8", "e4m3 + a float32 scale per token per layer (half of bf16)", floor=3e-3, row_scale=True,
        rounding="fp8 e4m3 with a per-token scale (at most 2^-4 per value)"),
    BlockScaled("mxfp6", "e2m3 + a power-of-two scale per 32 values, as OCP MXFP6, and outlier channels in bf16 "
                         "(2.5x under bf16)", floor=1.5e-3, fmt=microscaling.MXFP6,
                rounding="mxfp6 e2m3 with a power-of-two scale per 32 values"),
    BlockScaled("nvfp4", "e2m1 + an e4m3 scale per 16 values and a float32 one per row, as NVFP4, and outlier "
                         "channels in bf16 (3.5x under bf16)", floor=1.5e-2, fmt=microscaling.NVFP4,
                rounding="nvfp4 e2m1 with an e4m3 scale per 16 values"),
    BlockScaled("mxfp4", "e2m1 + a power-of-two scale per 32 values, as OCP MXFP4, and outlier channels in bf16 "
                         "(3.7x under bf16)", floor=2.5e-2, fmt=microscaling.MXFP4,
                rounding="mxfp4 e2m1 with a power-of-two scale per 32 values"),
)}
NAMES = tuple(ENCODINGS)


def get(name: str) -> Encoding:
    """The encoding a manifest names (ValueError naming the known ones)."""
    try:
        return ENCODINGS[name]
    except KeyError:
        raise ValueError(f"encoding {name!r} not supported (one of {NAMES})") from None


def decode_batch(batch: dict[str, Any], encoding: str, hidden: int, dtype=None) -> dict[str, Any]:
    """A batch or item whose stored ``hidden_states`` (and ``hidden_scales``) are decoded into ``dtype``, on their
    device: what the trainer does after the batch crosses, and the host when asked to. Raw batches are returned
    unchanged."""
    import torch

    enc = get(encoding)
    if not enc.quantised or batch["hidden_states"].dtype not in (torch.uint8, torch.float8_e4m3fn):
        return batch  # raw, or decoded already (on the host)
    out = {k: v for k, v in batch.items() if k != "hidden_scales"}
    out["hidden_states"] = enc.decode(batch["hidden_states"], batch.get("hidden_scales"), hidden, dtype)
    return out
