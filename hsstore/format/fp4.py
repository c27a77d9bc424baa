"""4-bit block encodings: e2m1 values with a shared scale per block, as OCP MX (``mxfp4``) and NVIDIA's NVFP4
(``nvfp4``) define them, and a few outlier channels per row kept in bfloat16.

Why: fp8 halves bf16 features; a 4-bit value with a scale per block of 16 or 32 values quarters them (the
scales add 1/16 or 1/32 of a byte per value), which is what a store of the seeds' corpus needs to fit under
a third of its bf16 size. A per-row scale (fp8's) cannot carry 4-bit values: one large channel would leave
every other value of the row at zero; a block's own scale confines that to the block.

A row (one token of one tapped layer, ``hidden`` values) is stored as one run of bytes, so it decodes alone:

    codes     n_blocks * block / 2 bytes   e2m1 codes, two per byte: value 2i in the low nibble, 2i+1 in the high
    scales    n_blocks bytes               one per block: E8M0 (mxfp4) or e4m3fn (nvfp4)
    row scale 4 bytes (nvfp4 only)         float32, little-endian: NVFP4's second-level scale, per row
    outliers  k * 2 bytes, then k * 2      k uint16 channel indices (strictly increasing), then their bfloat16
                                           values, little-endian (k = hidden // outlier_every; 0 below it)

``n_blocks = ceil(hidden / block)``; the last block is padded with zero values. e2m1 (1 sign, 2 exponent bits
with bias 1, 1 mantissa bit) holds 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. Decoding a value is
``e2m1(code) * block_scale`` (mxfp4: ``2^(e - 127)``, code 255 NaN) or ``e2m1(code) * e4m3(scale) * row_scale``
(nvfp4); then each outlier's channel takes its bfloat16 value (its code is 0).

Encoding (the decoder needs none of it): the outliers are the ``k`` channels of largest magnitude in the row;
then, per block, mxfp4 takes the OCP rule ``2^(floor(log2(amax)) - 2)`` (values above 6 saturate), nvfp4
``row_scale = amax(row) / (6 * 448)`` and ``e4m3(amax(block) / (6 * row_scale))``; values round to the nearest
e2m1 (ties to the even code) after division by the block's scale. Outlier channels: trained LLMs' hidden states
carry a few channels 100-1000x the median magnitude; in their own block they leave the other values at zero. Kept
apart in bfloat16 (4 bytes each), they cost one slot per ``outlier_every`` channels (0.7% of the row at 5,120
wide) and bring the error of the other channels back to what they have without outliers (docs/PERFORMANCE.md,
"Encodings below fp8").

Torch functions run on the tensors' device (the extraction and training GPUs); ``decode_numpy`` and ``bad_rows``
are numpy only, for the commands that never load torch (verify, subset).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import fp8

if TYPE_CHECKING:
    import torch

E2M1_MAX = 6.0
E4M3_MAX = fp8.FP8_MAX
# magnitudes of the 8 non-negative e2m1 codes, and the midpoints between neighbours (rounding thresholds)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_SIGNED = np.concatenate([E2M1, -E2M1]).astype(np.float32)  # code -> value (code 8 is -0)
E8M0_BIAS = 127
E8M0_NAN = 255
DECODE_VALUES = 1 << 24  # values decoded at a time on the device: bounds the float32 temporaries


@dataclass(frozen=True)
class BlockFormat:
    """One 4-bit block encoding: ``block`` values per scale, the scale's kind (``e8m0``: a power of two; ``e4m3``:
    an fp8 value under a float32 row scale), one outlier slot per ``outlier_every`` channels."""

    block: int
    scale: str
    outlier_every: int = 512

    def blocks(self, hidden: int) -> int:
        return -(-hidden // self.block)

    def outliers(self, hidden: int) -> int:
        return hidden // self.outlier_every if self.outlier_every else 0

    @property
    def row_scale_bytes(self) -> int:
        return 4 if self.scale == "e4m3" else 0

    def offsets(self, hidden: int) -> tuple[int, int, int, int, int]:
        """Byte offsets in a row: (scales, row scale, outlier indices, outlier values, end = the row's width)."""
        nb, k = self.blocks(hidden), self.outliers(hidden)
        scales = nb * self.block // 2
        row = scales + nb
        idx = row + self.row_scale_bytes
        vals = idx + 2 * k
        return scales, row, idx, vals, vals + 2 * k

    def width(self, hidden: int) -> int:
        return self.offsets(hidden)[4]


MXFP4 = BlockFormat(block=32, scale="e8m0")
NVFP4 = BlockFormat(block=16, scale="e4m3")


# -- torch: encode and decode on the device ------------------------------------------------------------------
def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, sign in bit 3) of float32 ``y`` already divided by its scale: nearest value, ties to the
    even code, saturating at 6."""
    import torch

    mags = torch.as_tensor(E2M1, device=y.device)
    mids = (mags[1:] + mags[:-1]) / 2
    a = y.abs().clamp_(max=E2M1_MAX)
    lo = torch.bucketize(a, mids, right=False)
    hi = torch.bucketize(a, mids, right=True)
    code = torch.where((lo != hi) & (lo % 2 == 1), hi, lo).to(torch.uint8)  # a tie: the even neighbour
    return code | ((y < 0) & (code > 0)).to(torch.uint8) << 3


def _split_outliers(xf: torch.Tensor, k: int):
    """(``xf`` with its ``k`` largest-magnitude channels per row set to zero, their indices ascending, their values
    in bfloat16)."""
    import torch

    idx = xf.abs().topk(k, dim=-1).indices.sort(dim=-1).values
    vals = torch.gather(xf, -1, idx).to(torch.bfloat16)
    return xf.scatter(-1, idx, 0.0), idx, vals


def encode(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Rows ``[..., H]`` (any float dtype, finite) as the format's bytes ``[..., width(H)]`` uint8, on ``x``'s
    device."""
    import torch

    H = x.shape[-1]
    lead = x.shape[:-1]
    xf = x.reshape(-1, H).float()
    N, nb, B, k = xf.shape[0], fmt.blocks(H), fmt.block, fmt.outliers(H)
    parts = []
    if k:
        xf, idx, ovals = _split_outliers(xf, k)
    if nb * B != H:
        xf = torch.nn.functional.pad(xf, (0, nb * B - H))
    xb = xf.view(N, nb, B)
    amax = xb.abs().amax(-1)  # [N, nb]
    if fmt.scale == "e8m0":
        _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
        exp = torch.where(amax > 0, e - 1 - 2, torch.full_like(e, -E8M0_BIAS)).clamp_(-E8M0_BIAS, E8M0_BIAS)
        scale = torch.exp2(exp.float())
        scale_bytes = (exp + E8M0_BIAS).to(torch.uint8)
        row_bytes = None
    else:
        row_amax = amax.amax(-1)
        row = torch.where(row_amax > 0, row_amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(row_amax))
        bs = (amax / (E2M1_MAX * row[:, None])).clamp_(max=E4M3_MAX).to(torch.float8_e4m3fn)
        scale = bs.float() * row[:, None]
        scale_bytes = bs.view(torch.uint8)
        row_bytes = row.contiguous().view(torch.uint8).view(N, 4)
    y = torch.where(scale[..., None] > 0, xb / torch.where(scale > 0, scale, 1.0)[..., None], 0.0)
    codes = _e2m1_codes(y).view(N, nb * B // 2, 2)
    parts.append(codes[..., 0] | codes[..., 1] << 4)
    parts.append(scale_bytes)
    if row_bytes is not None:
        parts.append(row_bytes)
    if k:
        parts.append(idx.to(torch.int32).to(torch.int16).view(torch.uint8).view(N, 2 * k))
        parts.append(ovals.contiguous().view(torch.uint8).view(N, 2 * k))
    return torch.cat(parts, dim=1).reshape(*lead, fmt.width(H))


def _le(t: torch.Tensor, dtype) -> torch.Tensor:
    """Columns of little-endian bytes ``[N, n * size]`` as ``[N, n]`` of ``dtype`` (a fresh copy: aligned for any
    offset of the columns in the row)."""
    import torch

    return t.clone(memory_format=torch.contiguous_format).view(dtype)


def _decode_rows(r: torch.Tensor, H: int, fmt: BlockFormat, dtype) -> torch.Tensor:
    """``decode`` of a 2-D run of rows."""
    import torch

    N, nb, B, k = r.shape[0], fmt.blocks(H), fmt.block, fmt.outliers(H)
    o_scales, o_row, o_idx, o_vals, _ = fmt.offsets(H)
    packed = r[:, :o_scales]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(N, nb, B)
    sign = 1.0 - ((codes >> 3) & 1).float() * 2.0
    e, m = ((codes >> 1) & 3).float(), (codes & 1).float()
    mag = torch.where(e == 0, m * 0.5, (1.0 + m * 0.5) * torch.exp2(e - 1.0))
    sb = r[:, o_scales:o_row]
    if fmt.scale == "e8m0":
        scale = torch.where(sb == E8M0_NAN, float("nan"), torch.exp2(sb.float() - E8M0_BIAS))
    else:
        scale = sb.contiguous().view(torch.float8_e4m3fn).float() * _le(r[:, o_row:o_idx], torch.float32)
    out = (sign * mag * scale[..., None]).view(N, nb * B)
    if k:
        # a trash column past the row: an index no writer writes (>= H) lands there, never outside the tensor
        out = torch.nn.functional.pad(out, (0, 1))
        idx = _le(r[:, o_idx:o_vals], torch.int16).to(torch.int64) & 0xFFFF
        idx = torch.where(idx < H, idx, nb * B)
        out.scatter_(1, idx, _le(r[:, o_vals:], torch.bfloat16).float())
    return out[:, :H].to(dtype)


def decode(values: torch.Tensor, H: int, fmt: BlockFormat, dtype=None) -> torch.Tensor:
    """Stored rows ``[..., width(H)]`` uint8 as values ``[..., H]`` in ``dtype`` (default bfloat16), on their device,
    ``DECODE_VALUES`` at a time. A forged outlier index (``>= H``) is dropped, never written out of bounds (on a
    GPU that would kill the process); ``verify`` names it."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    W = fmt.width(H)
    rows = values.reshape(-1, W)
    out = torch.empty((rows.shape[0], H), dtype=dtype, device=values.device)
    step = max(1, DECODE_VALUES // max(1, H))
    for a in range(0, rows.shape[0], step):
        out[a:a + step] = _decode_rows(rows[a:a + step], H, fmt, dtype)
    return out.view(*values.shape[:-1], H)


# -- numpy: the stored bytes as values, without torch ---------------------------------------------------------
def _le_np(a: np.ndarray, dtype: str) -> np.ndarray:
    return np.ascontiguousarray(a).view(dtype)


def decode_numpy(values: np.ndarray, H: int, fmt: BlockFormat) -> np.ndarray:
    """float32 values ``[..., H]`` of stored rows ``[..., width(H)]`` uint8 (``decode`` in float32, bit for bit)."""
    lead = values.shape[:-1]
    r = np.ascontiguousarray(values).reshape(-1, fmt.width(H))
    N, nb, B, k = r.shape[0], fmt.blocks(H), fmt.block, fmt.outliers(H)
    o_scales, o_row, o_idx, o_vals, _ = fmt.offsets(H)
    packed = r[:, :o_scales]
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(N, nb, B)
    sb = r[:, o_scales:o_row]
    if fmt.scale == "e8m0":
        with np.errstate(over="ignore"):
            scale = np.where(sb == E8M0_NAN, np.float32(np.nan),
                             np.ldexp(np.float32(1), sb.astype(np.int32) - E8M0_BIAS).astype(np.float32))
    else:
        scale = fp8.decode_bits(sb) * _le_np(r[:, o_row:o_idx], "<f4")
    out = (E2M1_SIGNED[codes] * scale[..., None]).reshape(N, nb * B)
    if k:
        out = np.pad(out, ((0, 0), (0, 1)))
        idx = _le_np(r[:, o_idx:o_vals], "<u2").astype(np.int64)
        idx = np.where(idx < H, idx, nb * B)
        ov = (_le_np(r[:, o_vals:], "<u2").astype(np.uint32) << 16).view(np.float32)
        np.put_along_axis(out, idx, ov, axis=1)
    return out[:, :H].reshape(*lead, H)


def bad_rows(values: np.ndarray, H: int, fmt: BlockFormat) -> np.ndarray:
    """Per row ``[...]``: whether it holds what no writer writes and readers must not serve: a scale that is NaN or
    negative (a sign flips a whole block), a row scale not finite and positive, an outlier index out of the row or
    not strictly increasing, or an outlier value that is not finite."""
    lead = values.shape[:-1]
    r = np.ascontiguousarray(values).reshape(-1, fmt.width(H))
    k = fmt.outliers(H)
    o_scales, o_row, o_idx, o_vals, _ = fmt.offsets(H)
    sb = r[:, o_scales:o_row]
    if fmt.scale == "e8m0":
        bad = (sb == E8M0_NAN).any(axis=1)
    else:
        row = _le_np(r[:, o_row:o_idx], "<f4")[:, 0]
        bad = ((sb & 0x7F) == 0x7F).any(axis=1) | (sb >= 0x80).any(axis=1) | ~(np.isfinite(row) & (row > 0))
    if k:
        idx = _le_np(r[:, o_idx:o_vals], "<u2").astype(np.int64)
        ov = _le_np(r[:, o_vals:], "<u2")
        bad |= (idx >= H).any(axis=1) | (np.diff(idx, axis=1) <= 0).any(axis=1) | ((ov & 0x7F80) == 0x7F80).any(axis=1)
    return bad.reshape(lead)
