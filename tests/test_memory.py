"""memory.pread_into, the local read path of both layouts (``preadv`` straight into the destination)."""

from __future__ import annotations

import numpy as np


def test_pread_into_fills_buffers_in_turn_and_reports_a_short_file(tmp_path):
    """``pread_into`` reads a real file across several buffers; at the end of the file it returns what it got."""
    from hsstore.memory import pread_into

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
