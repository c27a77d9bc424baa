"""``hsstore demo``: the main job, end to end, on an embedded default, in well under two minutes on a CPU.

Builds the tiny Qwen3.5-architecture target and tokenizer offline, runs the quality gate on the
bundled regenerated conversations (which include a few stubs the gate reports), extracts to a local
store, prints ``info`` and verifies every byte.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from hsstore.cli import main as hsstore_main

from .tiny import build_tiny_target, demo_conversations_path


def step(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def run_demo(out: str | Path = "hsstore-demo") -> int:
    t0 = time.perf_counter()
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    step("1/5 build the tiny Qwen3.5-architecture target (random weights, local tokenizer)")
    target = build_tiny_target(out / "target")
    print(f"target: {target}")
    data = str(demo_conversations_path())
    store = str(out / "store")
    step("2/5 quality gate on the bundled conversations (hsstore check)")
    rc = hsstore_main(["check", "--model", str(target), "--input", data])
    if rc not in (0, 1):
        return rc
    step("3/5 extract hidden states (hsstore extract)")
    rc = hsstore_main(["extract", "--model", str(target), "--input", data, "--out", store, "--device", "cpu"])
    if rc:
        return rc
    step("4/5 what the store holds (hsstore info)")
    rc = hsstore_main(["info", store])
    if rc:
        return rc
    step("5/5 re-read and check every byte (hsstore verify)")
    rc = hsstore_main(["verify", store, "--quiet"])
    if rc:
        return rc
    print(f"\ndemo done in {time.perf_counter() - t0:.1f}s; read a sample: hsstore show {store} 0")
    return 0
