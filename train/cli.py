"""``hsstore train``, ``hsstore export-drafter`` and ``hsstore eval``.

torch and transformers are imported inside the handlers: the ``hsstore`` CLI imports this module at
startup and must stay fast for commands that never train.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import json
import math
import sys

from hsstore.app.commands import Command, add_commands, command_settings, config, json_flag, quiet, storage_flags
from hsstore.app.config import flag_values
from hsstore.app.schema import from_args
from hsstore.io.storage import parse_storage_options

from .settings import EvalSettings, ExportDrafterSettings, TrainSettings
from .rundir import RUN_MARKER


def register(subparsers) -> None:
    add_commands(subparsers, COMMANDS)


# The loader's threads take the GIL in bursts; with Python's default switch interval the training thread can
# wait that long to launch its next kernel, so the interval is shorter (docs/PERFORMANCE.md, "Training step").
SWITCH_INTERVAL_S = 0.0005


def preflight_train(args: argparse.Namespace) -> None:
    """What ``train`` refuses without torch, the trainer or a model: an --out that is a user's folder, a store or
    --val-store that is not there (a --follow store may not be yet). Before the first line, and before OUT is
    made."""
    from hsstore.io import storage
    from hsstore.io.destination import check_output_folder
    from hsstore.distributed import launcher_rank
    from hsstore.format.manifest import read_manifest

    if args.out and launcher_rank() == 0:  # other ranks may already see rank 0's first files
        check_output_folder(args.out, (RUN_MARKER,), "train --out")
    options = parse_storage_options(args.storage_option)
    for url in [*([] if args.follow else args.store or []), *(args.val_store or [])]:
        read_manifest(*storage.resolve(url, options), url)


def announce_train(args: argparse.Namespace) -> None:
    """``train``'s first line, which the CLI prints before anything heavy (torch for --device, the trainer, the
    stores: many seconds on a busy machine), so that a start is never silent."""
    from hsstore.redaction import recordable_url

    logging.getLogger("hsstore.train").setLevel(logging.INFO)  # the settings line at the start, resume and save notes
    logging.getLogger("hsstore.loader.follow").setLevel(logging.INFO)  # --follow: arrivals, and what epoch 0 waits for
    logging.getLogger(__name__).info("train: loading torch and the trainer, then reading %s into %s",
                                     ", ".join(recordable_url(u) for u in args.store or []), args.out)


def run_train(args: argparse.Namespace) -> int:
    import sys

    from hsstore.io.destination import removed_if_left_empty
    from hsstore.distributed import launcher_rank

    from .checkpoint import read_best
    from .trainer import train

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    settings = command_settings(TrainSettings, args)
    # a run that fails before writing into the OUT it made leaves none behind (rank 0 only: the ranks share OUT)
    with removed_if_left_empty(settings.run.out) if launcher_rank() == 0 else contextlib.nullcontext():
        result = train(settings, flags=flag_values(args))
    if result.drafter_dir is None:  # not rank 0
        return 0
    last = result.last
    followed = result.followed
    rc = 1 if followed is not None and followed.differs else 0  # epoch 0 trained less (or more) than the stores hold
    if args.json:
        print(json.dumps({"steps": result.steps, "steps_this_run": result.steps_this_run,
                          "start_step": result.start_step, "epochs_done": result.epochs_done, "seconds": result.seconds,
                          "tokens": result.tokens, "step_seconds": result.step_seconds,
                          "tokens_per_s": result.tokens_per_s,
                          "resumed_from": None if result.resumed_from is None else str(result.resumed_from),
                          "drafter": str(result.drafter_dir), "metrics": f"{args.out}/metrics.jsonl",
                          "best": read_best(args.out), "last": last,
                          **({} if followed is None else {"follow": {"trained_samples": followed.trained,
                                                                     "held_samples": followed.held,
                                                                     "trained_twice": len(followed.twice),
                                                                     "never_trained": len(followed.never)}})},
                         indent=2))
        return rc
    fmt = lambda x: "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"  # noqa: E731
    resumed = ("" if result.resumed_from is None else
               f" in this run, resumed from {result.resumed_from} at step {result.start_step} ({result.steps} in all)")
    print(f"trained {result.steps_this_run} steps{resumed} ({result.epochs_done} epoch(s) complete) in "
          f"{result.seconds:.1f}s: {result.tokens:,} tokens in {result.step_seconds:.1f}s of steps, "
          f"{result.tokens_per_s:,.0f} tokens/s (the sums of metrics.jsonl's lines of this run); "
          f"last loss {fmt(last.get('loss'))}, acc {fmt(last.get('acc'))}, tau (teacher-forced, mean over the "
          f"logged steps' anchors) {fmt(last.get('tau'))}")
    if "val_tau" in last:
        print(f"validation (teacher-forced, every anchor of --val-store): loss {fmt(last['val_loss'])}, "
              f"tau {fmt(last['val_tau'])} (the mean over {last['val_anchors']:,} anchors)")
    print(f"drafter: {result.drafter_dir} (the last step); metrics: {args.out}/metrics.jsonl")
    best = read_best(args.out)
    if best is not None:
        print(f"best checkpoint (val_tau {fmt(best.get('val_tau'))} at step {best.get('step')}): "
              f"{args.out}/checkpoints/{best['checkpoint']}; hsstore export-drafter {args.out} NEW --best exports it")
    if followed is not None:
        print(followed.line(), file=sys.stderr if followed.differs else sys.stdout)
    return rc


def run_export(args: argparse.Namespace) -> int:
    from .build import serving_warnings
    from .checkpoint import export_drafter, read_drafter_config
    from .drafter_format import serving_notes

    x = from_args(ExportDrafterSettings, args).export
    out = export_drafter(x.ckpt, x.out, best=x.best)
    cfg, _ = read_drafter_config(out)
    print(f"drafter: {out} (taps {','.join(map(str, cfg.target_layers))}: each its target layer's output, before "
          "the final norm)")
    for line in serving_warnings(cfg.target_layers, cfg.num_target_layers):
        print(f"hsstore export-drafter: warning: drafter {line}", file=sys.stderr)
    for note in serving_notes(cfg):
        print(f"  {note}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    settings = command_settings(EvalSettings, args)
    spec = settings.speculative
    if spec.model is None:
        if spec.input:
            raise ValueError("--input needs --model (without it the evaluation reads the store's own samples)")
        return run_store_eval(settings, args.json)
    if not spec.input:
        raise ValueError("--model needs --input (the prompts to decode)")
    from .speculative import evaluate_target

    report = evaluate_target(settings.input.store, settings.input.drafter, spec.model, spec.input,
                             storage_options=settings.storage.storage_options, device=settings.run.device,
                             dtype=spec.dtype, num_samples=spec.num_samples, thinking=spec.thinking,
                             max_new_tokens=spec.max_new_tokens, progress=settings.run.progress,
                             cpu_threads=settings.run.cpu_threads)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format_text())
    return 0


def run_store_eval(settings: EvalSettings, as_json: bool) -> int:
    """``hsstore eval`` without a target: teacher-forced, over every valid anchor of the store."""
    from .evaluate import evaluate_store

    report = evaluate_store(settings.input.store, settings.input.drafter,
                            storage_options=settings.storage.storage_options, device=settings.run.device,
                            token_budget=settings.store_eval.token_budget,
                            anchor_chunk=settings.store_eval.anchor_chunk, cache_dir=settings.store_eval.cache_dir,
                            progress=settings.run.progress, cpu_threads=settings.run.cpu_threads)
    print(json.dumps(report.to_dict(), indent=2) if as_json else report.format_text())
    return 0


EVAL_DESCRIPTION = ("Without --model: teacher-forced evaluation from the store alone, no target needed. Every "
    "valid anchor (each position p with loss_mask[p] and loss_mask[p+1], the training rule, no sampling: "
    "deterministic) gets the drafter's block of S-1 argmax drafts, compared with the stored tokens. Prints "
    "the training loss, acceptance per draft position k (share of anchors whose drafts 1..k are all right) "
    "and tau = 1 + their sum (accepted prefix + the bonus token, 1..S), the mean over every anchor. "
    "With --model and --input: greedy (temperature 0) speculative decoding, the drafter proposing from the "
    "target's features and the target verifying; reports tau and target-only vs speculative tokens/s and "
    "checks that the output equals target-only greedy decoding. Defaults follow DFlash's published "
    "benchmark (z-lab dflash/benchmark.py): temperature 0, up to 2048 new tokens; thinking on, as for the "
    "Qwen3.5/3.6 thinking targets (--no-thinking for the non-thinking Qwen3 numbers). tau (tokens per "
    "verification step, the prefill no step) in both conventions: tau_per_prompt, the mean over prompts of "
    "each prompt's mean, as there (\"Average Acceptance length\"); tau_pooled, all steps' tokens over all "
    "steps, as SGLang's server counts it (\"accept len\"). The target-only baseline and the speculative run both "
    "decode with the target's own cache (attention keys/values, Gated DeltaNet conv and recurrent states) and "
    "compute logits only where they are read; after a rejected draft suffix the cache saved before the "
    "verification is restored and the accepted tokens run through it. On a CPU a small target decodes on "
    "one thread (--cpu-threads N to choose).")

COMMANDS = (
    Command("train", TrainSettings, run_train, defaults_in_help=True,
            help="train a DFlash drafter from one or more stores (no target needed)",
            description="Train a DFlash drafter from hidden-state stores alone: features, tokens and loss masks, and "
            "the target's embedding, lm_head and config (store assets). Writes OUT/metrics.jsonl, checkpoints under "
            "OUT/checkpoints/ and the drafter in OUT/drafter/. Re-running the same command resumes from the latest "
            "checkpoint. Multi-GPU: torchrun --nproc_per_node N -m hsstore train ...",
            # OUT/run.yaml beside the run marker is a run's record
            shared=(quiet("output"), json_flag("output", "the summary at the end (rank 0)"), storage_flags("storage"),
                    config(record_markers=(RUN_MARKER,))),
            before={"preflight": preflight_train, "announce": announce_train}),
    Command("export-drafter", ExportDrafterSettings, run_export,
            help="write a drafter directory SGLang and vLLM load, from any checkpoint or run",
            description="Turn a drafter directory, a checkpoint (OUT/checkpoints/step_N) or a training run (its "
            "drafter/ or latest checkpoint), in this or the earlier format, into a DFlash drafter directory: "
            "config.json (architectures DFlashDraftModel), bf16 model.safetensors and its index, hsstore_drafter.json. "
            "OUT must not exist or be empty.",
            shared=(quiet("export"),)),
    Command("eval", EvalSettings, run_eval, defaults_in_help=True,
            help="a drafter's acceptance: from the store alone (teacher-forced), or by speculative decoding (--model)",
            description=EVAL_DESCRIPTION,
            shared=(quiet("run"), json_flag("run", "the report"), storage_flags("storage"))),
)
