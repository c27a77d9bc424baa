"""The correctness checks of ``tools/gpu_node.sh`` (issue #41: one whole node, N GPUs), one subcommand each.

Each check writes its figures as JSON (``--json PATH``), prints one line (the table's key figure) and exits 0
when its check passed, 1 when it did not, so that the script's table says which held:

  corpus OUT --rows N             N distinct conversations (``tools/tiny_corpus``): an input for the kill phase
  ids STORE [--bench N | --same-as REF]   every sample id once, and the ids asked for (bench_extract's first N
                                  synthetic ids, or another store's ids, with their features compared bit for bit)
  kill STORE -- CMD...            run CMD (torchrun of ``hsstore extract``), SIGKILL its last rank once STORE
                                  has a committed shard, wait for torchrun to end
  s3-serve STORE --dir D          moto + the counting proxy on loopback (a process of its own, in the background),
                                  STORE uploaded and read through the proxy once; D/s3.json says where
  s3-counts --dir D --name NAME   the store's shard bytes the proxy sent since the last count (and resets them)
  interrupt RUN --world N -- CMD  CMD (torchrun of ``hsstore train``) gets Ctrl-C (SIGINT to its process group)
                                  after RUN/metrics.jsonl has --after lines: every rank stops at one step, with
                                  one checkpoint holding every rank's loader state
  run RUN --world N --ids-from STORE   a finished training run: lockstep, every sample exactly once per epoch,
                                  per-step time and the share of it spent waiting for data (from metrics.jsonl)
  same A B                        a resumed run against an uninterrupted one: each rank's sample ids step by
                                  step equal, losses within --rtol
  loader STORE (under torchrun)   the loader alone, N ranks x --workers: exactly once per epoch, the same order
                                  after a mid-epoch resume, GB/s of features per rank

    python -m tools.node_checks ids /tmp/store --bench 64 --json ids.json
    torchrun --standalone --nproc_per_node 8 -m tools.node_checks loader /tmp/store --workers 2 --json loader.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import hsstore


def _emit(args, ok: bool, line: str, figures: dict) -> int:
    """The check's JSON (when asked) and its one line; the exit status says whether it held."""
    figures = {"ok": ok, **figures}
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(figures, indent=1, default=str) + "\n")
    print(("OK " if ok else "FAILED ") + line, flush=True)
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------- stores, ids


def corpus(args) -> int:
    from tools.tiny_corpus import examples

    rows = [json.dumps({"id": f"c{i:05d}", "messages": e.messages()}) for i, e in enumerate(examples(7, args.rows))]
    Path(args.out).write_text("\n".join(rows) + "\n")
    return _emit(args, len(rows) == args.rows, f"{len(rows)} conversations in {args.out}", {"rows": len(rows)})


def ids(args) -> int:
    """Sample ids of the store: each once, and exactly the ones asked for."""
    store = hsstore.open(args.store)
    got = store.sample_ids()
    seen = Counter(got)
    dup = sorted(s for s, n in seen.items() if n > 1)
    if args.same_as:
        ref = hsstore.open(args.same_as)
        want = set(ref.sample_ids())
    else:
        from tools.bench_extract import synthetic

        want = {s.sample_id for s in synthetic(args.bench, 1, 1, 2)} if args.bench else set(seen)
    missing, extra = sorted(want - set(seen)), sorted(set(seen) - want)
    fig = {"store": args.store, "samples": len(got), "distinct": len(seen), "wanted": len(want),
           "duplicates": dup[:10], "missing": missing[:10], "extra": extra[:10], "commits": len(store.commits),
           "writers": sorted({c.writer for c in store.commits})}
    ok = not dup and not missing and not extra
    line = (f"{len(got)} samples, {len(seen)} distinct of {len(want)} wanted; {len(dup)} duplicated, "
            f"{len(missing)} missing, {len(extra)} extra; {len(store.commits)} shards by {len(fig['writers'])} writers")
    if args.same_as and ok:
        fig["features_equal"] = _features_equal(store, ref)
        line += f"; features bit-equal to the reference in {fig['features_equal']}/{len(got)}"
    return _emit(args, ok, line, fig)


def _features_equal(store, ref) -> int:
    """How many samples have the same input ids and the same feature bits in both stores."""
    import torch

    where = {ref.ref(i).sample_id: i for i in range(len(ref))}
    same = 0
    for i in range(len(store)):
        a = store.read(i)
        b = ref.read(where[a["sample_id"]])
        same += bool(torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(
            a["hidden_states"].contiguous().view(torch.uint8), b["hidden_states"].contiguous().view(torch.uint8)))
    return same


def _committed(store: Path) -> set[str]:
    """Shards with a commit record (a record being written, a dot file, does not count)."""
    d = store / "commits"
    return {p.stem for p in d.glob("*.json") if not p.name.startswith(".")} if d.is_dir() else set()


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _rank_pids(pid: int) -> dict[int, int]:
    """rank -> pid of the torchrun workers below ``pid`` (their RANK environment variable)."""
    ranks = {}
    for p in _descendants(pid):
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{p}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            ranks.setdefault(int(env["RANK"]), p)  # the worker itself, before its own children
    return ranks


def kill(args) -> int:
    """SIGKILL one rank of a running torchrun extraction once a first shard is committed."""
    store = Path(args.store)
    before = len(_committed(store))
    proc = subprocess.Popen(args.cmd, stdout=subprocess.DEVNULL, stderr=open(args.log, "w") if args.log else None)
    deadline = time.monotonic() + args.timeout
    while proc.poll() is None and time.monotonic() < deadline and len(_committed(store)) <= before:
        time.sleep(0.005)
    fig = {"committed_before": before, "killed": None}
    if proc.poll() is None:
        ranks = _rank_pids(proc.pid)
        if ranks:
            rank = max(ranks)
            os.kill(ranks[rank], signal.SIGKILL)
            fig.update(killed=rank, committed_at_kill=len(_committed(store)), ranks_seen=len(ranks))
    try:
        fig["torchrun_exit"] = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        fig["torchrun_exit"] = proc.wait()
    fig["committed_after"] = len(_committed(store))
    ok = fig["killed"] is not None and fig["torchrun_exit"] != 0
    line = (f"rank {fig['killed']} SIGKILLed with {fig.get('committed_at_kill')} shards committed; torchrun exit "
            f"{fig['torchrun_exit']}, {fig['committed_after']} shards committed" if fig["killed"] is not None
            else f"no kill: the run ended (exit {fig['torchrun_exit']}) before a shard was committed")
    return _emit(args, ok, line, fig)


# ------------------------------------------------------------------------------------------- S3 emulation


def s3_serve(args) -> int:
    """Serve until SIGTERM; SIGUSR1 appends the proxy's shard counts to D/counts.jsonl and resets them."""
    from tools.bench_source import emulated_s3, shard_counts, warm_through
    from hsstore.io import storage

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    with emulated_s3() as (endpoint, proxy):
        url = f"s3://{proxy.bucket}/store"
        fs, root = storage.resolve(url, {"endpoint_url": endpoint})
        local = Path(args.store)
        files = [p for p in sorted(local.rglob("*")) if p.is_file()]
        for p in files:
            fs.put_file(str(p), f"{root}/{p.relative_to(local).as_posix()}")
        shard_bytes = sum(p.stat().st_size for p in files if "shards" in p.relative_to(local).parts)
        warm_through(proxy, url, 0.0, None)

        def count(*_):
            by_array = Counter()  # shards/NAME/ARRAY/...: which arrays the bytes were of
            fetches = Counter()
            for path, n in list(proxy.sent.items()):
                parts = path.split("/shards/", 1)[-1].split("/")
                if "/shards/" in path and len(parts) > 1:
                    by_array[parts[1]] += n
            for entry in list(proxy.log):
                fetches[str(entry)] += 1
            row = {**shard_counts(proxy), "by_array": dict(by_array.most_common()),
                   "most_fetched": fetches.most_common(3)}
            with (d / "counts.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            proxy.reset_counts()

        signal.signal(signal.SIGUSR1, count)
        (d / "s3.json").write_text(json.dumps({"url": url, "read_endpoint": proxy.url, "write_endpoint": endpoint,
                                               "shard_bytes": shard_bytes, "files": len(files), "pid": os.getpid()}))
        while not stop:
            time.sleep(0.2)
    return 0


def s3_counts(args) -> int:
    d = Path(args.dir)
    info = json.loads((d / "s3.json").read_text())
    path = d / "counts.jsonl"
    n = len(path.read_text().splitlines()) if path.exists() else 0
    os.kill(info["pid"], signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not path.exists() or len(path.read_text().splitlines()) <= n):
        time.sleep(0.05)
    row = json.loads(path.read_text().splitlines()[-1])
    ratio = row["remote_bytes"] / info["shard_bytes"]
    fig = {"name": args.name, **row, "shard_bytes": info["shard_bytes"], "remote_vs_store": ratio}
    ok = args.at_most is None or ratio <= args.at_most
    return _emit(args, ok, f"{args.name}: {row['remote_bytes'] / 1e6:,.1f} MB of shards fetched = {ratio:.3f}x the "
                           f"store's {info['shard_bytes'] / 1e6:,.1f} MB" + (f" (goal <= {args.at_most})"
                                                                             if args.at_most else ""), fig)


# ------------------------------------------------------------------------------------------- training runs


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _sample_logs(run: Path, world: int) -> list[list[dict]]:
    return [_jsonl(run / f"samples.rank{r:05d}.jsonl") for r in range(world)]


def interrupt(args) -> int:
    """Ctrl-C to the launcher's process group mid-run: all ranks stop after one step, with its checkpoint."""
    run = Path(args.run)
    metrics = run / "metrics.jsonl"
    err_path = Path(args.log) if args.log else run.with_suffix(".interrupt.err")
    with err_path.open("w") as err:
        proc = subprocess.Popen(args.cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        deadline = time.monotonic() + args.timeout
        while proc.poll() is None and time.monotonic() < deadline and len(_jsonl(metrics)) < args.after:
            time.sleep(0.1)
        sent = proc.poll() is None
        if sent:
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
    text = err_path.read_text()
    steps = sorted({int(part.split(":")[0]) for part in text.split("stopped at step ")[1:]})
    stops = text.count("stopped at step ")
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step_*")) if (run / "checkpoints").is_dir() else []
    step = steps[0] if len(steps) == 1 else None
    loaders = [r for r in range(args.world) if step is not None and
               (run / "checkpoints" / f"step_{step:08d}" / f"loader.rank{r:05d}.json").is_file()]
    logged = [len(x) for x in _sample_logs(run, args.world)]
    fig = {"signal_sent": sent, "exit": code, "stopped_lines": stops, "steps": steps, "checkpoints": ckpts,
           "loader_states": len(loaders), "logged_steps_per_rank": logged}
    ok = (sent and stops == args.world and step is not None and step < args.before and ckpts == [f"step_{step:08d}"]
          and len(loaders) == args.world and set(logged) <= {step})
    return _emit(args, ok, f"Ctrl-C: {stops}/{args.world} ranks stopped at step(s) {steps}, exit {code}, "
                           f"checkpoints {ckpts}, {len(loaders)} loader states", fig)


def run_report(args) -> int:
    """A finished run: lockstep ranks, every sample once per epoch, steady step time and wait share."""
    run = Path(args.run)
    everything = set(hsstore.open(args.ids_from).sample_ids())
    logs = _sample_logs(run, args.world)
    m = _jsonl(run / "metrics.jsonl")
    lockstep = all([r["step"] for r in x] == [r["step"] for r in logs[0]] for x in logs) and bool(logs[0])
    epochs = {}
    for e in sorted({r["epoch"] for x in logs for r in x}):
        seen = Counter(s for x in logs for r in x if r["epoch"] == e for s in r["samples"])
        epochs[e] = {"distinct": len(seen), "max_uses": max(seen.values()), "every_sample": set(seen) == everything}
    once = bool(epochs) and all(v["every_sample"] and v["max_uses"] == 1 for v in epochs.values())
    # steady state: not step 1 (compile, caches) nor an epoch's first step (the loader starts again)
    first = {min(r["step"] for r in m if r["epoch"] == e) for e in {r["epoch"] for r in m}}
    steady = [r for r in m if r["step"] not in first and r.get("tokens_per_s")] or m[1:] or m
    secs = [r["tokens"] / r["tokens_per_s"] for r in steady if r.get("tokens_per_s")]
    wait = [r["wait_frac"] for r in steady]
    fig = {"world": args.world, "steps": len(m), "epochs": epochs, "lockstep": lockstep, "exactly_once": once,
           "step_s_median": statistics.median(secs) if secs else None,
           "wait_frac_mean": statistics.mean(wait) if wait else None,
           "fed_vs_resident_estimate": 1 - statistics.mean(wait) if wait else None,
           "tokens_per_s_per_gpu": (statistics.median(r["tokens_per_s"] for r in steady) / args.world
                                    if steady else None),
           "peak_gib": max((r.get("gpu_mem_gib", 0) for r in m), default=None), "last_loss": m[-1]["loss"] if m else None}
    ok = lockstep and once and len(m) == len(logs[0])
    return _emit(args, ok, f"{args.world} rank(s), {len(m)} steps, {len(epochs)} epochs, exactly once per epoch: "
                           f"{once}, lockstep: {lockstep}; step {fig['step_s_median'] or 0:.3f} s, waiting for data "
                           f"{(fig['wait_frac_mean'] or 0) * 100:.1f}% of it", fig)


def same(args) -> int:
    """A resumed run equals an uninterrupted one: the same samples per rank and step, the same losses."""
    a, b = Path(args.a), Path(args.b)
    la, lb = _sample_logs(a, args.world), _sample_logs(b, args.world)
    order = la == lb and bool(la[0])
    ma, mb = _jsonl(a / "metrics.jsonl"), _jsonl(b / "metrics.jsonl")
    rel = [abs(x["loss"] - y["loss"]) / max(abs(x["loss"]), 1e-12) for x, y in zip(ma, mb)]
    worst = max(rel, default=float("inf"))
    fig = {"steps": [len(ma), len(mb)], "same_samples_per_rank_and_step": order, "loss_max_rel_diff": worst,
           "rtol": args.rtol}
    ok = order and len(ma) == len(mb) > 0 and worst <= args.rtol
    return _emit(args, ok, f"resumed vs uninterrupted: {len(mb)} vs {len(ma)} steps, same samples per rank and step: "
                           f"{order}, losses' largest relative difference {worst:.2e} (rtol {args.rtol:g})", fig)


def _json_of(path: str) -> dict:
    """The JSON object a bench printed (after whatever else it wrote first)."""
    text = Path(path).read_text()
    return json.loads(text[text.index("{"):])


def extract_speed(args) -> int:
    """Per-GPU extraction tokens/s of the N-rank run over the 1-rank run (compiled where it was)."""
    one, many = _json_of(args.one), _json_of(args.many)
    mode = max(one["tokens_per_s"], key=lambda m: (m.endswith("+compile"), m.startswith("extract_process")))
    ranks = many["per_rank"]
    # all ranks ran each mode at once: the slowest rank's time is the node's
    node = sum(r["tokens"] for r in ranks) / max(r["tokens"] / r["tokens_per_s"][mode] for r in ranks)
    ratio = node / len(ranks) / one["tokens_per_s"][mode]
    fig = {"mode": mode, "one_gpu": one["tokens_per_s"][mode], "per_gpu": node / len(ranks), "ranks": len(ranks),
           "ratio": ratio, "goal": args.at_least, "goal_checked": args.goal}
    return _emit(args, ratio >= args.at_least or not args.goal,
                 f"{mode}: {node / len(ranks):,.0f} tokens/s per GPU on {len(ranks)} vs {one['tokens_per_s'][mode]:,.0f} "
                 f"on 1 = {ratio:.3f}x (goal >= {args.at_least}{'' if args.goal else ', not checked here'})", fig)


def train_speed(args) -> int:
    """Per-GPU step time of the 1-rank run over the N-rank run's, and the N-rank run's wait for data."""
    one, many = json.loads(Path(args.one).read_text()), json.loads(Path(args.many).read_text())
    ratio = one["step_s_median"] / many["step_s_median"]
    wait = many["wait_frac_mean"]
    fig = {"step_s_1": one["step_s_median"], "step_s_n": many["step_s_median"], "ranks": many["world"],
           "ratio": ratio, "wait_frac_n": wait, "fed_vs_resident_estimate_n": 1 - wait,
           "goals": {"ratio": args.at_least, "wait": args.max_wait}, "goal_checked": args.goal}
    ok = (ratio >= args.at_least and wait <= args.max_wait) or not args.goal
    return _emit(args, ok, f"step {many['step_s_median']:.3f} s on {many['world']} ranks vs {one['step_s_median']:.3f} s "
                           f"on 1 = {ratio:.3f}x (goal >= {args.at_least}); waited for data {wait * 100:.1f}% of the "
                           f"steps (goal <= {args.max_wait * 100:g}%){'' if args.goal else ', goals not checked here'}",
                 fig)


# ------------------------------------------------------------------------------------------- the loader alone


def loader(args) -> int:
    """Every rank reads its share through ``--workers`` DataLoader workers for ``--epochs`` epochs, then the
    last epoch again, cut after ``--cut`` batches and resumed from the state saved there by a fresh loader:
    rank 0 checks that the ranks together saw every sample once per epoch and the resumed order."""
    import torch
    import torch.distributed as dist

    from hsstore.distributed import rank_and_world
    from hsstore.train.data import StoreBatches

    rank, world = rank_and_world()
    if world > 1:
        dist.init_process_group("gloo")
    device = torch.device(args.device if args.device != "cuda" else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    options = dict(kv.split("=", 1) for kv in args.storage_option)
    store = hsstore.open(args.store, **options)

    def source():
        return StoreBatches([args.store], layers=store.layers, token_budget=args.token_budget, seed=0, rank=rank,
                            world_size=world, workers=args.workers, pin_memory=device.type == "cuda",
                            partition=args.partition, cache_dir=args.cache_dir, storage_options=options)

    def read(src):
        """(sample ids per batch, GB/s of features to the device after the first batch: the workers' start
        and the first fetches are not the rate)"""
        got, nbytes, t = [], 0, None
        for batch in src:
            hs = batch["hidden_states"].to(device, non_blocking=True)
            if t is None:
                t = time.perf_counter()
            else:
                nbytes += hs.numel() * hs.element_size()
            got.append(list(batch["sample_id"]))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return got, nbytes / max(time.perf_counter() - (t or 0), 1e-9) / 1e9 if len(got) > 1 else 0.0

    src, rates, per_epoch = source(), [], []
    for e in range(args.epochs):
        src.set_epoch(e)
        if world > 1:
            dist.barrier()
        got, gbps = read(src)
        rates.append(gbps)
        per_epoch.append(got)
    last = args.epochs - 1
    cut = source()
    cut.set_epoch(last)
    it = iter(cut)
    head = [list(next(it)["sample_id"]) for _ in range(min(args.cut, len(per_epoch[last])))]
    state = cut.state_dict()
    del it, cut
    again = source()
    again.set_epoch(last)
    again.load_state_dict(state)
    tail, _ = read(again)
    mine = {"rank": rank, "epochs": per_epoch, "gbps": rates, "resumed_same": head + tail == per_epoch[last],
            "cut_at": len(head), "mid_epoch": 0 < len(head) < len(per_epoch[last])}
    everyone = [None] * world
    if world > 1:
        dist.all_gather_object(everyone, mine)
        dist.destroy_process_group()
    else:
        everyone = [mine]
    if rank != 0:
        return 0
    return _loader_verdict(args, everyone, set(store.sample_ids()))


def _loader_verdict(args, everyone: list[dict], wanted: set[str]) -> int:
    epochs = []
    for e in range(args.epochs):
        seen = Counter(s for r in everyone for batch in r["epochs"][e] for s in batch)
        epochs.append({"distinct": len(seen), "max_uses": max(seen.values(), default=0),
                       "every_sample": set(seen) == wanted})
    once = all(x["every_sample"] and x["max_uses"] == 1 for x in epochs)
    resumed = all(r["resumed_same"] and r["mid_epoch"] for r in everyone)  # a cut at an epoch's end proves nothing
    # epoch 0 fills a node cache (or the page cache); later epochs read from it
    steady = [min(r["gbps"][1:] or r["gbps"]) for r in everyone]
    fig = {"world": len(everyone), "workers": args.workers, "partition": args.partition, "epochs": epochs,
           "exactly_once": once, "resumed_same_order": resumed, "cut_at": [r["cut_at"] for r in everyone],
           "gbps_per_rank": [r["gbps"] for r in everyone], "steady_gbps_min_rank": min(steady)}
    return _emit(args, once and resumed, f"{len(everyone)} ranks x {args.workers} workers, {args.epochs} epochs: "
                                         f"exactly once per epoch: {once}, same order after a mid-epoch resume: "
                                         f"{resumed}; slowest rank {min(steady):.3g} GB/s after epoch 0 (after each epoch's first batch)", fig)


# ------------------------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    sub = ap.add_subparsers(dest="check", required=True)

    def cmd(name, fn, *positional):
        p = sub.add_parser(name)
        for a in positional:
            p.add_argument(a)
        p.add_argument("--json", default=None, help="write the figures here")
        p.set_defaults(fn=fn)
        return p

    cmd("corpus", corpus, "out").add_argument("--rows", type=int, default=200)
    p = cmd("ids", ids, "store")
    p.add_argument("--bench", type=int, default=0, help="the store must hold bench_extract's first N sample ids")
    p.add_argument("--same-as", default=None, help="... or the ids of this store (features compared too)")
    for name, fn, pos in (("kill", kill, "store"), ("interrupt", interrupt, "run")):
        p = cmd(name, fn, pos)
        p.add_argument("--timeout", type=float, default=600)
        p.add_argument("--log", default=None, help="the command's stderr")
        p.set_defaults(cmd=[])  # what follows `--`
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--after", type=int, default=3, help="Ctrl-C once metrics.jsonl has this many lines")
    p.add_argument("--before", type=int, required=True, help="the run's steps: the stop must come before its end")
    cmd("s3-serve", s3_serve, "store").add_argument("--dir", required=True)
    p = cmd("s3-counts", s3_counts)
    p.add_argument("--dir", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--at-most", type=float, default=None, help="fail above this ratio of the store's shard bytes")
    p = cmd("run", run_report, "run")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--ids-from", required=True, help="a store with the same sample ids (the local copy)")
    p = cmd("same", same, "a", "b")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--rtol", type=float, default=1e-3, help="GPU kernels need not repeat a loss to the bit")
    p = cmd("loader", loader, "store")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--cut", type=int, default=2, help="batches read before the resume")
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--partition", choices=("global", "node"), default="node")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    for name, fn in (("extract-speed", extract_speed), ("train-speed", train_speed)):
        p = cmd(name, fn, "one", "many")
        p.add_argument("--at-least", type=float, required=True, help="goal: the N-rank figure per GPU / 1-rank's")
        p.add_argument("--goal", action="store_true", help="fail below the goal (on GPUs; CPU figures mean nothing)")
    p.add_argument("--max-wait", type=float, default=0.05, help="goal: the N-rank run's share of time waiting")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = _parser().parse_args(argv[:cut])
    if hasattr(args, "cmd"):
        args.cmd = argv[cut + 1:]
        if not args.cmd:
            _parser().error(f"{args.check}: the command to run goes after --")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
