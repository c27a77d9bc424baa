"""Is the loader ever the bottleneck of DFlash training? Step time fed by the loader vs already in memory.

Writes a synthetic store (random bf16 features, every sample ``--seq`` tokens so every batch costs the
same), builds a random-weight drafter of the requested size, and times the trainer's own step
(``train.trainer.train_step``) two ways, alternating for ``--rounds`` rounds:

  loader     batches read from the store by the trainer's pipeline (HiddenStateDataset -> token-budget
             batches -> anchors -> read-ahead thread -> pinned copy to the device on a side stream);
  resident   the same kind of batches, read once beforehand and kept in device memory.

ratio = resident step time / loader step time (1.0: the loader costs nothing; the target is >= 0.97), with
each round's own ratio. Each loader-fed step is broken down (``breakdown_ms``, from ``ReadAheadStats``): the
wait for data (the loader was late; ``ready_mean``: batches queued when the step asked) and the rest, whose
excess over the resident step (``step_vs_resident_ms``) is what the loader took from the step itself (cores,
memory bandwidth, the GIL of the thread launching kernels); and, on the read-ahead thread, read + collate,
anchors, copy issue and (CUDA) the copy itself. ``--reader-threads N`` gives the read-ahead thread and the
loader threads it starts N torch threads; the GIL switch interval is ``hsstore train``'s.
The store is written just before, so it is in the page cache unless ``--cold`` drops it (local files).

    python -m tools.bench_train --dir /scratch/bench --device cuda              # 27B-sized drafter layer
    python -m tools.bench_train --dir /tmp/b --tiny                              # CPU smoke test

``--launch-probe`` times a thread launching tiny ops on the device alone and while the read-ahead streams
batches flat out, with the process's threads and with one reader thread, alternated (``launch_probe``).

``--loader-only`` times the data path alone (no drafter): batches per second from the store to the
device, the way the trainer reads them, for the settings the trainer can change, alternated in one run:
``pinned`` (features collated straight into pinned memory, the default) vs ``copy`` (collated into
plain memory, then pinned by a second copy, as before), each with this rank's share of the cores and
with one thread (torchrun's ``OMP_NUM_THREADS=1``). Under ``torchrun`` every rank reads its own share at
the same time, so the figure per rank is what DDP training gets from the loader:

    torchrun --standalone --nproc_per_node 2 -m tools.bench_train --dir /tmp/b --loader-only --json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import shutil
import statistics
import sys
import threading
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from hsstore import Manifest, StoreWriter, TargetIdentity, TokenizerIdentity
from hsstore.format import encodings
from hsstore.train.cli import SWITCH_INTERVAL_S
from hsstore.train.data import ReadAheadStats, StoreBatches, add_anchors, read_ahead
from hsstore.train.settings import CHECKPOINT_CHOICES
from hsstore.train.model import ATTN_IMPLS, DFlashDrafter, DrafterConfig
from hsstore.train.objective import default_gamma
from hsstore.train.optim import build_optimizer, build_scheduler
from hsstore.train.trainer import DraftLoss, train_step
from tools.measure import drop_tree_cache

TINY = dict(hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, vocab=1000, taps=3, seq=256, samples=24,
            max_tokens=1024, anchors=32, steps=4, warmup=1, rounds=2)


def write_store(path, args, device, storage_options=None) -> None:
    """``--samples`` samples of ``--seq`` tokens, random N(0, 1) bf16 features (made, and encoded with
    ``--encoding``, on ``device``: fast)."""
    # the tokenizer's vocabulary one short of the embedding: `hsstore train` takes the row past it as its mask
    # token, the one this bench's drafter uses (``build``), with nothing to pass
    manifest = Manifest(
        target=TargetIdentity(name="bench", num_layers=args.taps + 3, hidden_size=args.hidden, config_hash="bench"),
        tokenizer=TokenizerIdentity(name="bench", vocab_hash="bench", vocab_size=args.vocab - 1),
        layers=tuple(range(args.taps)), encoding=args.encoding)
    enc = encodings.get(args.encoding)
    g = torch.Generator(device=device).manual_seed(0)
    with StoreWriter(str(path), manifest, storage_options=storage_options) as w:
        for i in range(args.samples):
            hs = torch.randn(args.seq, args.taps, args.hidden, generator=g, device=device).to(torch.bfloat16)
            hs = enc.encode(hs).cpu() if enc.quantised else hs.cpu()
            ids = torch.randint(0, args.vocab - 1, (args.seq,), generator=g, device=device).cpu()
            w.add(f"bench-{i}", ids, torch.ones(args.seq, dtype=torch.bool), hs)


def write_target_assets(path: Path, args) -> None:
    """Random embedding/lm_head and a Qwen3.5 text config of the drafter's sizes, so that ``hsstore train``
    (which replaces the target by these assets) can run on the synthetic store, e.g. under torchrun."""
    from transformers import Qwen3_5TextConfig

    from hsstore.format import assets
    from hsstore.io import storage

    cfg = Qwen3_5TextConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                            num_hidden_layers=args.taps + 3, num_attention_heads=args.heads,
                            num_key_value_heads=args.kv_heads, head_dim=args.head_dim)
    g = torch.Generator().manual_seed(1)
    weight = lambda: (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
    fs, root = storage.resolve(str(path), {})
    assets.write_assets(fs, root, {assets.EMBED: assets.tensors_bytes({"weight": weight()}),
                                   assets.LM_HEAD: assets.tensors_bytes({"weight": weight()}),
                                   assets.CONFIG: cfg.to_json_string().encode()})


def build(args, device):
    w = args.sliding_window or None
    cfg = DrafterConfig(hidden_size=args.hidden, intermediate_size=args.ffn, vocab_size=args.vocab,
                        target_layers=list(range(args.taps)), mask_token_id=args.vocab - 1, num_heads=args.heads,
                        num_kv_heads=args.kv_heads, head_dim=args.head_dim, num_layers=args.draft_layers,
                        block_size=args.block, sliding_window=[w] * (args.draft_layers - 1) + [None] if w else None,
                        sliding_causal=not args.non_causal_sliding,
                        attn_impl=args.attn)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed = (torch.randn(args.vocab, args.hidden, device=device) * 0.02).to(dtype)
    head = (torch.randn(args.vocab, args.hidden, device=device) * 0.02).to(dtype)
    drafter = DFlashDrafter(cfg, embed, head).to(device)
    opt = build_optimizer(drafter)
    sched = build_scheduler(opt, 10**6)
    return DraftLoss(drafter, default_gamma(args.block), 1024), drafter, opt, sched


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_drafter_size_args(ap: argparse.ArgumentParser) -> None:
    """Drafter dimensions; the defaults are the published Qwen3.6-27B drafter's (hidden 5120, FFN 17408,
    32 heads x 128, 8 KV heads, 5 taps, vocab 248320)."""
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--ffn", type=int, default=17408)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--taps", type=int, default=5)
    ap.add_argument("--encoding", default="raw", choices=list(encodings.NAMES),
                    help="the store's feature encoding: its bytes cross to the device, decoded there (read-ahead)")


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="scratch directory for the store (reused if its settings match)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU smoke test")
    add_drafter_size_args(ap)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--sliding-window", type=int, default=2048, help="of every draft layer but the last (0: none)")
    ap.add_argument("--non-causal-sliding", action="store_true")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=48, help="store size: samples x seq tokens")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round and mode")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--switch-interval", type=float, default=SWITCH_INTERVAL_S,
                    help="sys.setswitchinterval, as `hsstore train` sets it (Python's default: 0.005)")
    ap.add_argument("--reader-threads", type=int, default=0,
                    help="torch threads of the read-ahead thread and the loader threads it starts (0: the process's)")
    ap.add_argument("--attn", choices=ATTN_IMPLS, default="blocks")
    ap.add_argument("--cold", action="store_true", help="drop the store from the page cache before each loader round")
    ap.add_argument("--s3", action="store_true",
                    help="read the store from S3 emulated on loopback: moto behind the fault proxy (replaying from "
                         "memory) with --s3-latency per request and --s3-bandwidth-mb per connection")
    ap.add_argument("--s3-latency", type=float, default=0.03)
    ap.add_argument("--s3-bandwidth-mb", type=float, default=100.0, help="MB/s per connection (0: no cap)")
    ap.add_argument("--checkpoint-layers", nargs="?", const="mlp", default="auto", choices=CHECKPOINT_CHOICES,
                    help="recompute draft layers in backward: mlp (the bare flag) their MLP halves, full whole layers; "
                         "auto (default) as `hsstore train` plans it for this device's memory (``plan_step``)")
    ap.add_argument("--gpu-memory-gib", type=float, default=None,
                    help="plan the step for this much GPU memory and hold the process to it, as `hsstore train "
                         "--gpu-memory-gib` (default: the device's)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="after the rounds, one more loader-fed pass under torch's CUDA sync debug mode: how many "
                         "times per step the launching thread waits for the GPU, and where (syncs_per_step)")
    ap.add_argument("--keep-store", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--loader-only", action="store_true",
                    help="time the data path alone (torchrun: all ranks at once); see the module doc")
    ap.add_argument("--launch-probe", action="store_true",
                    help="how much the read-ahead slows a thread that launches small ops (see launch_probe)")
    ap.add_argument("--probe-seconds", type=float, default=3.0)
    ap.add_argument("--store-only", action="store_true",
                    help="only write the store, with random target assets, for `hsstore train` (kept; path printed)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the memory plan's lines, as train logs them
    sys.setswitchinterval(args.switch_interval)  # what the training thread waits for the GIL at most, as in train
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    per_step = args.steps + args.warmup
    batch_samples = max(1, args.max_tokens // args.seq)
    ranks = int(os.environ.get("WORLD_SIZE", 1)) if args.loader_only else 1
    if args.samples < per_step * batch_samples * ranks:
        args.samples = per_step * batch_samples * ranks  # one epoch must cover a round (of every rank)

    key = f"h{args.hidden}-L{args.taps}-v{args.vocab}-T{args.seq}-n{args.samples}-{args.encoding}"
    store = Path(args.dir) / f"bench-train-{key}"
    if args.loader_only:
        return loader_only(args, store, device)
    if args.launch_probe:
        return launch_probe(args, store, device)
    if args.s3:
        from tools.bench_source import EmulatedS3Process

        # the server in a process of its own: its Python threads off the trainer's GIL, as a remote store's are
        with EmulatedS3Process() as s3:
            url = f"s3://{s3.bucket}/store"
            t = time.perf_counter()
            write_store(url, args, device, {"endpoint_url": s3.endpoint})
            print(f"wrote {url} (moto) in {time.perf_counter() - t:.1f}s", flush=True)
            s3.warm(url, args.s3_latency, args.s3_bandwidth_mb * 1e6 or None)
            return run(args, device, url, {"endpoint_url": s3.url}, s3.counts)
    if not (store / "manifest.json").exists():
        shutil.rmtree(store, ignore_errors=True)
        t = time.perf_counter()
        write_store(store, args, device)
        print(f"wrote {store} in {time.perf_counter() - t:.1f}s", flush=True)
    if args.store_only:
        write_target_assets(store, args)
        print(store)
        return
    run(args, device, str(store), None, None)
    if not args.keep_store:
        shutil.rmtree(store, ignore_errors=True)


def run(args, device, store_url: str, storage_options, s3_counts) -> None:
    """Loader-fed vs resident steps (the module doc); ``s3_counts``: the emulated S3's byte counts (or None)."""
    per_step = args.steps + args.warmup
    model, drafter, opt, sched = build(args, device)
    plan = planned(args, drafter, device, None if storage_options else store_url)
    args.anchors, drafter.checkpoint_layers = plan.batch.anchors, plan.memory.checkpoint_layers
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    gamma = default_gamma(args.block)
    source = StoreBatches([store_url], layers=list(range(args.taps)), token_budget=args.max_tokens, seed=0, rank=0,
                          world_size=1, workers=args.workers, pin_memory=device.type == "cuda",
                          storage_options=storage_options)

    def stream(epoch, stats=None):
        source.set_epoch(epoch)
        return read_ahead(source, lambda b: add_anchors(b, 0, epoch, args.anchors, args.block, gamma,
                                                        drafter.key_lengths),
                          device, args.prefetch, stats=stats, threads=args.reader_threads or None,
                          decode=lambda b: encodings.decode_batch(b, args.encoding, args.hidden))

    def timed(batches) -> float:
        it = iter(batches)
        for _ in range(args.warmup):
            train_step(model, drafter, opt, sched, [next(it)[0]], 1.0, amp)
        sync(device)
        t = time.perf_counter()
        for _ in range(args.steps):
            train_step(model, drafter, opt, sched, [next(it)[0]], 1.0, amp)
        sync(device)
        return (time.perf_counter() - t) / args.steps

    resident_src = stream(10**6)  # an epoch of its own, read once, kept on the device
    resident = [next(resident_src) for _ in range(per_step)]
    resident_src.close()
    tokens = sum(int(b["attention_mask"].sum()) for b, _ in resident[args.warmup:]) / args.steps

    loader_t, resident_t, parts = [], [], []
    for r in range(args.rounds):
        if args.cold and s3_counts is None:
            drop_tree_cache(store_url)
        stats = ReadAheadStats()
        s = stream(r, stats)
        loader_t.append(timed(s))
        s.close()
        sync(device)
        parts.append(stats.summary(skip=args.warmup, count=args.steps))
        resident_t.append(timed(resident))
    def synced_pass():
        s = stream(args.rounds)
        try:
            timed(s)
        finally:
            s.close()

    syncs = count_syncs(synced_pass, device) if args.sync_debug else None
    lo, re_ = statistics.median(loader_t), statistics.median(resident_t)
    breakdown = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    # the loader-fed step less its wait for data: above the resident step, the loader slowed the step itself
    # (CPU, memory bandwidth or the GIL taken from the thread that launches its kernels)
    breakdown["step_ms"] = lo * 1e3 - breakdown["wait_ms"]
    breakdown["resident_ms"] = re_ * 1e3
    breakdown["step_vs_resident_ms"] = breakdown["step_ms"] - re_ * 1e3
    result = {
        "device": str(device), "hidden": args.hidden, "taps": args.taps, "vocab": args.vocab,
        "draft_layers": args.draft_layers, "heads": [args.heads, args.kv_heads, args.head_dim],
        "sliding_window": args.sliding_window, "sliding_causal": not args.non_causal_sliding, "block": args.block, "anchors": args.anchors, "seq": args.seq,
        "max_tokens": args.max_tokens, "tokens_per_step": tokens, "workers": args.workers, "cold": args.cold,
        "bytes_per_step": tokens * args.taps * args.hidden * 2,
        "loader_ms": lo * 1e3, "resident_ms": re_ * 1e3, "ratio": re_ / lo,
        "loader_tokens_per_s": tokens / lo, "resident_tokens_per_s": tokens / re_,
        "loader_gbps": tokens * args.taps * args.hidden * 2 / lo / 1e9,
        "rounds_loader_ms": [x * 1e3 for x in loader_t], "rounds_resident_ms": [x * 1e3 for x in resident_t],
        "rounds_ratio": [b / a for a, b in zip(loader_t, resident_t)],
        "breakdown_ms": breakdown, "rounds_breakdown_ms": parts, "reader_threads": args.reader_threads,
        "prefetch": args.prefetch, "switch_interval": sys.getswitchinterval(),
        "checkpoint_layers": drafter.checkpoint_layers, "asked": {"anchors": plan.asked_anchors,
                                                                  "checkpoint_layers": args.checkpoint_layers},
        "estimate_gib": plan.estimate / 2**30, "source": "s3 (emulated)" if s3_counts is not None else "local",
    }
    if syncs is not None:
        result["syncs_per_step"] = sum(syncs.values()) / per_step
        result["syncs_where"] = dict(syncs.most_common(8))
    if s3_counts is not None:
        result.update(s3_latency=args.s3_latency, s3_bandwidth_mb=args.s3_bandwidth_mb, **s3_counts(),
                      trainer_pid=os.getpid())
    if device.type == "cuda":  # the whole step's: AdamW's moments exist from the first step on
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["estimate_vs_peak"] = result["estimate_gib"] / result["peak_gib"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"drafter H={args.hidden} taps={args.taps} V={args.vocab} layers={args.draft_layers} block={args.block} "
              f"anchors={args.anchors}; {tokens:.0f} tokens/step ({result['bytes_per_step'] / 1e6:.0f} MB of features)")
        print(f"  loader-fed : {lo * 1e3:8.1f} ms/step  {tokens / lo:10,.0f} tokens/s  "
              f"({result['loader_gbps']:.2f} GB/s of features)")
        print(f"  resident   : {re_ * 1e3:8.1f} ms/step  {tokens / re_:10,.0f} tokens/s")
        print(f"  ratio (resident / loader-fed step time): {re_ / lo:.3f}  (>= 0.97: the loader is not the bottleneck)")
        b = breakdown
        print(f"  per loader-fed step (ms): waited for data {b['wait_ms']:.1f} (batches ready {b['ready_mean']:.1f}), "
              f"step {b['step_ms']:.1f} = resident {b['step_vs_resident_ms']:+.1f}; read-ahead thread: read+collate "
              f"{b['read_ms']:.1f}, anchors {b['prep_ms']:.1f}, copy issue {b['copy_issue_ms']:.1f}"
              + (f", copy on GPU {b['copy_gpu_ms']:.1f}" if "copy_gpu_ms" in b else ""))


@dataclasses.dataclass
class Planned:
    """The bench's step as `hsstore train` plans it: the trainer's settings after its memory check, the anchors
    asked, and the check's estimate (bytes)."""

    batch: Any
    memory: Any
    asked_anchors: int
    estimate: int


def planned(args, drafter, device, store_url: str | None) -> Planned:
    """The step through the trainer's own memory plan (``budget.check_gpu_memory`` / ``check_cpu_memory``, the
    functions ``hsstore train`` calls): anchors, recompute policy and estimate for this device, its lines logged
    (``store_url``: a local store, whose lengths bound the sequences per batch, as in training)."""
    import hsstore
    from hsstore.app.schema import build as build_settings
    from hsstore.train import budget
    from hsstore.train.settings import TrainSettings

    settings = build_settings(TrainSettings, store=["bench"], out="bench", token_budget=args.max_tokens,
                              anchors=args.anchors, checkpoint_layers=args.checkpoint_layers, shard_optimizer="off",
                              gpu_memory_gib=args.gpu_memory_gib)
    params = drafter.num_trainable_parameters()
    frozen = drafter.embed_tokens.numel() + drafter.lm_head.numel()
    if device.type == "cuda":
        stores = [hsstore.open(store_url)] if store_url else None
        settings, plan = budget.gpu_plan(drafter.config, settings, params, frozen, device, stores)
        estimate = plan.estimate
    else:
        settings = budget.check_cpu_memory(drafter.config, settings, params, frozen)
        estimate = budget.step_bytes(drafter.config, args.max_tokens, settings.batch.anchors, params, frozen,
                                     checkpoint_layers=settings.memory.checkpoint_layers, device="cpu")
    print(f"plan: {settings.batch.anchors} anchors per sequence (asked {args.anchors}), --checkpoint-layers "
          f"{settings.memory.checkpoint_layers} (asked {args.checkpoint_layers}), estimated peak "
          f"{estimate / 2**30:.1f} GiB", file=sys.stderr, flush=True)
    return Planned(settings.batch, settings.memory, args.anchors, estimate)


def count_syncs(fn, device) -> collections.Counter:
    """Run ``fn`` with torch's CUDA sync debug mode on ("warn": a warning at every operation that waits for
    the GPU) and count the warnings raised on this thread (the one launching the step's kernels), by source
    line. Every such wait empties the GPU's queue until the thread refills it. Empty off CUDA."""
    found = collections.Counter()
    if device.type != "cuda":
        return found
    me = threading.get_ident()

    def show(message, category, filename, lineno, *rest):
        if threading.get_ident() == me and "synchroniz" in str(message):
            found[f"{os.path.relpath(filename)}:{lineno}"] += 1

    with warnings.catch_warnings():  # restores the filters and showwarning on the way out
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def launch_probe(args, store: Path, device: torch.device) -> None:
    """Between its syncs a GPU step's main thread only launches kernels: a few microseconds of Python and
    dispatcher each, under the GIL, on one core. This times such a thread (a loop of tiny in-place ops on
    ``device``) alone and while batches stream through the trainer's read-ahead as fast as it can make them
    (the consumer drops them), for each ``--reader-threads`` setting (0, the process's, and 1), alternated in one
    run: ``ops_ratio`` = rate while streaming / rate alone (1.0: the loader costs the launching thread nothing)."""
    if not (store / "manifest.json").exists():
        shutil.rmtree(store, ignore_errors=True)
        write_store(store, args, device)
    gamma = default_gamma(args.block)
    x = torch.zeros(1, device=device)

    def probe(seconds: float) -> float:  # tiny ops per second on this thread
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(100):
                x.add_(1.0)
            n += 100
        sync(device)
        return n / (time.perf_counter() - t0)

    def streamed(threads: int) -> tuple[float, float]:  # (ops/s, batches/s) while the read-ahead streams
        source = StoreBatches([str(store)], layers=list(range(args.taps)), token_budget=args.max_tokens, seed=0,
                              rank=0, world_size=1, pin_memory=device.type == "cuda")
        done, batches, rate = threading.Event(), [0], [0.0]

        def launcher():
            rate[0] = probe(args.probe_seconds)
            done.set()

        epoch = 0
        t = threading.Thread(target=launcher)
        t.start()
        t0 = time.perf_counter()
        while not done.is_set():
            source.set_epoch(epoch)
            s = read_ahead(source, lambda b, e=epoch: add_anchors(b, 0, e, args.anchors, args.block, gamma), device,
                           args.prefetch, threads=threads or None)
            for _ in s:
                batches[0] += 1
                if done.is_set():
                    break
            s.close()
            epoch += 1
        t.join()
        return rate[0], batches[0] / (time.perf_counter() - t0)

    res: dict[str, list] = {}
    for _ in range(args.rounds):
        res.setdefault("alone", []).append(probe(args.probe_seconds))
        for threads in (0, 1):
            ops, bps = streamed(threads)
            res.setdefault(f"threads={threads}", []).append(ops)
            res.setdefault(f"threads={threads} batches/s", []).append(bps)
    alone = statistics.median(res["alone"])
    out = {"device": str(device), "torch_threads": torch.get_num_threads(), "max_tokens": args.max_tokens,
           "ops_per_s_alone": alone, "rounds": res,
           "rounds_ops_1_vs_0": [b / a for a, b in zip(res["threads=0"], res["threads=1"])],  # paired, per round
           "rounds_batches_1_vs_0": [b / a for a, b in zip(res["threads=0 batches/s"], res["threads=1 batches/s"])]}
    for threads in (0, 1):
        out[f"reader_threads_{threads}"] = {
            "ops_ratio": statistics.median(res[f"threads={threads}"]) / alone,
            "batches_per_s": statistics.median(res[f"threads={threads} batches/s"]),
            "gb_per_s": statistics.median(res[f"threads={threads} batches/s"]) * args.max_tokens * args.taps
            * args.hidden * 2 / 1e9}
    print(json.dumps(out, indent=1) if args.json else out)


def loader_only(args, store: Path, device: torch.device) -> None:
    """Per rank: tokens/s and GB/s of batches landing on the device, for each data-path setting."""
    import torch.distributed as dist

    from hsstore.distributed import rank_and_world
    from hsstore.train.trainer import share_cpu_threads

    rank, world = rank_and_world()
    if world > 1:
        dist.init_process_group("gloo")
    if rank == 0 and not (store / "manifest.json").exists():
        shutil.rmtree(store, ignore_errors=True)
        write_store(store, args, device)
    if world > 1:
        dist.barrier()
    shared = share_cpu_threads(None, device)
    gamma = default_gamma(args.block)
    settings = [(pin, threads) for pin in ("pinned", "copy") for threads in dict.fromkeys([shared, 1])]
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    epoch = 0
    for r in range(args.rounds):
        for pin, threads in settings:
            name = f"{pin}/threads={threads}"
            torch.set_num_threads(threads)
            source = StoreBatches([str(store)], layers=list(range(args.taps)), token_budget=args.max_tokens, seed=0,
                                  rank=rank, world_size=world, pin_memory=pin == "pinned" and device.type == "cuda")
            source.set_epoch(epoch)
            stream = read_ahead(source, lambda b, e=epoch: add_anchors(b, 0, e, args.anchors, args.block, gamma),
                                device, args.prefetch)
            epoch += 1
            n = 0
            for i, (batch, _) in enumerate(stream):
                if i == args.warmup:  # the first batches fill the read-ahead: not timed
                    if world > 1:
                        dist.barrier()
                    sync(device)
                    t = time.perf_counter()
                if i >= args.warmup:
                    n += int(batch["attention_mask"].sum())
                    batch["hidden_states"].float().sum()  # the step uses what arrived (and keeps the copy honest)
                if i + 1 == args.warmup + args.steps:
                    break
            sync(device)
            times.setdefault(name, []).append(time.perf_counter() - t)
            tokens.setdefault(name, []).append(n)
            stream.close()
    token_bytes = args.taps * args.hidden * 2
    res = {"rank": rank, "world": world, "device": str(device), "threads_shared": shared, "settings": {}}
    for name in times:
        rates = [n / t for n, t in zip(tokens[name], times[name])]
        best = max(rates)
        res["settings"][name] = {"tokens_per_s": round(best), "gb_per_s": round(best * token_bytes / 1e9, 2),
                                 "rounds_tokens_per_s": [round(x) for x in rates]}
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, res)
        dist.destroy_process_group()
    else:
        gathered = [res]
    if rank == 0:
        out = {"world_size": world, "steps": args.steps, "max_tokens": args.max_tokens, "per_rank": gathered}
        print(json.dumps(out, indent=1) if args.json else out)


if __name__ == "__main__":
    main()
