"""memory.pread_into, the local read path of both layouts (``preadv`` straight into the destination)."""

from __future__ import annotations

import numpy as np


def test_pread_into_fills_buffers_in_turn_and_reports_a_short_file(tmp_path):
    """``pread_into`` reads a real file across several buffers; at the end of the file it returns what it got."""
    from hsstore.io.memory import pread_into

    data = bytes(range(256)) * 40  # 10,240 bytes
    path = tmp_path / "f"
    path.write_bytes(data)
    with open(path, "rb", buffering=0) as f:
        a, b = np.empty(4096, np.uint8), bytearray(4096)
        assert pread_into(f.fileno(), [a, b], 1000) == 8192
        assert a.tobytes() + bytes(b) == data[1000:9192]
        c = np.zeros(4096, np.uint8)
        assert pread_into(f.fileno(), [c], 8192) == 2048  # the file ends first
        assert c[:2048].tobytes() == data[8192:] and not c[2048:].any()
        assert pread_into(f.fileno(), [c], len(data) + 5) == 0


def test_pread_fold_checksums_block_by_block_what_one_pass_checksums(tmp_path, monkeypatch):
    """``pread_fold`` reads a file in blocks (a small block here: several of them, the last one short) and folds
    every block into the CRC32C: the bytes and the checksum equal one read and one checksum of the whole; a file
    that ends early gives fewer bytes and the checksum of what was read."""
    from hsstore.io import memory
    from hsstore.format import codec

    data = np.random.default_rng(0).integers(0, 256, 10_500, dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    with open(path, "rb", buffering=0) as f:
        dest = np.zeros(10_000, np.uint8)
        got, crc = memory.pread_fold(f.fileno(), dest, 300, codec.crc32c, block=1000)
        assert got == 10_000 and dest.tobytes() == data[300:10_300]
        assert crc == codec.crc32c(data[300:10_300])
        start = codec.crc32c(b"header")
        got, crc = memory.pread_fold(f.fileno(), dest, 7_000, codec.crc32c, start, block=1000)
        assert got == 3_500 and dest[:3_500].tobytes() == data[7_000:]
        assert crc == codec.crc32c(b"header" + data[7_000:])
        calls = []
        got, crc = memory.pread_fold(f.fileno(), dest, 300, lambda b, c: calls.append(len(b)) or codec.crc32c(b, c),
                                     block=1000)
        assert got == 10_000 and calls == [1000] * 10 and crc == codec.crc32c(data[300:10_300])
