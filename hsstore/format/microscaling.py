"""Block-scaled encodings: small floats (e2m1, 4 bits; e2m3, 6 bits) with a shared scale per block of values, as OCP
Microscaling (``mxfp4``, ``mxfp6``) and NVIDIA's NVFP4 (``nvfp4``) define them, and a few outlier channels per row
kept in bfloat16.

Why: fp8 halves bf16 features; 4 bits with a scale per block of 16 or 32 values quarter them (the scales add 1/16
or 1/32 of a byte per value), which is what a store of the seeds' corpus needs to fit under a third of its bf16
size; 6 bits lie between. A per-row scale (fp8's) cannot carry so few bits: one large channel would leave every
other value of the row at zero; a block's own scale confines that to the block.

A row (one token of one tapped layer, ``hidden`` values) is stored as one run of bytes, so it decodes alone:

    codes     n_blocks * block * bits / 8 bytes   the values' codes as one little-endian bit stream: value i in bits
                                                  [bits * i, bits * (i + 1)) (4 bits: value 2i in a byte's low nibble)
    scales    n_blocks bytes                      one per block: E8M0 (mxfp4, mxfp6) or e4m3fn (nvfp4)
    row scale 4 bytes (nvfp4 only)                float32, little-endian: NVFP4's second-level scale, per row
    outliers  k * 2 bytes, then k * 2             k uint16 channel indices (strictly increasing), then their bfloat16
                                                  values, little-endian (k = hidden // outlier_every; 0 below it)

``n_blocks = ceil(hidden / block)``; the last block is padded with zero values. A code is a sign bit (the highest),
``e_bits`` exponent bits with bias 1 and ``m_bits`` mantissa bits: e2m1 holds 0, 0.5, 1, 1.5, 2, 3, 4, 6; e2m3
0 to 7.5 in steps of 1/8 below 1. Decoding a value is ``element(code) * block_scale`` (E8M0: ``2^(e - 127)``, code
255 NaN) or ``element(code) * e4m3(scale) * row_scale`` (nvfp4); then each outlier's channel takes its bfloat16
value (its code is 0).

Encoding (the decoder needs none of it): the outliers are the ``k`` channels of largest magnitude in the row; then,
per block, E8M0 takes the OCP rule ``2^(floor(log2(amax)) - 2)`` (2: both elements' largest exponent; values above
the element's largest saturate), nvfp4 ``row_scale = amax(row) / (6 * 448)`` and ``e4m3(amax(block) / (6 *
row_scale))``; values round to the nearest element (ties to the even code) after division by the block's scale.
Outlier channels: trained LLMs' hidden states carry a few channels 100-1000x the median magnitude; in their own
block they leave the other values at zero. Kept apart in bfloat16 (4 bytes each), they cost one slot per
``outlier_every`` channels (0.7% of an nvfp4 row at 5,120 wide) and bring the error of the other channels back to
what they have without outliers (docs/PERFORMANCE.md, "Encodings below fp8").

Torch functions run on the tensors' device (the extraction and training GPUs); ``decode_numpy`` and ``bad_rows``
are numpy only, for the commands that never load torch (verify, subset).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import fp8

if TYPE_CHECKING:
    import torch

E4M3_MAX = fp8.FP8_MAX
E8M0_BIAS = 127
E8M0_NAN = 255
E_MAX = 2  # the largest exponent of e2m1 and e2m3 (bias 1): the OCP rule's emax_elem
# values encoded or decoded at a time: bounds the temporaries (a few float32 and int32 copies) beside the target or the
# drafter on their GPU
DECODE_VALUES = 1 << 24


@dataclass(frozen=True)
class Element:
    """A small float without infinities or NaN: a sign bit, ``e_bits`` exponent bits (bias 1), ``m_bits`` mantissa
    bits."""

    e_bits: int
    m_bits: int

    @property
    def bits(self) -> int:
        return 1 + self.e_bits + self.m_bits

    def magnitudes(self) -> np.ndarray:
        """float32 magnitude of each non-negative code, ascending (subnormal when the exponent bits are 0)."""
        m = np.arange(1 << (self.e_bits + self.m_bits))
        e, frac = m >> self.m_bits, (m & ((1 << self.m_bits) - 1)) / (1 << self.m_bits)
        return np.where(e == 0, frac, (1 + frac) * 2.0 ** (e - 1)).astype(np.float32)

    @property
    def max(self) -> float:
        return float(self.magnitudes()[-1])

    def values(self) -> np.ndarray:
        """float32 value of every code (the sign bit highest; its code with magnitude 0 is -0)."""
        mags = self.magnitudes()
        return np.concatenate([mags, -mags]).astype(np.float32)


E2M1 = Element(2, 1)
E2M3 = Element(2, 3)


@dataclass(frozen=True)
class BlockFormat:
    """One block encoding: ``element`` values, ``block`` of them per scale, the scale's kind (``e8m0``: a power of
    two; ``e4m3``: an fp8 value under a float32 row scale), one outlier slot per ``outlier_every`` channels."""

    element: Element
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

    @property
    def group(self) -> int:
        """Values whose codes fill whole bytes (4 bits: 2 in 1 byte; 6 bits: 4 in 3 bytes)."""
        return 8 // math.gcd(8, self.element.bits)

    def offsets(self, hidden: int) -> tuple[int, int, int, int, int]:
        """Byte offsets in a row: (scales, row scale, outlier indices, outlier values, end = the row's width)."""
        nb, k = self.blocks(hidden), self.outliers(hidden)
        scales = nb * self.block * self.element.bits // 8
        row = scales + nb
        idx = row + self.row_scale_bytes
        vals = idx + 2 * k
        return scales, row, idx, vals, vals + 2 * k

    def width(self, hidden: int) -> int:
        return self.offsets(hidden)[4]


NVFP4 = BlockFormat(E2M1, block=16, scale="e4m3")
MXFP4 = BlockFormat(E2M1, block=32, scale="e8m0")
MXFP6 = BlockFormat(E2M3, block=32, scale="e8m0")


# -- torch: encode and decode on the device ------------------------------------------------------------------
def _codes(y: torch.Tensor, el: Element) -> torch.Tensor:
    """Element codes (uint8, the sign bit highest) of float32 ``y`` already divided by its scale: the nearest value,
    ties to the even code, saturating at the element's largest."""
    import torch

    mags = torch.as_tensor(el.magnitudes(), device=y.device)
    mids = (mags[1:] + mags[:-1]) / 2
    a = y.abs().clamp_(max=el.max)
    lo = torch.bucketize(a, mids, right=False, out_int32=True)
    hi = torch.bucketize(a, mids, right=True, out_int32=True)
    code = torch.where((lo != hi) & (lo % 2 == 1), hi, lo).to(torch.uint8)  # a tie: the even neighbour
    return code | ((y < 0) & (code > 0)).to(torch.uint8) << (el.bits - 1)


def _pack(codes: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Codes ``[N, n]`` (uint8) as the little-endian bit stream of ``bits`` per code: ``[N, n * bits / 8]``."""
    import torch

    g, bits = fmt.group, fmt.element.bits
    c = codes.view(codes.shape[0], -1, g).to(torch.int32)
    word = sum(c[..., j] << (bits * j) for j in range(g))
    nbytes = g * bits // 8
    return torch.stack([(word >> (8 * b)) & 0xFF for b in range(nbytes)], dim=-1).to(torch.uint8).view(
        codes.shape[0], -1)


def _unpack(packed: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """``_pack``'s inverse: ``[N, n]`` codes (uint8)."""
    import torch

    g, bits = fmt.group, fmt.element.bits
    nbytes = g * bits // 8
    b = packed.view(packed.shape[0], -1, nbytes).to(torch.int32)
    word = sum(b[..., k] << (8 * k) for k in range(nbytes))
    mask = (1 << bits) - 1
    return torch.stack([(word >> (bits * j)) & mask for j in range(g)], dim=-1).to(torch.uint8).view(
        packed.shape[0], -1)


def _split_outliers(xf: torch.Tensor, k: int):
    """(``xf`` with its ``k`` largest-magnitude channels per row set to zero, their indices ascending, their values
    in bfloat16)."""
    import torch

    idx = xf.abs().topk(k, dim=-1).indices.sort(dim=-1).values
    vals = torch.gather(xf, -1, idx).to(torch.bfloat16)
    return xf.scatter(-1, idx, 0.0), idx, vals


def encode(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Rows ``[..., H]`` (any float dtype, finite) as the format's bytes ``[..., width(H)]`` uint8, on ``x``'s
    device, ``DECODE_VALUES`` at a time."""
    import torch

    H = x.shape[-1]
    rows = x.reshape(-1, H)
    out = torch.empty((rows.shape[0], fmt.width(H)), dtype=torch.uint8, device=x.device)
    step = max(1, DECODE_VALUES // max(1, H))
    for a in range(0, rows.shape[0], step):
        out[a:a + step] = _encode_rows(rows[a:a + step], fmt)
    return out.view(*x.shape[:-1], fmt.width(H))


def _encode_rows(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """``encode`` of a 2-D run of rows."""
    import torch

    H = x.shape[-1]
    xf = x.float()
    N, nb, B, k, el = xf.shape[0], fmt.blocks(H), fmt.block, fmt.outliers(H), fmt.element
    if k:
        xf, idx, ovals = _split_outliers(xf, k)
    if nb * B != H:
        xf = torch.nn.functional.pad(xf, (0, nb * B - H))
    xb = xf.view(N, nb, B)
    amax = xb.abs().amax(-1)  # [N, nb]
    if fmt.scale == "e8m0":
        _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
        exp = torch.where(amax > 0, e - 1 - E_MAX, torch.full_like(e, -E8M0_BIAS)).clamp_(-E8M0_BIAS, E8M0_BIAS)
        scale = torch.exp2(exp.float())
        parts_scale = [(exp + E8M0_BIAS).to(torch.uint8)]
    else:
        row_amax = amax.amax(-1)
        row = torch.where(row_amax > 0, row_amax / (el.max * E4M3_MAX), torch.ones_like(row_amax))
        bs = (amax / (el.max * row[:, None])).clamp_(max=E4M3_MAX).to(torch.float8_e4m3fn)
        scale = bs.float() * row[:, None]
        parts_scale = [bs.view(torch.uint8), row.contiguous().view(torch.uint8).view(N, 4)]
    y = torch.where(scale[..., None] > 0, xb / torch.where(scale > 0, scale, 1.0)[..., None], 0.0)
    parts = [_pack(_codes(y, el).view(N, nb * B), fmt), *parts_scale]
    if k:
        parts.append(idx.to(torch.int32).to(torch.int16).view(torch.uint8).view(N, 2 * k))
        parts.append(ovals.contiguous().view(torch.uint8).view(N, 2 * k))
    return torch.cat(parts, dim=1)


def _le(t: torch.Tensor, dtype) -> torch.Tensor:
    """Columns of little-endian bytes ``[N, n * size]`` as ``[N, n]`` of ``dtype`` (a fresh copy: aligned for any
    offset of the columns in the row)."""
    import torch

    return t.clone(memory_format=torch.contiguous_format).view(dtype)


@functools.lru_cache(maxsize=None)
def _code_values(el: Element, device) -> torch.Tensor:
    """float32 value of every code of ``el`` on ``device``: a decode looks each code up, one gather where the
    arithmetic on its bits takes several passes (the same values, so the same bits)."""
    import torch

    return torch.as_tensor(el.values(), device=device)


@functools.lru_cache(maxsize=None)
def _byte_values(el: Element, device) -> torch.Tensor:
    """``[256, 2]``: the values of the two 4-bit codes of every byte, the low half's first (``_pack``'s order)."""
    import torch

    b = torch.arange(256, device=device)
    values = _code_values(el, device)
    return torch.stack([values[b & 15], values[b >> 4]], dim=-1)


def _decode_rows(r: torch.Tensor, H: int, fmt: BlockFormat, dtype) -> torch.Tensor:
    """``decode`` of a 2-D run of rows."""
    import torch

    N, nb, B, k, el = r.shape[0], fmt.blocks(H), fmt.block, fmt.outliers(H), fmt.element
    o_scales, o_row, o_idx, o_vals, _ = fmt.offsets(H)
    if el.bits == 4:  # two codes a byte: a byte's pair of values in one lookup
        elements = _byte_values(el, r.device).index_select(0, r[:, :o_scales].reshape(-1).int())
    else:
        elements = _code_values(el, r.device).index_select(0, _unpack(r[:, :o_scales], fmt).reshape(-1).int())
    elements = elements.view(N, nb, B)
    sb = r[:, o_scales:o_row]
    if fmt.scale == "e8m0":
        scale = torch.where(sb == E8M0_NAN, float("nan"), torch.exp2(sb.float() - E8M0_BIAS))
    else:
        scale = sb.contiguous().view(torch.float8_e4m3fn).float() * _le(r[:, o_row:o_idx], torch.float32)
    out = (elements * scale[..., None]).view(N, nb * B)
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


def _unpack_np(packed: np.ndarray, fmt: BlockFormat) -> np.ndarray:
    g, bits = fmt.group, fmt.element.bits
    nbytes = g * bits // 8
    b = packed.reshape(packed.shape[0], -1, nbytes).astype(np.int32)
    word = sum(b[..., k] << (8 * k) for k in range(nbytes))
    mask = (1 << bits) - 1
    return np.stack([(word >> (bits * j)) & mask for j in range(g)], axis=-1).reshape(packed.shape[0], -1)


def decode_numpy(values: np.ndarray, H: int, fmt: BlockFormat) -> np.ndarray:
    """float32 values ``[..., H]`` of stored rows ``[..., width(H)]`` uint8 (``decode`` in float32, bit for bit)."""
    lead = values.shape[:-1]
    r = np.ascontiguousarray(values).reshape(-1, fmt.width(H))
    N, nb, B, k = r.shape[0], fmt.blocks(H), fmt.block, fmt.outliers(H)
    o_scales, o_row, o_idx, o_vals, _ = fmt.offsets(H)
    codes = _unpack_np(r[:, :o_scales], fmt).reshape(N, nb, B)
    sb = r[:, o_scales:o_row]
    if fmt.scale == "e8m0":
        with np.errstate(over="ignore"):
            scale = np.where(sb == E8M0_NAN, np.float32(np.nan),
                             np.ldexp(np.float32(1), sb.astype(np.int32) - E8M0_BIAS).astype(np.float32))
    else:
        scale = fp8.decode_bits(sb) * _le_np(r[:, o_row:o_idx], "<f4")
    with np.errstate(over="ignore", invalid="ignore"):  # a forged scale: inf or NaN, which verify counts
        out = (fmt.element.values()[codes] * scale[..., None]).reshape(N, nb * B)
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
