"""``hsstore demo``: the main job, end to end, on a tiny trained target, in about 2 minutes on 2 CPU cores. Left
to itself it runs on the device that runs it fastest (:func:`choose_device`, which says why): the CPU, also on a
GPU machine, where the tiny models' steps are launch-bound and the kernels' first-use compiles cost more than
the whole CPU run; ``--device`` chooses.

The target is the tiny Qwen3.5-architecture model shipped with the package, trained by
``tools/train_tiny_target.py`` on a structured synthetic corpus, so that its answers are predictable and
a drafter that reads its features really learns (a random-weight target would give tau ~ 1 whatever the
pipeline did). The demo's conversations are that target's own greedy answers to prompts it was not
trained on, as ``hsstore regenerate`` would produce them. The demo runs the quality gate on them,
extracts a store, prints ``info``, verifies every byte, trains a small DFlash drafter from the store alone
(the target directory is moved out of reach first, to show it is not needed) and evaluates it with
speculative decoding against the target on held-out prompts, next to the target alone. Every step prints
the ``hsstore`` command it runs.

``--out`` is never wiped blindly: the demo refuses a non-empty folder it did not create, and on a re-run
removes only the entries its marker file lists.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil
import time
from pathlib import Path

from hsstore.app.cli import main as hsstore_main
from hsstore.app.devices import describe, resolve_device

from .tiny import build_trained_target, trained_files

#: Written into --out; lists what the demo created there, which is all a later run may remove.
MARKER = ".hsstore-demo"
CREATED = ("target", "data", "store", "run", ".target-hidden", "store.html", "run.html")

# Drafter training and eval: most of the whole demo's 2 minutes on 2 CPU cores. Two draft layers: with one, whose
# block queries are all the same mask token, draft accuracy was 0.2 after 1,000 steps on this target, with two 0.65
# after 500. The 32-position window of the first layer (the last one sees the whole context) learns a little faster.
TRAIN_STEPS = 500
# No -q: the steps that take minutes (extract, train) show their progress bars.
TRAIN_FLAGS = ["--draft-layers", "2", "--sliding-window", "32", "--anchors", "16", "--token-budget", "4096", "--lr", "3e-3",
               "--log-every", "50"]
EVAL_SAMPLES = 16
EVAL_MAX_NEW_TOKENS = 160
EVAL_FLAGS = ["--max-new-tokens", str(EVAL_MAX_NEW_TOKENS)]


# ``hsstore demo`` wall seconds, measured on each kind of device (docs/PERFORMANCE.md, "Demo and drafter quality"):
# a GPU machine's fresh run (its kernels compiling on first use) and the slowest run on 2 CPU cores
MEASURED_SECONDS = {"cuda": 289.0, "cpu": 119.0}


def choose_device(requested: str | None) -> tuple[str, str]:
    """(device, why): ``--device`` as given, else the CPU where there is no GPU, else the device whose measured
    demo ran faster (``MEASURED_SECONDS``)."""
    dev = resolve_device(requested)
    if requested:
        return str(dev), "--device"
    if dev.type != "cuda":
        return str(dev), "no GPU"
    gpu, cpu = MEASURED_SECONDS["cuda"], MEASURED_SECONDS["cpu"]
    if gpu < cpu:
        return str(dev), f"measured: {gpu:.0f}s on a GPU machine against {cpu:.0f}s on 2 CPU cores"
    return "cpu", (f"faster here than {describe(dev)}: this tiny target and drafter are launch-bound on a GPU, whose "
                   f"first-use kernel compiles cost more than the work (measured {gpu:.0f}s there against {cpu:.0f}s "
                   "on 2 CPU cores); --device cuda runs every step on the GPU")


_STEPS: list[tuple[str, float]] = []  # (short name, seconds) of the steps run so far


def step(title: str) -> None:
    note_created()
    print(f"\n=== {title} ===", flush=True)


def timed(name: str, fn, *args):
    """``fn(*args)``, its wall time said after it and kept for the summary line."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    finally:
        _STEPS.append((name, time.perf_counter() - t0))
        print(f"[{name}: {_STEPS[-1][1]:.1f}s]", flush=True)


def run(argv: list[str]) -> int:
    """Print the command, as a user would type it, then run it in this process."""
    print("$ hsstore " + shlex.join(argv), flush=True)
    try:
        return hsstore_main(argv)
    finally:
        note_created()


_OUT: list[Path] = []  # the --out of the demo running in this process (set by prepare_out)


def _files_under(out: Path, names) -> set[str]:
    """Relative paths of the files (and links) under the entries ``names`` of ``out``."""
    found = set()
    for name in names:
        top = out / name
        if top.is_symlink() or top.is_file():
            found.add(name)
        elif top.is_dir():
            for d, _, files in os.walk(top):
                found.update(os.path.relpath(os.path.join(d, f), out) for f in files)
    return found


def note_created() -> None:
    """Add the files now under the demo's entries to its marker: what a later run may delete (and nothing else)."""
    if not _OUT:
        return
    out = _OUT[-1]
    marker = out / MARKER
    info = json.loads(marker.read_text(encoding="utf-8")) if marker.exists() else {"created": list(CREATED)}
    info["files"] = sorted(set(info.get("files", [])) | _files_under(out, CREATED))
    marker.write_text(json.dumps(info) + "\n", encoding="utf-8")


def prepare_out(out: Path) -> None:
    """Make ``out`` ready: create it, or take an empty folder, or clear what an earlier demo created there (the
    files its marker lists, nothing else: an entry holding any other file is refused, as is any other non-empty
    folder: it may hold the user's files)."""
    marker = out / MARKER
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    if out.exists():
        if marker.exists():
            info = json.loads(marker.read_text(encoding="utf-8"))
            names = [n for n in info.get("created", []) if n in CREATED]  # only plain names this code creates
            theirs = sorted(_files_under(out, names) - set(info.get("files", [])))
            if theirs:  # a file the demo did not write: the user's, never deleted
                shown = ", ".join(theirs[:5]) + (", ..." if len(theirs) > 5 else "")
                raise ValueError(f"--out {out} holds files hsstore demo did not create ({shown}); move them "
                                 "elsewhere or give another folder (nothing was changed)")
            for name in names:
                path = out / name
                if path.is_symlink() or path.is_file():
                    path.unlink()
                elif path.is_dir():
                    shutil.rmtree(path)
        else:
            entries = sorted(p.name for p in out.iterdir())
            if entries:
                shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
                raise ValueError(f"--out {out} is not empty ({shown}) and was not made by hsstore demo; "
                                 "give a new or empty folder (nothing was changed)")
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"created": list(CREATED), "files": []}) + "\n", encoding="utf-8")
    _OUT[:] = [out]


def demo_target_and_data(out: Path, dev: str, why: str = "--device") -> tuple[Path, Path, Path]:
    """Step 1: the shipped tiny target built under OUT/target, its conversations and held-out prompts copied
    under OUT/data, and what they are, said; returns (target, conversations, held-out)."""
    shipped = trained_files()
    meta = json.loads((shipped / "target.json").read_text(encoding="utf-8"))
    target = build_trained_target(out / "target")
    data = out / "data"
    data.mkdir()
    convs, heldout = data / "conversations.jsonl", data / "heldout.jsonl"
    shutil.copyfile(shipped / "conversations.jsonl", convs)
    shutil.copyfile(shipped / "heldout.jsonl", heldout)
    n_conv = sum(1 for line in convs.read_text().splitlines() if line.strip())
    n_held = sum(1 for line in heldout.read_text().splitlines() if line.strip())
    tr = meta["training"]
    print(f"target : {target} (hybrid Gated DeltaNet + gated attention, Qwen3_5ForCausalLM, "
          f"{meta['sizes']['num_layers']} layers, hidden {meta['sizes']['hidden_size']})")
    print(f"         weights shipped in {shipped}, trained by `{meta['command']}` on "
          f"{meta['examples']['train']:,} synthetic conversations ({tr['steps']} steps, loss {tr['first_loss']:.2f} "
          f"-> {tr['final_loss']:.2f}, {tr['train_seconds']:.0f}s)")
    print(f"device : {describe(resolve_device(dev))} (extraction, training and eval: {why})")
    print(f"data   : {convs} ({n_conv} prompts the target answered itself, greedily, thinking on)")
    print(f"         {heldout} ({n_held} held-out prompts for eval: in neither the target's nor the drafter's "
          "training data)")
    return target, convs, heldout


def run_demo(out: str | Path = "hsstore-demo", *, train_steps: int = TRAIN_STEPS,
             eval_samples: int = EVAL_SAMPLES, device: str | None = None) -> int:
    """``device``: what every step runs on (default: the GPU when there is one, else the CPU)."""
    t0 = time.perf_counter()
    out = Path(out)
    dev, why = choose_device(device)
    prepare_out(out)
    _STEPS.clear()
    step("1/7 the tiny trained Qwen3.5-architecture target and its data")
    target, convs, heldout = demo_target_and_data(out, dev, why)
    store = str(out / "store")
    step("2/7 quality gate on the conversations (hsstore check)")
    rc = timed("check", run, ["check", "--model", str(target), "--input", str(convs)])
    if rc not in (0, 1):
        return rc
    step("3/7 extract hidden states (hsstore extract)")
    rc = timed("extract", run, ["extract", "--model", str(target), "--input", str(convs), "--out", store, "--device",
                                dev])
    if rc:
        return rc
    step("4/7 what the store holds (hsstore info)")
    rc = run(["info", store])
    if rc:
        return rc
    step("5/7 re-read and check every byte (hsstore verify)")
    rc = timed("verify", run, ["verify", store, "--quiet"])
    if rc:
        return rc
    step("6/7 train a drafter from the store alone (hsstore train; the target directory is out of reach)")
    run_dir = str(out / "run")
    hidden = out / ".target-hidden"
    target.rename(hidden)  # training must not need it
    try:
        rc = timed("train", run, ["train", "--store", store, "--out", run_dir, "--steps", str(train_steps),
                                  *TRAIN_FLAGS, "--device", dev])
    finally:
        hidden.rename(target)
    if rc:
        return rc
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    print(f"loss {rows[0]['loss']:.3f} (step {rows[0]['step']}) -> {rows[-1]['loss']:.3f} (step {rows[-1]['step']}); "
          f"draft-position accuracy {rows[0]['acc']:.3f} -> {rows[-1]['acc']:.3f}; teacher-forced tau "
          f"{rows[0]['tau']:.2f} -> {rows[-1]['tau']:.2f}")
    for what, path in ((store, out / "store.html"), (run_dir, out / "run.html")):  # pictures to open in a browser
        rc = run(["report", what, "--out", str(path)])
        if rc:
            return rc

    step("7/7 speculative decoding on held-out prompts: the target alone vs the target + drafter (hsstore eval)")
    buf = io.StringIO()
    argv = ["eval", "--store", store, "--drafter", run_dir, "--model", str(target), "--input", str(heldout),
            "--num-samples", str(eval_samples), *EVAL_FLAGS, "--device", dev, "--json"]
    print("$ hsstore " + shlex.join(argv), flush=True)
    def quiet_eval():
        with contextlib.redirect_stdout(buf):  # its --json report is read below
            return hsstore_main(argv)

    rc = timed("eval", quiet_eval)
    if rc:
        print(buf.getvalue())
        return rc
    report = json.loads(buf.getvalue())
    print_eval(report)
    print_guide(out, report)
    print(f"\ndemo done in {time.perf_counter() - t0:.1f}s on {dev} ("
          + ", ".join(f"{name} {sec:.1f}s" for name, sec in _STEPS) + ")")
    return 0


def print_eval(r: dict) -> None:
    S = r["block_size"]
    print(f"{r['samples']} held-out prompts, greedy, up to {r['max_new_tokens']} new tokens, block {S}")
    print(f"  {'':18} {'tau/prompt':>10}  {'tau pooled':>10}  {'target forwards':>15}  {'tokens/s':>9}")
    print(f"  {'target alone':18} {1.0:10.2f}  {1.0:10.2f}  {r['target_forwards']:15,}  "
          f"{r['target_tokens_per_s']:9.1f}")
    print(f"  {'target + drafter':18} {r['tau_per_prompt']:10.2f}  {r['tau_pooled']:10.2f}  {r['spec_forwards']:15,}  "
          f"{r['spec_tokens_per_s']:9.1f}")
    print(f"  per prompt: {' '.join(f'{t:.2f}' for t in r['tau_per_sample'])}")
    print(f"  speculative output == target greedy output: {r['identical']}/{r['samples']}"
          + (f" ({r['divergence_note']})" if r.get("divergence_note") else ""))


def print_guide(out: Path, r: dict) -> None:
    S = r["block_size"]
    print(f"""
What the numbers mean
  tau    tokens a verification step adds (the accepted drafts + the target's own next token), 1..{S}; the
         prefill is no step. tau/prompt: each prompt's mean over its steps, averaged over the prompts (z-lab
         dflash's benchmark, "Average Acceptance length"); tau pooled: all prompts' step tokens over their
         steps ({r['spec_tokens'] - r['samples']:,} / {r['verify_steps']:,} here; SGLang's server, "accept len").
         Compare a published number with the one of its convention.
         The target alone makes one token per forward: 1 by definition. A drafter that learned nothing stays
         near 1.0; on this target a working pipeline gives about 3.6 tau/prompt and 2.6 pooled with these
         settings (this run: {r['tau_per_prompt']:.2f}, {r['tau_pooled']:.2f}), while shuffled features or labels
         shifted by one give 1.1-1.3
         (tests/test_demo_learns.py). Published DFlash drafters reach about 6.5 tau/prompt on Qwen3-8B (GSM8K,
         greedy): 5 layers, hours of GPU training.
  speed  both rows decode with the target's own cache; a verification keeps its Gated DeltaNet states, so
         a rejected suffix costs no second forward. On this tiny target a 16-token forward costs little more
         than a 1-token one, but the drafter's own step costs about as much again, so tokens/s shows less of
         what fewer target forwards buy than a large target would: the forward counts show that.
  equal  speculative decoding is lossless: every output must equal the target's own greedy output. In
         bf16 (on a GPU) two forwards of different shapes may break a near-tie of the target's two best
         tokens differently; the line says how many outputs first differ at such a tie (logit margin
         within rounding) and how many beyond it (a decoding error).
Where things are
  target   {out / 'target'}   (a from_pretrained folder)
  data     {out / 'data'}   (conversations.jsonl: extraction input; heldout.jsonl: eval prompts)
  store    {out / 'store'}   (read a sample: hsstore show {out / 'store'} 0)
  drafter  {out / 'run' / 'drafter'}   (training curve: {out / 'run' / 'metrics.jsonl'})
  pictures {out / 'store.html'}, {out / 'run.html'}   (hsstore report: open in a browser, no server)""")
