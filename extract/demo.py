"""``hsstore demo``: the main job, end to end, on an embedded default, in well under two minutes on a CPU.

Builds the tiny Qwen3.5-architecture target and tokenizer offline, runs the quality gate on the
bundled regenerated conversations (which include a few stubs the gate reports), extracts to a local
store, prints ``info`` and verifies every byte, then trains a small DFlash drafter from the store alone
(the target directory is moved out of reach first, to show it is not needed) and evaluates it with
speculative decoding against the target.
"""

from __future__ import annotations

import json
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
    step("1/7 build the tiny Qwen3.5-architecture target (random weights, local tokenizer)")
    target = build_tiny_target(out / "target")
    print(f"target: {target}")
    data = str(demo_conversations_path())
    store = str(out / "store")
    step("2/7 quality gate on the bundled conversations (hsstore check)")
    rc = hsstore_main(["check", "--model", str(target), "--input", data])
    if rc not in (0, 1):
        return rc
    step("3/7 extract hidden states (hsstore extract)")
    rc = hsstore_main(["extract", "--model", str(target), "--input", data, "--out", store, "--device", "cpu"])
    if rc:
        return rc
    step("4/7 what the store holds (hsstore info)")
    rc = hsstore_main(["info", store])
    if rc:
        return rc
    step("5/7 re-read and check every byte (hsstore verify)")
    rc = hsstore_main(["verify", store, "--quiet"])
    if rc:
        return rc
    step("6/7 train a drafter from the store alone (hsstore train; the target directory is out of reach)")
    run = str(out / "run")
    hidden = out / ".target-hidden"
    target.rename(hidden)  # training must not need it
    try:
        rc = hsstore_main(["train", "--store", store, "--out", run, "--steps", "40", "--draft-layers", "1",
                           "--anchors", "64", "--max-tokens", "2048", "--log-every", "10", "--device", "cpu",
                           "--no-progress"])
    finally:
        hidden.rename(target)
    if rc:
        return rc
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    print(f"loss {rows[0]['loss']:.3f} (step {rows[0]['step']}) -> {rows[-1]['loss']:.3f} (step {rows[-1]['step']}); "
          f"draft-position accuracy {rows[-1]['acc']:.3f}")
    step("7/7 speculative decoding with the target and the drafter (hsstore eval)")
    rc = hsstore_main(["eval", "--store", store, "--drafter", run, "--model", str(target), "--input", data,
                       "--num-samples", "4", "--max-new-tokens", "32", "--device", "cpu"])
    if rc:
        return rc
    print("(the tiny target has random weights: its frozen lm_head gives the drafter nearly flat logits, and its "
          "greedy text\n is not what the store's responses teach, so the loss moves little and tau stays near 1 "
          "here; the point is\n the pipeline: training from the store alone, and speculative output == target output)")
    print(f"\ndemo done in {time.perf_counter() - t0:.1f}s; read a sample: hsstore show {store} 0; "
          f"training curve: {run}/metrics.jsonl")
    return 0
