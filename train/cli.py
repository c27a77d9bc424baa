"""``hsstore train``, ``hsstore export-drafter`` and ``hsstore eval``.

torch and transformers are imported inside the handlers: the ``hsstore`` CLI imports this module at
startup and must stay fast for commands that never train.
"""

from __future__ import annotations

import argparse
import logging
import json
import math

from hsstore.config import add_config_option, settings
from hsstore.cli import Deprecated, DefaultsHelpFormatter, add_json_option, add_quiet_option, add_storage_option
from hsstore.storage import parse_storage_options



def register(subparsers) -> None:
    t = subparsers.add_parser(
        "train", formatter_class=DefaultsHelpFormatter,
        help="train a DFlash drafter from one or more stores (no target needed)",
        description="Train a DFlash drafter from hidden-state stores alone: features, tokens and loss masks, and "
        "the target's embedding, lm_head and config (store assets). Writes OUT/metrics.jsonl, checkpoints under "
        "OUT/checkpoints/ and the drafter in OUT/drafter/. Re-running the same command resumes from the latest "
        "checkpoint. Multi-GPU: torchrun --nproc_per_node N -m hsstore train ...",
    )
    parser = t  # the flags in groups: --help shows them so, and --config files have these sections
    t = parser.add_argument_group("run")
    t.add_argument("--store", required=True, action="append", metavar="URL", help="store URL (repeatable)")
    t.add_argument("--out", required=True, help="run directory (metrics, checkpoints, drafter)")
    n = t.add_mutually_exclusive_group()
    n.add_argument("--steps", type=int, default=None, help="optimizer steps")
    n.add_argument("--epochs", type=int, default=None, help="passes over the data (default 6)")
    t.add_argument("--device", default=None,
                   help="cpu, cuda (this process's GPU: cuda:LOCAL_RANK) or cuda:N (default: the GPU when there is one)")
    t = parser.add_argument_group("batch")
    t.add_argument("--token-budget", dest="token_budget", type=int, default=None, metavar="N",
                   help="padded tokens per batch and rank (default: 16384 on a GPU, the published recipe; 4096 on a "
                        "CPU; a CPU step estimated above the available memory is refused)")
    t.add_argument("--max-tokens", dest="token_budget", type=int, action=Deprecated, new="--token-budget")
    t.add_argument("--anchors", type=int, default=None, metavar="N",
                   help="anchors per sequence, at most (default: 512 on a GPU, 128 on a CPU)")
    t = parser.add_argument_group("drafter")
    t.add_argument("--block-size", type=int, default=16, help="anchor + mask tokens drafted per block")
    t.add_argument("--draft-layers", type=int, default=5, help="draft decoder layers")
    t.add_argument("--sliding-window", type=int, default=2048,
                   help="window of every draft layer but the last, in positions counting the query's own, as "
                        "Hugging Face's sliding_window (0: full attention everywhere)")
    t.add_argument("--non-causal-sliding", action="store_true",
                   help="sliding layers see their whole block (exported as is_causal: false); default: causal "
                        "inside the block, as SpecForge trains and SGLang/vLLM serve")
    d = parser.add_argument_group("drafter shape (default: the published DFlash drafters' rule, e.g. Qwen3.6-27B "
                             "-> 32 heads x 128, 8 KV heads; FFN, RoPE base from the target)")
    d.add_argument("--num-heads", type=int, default=None, help="attention heads")
    d.add_argument("--num-kv-heads", type=int, default=None, help="key/value heads")
    d.add_argument("--head-dim", type=int, default=None, help="per head")
    d.add_argument("--intermediate-size", type=int, default=None, help="SwiGLU width (default: the target's)")
    d.add_argument("--rope-theta", type=float, default=None, help="RoPE base, full rotary (default: the target's)")
    t.add_argument("--init", default=None, metavar="DIR",
                   help="start from this drafter (DFlash format: ours, SpecForge's, z-lab's); refused unless its "
                        "taps, hidden size, vocabulary and block size fit the store")
    t.add_argument("--mask-token-id", type=int, default=None,
                   help="default: first unused embedding row, else the target's pad token")
    t = parser.add_argument_group("training")
    t.add_argument("--gamma", type=float, default=None, help="loss decay over block positions (default by block)")
    t.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (AdamW, cosine)")
    t.add_argument("--warmup", type=float, default=0.04, help="warmup share of the steps")
    t.add_argument("--min-lr-ratio", type=float, default=0.0, help="final lr / peak lr")
    t.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    t.add_argument("--seed", type=int, default=0, help="data order, anchors and initial weights")
    t.add_argument("--attn", choices=["auto", "blocks", "sdpa", "flex"], default="auto",
                   help="auto: blocks (each chunk of anchors attends to only the keys it may see; memory and time "
                        "follow the visible keys). sdpa: one dense mask [queries x (context + queries)], the "
                        "reference. flex: compiles on its first step and again when batch shapes vary")
    t = parser.add_argument_group("data")
    t.add_argument("--weight", type=float, action="append", default=None, metavar="W",
                   help="per --store, in order: 2 = every sample twice per epoch, 0.5 = a seeded half")
    t.add_argument("--workers", type=int, default=0, help="loader worker processes per rank (needs torchdata)")
    t.add_argument("--prefetch", type=int, default=2, help="batches read (and copied to the GPU) ahead")
    t.add_argument("--cpu-threads", type=int, default=None,
                   help="torch CPU threads per rank (default: under torchrun on GPUs, the cores / local ranks)")
    t.add_argument("--cache-dir", default=None, help="local chunk cache for remote stores")
    t.add_argument("--cache-bytes", type=int, default=None, metavar="N",
                   help="cap of --cache-dir in bytes (default 64 GiB); with --partition node, at least a node's share")
    t.add_argument("--partition", choices=["global", "node"], default="global",
                   help="global: one permutation of the stores per epoch over all ranks. node: each node (torchrun's "
                        "GROUP_RANK, LOCAL_WORLD_SIZE) reads one fixed share every epoch, shuffled within, so a "
                        "--cache-dir that holds the share serves epochs 2.. without remote reads")
    t.add_argument("--checkpoint-layers", action="store_true",
                   help="recompute each draft layer in backward instead of keeping its activations (about a third "
                        "more layer compute, a fraction of the memory: the published recipe on an 80 GB GPU)")
    t.add_argument("--gpu-memory-gib", type=float, default=None, metavar="GIB",
                   help="GPU memory to plan the step for, and hold to (default: the device's); e.g. 80 on a larger "
                        "GPU to check a recipe for an 80 GB one")
    t = parser.add_argument_group("output")
    t.add_argument("--log-every", type=int, default=10, help="steps between metrics.jsonl rows")
    t.add_argument("--save-every", type=int, default=1000, help="steps between checkpoints (Ctrl-C also saves one)")
    t.add_argument("--keep", type=int, default=2, help="checkpoints to keep (0: all)")
    t.add_argument("--no-resume", action="store_true", help="start over even if OUT has checkpoints")
    t.add_argument("--log-samples", action="store_true", help="write OUT/samples.rankN.jsonl (sample ids per step)")
    add_quiet_option(t)
    add_json_option(t, "the summary at the end (rank 0)")
    t.add_argument("--report-to", default="none", metavar="NAMES",
                   help="also send the metrics.jsonl rows and the settings to tensorboard, wandb and/or mlflow "
                        "(comma-separated; OUT/tensorboard, OUT/wandb, OUT/mlruns unless their environment says "
                        "otherwise; WANDB_MODE=offline works without a network; pip install 'hsstore[track]')")
    t = parser.add_argument_group("validation")
    t.add_argument("--val-store", action="append", default=None, metavar="URL",
                   help="held-out store (repeatable, same target): teacher-forced loss, acceptance and tau over every "
                        "valid anchor (as `hsstore eval` without --model), logged to metrics.jsonl as val_*")
    t.add_argument("--val-every", type=int, default=None, metavar="N",
                   help="steps between evaluations on --val-store (default: --save-every); always at the end too")
    t = parser.add_argument_group("storage")
    add_storage_option(t)
    add_config_option(parser)
    t.set_defaults(func=run_train)

    x = subparsers.add_parser(
        "export-drafter",
        help="write a drafter directory SGLang and vLLM load, from any checkpoint or run",
        description="Turn a drafter directory, a checkpoint (OUT/checkpoints/step_N) or a training run (its "
        "drafter/ or latest checkpoint), in this or the earlier format, into a DFlash drafter directory: "
        "config.json (architectures DFlashDraftModel), bf16 model.safetensors and its index, hsstore_drafter.json. "
        "OUT must not exist or be empty.",
    )
    x.add_argument("ckpt", metavar="CKPT")
    x.add_argument("out", metavar="OUT")
    x.set_defaults(func=run_export)

    e = subparsers.add_parser(
        "eval", formatter_class=DefaultsHelpFormatter,
        help="a drafter's acceptance: from the store alone (teacher-forced), or by speculative decoding (--model)",
        description="Without --model: teacher-forced evaluation from the store alone, no target needed. Every "
        "valid anchor (each position p with loss_mask[p] and loss_mask[p+1], the training rule, no sampling: "
        "deterministic) gets the drafter's block of S-1 argmax drafts, compared with the stored tokens. Prints "
        "the training loss, acceptance per draft position k (share of anchors whose drafts 1..k are all right) "
        "and tau = 1 + their sum (accepted prefix + the bonus token, 1..S). "
        "With --model and --input: greedy (temperature 0) speculative decoding, the drafter proposing from the "
        "target's features and the target verifying; reports tau and target-only vs speculative tokens/s and "
        "checks that the output equals target-only greedy decoding. Defaults follow DFlash's published "
        "benchmark (z-lab dflash/benchmark.py): temperature 0, up to 2048 new tokens; thinking on, as for the "
        "Qwen3.5/3.6 thinking targets (--no-thinking for the non-thinking Qwen3 numbers). tau is the mean over "
        "prompts of each prompt's mean per step, as there. The target is re-run over the whole sequence each "
        "step (no KV cache), for the target-only baseline and the speculative run alike: slow for long generations.",
    )
    e.add_argument("--store", required=True, help="without --model: the store to evaluate on; with it: the store "
                   "the drafter was trained on (frozen head, taps)")
    e.add_argument("--drafter", required=True, help="drafter dir, or a training OUT dir (its drafter/ or latest "
                   "checkpoint)")
    e.add_argument("--model", default=None, help="target model directory: speculative decoding instead of the "
                   "teacher-forced evaluation")
    e.add_argument("--input", nargs="+", default=None, help="with --model: JSONL with 'messages' (prompt = before "
                   "the last assistant turn) or 'prompt'")
    e.add_argument("--num-samples", type=int, default=8, help="with --model: prompts to decode")
    e.add_argument("--max-new-tokens", type=int, default=2048, help="with --model (DFlash's benchmark: 2048)")
    e.add_argument("--no-thinking", dest="thinking", action="store_false",
                   help="with --model: render prompts with enable_thinking=False (default: thinking on)")
    e.add_argument("--token-budget", dest="token_budget", type=int, default=16384, metavar="N",
                   help="without --model: padded tokens per batch, as in training")
    e.add_argument("--max-tokens", dest="token_budget", type=int, action=Deprecated, new="--token-budget")
    e.add_argument("--anchor-chunk", type=int, default=512,
                   help="without --model: anchors per sequence per forward (memory; the training default)")
    e.add_argument("--device", default=None,
                   help="cpu, cuda (this process's GPU: cuda:LOCAL_RANK) or cuda:N (default: the GPU when there is one)")
    e.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="with --model: default bfloat16 on CUDA, float32 on CPU")
    e.add_argument("--cache-dir", default=None, help="local chunk cache for remote stores")
    add_quiet_option(e)
    add_json_option(e, "the report")
    add_storage_option(e)
    e.set_defaults(func=run_eval)


# The loader's threads take the GIL in bursts; with Python's default 5 ms switch interval the training
# thread can wait that long to launch its next kernel. On an H200, with 2.5 GB/s of features read per
# GPU, 0.5 ms gave 41.4K tokens/s against 38.8K and 39.1K (one run each).
SWITCH_INTERVAL_S = 0.0005


def run_train(args: argparse.Namespace) -> int:
    import sys

    from .trainer import TrainConfig, train

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    logging.getLogger("hsstore.train").setLevel(logging.INFO)  # the settings line at the start, resume and save notes
    cfg = TrainConfig(
        stores=args.store, out=args.out, steps=args.steps, epochs=args.epochs, device=args.device,
        max_tokens=args.token_budget, anchors=args.anchors, block_size=args.block_size, draft_layers=args.draft_layers,
        sliding_window=args.sliding_window or None, sliding_causal=not args.non_causal_sliding,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
        intermediate_size=args.intermediate_size, rope_theta=args.rope_theta, init=args.init,
        mask_token_id=args.mask_token_id, gamma=args.gamma, lr=args.lr,
        warmup=args.warmup, min_lr_ratio=args.min_lr_ratio, clip=args.clip, seed=args.seed, attn=args.attn,
        log_every=args.log_every, save_every=args.save_every, keep=args.keep, workers=args.workers,
        prefetch=args.prefetch, resume=not args.no_resume, progress=not args.quiet,
        log_samples=args.log_samples, weights=args.weight, cache_dir=args.cache_dir, cpu_threads=args.cpu_threads,
        partition=args.partition, checkpoint_layers=args.checkpoint_layers, gpu_memory_gib=args.gpu_memory_gib,
        cache_bytes=None if args.cache_bytes is None else int(args.cache_bytes),
        val_stores=args.val_store, val_every=args.val_every, storage_options=parse_storage_options(args.storage_option),
        report_to=args.report_to)
    result = train(cfg, settings=settings(args))
    if result.drafter_dir is None:  # not rank 0
        return 0
    last = result.last
    if args.json:
        print(json.dumps({"steps": result.steps, "epochs_done": result.epochs_done, "seconds": result.seconds,
                          "resumed_from": None if result.resumed_from is None else str(result.resumed_from),
                          "drafter": str(result.drafter_dir), "metrics": f"{args.out}/metrics.jsonl",
                          "last": last}, indent=2))
        return 0
    if result.resumed_from is not None:
        print(f"resumed from {result.resumed_from}")
    fmt = lambda x: "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"  # noqa: E731
    print(f"trained {result.steps} steps ({result.epochs_done} epoch(s) complete) in {result.seconds:.1f}s; "
          f"last loss {fmt(last.get('loss'))}, acc {fmt(last.get('acc'))}, tau(teacher-forced) "
          f"{fmt(last.get('tau'))}, {last.get('tokens_per_s', 0):,.0f} tokens/s")
    if "val_tau" in last:
        print(f"validation (teacher-forced, every anchor of --val-store): loss {fmt(last['val_loss'])}, "
              f"tau {fmt(last['val_tau'])} over {last['val_anchors']:,} anchors")
    print(f"drafter: {result.drafter_dir}; metrics: {args.out}/metrics.jsonl")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from .checkpoint import export_drafter

    print(f"drafter: {export_drafter(args.ckpt, args.out)}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    if args.model is None:
        if args.input:
            raise ValueError("--input needs --model (without it the evaluation reads the store's own samples)")
        return run_store_eval(args)
    if not args.input:
        raise ValueError("--model needs --input (the prompts to decode)")
    from .speculative import evaluate_target

    report = evaluate_target(args.store, args.drafter, args.model, args.input,
                             storage_options=parse_storage_options(args.storage_option), device=args.device,
                             dtype=args.dtype, num_samples=args.num_samples, thinking=args.thinking,
                             max_new_tokens=args.max_new_tokens, progress=not args.quiet)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format_text())
    return 0


def run_store_eval(args: argparse.Namespace) -> int:
    """``hsstore eval`` without a target: teacher-forced, over every valid anchor of the store."""
    from .evaluate import evaluate_store

    report = evaluate_store(args.store, args.drafter, storage_options=parse_storage_options(args.storage_option),
                            device=args.device, max_tokens=args.token_budget, anchor_chunk=args.anchor_chunk,
                            cache_dir=args.cache_dir, progress=not args.quiet)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format_text())
    return 0
