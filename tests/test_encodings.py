"""The encodings below fp8 (``mxfp6``, ``nvfp4``, ``mxfp4``: format/microscaling.py) and the registry every command asks
(format/encodings.py): a row's bytes as docs/FORMAT.md describes them (decoded here by a reader written from that
text alone), the outlier channels, decoding on the host in torch and numpy alike and on CUDA, the rows no reader
serves, the manifest's rules, and the round trip through the writer, verify, the loader and the trainer's read-ahead.
The commands on the tiny target: tests/test_encodings_commands.py."""

import dataclasses
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import hsstore
from conftest import make_manifest, make_samples
from hsstore.errors import ManifestError, SampleError
from hsstore.format import commit, encodings, health, microscaling
from hsstore.format.encodings import Encoded
from hsstore.layouts import zarr as zarr_layout
from hsstore.ops.verify import verify
from test_loader_batching import assert_same_batches, direct_and_copied

BLOCK = ("mxfp6", "nvfp4", "mxfp4")
QUANTISED = ("fp8", *BLOCK)


# ------------------------------------------------------------------------------------------ the bytes of a row
def e4m3_by_the_book(b: int) -> float:
    """e4m3fn: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 subnormal; ``x111 1111`` NaN."""
    if b & 0x7F == 0x7F:
        return math.nan
    s, e, m = -1.0 if b & 0x80 else 1.0, (b >> 3) & 0xF, b & 7
    return s * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def element_by_the_book(code: int, m_bits: int) -> float:
    """e2m1 / e2m3: the sign bit highest, 2 exponent bits (bias 1), ``m_bits`` mantissa bits; exponent 0 subnormal."""
    sign = -1.0 if code >> (2 + m_bits) else 1.0
    e, m = (code >> m_bits) & 3, (code & ((1 << m_bits) - 1)) / (1 << m_bits)
    return sign * (m if e == 0 else (1 + m) * 2.0 ** (e - 1))


def decode_by_the_book(row: bytes, hidden: int, name: str) -> list[float]:
    """One row decoded as docs/FORMAT.md ("Encodings mxfp6, nvfp4 and mxfp4") says, in plain Python."""
    block, nvfp4, bits = {"nvfp4": (16, True, 4), "mxfp4": (32, False, 4), "mxfp6": (32, False, 6)}[name]
    n_blocks, k = -(-hidden // block), hidden // 512
    code_bytes = n_blocks * block * bits // 8
    stream = int.from_bytes(row[:code_bytes], "little")  # value i at bits [bits * i, bits * (i + 1))
    codes = [(stream >> (bits * i)) & ((1 << bits) - 1) for i in range(n_blocks * block)]
    at = code_bytes
    scales = list(row[at:at + n_blocks])
    at += n_blocks
    if nvfp4:
        (row_scale,) = struct.unpack("<f", row[at:at + 4])
        at += 4
        scale = [e4m3_by_the_book(s) * row_scale for s in scales]
    else:
        scale = [math.nan if s == 255 else 2.0 ** (s - 127) for s in scales]
    values = [element_by_the_book(c, bits - 3) * scale[i // block] for i, c in enumerate(codes[:hidden])]
    idx = struct.unpack(f"<{k}H", row[at:at + 2 * k])
    bits = struct.unpack(f"<{k}H", row[at + 2 * k:at + 4 * k])
    for i, b in zip(idx, bits):  # bfloat16: the high half of a float32
        values[i] = struct.unpack("<f", struct.pack("<I", b << 16))[0]
    return values


def hidden_rows(n: int, hidden: int, seed: int = 0, outliers: int = 0) -> torch.Tensor:
    """Rows as hidden states look: channels of lognormal scale, rows of very different magnitudes, and ``outliers``
    channels 100-1000x the median magnitude (as trained LLMs carry a few), in bfloat16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g) * torch.exp(torch.randn(hidden, generator=g) * 0.5)
    x = x * torch.logspace(-2, 2, n)[:, None]
    if outliers:
        ch = torch.randperm(hidden, generator=g)[:outliers]
        x[:, ch] *= torch.logspace(2, 3, outliers)
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("name", BLOCK)
@pytest.mark.parametrize("hidden", [100, 1024])  # a padded last block; outlier slots (one per 512 channels)
def test_row_bytes_as_the_format_says(name, hidden):
    enc = encodings.get(name)
    x = hidden_rows(12, hidden, outliers=3 if hidden >= 512 else 0)
    rows = enc.encode(x).values
    assert rows.dtype == torch.uint8 and rows.shape == (12, enc.width(hidden))
    want = {("nvfp4", 100): 7 * 8 + 7 + 4, ("mxfp4", 100): 4 * 16 + 4, ("mxfp6", 100): 4 * 24 + 4,
            ("nvfp4", 1024): 512 + 64 + 4 + 2 * 4, ("mxfp4", 1024): 512 + 32 + 2 * 4,
            ("mxfp6", 1024): 768 + 32 + 2 * 4}[name, hidden]
    assert enc.width(hidden) == enc.row_bytes(hidden, "bfloat16") == want
    got = enc.decode_numpy(rows.numpy(), None, hidden)
    for r in range(12):
        book = np.array(decode_by_the_book(bytes(rows[r].numpy()), hidden, name))
        np.testing.assert_allclose(got[r], book, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", BLOCK)
def test_packing_and_representable_values(name):
    """Values the element holds come back exactly; codes are a little-endian bit stream (4 bits: the first value of
    a pair in the byte's low nibble; 6 bits: four values in three bytes)."""
    enc = encodings.get(name)
    x = torch.zeros(1, 64)
    x[0, :10] = torch.tensor([1.0, -6.0, 0.5, 3.0, -0.5, 4.0, 1.5, -2.0, 0.0, 6.0])
    rows = enc.encode(x).values
    if name == "mxfp6":  # e2m3: 1.0 is code 8, -6 32 + 28, 0.5 4, 3.0 20; scale 2^0 (floor(log2 6) - 2 = 0)
        assert bytes(rows[0, :3].numpy()) == (8 | 60 << 6 | 4 << 12 | 20 << 18).to_bytes(3, "little")
    else:  # e2m1: 1.0 is code 2 (low nibble), -6 code 15 (high)
        assert int(rows[0, 0]) == 0xF2
    assert torch.equal(enc.decode(rows, None, 64, torch.float32), x)


# Per encoding: rows written, and the bytes docs/FORMAT.md says the store holds for them, worked out by hand from the
# element tables (e2m1 codes 0-7: 0, 0.5, 1, 1.5, 2, 3, 4, 6; e2m3: sign, 2 exponent bits of bias 1, 3 mantissa
# bits), the E8M0 rule 2^(floor(log2 amax) - 2), e4m3fn bits (bias 7) and IEEE float32/bfloat16 bits.
def row(hidden: int, **at: float) -> list[float]:
    out = [0.0] * hidden
    for k, v in at.items():
        out[int(k[1:])] = v
    return out


def hexed(*parts: str, width: int) -> bytes:
    """Bytes from ``"OFFSET:HEX"`` parts, zeros elsewhere."""
    out = bytearray(width)
    for p in parts:
        at, hx = p.split(":")
        b = bytes.fromhex(hx)
        out[int(at):int(at) + len(b)] = b
    return bytes(out)


MXFP4_ROW = row(32, c0=1.0, c1=-6.0, c2=0.5, c3=3.0, c4=2.5, c5=0.25, c6=5.0, c31=1.5)
MXFP6_ROW = row(32, c0=1.0, c1=-6.0, c2=0.5, c3=3.0, c31=7.5)
BY_HAND = {
    # bf16 bits, little-endian: 1.0 = 0x3F80, -2.0 = 0xC000, 0.5 = 0x3F00
    "raw": ([row(32, c0=1.0, c1=-2.0, c2=0.5)], [hexed("0:803f00c0003f", width=64)], None),
    # e4m3fn: 448 = 0 1111 110 (0x7E), -1 = 1 0111 000 (0xB8), 0.5 = 0 0110 000 (0x30); scale amax / 448 in
    # float32: 1.0 (0x3F800000), a zero row's 1.0, 3.5 / 448 = 2^-7 (0x3C000000)
    "fp8": ([row(32, c0=448.0, c1=-1.0, c2=0.5), row(32), row(32, c5=3.5)],
            [hexed("0:7eb830", width=32), hexed(width=32), hexed("5:7e", width=32)],
            [bytes.fromhex("0000803f"), bytes.fromhex("0000803f"), bytes.fromhex("0000003c")]),
    # one block of 32: amax 6 -> 2^(2 - 2), s = 127 (0x7F); codes 1.0 = 2, -6 = 8 + 7, 0.5 = 1, 3 = 5, 2.5 -> 2
    # (code 4: a tie, to the even code), 0.25 -> 0 (a tie), 5 -> 4 (code 6: a tie), 1.5 = 3; low nibble first.
    # A zero block: s = 0. The same row x 2^-10: s = 117 (0x75)
    "mxfp4": ([MXFP4_ROW, row(32), [v * 2.0 ** -10 for v in MXFP4_ROW]],
              [hexed("0:f2510406", "15:30", "16:7f", width=17), hexed(width=17),
               hexed("0:f2510406", "15:30", "16:75", width=17)], None),
    # e2m3 codes 1.0 = 0 01 000 (8), -6 = 1 11 100 (60), 0.5 = 0 00 100 (4), 3 = 0 10 100 (20), 7.5 = 0 11 111 (31);
    # four values in three bytes: 8 | 60 << 6 | 4 << 12 | 20 << 18 = 0x504F08; value 31 is the fourth of the last
    # three bytes: 31 << 18 = 0x7C0000; amax 7.5 -> 2^(2 - 2), s = 127
    "mxfp6": ([MXFP6_ROW, row(32)], [hexed("0:084f50", "21:00007c", "24:7f", width=25), hexed(width=25)], None),
    # row scale 10.5 / (6 * 448) = 2^-8 (float32 0x3B800000); block 0: e4m3(10.5 / (6 * 2^-8)) = e4m3(448) = 0x7E,
    # scale 1.75: codes 1.75 = 2, -10.5 = 15, 0.875 = 1, 5.25 = 5; block 1: e4m3(6 / 256 / (6 / 256)) = e4m3(1) =
    # 0x38, scale 2^-8: -6/256 = 15, 0.5/256 = 1. A zero row: row scale 1.0, block scales 0
    "nvfp4": ([row(32, c0=1.75, c1=-10.5, c2=0.875, c3=5.25, c16=-6 / 256, c17=0.5 / 256), row(32)],
              [hexed("0:f251", "8:1f", "16:7e38", "18:0000803b", width=22),
               hexed("18:0000803f", width=22)], None),
}
# 512 wide: one outlier slot (index 7, bfloat16 1000 = 0x447A); the rest's blocks as above without it: mxfp4 and
# mxfp6 amax 1 -> s = 125 (0x7D), 1.0 / 0.25 = 4 (e2m1 code 6, e2m3 0 11 000 = 24); nvfp4's row scale from the
# values outside the slot (10.5: 2^-8), 10.5 / 1.75 = 6 (code 7)
OUTLIER = {
    "mxfp4": (row(512, c0=1.0, c7=1000.0), hexed("0:06", "256:7d", "272:0700", "274:7a44", width=276)),
    "mxfp6": (row(512, c0=1.0, c7=1000.0), hexed("0:18", "384:7d", "400:0700", "402:7a44", width=404)),
    "nvfp4": (row(512, c0=10.5, c7=1000.0), hexed("0:07", "256:7e", "288:0000803b", "292:0700", "294:7a44",
                                                   width=296)),
}


def stored_bytes(url: str, name: str, rows: list[list[float]]) -> tuple[list[bytes], list[bytes] | None]:
    """``rows`` written as one sample (the same rows at every tap) and read back with zarr-python, not hsstore:
    each stored row's bytes in layer 3's array, and its scale's bytes where the encoding keeps them apart."""
    import zarr

    hidden = len(rows[0])
    m = dataclasses.replace(make_manifest(hidden=hidden), encoding=name)
    s = make_samples(1, hidden=hidden, min_len=len(rows), max_len=len(rows) + 1)[0]
    x = torch.tensor(rows, dtype=torch.bfloat16)[:, None, :].expand(-1, 3, -1).contiguous()
    assert torch.equal(x.float()[:, 0], torch.tensor(rows))  # every value written is a bfloat16 one
    with hsstore.StoreWriter(url, m) as w:
        w.add("s0", s["input_ids"], s["loss_mask"], x)
    g = zarr.open_group(url, path=f"shards/{hsstore.open(url).commits[0].shard}", mode="r")
    a = g["layer_003"][: len(rows)]
    scales = g["scale_003"][: len(rows)] if "scale_003" in g else None
    return ([a[i].astype(a.dtype.newbyteorder("<")).tobytes() for i in range(len(rows))],
            None if scales is None else [scales[i:i + 1].astype("<f4").tobytes() for i in range(len(rows))])


@pytest.mark.parametrize("name", encodings.NAMES)
def test_stored_bytes_worked_out_by_hand(tmp_path, name):
    """Each encoding's stored bytes, as zarr-python reads them from the shard, equal the bytes worked out by hand
    from docs/FORMAT.md and the element, scale and float definitions (OCP MX, NVFP4, IEEE), not from hsstore."""
    rows, want, want_scales = BY_HAND[name]
    got, scales = stored_bytes(str(tmp_path / "a"), name, rows)
    assert [g.hex() for g in got] == [w.hex() for w in want]
    assert scales == want_scales
    if name in OUTLIER:
        x, want_row = OUTLIER[name]
        got, _ = stored_bytes(str(tmp_path / "b"), name, [x])
        assert got[0].hex() == want_row.hex()


@pytest.mark.parametrize("name", BLOCK)
def test_error_and_outlier_channels(name):
    """At 5,120 wide with six channels 100-1000x the median magnitude: the outlier slots hold the largest channels
    exactly (bfloat16), so the other channels keep the error they have without outliers; without the slots, the
    outliers' blocks leave their other values at zero and that error grows by half or more."""
    enc = encodings.get(name)
    H = 5120
    x = hidden_rows(64, H, seed=1, outliers=6)
    q = enc.decode(enc.encode(x).values, None, H, torch.float32)
    top = x.float().abs().topk(6, dim=-1).indices
    assert torch.equal(q.gather(1, top), x.float().gather(1, top))  # kept exactly
    others = torch.ones_like(x, dtype=torch.bool).scatter(1, top, False)
    rel = ((q - x.float()) * others).norm(dim=-1) / (x.float() * others).norm(dim=-1)
    assert float(rel.max()) < {"mxfp6": 0.04, "nvfp4": 0.12, "mxfp4": 0.16}[name]
    bare = dataclasses.replace(enc.fmt, outlier_every=0)
    q0 = microscaling.decode(microscaling.encode(x, bare), H, bare, torch.float32)
    rel0 = ((q0 - x.float()) * others).norm(dim=-1) / (x.float() * others).norm(dim=-1)
    assert float(rel0.mean()) > 1.5 * float(rel.mean())


@pytest.mark.parametrize("name", QUANTISED)
def test_torch_and_numpy_decode_agree(name):
    """The numpy decoder (verify, subset: no torch) gives the torch decoder's float32 values, bit for bit."""
    enc = encodings.get(name)
    for hidden in (48, 1024):
        v = enc.encode(hidden_rows(40, hidden, seed=2, outliers=4))
        t = enc.decode(v.values, v.scales, hidden, torch.float32).numpy()
        values = v.values.contiguous().view(torch.uint8).numpy()
        n = enc.decode_numpy(values, None if v.scales is None else v.scales.numpy(), hidden)
        assert np.array_equal(t.view(np.uint32), n.view(np.uint32))
        assert not enc.bad_rows(values, None if v.scales is None else v.scales.numpy(), hidden).any()
    if name in BLOCK:  # every code byte, the signed zeros too, under the rows' own scales
        rows = enc.encode(hidden_rows(40, 1024, seed=4, outliers=4)).values.numpy().copy()
        o_scales = enc.fmt.offsets(1024)[0]
        rows[:, :o_scales] = (np.arange(rows.shape[0] * o_scales) % 256).reshape(rows.shape[0], o_scales)
        t = enc.decode(torch.from_numpy(rows), None, 1024, torch.float32).numpy()
        assert np.array_equal(t.view(np.uint32), enc.decode_numpy(rows, None, 1024).view(np.uint32))
        assert np.signbit(t[t == 0]).any()


# ------------------------------------------------------------------------------------------ rows no reader serves
def forged(name: str, hidden: int = 1024) -> tuple[np.ndarray, dict[str, int]]:
    """Valid rows of ``name`` and, per way of forging one, the row forged that way."""
    enc = encodings.get(name)
    rows = enc.encode(hidden_rows(8, hidden, seed=3, outliers=2)).values.numpy().copy()
    o_scales, o_row, o_idx, o_vals, _ = enc.fmt.offsets(hidden)
    ways = {}
    rows[0, o_scales] = 0x7F if name == "nvfp4" else 0xFF  # a NaN block scale
    ways["nan scale"] = 0
    if name == "nvfp4":
        rows[1, o_scales + 1] |= 0x80  # a negative block scale: the block's signs flipped
        rows[2, o_row:o_idx] = np.frombuffer(struct.pack("<f", math.inf), np.uint8)
        ways.update({"negative scale": 1, "infinite row scale": 2})
    rows[3, o_vals - 2:o_vals] = np.frombuffer(struct.pack("<H", 0xFFFF), np.uint8)  # the last index past the row
    rows[4, o_idx:o_idx + 2] = rows[4, o_idx + 2:o_idx + 4]  # the same channel twice
    rows[5, o_vals:o_vals + 2] = np.frombuffer(struct.pack("<H", 0x7FC0), np.uint8)  # a NaN outlier value
    ways.update({"index past the row": 3, "repeated index": 4, "nan outlier": 5})
    return rows, ways


@pytest.mark.parametrize("name", BLOCK)
def test_bad_rows_named(name):
    enc = encodings.get(name)
    rows, ways = forged(name)
    bad = enc.bad_rows(rows, None, 1024)
    assert sorted(np.flatnonzero(bad).tolist()) == sorted(ways.values()), ways


@pytest.mark.parametrize("name", BLOCK)
def test_forged_index_never_written_out_of_the_row(name):
    """An index past the row (no writer writes one) is dropped by the decoder, on any device: scattered out of
    bounds it would raise on the CPU and kill the process on a GPU."""
    enc = encodings.get(name)
    rows, ways = forged(name)
    r = ways["index past the row"]
    got = enc.decode(torch.from_numpy(rows), None, 1024, torch.float32)
    assert got.shape == (8, 1024) and bool(torch.isfinite(got[r]).all())
    clean = enc.decode(torch.from_numpy(rows[[6, 7]]), None, 1024, torch.float32)
    assert torch.equal(got[[6, 7]], clean)


@pytest.mark.parametrize("name", BLOCK)
def test_writer_refuses_bad_rows(tmp_path, name):
    m = dataclasses.replace(make_manifest(hidden=1024), encoding=name)
    rows, ways = forged(name)
    s = make_samples(1, hidden=1024)[0]
    with hsstore.StoreWriter(str(tmp_path), m) as w:
        values = torch.from_numpy(np.stack([rows[:8]] * 3, axis=1))  # [T, taps, W]
        with pytest.raises(SampleError, match="layer 1 has NaN/Inf features"):
            w.add("forged", s["input_ids"][:8], s["loss_mask"][:8], Encoded(values))


def test_writer_refuses_rows_of_another_encoding(tmp_path):
    """Encoded rows that are not the store's encoding's (another block encoding's width, fp8's values and scales)
    are refused with the sample and layer named, and nothing is written: read as the store's they would be noise."""
    m = dataclasses.replace(make_manifest(hidden=1024), encoding="mxfp4")
    s = make_samples(1, hidden=1024, prefix="other")[0]
    with hsstore.StoreWriter(str(tmp_path), m) as w:
        for name in ("nvfp4", "mxfp6", "fp8"):
            with pytest.raises(SampleError, match=r"other0.*layer 1: mxfp4 values must be torch.uint8 \[\d+, 552\]"):
                w.add(s["sample_id"], s["input_ids"], s["loss_mask"], encodings.get(name).encode(s["hidden_states"]))
    assert len(hsstore.open(str(tmp_path))) == 0


def test_manifest_rules(new_manifest):
    m = make_manifest()
    with pytest.raises(ManifestError, match="encoding 'fp4' not supported"):
        dataclasses.replace(m, encoding="fp4")
    with pytest.raises(ManifestError, match="layout 'wds' holds raw features only"):
        dataclasses.replace(m, encoding="nvfp4", layout="wds")
    with pytest.raises(ManifestError, match="stored with encoding 'raw' only"):
        dataclasses.replace(m, encoding="mxfp4", features=("final_hidden",))
    wide = make_manifest(hidden=70_000)
    with pytest.raises(ManifestError, match="indexes channels with 16 bits"):
        dataclasses.replace(wide, encoding="nvfp4")
    assert dataclasses.replace(wide, encoding="fp8").encoding == "fp8"


# ------------------------------------------------------------------------------------------ the store
def block_store(url: str, name: str, hidden: int = 48, n: int = 16, **kw) -> list[dict]:
    m = dataclasses.replace(make_manifest(hidden=hidden, chunk_tokens=50), encoding=name)
    samples = make_samples(n, hidden=hidden, seed=5)
    with hsstore.StoreWriter(url, m, shard_bytes=kw.pop("shard_bytes", 40_000), **kw) as w:
        for j, s in enumerate(samples):  # encoded by the caller (as extraction does on the GPU) or by the writer
            hs = encodings.get(name).encode(s["hidden_states"]) if j % 2 else s["hidden_states"]
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], hs)
    return samples


@pytest.mark.parametrize("name", BLOCK)
@pytest.mark.parametrize("hidden", [48, pytest.param(1024, marks=pytest.mark.slow)])  # wide: seconds of encoding
def test_store_roundtrip_and_verify(tmp_path, name, hidden):
    enc = encodings.get(name)
    samples = block_store(str(tmp_path), name, hidden, n=16 if hidden < 512 else 6)  # wide rows: a shard each
    store = hsstore.open(str(tmp_path))
    assert len(store.commits) > 1 and store.manifest.encoding == name
    by_id = {s["sample_id"]: s for s in samples}
    for i in range(len(store)):
        raw = store.read(i, dequantise=False)
        x = by_id[raw["sample_id"]]["hidden_states"]
        want = enc.encode(x).values
        assert raw["hidden_states"].dtype == torch.uint8 and torch.equal(raw["hidden_states"], want)
        assert torch.equal(store.read(i)["hidden_states"], enc.decode(want, None, hidden))
        assert torch.equal(store.read(i, layers=[5])["hidden_states"], enc.decode(want[:, -1:], None, hidden))
    assert [x["sample_id"] for x in store] == store.sample_ids()
    assert verify(store).ok
    stats = store.commits[0].stats["features"]["1"]  # of the values a reader decodes
    assert stats["count"] == store.commits[0].n_tokens * hidden


def publish_rows(store0, feats: dict[int, np.ndarray]) -> None:
    """A shard of two 4-token samples s0 and s1 holding rows ``feats`` (8 per layer), written with valid checksums
    and record, as a team that forged its bytes would publish it."""
    cols = {"sample_id": ["s0", "s1"], "source": ["", ""], "length": [4, 4], "loss_tokens": [1, 1],
            "thinking_tokens": [0, 0], "flags": [[], []]}
    mask = np.array([0, 0, 0, 1, 0, 0, 0, 1], np.uint8)
    rec = zarr_layout.write_shard(store0.fs, store0.root, "w-00000000-00000", "w", store0.manifest, feats,
                                  np.arange(8, dtype=np.int32), mask, cols)
    commit.publish(store0.fs, store0.root, rec)


def test_verify_names_forged_rows(tmp_path):
    """A shard whose rows no writer writes (an outlier index past the row: its values stay finite) written with
    valid checksums and record: verify fails it, naming the sample."""
    m = dataclasses.replace(make_manifest(hidden=1024, chunk_tokens=64), encoding="nvfp4")
    hsstore.StoreWriter(str(tmp_path), m).close()  # creates the store
    store0 = hsstore.open(str(tmp_path))
    rows, ways = forged("nvfp4")
    good = encodings.get("nvfp4").encode(hidden_rows(8, 1024, seed=4, outliers=2)).values.numpy()
    feats = {l: good.copy() for l in m.layers}
    feats[3][2] = rows[ways["index past the row"]]
    publish_rows(store0, feats)
    problems = verify(hsstore.open(str(tmp_path))).problems
    assert len(problems) == 1 and "layer 3: 1 row(s) with a NaN or negative scale or an outlier index" in str(
        problems[0])
    assert problems[0].samples == ["s0"]


def past_bfloat16(url: str) -> dict[int, np.ndarray]:
    """An nvfp4 store at ``url`` of one shard (``publish_rows``) whose layer 3 holds, at sample s1's second token, a
    row whose scales multiply past bfloat16's largest value (6 x 448 x a row scale of 2.53e35); its rows by layer."""
    m = dataclasses.replace(make_manifest(hidden=1024, chunk_tokens=64), encoding="nvfp4")
    hsstore.StoreWriter(url, m).close()
    enc = encodings.get("nvfp4")
    good = enc.encode(hidden_rows(8, 1024, seed=4)).values.numpy()
    o_scales, o_row, o_idx, _, _ = enc.fmt.offsets(1024)
    row = good[5].copy()
    row[:o_scales] = 0x77  # every code e2m1's 6
    row[o_scales:o_row] = 0x7E  # every block scale e4m3's 448
    row[o_row:o_idx] = np.frombuffer(np.float32(3.40e38 / (6 * 448)).tobytes(), np.uint8)
    assert np.isfinite(enc.decode_numpy(row[None], None, 1024)).all()  # finite in float32
    assert not torch.isfinite(enc.decode(torch.from_numpy(row[None]), None, 1024, torch.bfloat16)).all()
    feats = {l: good.copy() for l in m.layers}
    feats[3][5] = row
    publish_rows(hsstore.open(url), feats)
    return feats


def test_verify_names_rows_that_decode_past_bfloat16(tmp_path):
    """An nvfp4 row whose scales multiply to a value finite in float32 but past bfloat16's largest (6 x 448 x a row
    scale of 2.53e35; no writer writes one: its scales come from bfloat16 values): readers decode into the store's
    bfloat16, where it is infinite, so verify counts it non-finite as they would see it, naming the sample; a copy's
    record statistics count it too (``bits_stats``), so train refuses the copy."""
    enc = encodings.get("nvfp4")
    feats = past_bfloat16(str(tmp_path))
    problems = verify(hsstore.open(str(tmp_path))).problems
    assert len(problems) == 1 and "layer 3: non-finite values" in str(problems[0]), problems
    assert problems[0].samples == ["s1"]
    stats = health.bits_stats(feats[3][None, 4:], "bfloat16", encoding="nvfp4", hidden=1024)
    assert stats[0, health.SUMS.index("nonfinite")] == 1024 - enc.fmt.outliers(1024)  # the outliers keep theirs


@pytest.mark.parametrize("how", [["--encoding", "raw"], ["--encoding", "fp8"], ["--codec", "zstd"]])
def test_convert_refuses_rows_that_decode_past_bfloat16(tmp_path, capsys, how):
    """``convert`` of that store, into raw or fp8 (decoded, then encoded again) or bit-exact into another codec:
    refused in one line naming the sample, the layer and the token, exit 2, nothing of the shard written and no lock
    left (without the check: exit 0, and the copy holds infinities that verify fails)."""
    from hsstore.app.cli import main

    url, dst = str(tmp_path / "s"), str(tmp_path / "d")
    past_bfloat16(url)
    assert main(["convert", url, dst, *how, "-q"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "sample 's1': layer 3 has NaN/Inf features (first at token 1)" in err[0], err
    assert not list(Path(dst, "commits").glob("*.json")) and not list(Path(dst, "locks").glob("*"))


@pytest.mark.parametrize("name", BLOCK)
def test_loader_batches_and_host_decoding(tmp_path, monkeypatch, name):
    """Items and batches hold the stored bytes (what crosses to the trainer's device); the trainer's read-ahead
    decodes them after the copy; ``Reading(dequantise=True)`` decodes on the host. All give the store's values."""
    from hsstore.train.data import read_ahead

    enc = encodings.get(name)
    block_store(str(tmp_path), name, n=12)
    store = hsstore.open(str(tmp_path))
    decoded = {store.read(i)["sample_id"]: store.read(i, layers=[1, 5])["hidden_states"] for i in range(len(store))}
    items = list(hsstore.HiddenStateDataset(str(tmp_path), layers=[1, 5]))
    assert all(x["hidden_states"].dtype == torch.uint8 and x["hidden_states"].shape[-1] == enc.width(48)
               for x in items)
    host = list(hsstore.HiddenStateDataset(str(tmp_path), layers=[1, 5], reading=hsstore.Reading(dequantise=True)))
    assert all(torch.equal(h["hidden_states"], decoded[h["sample_id"]]) for h in host)
    for mode in ("pad", "pack"):  # bytes read straight into their batch slots, or collated
        assert_same_batches(*direct_and_copied(lambda: hsstore.TokenBatches(
            hsstore.HiddenStateDataset(str(tmp_path), layers=[1, 5]), token_budget=300, mode=mode), monkeypatch))
    source = hsstore.TokenBatches(hsstore.HiddenStateDataset(str(tmp_path), layers=[1, 5]), token_budget=300)
    m = store.manifest
    for batch, _ in read_ahead(source, lambda b: b, torch.device("cpu"),
                               decode=lambda b: encodings.decode_batch(b, name, m.hidden_size, torch.bfloat16)):
        assert batch["hidden_states"].dtype == torch.bfloat16
        assert encodings.decode_batch(batch, name, m.hidden_size) is batch  # decoded once (the step asks again)
        for b, (sid, n) in enumerate(zip(batch["sample_id"], batch["lengths"].tolist())):
            assert torch.equal(batch["hidden_states"][b, :n], decoded[sid])
            assert not bool(batch["hidden_states"][b, n:].float().any())  # padding decodes to zeros


# ------------------------------------------------------------------------------------------ on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", QUANTISED)
def test_cuda_encode_and_decode_equal_the_cpu(name):
    """Extraction encodes on its GPU and training decodes on its GPU: the bytes and values are the host's."""
    enc = encodings.get(name)
    for hidden in (48, 5120):
        x = hidden_rows(300, hidden, seed=6, outliers=6)
        cpu = enc.encode(x)
        gpu = enc.encode(x.cuda())
        assert torch.equal(gpu.values.cpu().view(torch.uint8), cpu.values.view(torch.uint8))
        if cpu.scales is not None:
            assert torch.equal(gpu.scales.cpu(), cpu.scales)
        for dtype in (torch.float32, torch.bfloat16):
            got = enc.decode(gpu.values, gpu.scales, hidden, dtype)
            assert got.is_cuda and torch.equal(got.cpu(), enc.decode(cpu.values, cpu.scales, hidden, dtype))
    rows, ways = forged(name) if name in BLOCK else (None, None)
    if rows is not None:  # a forged index: dropped on the device too, not a device-side assert
        got = enc.decode(torch.from_numpy(rows).cuda(), None, 1024, torch.float32)
        assert bool(torch.isfinite(got[ways["index past the row"]]).all())
        torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("name", BLOCK)
def test_cuda_read_ahead_decodes_on_the_device(tmp_path, name):
    """The trainer's read-ahead copies the stored bytes to the GPU on its side stream and decodes them there."""
    from hsstore.train.data import read_ahead

    block_store(str(tmp_path), name, n=8)
    store = hsstore.open(str(tmp_path))
    decoded = {store.read(i)["sample_id"]: store.read(i, layers=[1, 5])["hidden_states"] for i in range(len(store))}
    source = hsstore.TokenBatches(hsstore.HiddenStateDataset(str(tmp_path), layers=[1, 5]), token_budget=300)
    seen = 0
    for batch, _ in read_ahead(source, lambda b: b, torch.device("cuda"),
                               decode=lambda b: encodings.decode_batch(b, name, 48, torch.bfloat16)):
        assert batch["hidden_states"].is_cuda and batch["hidden_states"].dtype == torch.bfloat16
        for b, (sid, n) in enumerate(zip(batch["sample_id"], batch["lengths"].tolist())):
            assert torch.equal(batch["hidden_states"][b, :n].cpu(), decoded[sid])
            seen += 1
    assert seen == len(store)
