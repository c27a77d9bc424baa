"""The ``fp8`` encoding: e4m3fn values with one float32 scale per token per layer.

Why: bf16 features cost ``taps x hidden x 2`` bytes per token (51 KB for a 27B target); lossless codecs
gain ~1.3x at best. fp8 halves every byte the pipeline moves -- device->host in extraction, storage,
host->device in training -- when quantised on the extraction GPU and dequantised on the training GPU.

Per row (one token of one layer): ``scale = amax(|x|) / 448`` (448 = e4m3fn's largest finite value),
``q = e4m3fn(x / scale)``; a row of zeros gets scale 1. Dequantised ``q * scale`` has a relative error
of at most 2^-4 for elements within 2^-6 * 448 * scale of the row's amax range (e4m3 normals: 3 mantissa
bits, round to nearest); smaller elements fall into e4m3 subnormals, with an absolute error of at most
2^-10 * scale. The scale is float32, not bf16: a bf16 scale would add its own 2^-9 error to every
element of the row, and 4 bytes per row are 0.1% of a 5120-wide row.

On disk (docs/FORMAT.md) the values are their uint8 bits; numpy has no fp8 type, so the numpy form
decodes bits through a 256-entry table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

ENCODING = "fp8"
FP8_MAX = 448.0
VALUE_DTYPE = np.dtype("|u1")   # stored bits of the values
SCALE_DTYPE = np.dtype("<f4")   # stored scales


def __getattr__(name: str):
    """``FP8_DTYPE`` (torch's float8_e4m3fn), looked up on first use: reading metadata never imports torch."""
    if name == "FP8_DTYPE":
        import torch

        return torch.float8_e4m3fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Quantised(NamedTuple):
    """fp8 features: ``values`` ``[..., H]`` float8_e4m3fn and ``scales`` ``[...]`` float32, one per row."""

    values: torch.Tensor
    scales: torch.Tensor


def quantise(x: torch.Tensor) -> Quantised:
    """Per-row (last dimension) e4m3 quantisation, on ``x``'s device. NaN/Inf rows give a NaN/Inf scale
    (callers check finiteness before, as for raw features; :func:`first_bad_row` finds them after)."""
    import torch

    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    values = (xf / scales.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Quantised(values, scales)


def dequantise(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values * scales`` in ``dtype`` (default bfloat16), on the tensors' device (the trainer's GPU)."""
    import torch

    if values.dtype == torch.uint8:
        values = values.view(torch.float8_e4m3fn)
    dtype = torch.bfloat16 if dtype is None else dtype
    return (values.float() * scales.float().unsqueeze(-1)).to(dtype)


def dequantise_batch(batch: dict[str, Any], dtype: torch.dtype | None = None) -> dict[str, Any]:
    """A batch or item whose ``hidden_states`` are dequantised into ``dtype`` (``hidden_scales`` removed);
    batches without ``hidden_scales`` (raw stores) are returned unchanged."""
    if batch.get("hidden_scales") is None:
        return batch
    out = {k: v for k, v in batch.items() if k != "hidden_scales"}
    out["hidden_states"] = dequantise(batch["hidden_states"], batch["hidden_scales"], dtype)
    return out


# -- numpy-bit form: the stored uint8 bits ---------------------------------------------------------------
def _e4m3fn_table() -> np.ndarray:
    """float32 value of every e4m3fn bit pattern: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
    is subnormal, ``x111 1111`` NaN, no Inf (tests check it against torch's own conversion)."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    mag = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    return np.where((b & 0x7F) == 0x7F, np.nan, sign * mag).astype(np.float32)


_TABLE = _e4m3fn_table()


def decode_bits(bits: np.ndarray) -> np.ndarray:
    """float32 values of e4m3fn bits (uint8), without torch."""
    return _TABLE[bits]


def dequantise_numpy(bits: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``values * scales`` from stored uint8 bits ``[..., H]`` and float32 scales ``[...]``."""
    return decode_bits(bits) * scales[..., None].astype(np.float32)


def as_bits(values: torch.Tensor) -> np.ndarray:
    """The uint8 bits of fp8 values as a numpy array (a view when already on the CPU)."""
    import torch

    v = values.detach()
    if v.device.type != "cpu":
        v = v.cpu()
    return v.view(torch.uint8).numpy()


def first_bad_row(bits: np.ndarray, scales: np.ndarray) -> int | None:
    """First row (axis 0) holding a NaN value (e4m3fn has no Inf: NaN is ``x111 1111``) or a scale that
    is not finite and positive; None when all are good."""
    bad_scale = ~(np.isfinite(scales) & (scales > 0))
    bad = np.bitwise_and(bits, 0x7F) == 0x7F
    rows = bad.reshape(bad.shape[0], -1).any(axis=1) | bad_scale.reshape(bad_scale.shape[0], -1).any(axis=1)
    hit = np.flatnonzero(rows)
    return int(hit[0]) if hit.size else None
