"""Benchmarks of issue #17 (the seeds' scale: ~914K conversations, ~1e5 shards), one section per concern.

Sections (``--sections``; each a ``bench_<name>(args) -> dict`` in ``SECTIONS``):

  store     metadata-only stores of ``--shards`` (default 1e3 and 1e4; 1e5 locally) shards, locally and on moto
            behind the fault proxy's request latency (``--latency``): requests, time and peak memory of
            ``open``, ``info --json``, ``verify``'s metadata part and the loader's first item, with and without
            the index; the loader plan alone for ``--plan-samples`` samples (tools/bench_scale_store.py)

  tokenize  synthetic conversations (``--sizes``, default 1e5) in one JSONL file, tokenized with the tiny
            target's tokenizer (``extract/tiny.py``) the way ``hsstore extract`` does per rank
            (``load_samples(..., shard=RowShard(rank, world))``, samples kept as extract keeps them) for
            each world size (``--worlds``, default 1 and 8); each rank in a fresh process, one after
            another (``--parallel``: all ranks of a world size at once, as torchrun runs them), reporting
            time, rows, samples, tokens and memory (peak RSS and its growth over the process after the
            tokenizer loaded); and the quality gate over the whole input once (``gate_inputs``, what
            ``hsstore check --report`` runs), its time and memory.

Prints (and with ``--out`` writes) JSON.

    python -m tools.bench_scale --sizes 1e5 --worlds 1 8
    python -m tools.bench_scale --sizes 1e6 --worlds 8 --ranks 0 --no-gate   # one rank of 8 at 1e6
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import time
from pathlib import Path

from tools.measure import peak_rss_mb, rss_mb

WORDS = ("the of and to in is that for it as with was on be by this are from or have an they which one had "
         "not but what all were when we there can your more would about if will up out so said some into do "
         "number value step first then check answer result because each other time way could people").split()


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def synthetic_conversations(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` chats (one to three exchanges, answers with reasoning) as JSONL; reused when already written."""
    if path.exists():
        return path
    rng = random.Random(seed)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for i in range(n):
            messages = []
            for _ in range(rng.choice((1, 1, 2, 3))):
                messages.append({"role": "user", "content": _text(rng, 8, 60)})
                messages.append({"role": "assistant", "content": _text(rng, 5, 80),
                                 "reasoning_content": _text(rng, 0, 120)})
            f.write(json.dumps({"id": f"s{i}", "source": f"src{i % 3}", "messages": messages}) + "\n")
    tmp.rename(path)
    return path


def _tokenizer():
    from transformers import AutoTokenizer

    from hsstore.extract.tiny import tiny_target_dir

    return AutoTokenizer.from_pretrained(tiny_target_dir())


def _rank_job(inputs: list[str], rank: int, world: int, queue) -> None:
    """One rank's tokenization, as ``run_extract`` does it (its rows, samples kept), in this fresh process."""
    from hsstore.extract.readers import RowShard
    from hsstore.extract.tokenize import TokenizeStats, load_samples

    tok = _tokenizer()
    base = rss_mb()
    stats = TokenizeStats()
    t0 = time.perf_counter()
    samples = list(load_samples(inputs, tok, keep_over_length=True, stats=stats, shard=RowShard(rank, world)))
    seconds = time.perf_counter() - t0
    queue.put({"rank": rank, "world": world, "rows": stats.rows, "samples": len(samples),
               "tokens": int(sum(s.num_tokens for s in samples)), "seconds": round(seconds, 2),
               "rows_per_s": round(stats.rows / seconds, 1) if seconds else None,
               "peak_rss_mb": round(peak_rss_mb(), 1), "rss_growth_mb": round(peak_rss_mb() - base, 1)})


def _gate_job(inputs: list[str], queue) -> None:
    from hsstore.extract.gate import GateThresholds
    from hsstore.extract.gate_report import gate_inputs

    tok = _tokenizer()
    base = rss_mb()
    t0 = time.perf_counter()
    report = gate_inputs(inputs, tok, thresholds=GateThresholds())
    seconds = time.perf_counter() - t0
    queue.put({"samples": report.n_samples, "ok": report.ok, "seconds": round(seconds, 2),
               "peak_rss_mb": round(peak_rss_mb(), 1), "rss_growth_mb": round(peak_rss_mb() - base, 1)})


def _run(target, args_list: list[tuple]) -> list[dict]:
    """Each job in its own spawned process (so peak memory is that job's), at once; results in job order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, queue)) for a in args_list]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"benchmark process failed (exit {p.exitcode})")
    return results


def bench_tokenize(args) -> dict:
    _tokenizer()  # build the tiny target once, before processes race to build it
    out = {}
    for size in args.sizes:
        n = int(float(size))
        path = synthetic_conversations(Path(args.workdir) / f"conversations-{n}.jsonl", n)
        entry = {"rows": n, "input_bytes": path.stat().st_size, "worlds": {}}
        for world in args.worlds:
            ranks = [r for r in (args.ranks if args.ranks is not None else range(world)) if r < world]
            t0 = time.perf_counter()
            if args.parallel:
                per_rank = _run(_rank_job, [([str(path)], r, world) for r in ranks])
            else:
                per_rank = [_run(_rank_job, [([str(path)], r, world)])[0] for r in ranks]
            per_rank.sort(key=lambda d: d["rank"])
            entry["worlds"][str(world)] = {
                "ranks": per_rank,
                "wall_s": round(time.perf_counter() - t0, 2),
                "max_rank_s": max(d["seconds"] for d in per_rank),
                "max_rank_rss_growth_mb": max(d["rss_growth_mb"] for d in per_rank),
            }
            print(json.dumps({"size": n, "world": world, **entry["worlds"][str(world)]}), flush=True)
        if not args.no_gate:
            entry["gate"] = _run(_gate_job, [([str(path)],)])[0]
            print(json.dumps({"size": n, "gate": entry["gate"]}), flush=True)
        out[str(n)] = entry
    return out


def bench_store(args) -> dict:
    """Store metadata at scale (tools/bench_scale_store.py, each measurement in a fresh process): open, info
    --json, verify's metadata part and the loader's first item, with and without the index, locally and on moto
    behind the delaying proxy."""
    from tools import bench_scale_store

    out = Path(args.workdir) / "store.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    bench_scale_store.main(["--shards", args.shards, "--where", args.where, "--latency", args.latency,
                            "--plan-samples", str(args.plan_samples),
                            "--plan-shards", str(max(1, min(100000, args.plan_samples // 10))), "--json", str(out)])
    return {"runs": json.loads(out.read_text())}


SECTIONS = {"tokenize": bench_tokenize, "store": bench_store}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--sections", nargs="+", default=["tokenize"], choices=sorted(SECTIONS))
    ap.add_argument("--sizes", nargs="+", default=["1e5"], help="conversations per synthetic input (1e5 1e6)")
    ap.add_argument("--worlds", nargs="+", type=int, default=[1, 8], help="world sizes to simulate")
    ap.add_argument("--ranks", nargs="+", type=int, default=None, help="only these ranks of each world size")
    ap.add_argument("--parallel", action="store_true", help="run a world size's ranks at once (needs the cores)")
    ap.add_argument("--no-gate", action="store_true", help="skip the whole-input gate")
    ap.add_argument("--workdir", default="/tmp/hsstore-bench-scale", help="where the synthetic inputs are kept")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--shards", default="1000,10000", help="store: comma-separated shard counts")
    ap.add_argument("--where", default="local,s3", help="store: local, s3 (moto behind the delaying proxy), or both")
    ap.add_argument("--latency", default="0.03,0.1", help="store: seconds added to every S3 request")
    ap.add_argument("--plan-samples", type=int, default=1000000, help="store: the loader plan alone for N samples")
    args = ap.parse_args(argv)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    result = {"cpu_count": os.cpu_count(), **{name: SECTIONS[name](args) for name in args.sections}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
