#!/usr/bin/env bash
# Issue #28 on one H200 (16 cores): every figure the issue asks for, one command each (each under ~3 minutes,
# each capped by `timeout`), then one compact table. Run from the repository root with the venv active:
#
#   bash tools/gpu_loader_28.sh [SCRATCH]        # SCRATCH: local NVMe directory (default /tmp/hs28)
#
# The S3 rows need moto's server, boto3 and s3fs, which the GPU machine lacks: `bash tools/gpu_wheels.sh` here puts
# their wheels into .whl/ (carry it); this script installs them into /tmp/site when moto is missing, and without
# them those rows say so.
set -u
S=${1:-/tmp/hs28}
R=$S/results
mkdir -p "$S" "$R"
T=${T:-180}
ONLY=${ONLY:-}  # names of the rows to run (default: all), e.g. ONLY="source_cold ckpt_1x16384"
if ! python3 -c "import moto.server, s3fs" 2>/dev/null && ls .whl/moto-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
S3=1; python3 -c "import moto.server, s3fs" 2>/dev/null || { S3=; echo "moto/s3fs missing: S3 rows skipped (bash tools/gpu_wheels.sh, carry .whl)" >&2; }
run() {  # name, command...: JSON (last line block) to $R/name.json, log to $R/name.log
    local name=$1; shift
    [[ -z $ONLY || " $ONLY " == *" $name "* ]] || return 0
    if [[ -z $S3 && $name == *s3* ]]; then echo "skipped: moto/s3fs missing" >"$R/$name.log"; return 0; fi
    echo "== $name: $*" >&2
    timeout "$T" "$@" >"$R/$name.json" 2>"$R/$name.log" || echo "   (exit $?; see $R/$name.log)" >&2
}

# 1. four ranks at once from local files, page cache dropped before each epoch (read-once, cold NVMe)
#    (3 epochs: epoch 0 also faults in the loader's buffers, 1-3 CPU-s per GB in a VM; epochs 1-2 are the steady
#    state), then again (the former mapped reads, HSSTORE_MAPPED_READS=1, are gone from the package; their paired
#    rows are in docs/PERFORMANCE.md)
run source_cold hsstore bench "$S" --what source --procs 4 --size-mb 4096 --epochs 3 --cold --quiet --json
run source_cold_again hsstore bench "$S" --what source --procs 4 --size-mb 4096 --epochs 3 --cold --quiet --json
# 2. the same four ranks from S3 emulated on loopback (moto + proxy replaying from memory): latency 0 vs 30 ms,
#    100 MB/s per connection (~100 s) (chunks fetched whole as bytes, HSSTORE_STREAM_READS=0, are gone from the
#    package; their paired rows are in docs/PERFORMANCE.md); then --partition node with a per-rank cache: remote
#    bytes per epoch
run source_s3 python -m tools.bench_source --procs 4 --size-mb 1024 --latency 0.03 --bandwidth-mb 100 \
    --sections s3 --scratch "$S" --json
run source_s3_node python -m tools.bench_source --procs 4 --size-mb 1024 --latency 0.03 --bandwidth-mb 100 \
    --sections node --scratch "$S" --json
# 3. the published 5-layer drafter, activation checkpointing off/on: 4 x 4096 tokens (2,048 anchors) and
#    1 x 16,384 (512 anchors): peak, step time, train's estimate
run ckpt_4x4096 python -m tools.bench_attention --published --seq 4096 --batch 4 --anchors 512 --impl blocks \
    --ckpt off on --steps 3 --warmup 1 --json
run ckpt_1x16384 python -m tools.bench_attention --published --seq 16384 --batch 1 --anchors 512 --impl blocks \
    --ckpt off on --steps 3 --warmup 1 --json
# 4. the trainer fed by the loader vs resident, published recipe (5 layers, 4 x 4096, 512 anchors each), cold;
#    each with the per-step breakdown (waited for data, step vs resident, read/anchors/copy on the read-ahead
#    thread); _t1: the read-ahead and loader threads on one torch thread each (off the launching thread's cores);
#    launch_probe: how much the streaming read-ahead slows a thread that launches kernels, 0 vs 1 reader threads
run fed_cold python -m tools.bench_train --dir "$S" --device cuda --draft-layers 5 --seq 4096 --max-tokens 16384 \
    --anchors 512 --cold --rounds 3 --steps 5 --warmup 2 --keep-store --json
run fed_cold_t1 python -m tools.bench_train --dir "$S" --device cuda --draft-layers 5 --seq 4096 --max-tokens 16384 \
    --anchors 512 --cold --rounds 3 --steps 5 --warmup 2 --reader-threads 1 --keep-store --json
run launch_probe python -m tools.bench_train --dir "$S" --device cuda --seq 4096 --max-tokens 16384 --launch-probe \
    --rounds 2 --probe-seconds 5 --keep-store --json
run fed_cold_ckpt python -m tools.bench_train --dir "$S" --device cuda --draft-layers 5 --seq 4096 \
    --max-tokens 16384 --anchors 512 --cold --rounds 2 --steps 5 --warmup 1 --checkpoint-layers full --keep-store --json
# 5. ... and from the S3 emulation (30 ms, 100 MB/s per connection; 16 samples, one epoch a round; moto and the
#    proxy in a process of their own), read in the trainer's process and by 2 DataLoader workers (the S3 client's Python off the launching thread's GIL;
#    needs torchdata: bash tools/gpu_wheels.sh)
run fed_s3 python -m tools.bench_train --dir "$S" --device cuda --draft-layers 5 --seq 4096 --max-tokens 16384 \
    --anchors 512 --s3 --s3-latency 0.03 --s3-bandwidth-mb 100 --rounds 2 --steps 3 --warmup 1 --samples 16 --json
run fed_s3_w2 python -m tools.bench_train --dir "$S" --device cuda --draft-layers 5 --seq 4096 --max-tokens 16384 \
    --anchors 512 --s3 --s3-latency 0.03 --s3-bandwidth-mb 100 --rounds 2 --steps 3 --warmup 1 --samples 16 \
    --workers 2 --json
# 6. hsstore train planning for an 80 GB GPU (and held to it): without checkpointing it lowers anchors, saying
#    so; with --checkpoint-layers it keeps 512
STORE=; [[ -z $ONLY || " $ONLY " == *" train80"* ]] && STORE=$(timeout "$T" python -m tools.bench_train --dir "$S" --device cuda --seq 4096 --samples 24 --steps 1 --warmup 1 --store-only \
    2>>"$R/store.log" | tail -1)
for ck in "" "--checkpoint-layers full"; do
    name=train80${ck:+_ckpt}
    rm -rf "$S/$name"
    run "$name" hsstore train --store "$STORE" --out "$S/$name" --steps 3 --device cuda --gpu-memory-gib 80 \
        --token-budget 16384 --anchors 512 $ck --mask-token-id 0 --save-every 1000 --quiet --json
done

python - "$R" <<'EOF'
import json, pathlib, re, sys
R = pathlib.Path(sys.argv[1])
def load(name):
    try:
        text = (R / f"{name}.json").read_text()
        return json.loads(text[text.index("{"):])
    except (OSError, ValueError):
        return None
def rows_of_jsonl(name):
    try:
        return [json.loads(l) for l in (R / f"{name}.json").read_text().splitlines() if l.startswith("{")]
    except FileNotFoundError:
        return []
print("\n# issue 28, H200")
print("| source | epoch | GB/s total | GB/s/rank min | CPU-s/GB | remote GB | in flight |")
print("|---|---|---|---|---|---|---|")
src = {}
for key, label in (("source_cold", "local cold"), ("source_cold_again", "local cold, again")):
    c = load(key)
    if isinstance(c, dict):
        src[label] = c["source"]
for key, prefix in (("source_s3", ""), ("source_s3_node", "")):
    s3 = load(key)
    if isinstance(s3, dict):
        src.update({prefix + k: v for k, v in s3.items()})
for name, r in src.items():
    for e in r["epochs"]:
        rem = f"{e['remote_bytes'] / 1e9:.3f}" if "remote_bytes" in e else "-"
        print(f"| {name} | {e['epoch']} | {e['total_gbps']:.2f} | {e['min_rank_gbps']:.2f} | {e['cpu_s_per_gb']:.2f} "
              f"| {rem} | {e.get('max_in_flight', '-')} |")
        for mode, raw in e.get("raw", {}).items():  # the disk's limit: plain reads by as many processes
            v = e["vs_raw"][mode]
            print(f"| {name}, raw {mode} (loader/raw {v['total']:.2f}, slowest {v['min_rank']:.2f}) | {e['epoch']} | "
                  f"{raw['total_gbps']:.2f} | {raw['min_rank_gbps']:.2f} | {raw['cpu_s_per_gb']:.2f} | - | - |")
print("\n| drafter step | ckpt | ms/step | tokens/s | peak GiB | train's estimate GiB |")
print("|---|---|---|---|---|---|")
for name in ("ckpt_4x4096", "ckpt_1x16384"):
    for r in rows_of_jsonl(name):
        if "error" in r:
            print(f"| {name} | {r.get('ckpt')} | {r['error']} | | | |")
        else:
            print(f"| {name} | {r['ckpt']} | {r['ms_per_step']:.0f} | {r['tokens_per_s']:,.0f} | "
                  f"{r.get('peak_gib', float('nan')):.1f} | {r.get('estimate_gib', float('nan')):.1f} |")
print("\n| trainer | loader ms | resident ms | resident/loader | GB/s fed | peak GiB | remote GB |")
print("|---|---|---|---|---|---|---|")
fed = {}
for name in ("fed_cold", "fed_cold_t1", "fed_cold_ckpt", "fed_s3", "fed_s3_w2"):
    r = load(name)
    if isinstance(r, dict):
        fed[name] = r
        rem = f"{r['remote_bytes'] / 1e9:.2f}" if "remote_bytes" in r else "-"
        print(f"| {name} | {r['loader_ms']:.0f} | {r['resident_ms']:.0f} | {r['ratio']:.3f} | {r['loader_gbps']:.2f} | "
              f"{r.get('peak_gib', float('nan')):.1f} | {rem} |")
    else:
        print(f"| {name} | failed: see {R}/{name}.log | | | | | |")
print("\n| loader-fed step, ms | waited for data | batches ready | step - resident | read+collate | anchors | "
      "copy issue | copy on GPU | rounds' ratios |")
print("|---|---|---|---|---|---|---|---|---|")
for name, r in fed.items():
    b = r.get("breakdown_ms")
    if b:
        print(f"| {name} | {b['wait_ms']:.1f} | {b['ready_mean']:.1f} | {b['step_vs_resident_ms']:+.1f} | "
              f"{b['read_ms']:.1f} | {b['prep_ms']:.1f} | {b['copy_issue_ms']:.1f} | {b.get('copy_gpu_ms', float('nan')):.1f} | "
              f"{' '.join(f'{x:.3f}' for x in r.get('rounds_ratio', []))} |")
p = load("launch_probe")
if isinstance(p, dict):
    print("\n| launch probe | ops/s vs alone | read-ahead GB/s meanwhile |")
    print("|---|---|---|")
    for t in (0, 1):
        x = p[f"reader_threads_{t}"]
        print(f"| reader threads {t or 'as the process'} | {x['ops_ratio']:.3f} | {x['gb_per_s']:.2f} |")
print("\n| hsstore train, 80 GiB plan | what it said |")
print("|---|---|")
for name in ("train80", "train80_ckpt"):
    try:
        log = (R / f"{name}.log").read_text()
    except FileNotFoundError:
        continue
    said = [l.strip() for l in log.splitlines() if re.search(r"estimated GPU peak|lowering anchors|needs about|Error", l)]
    print(f"| {name} | {' / '.join(said)[:400] or 'see log'} |")
EOF
