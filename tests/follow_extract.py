"""``hsstore extract`` for tests/test_train_follow.py, with its commits held where the test says, so what the trainer
sees is decided by the test and not by the machine's speed (the extraction itself is the product's, unchanged).

    python tests/follow_extract.py CONTROL -- <hsstore extract arguments>

``FOLLOW_HOLD=N:PATH``: after the N-th committed shard, wait until PATH exists, then write CONTROL/released with the
samples committed by then. ``FOLLOW_PAUSE=M``: after the M-th committed shard, write CONTROL/paused and hang (the
test kills the process).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path


def main() -> int:
    control = Path(sys.argv[1])
    argv = sys.argv[sys.argv.index("--") + 1:]
    from hsstore.app.cli import main as hsstore_main
    from hsstore.format import commit

    hold = os.environ.get("FOLLOW_HOLD")
    pause = int(os.environ.get("FOLLOW_PAUSE", "0"))
    publish, lock = commit.publish, threading.Lock()
    gate = threading.Event()  # cleared while held: no writer thread publishes another shard meanwhile
    gate.set()
    counts = {"shards": 0, "samples": 0}

    def held(fs, root, record):
        gate.wait()
        with lock:
            stamp = publish(fs, root, record)
            counts["shards"] += 1
            counts["samples"] += record.n_samples
            n = counts["shards"]
            if (hold and n == int(hold.split(":", 1)[0])) or n == pause:
                gate.clear()
        if hold and n == int(hold.split(":", 1)[0]):
            until = Path(hold.split(":", 1)[1])
            deadline = time.monotonic() + 300
            while not until.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            (control / "released").write_text(str(counts["samples"]))
            gate.set()
        if n == pause:
            (control / "paused").write_text(str(counts["samples"]))
            time.sleep(3600)
        return stamp

    commit.publish = held
    return hsstore_main(argv)


if __name__ == "__main__":
    sys.exit(main())
