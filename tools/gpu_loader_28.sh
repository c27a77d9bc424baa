#!/usr/bin/env bash
# Issue #28 on one H200 (16 cores): every figure the issue asks for, one command each (each under ~3 minutes,
# each capped by `timeout`), then one compact table. Run from the repository root with the venv active:
#
#   bash tools/gpu_loader_28.sh [SCRATCH]        # SCRATCH: local NVMe directory (default /tmp/hs28)
#
# Needs moto (pip install 'moto[server]', a test dependency) for the S3 rows; without it those rows say so.
set -u
S=${1:-/tmp/hs28}
R=$S/results
mkdir -p "$S" "$R"
T=${T:-180}
ONLY=${ONLY:-}  # names of the rows to run (default: all), e.g. ONLY="source_cold ckpt_1x16384"
run() {  # name, command...: JSON (last line block) to $R/name.json, log to $R/name.log
    local name=$1; shift
    [[ -z $ONLY || " $ONLY " == *" $name "* ]] || return 0
    echo "== $name: $*" >&2
    timeout "$T" "$@" >"$R/$name.json" 2>"$R/$name.log" || echo "   (exit $?; see $R/$name.log)" >&2
}

# 1. four ranks at once from local files, page cache dropped before each epoch (read-once, cold NVMe)
run source_cold hsstore bench "$S" --what source --procs 4 --size-mb 4096 --epochs 2 --cold --quiet --json
# 2. the same four ranks from S3 emulated on loopback (moto + proxy replaying from memory): latency 0 vs 30 ms,
#    100 MB/s per connection; then --partition node with a per-rank cache: remote bytes per epoch
run source_s3 python -m tools.bench_source --procs 4 --size-mb 1024 --latency 0.03 --bandwidth-mb 100 \
    --sections s3,node --scratch "$S" --json
# 3. the published 5-layer drafter, activation checkpointing off/on: 4 x 4096 tokens (2,048 anchors) and
#    1 x 16,384 (512 anchors): peak, step time, train's estimate
run ckpt_4x4096 python -m tools.bench_attention --published --seq 4096 --batch 4 --anchors 512 --impl blocks \
    --ckpt off on --steps 3 --warmup 1 --json
run ckpt_1x16384 python -m tools.bench_attention --published --seq 16384 --batch 1 --anchors 512 --impl blocks \
    --ckpt off on --steps 3 --warmup 1 --json
# 4. the trainer fed by the loader vs resident, published recipe (5 layers, 4 x 4096, 512 anchors each), cold
run fed_cold python -m tools.bench_train --dir "$S" --device cuda --draft-layers 5 --seq 4096 --max-tokens 16384 \
    --anchors 512 --cold --rounds 2 --steps 5 --warmup 1 --keep-store --json
run fed_cold_ckpt python -m tools.bench_train --dir "$S" --device cuda --draft-layers 5 --seq 4096 \
    --max-tokens 16384 --anchors 512 --cold --rounds 2 --steps 5 --warmup 1 --checkpoint-layers --keep-store --json
# 5. ... and from the S3 emulation (30 ms, 100 MB/s per connection)
run fed_s3 python -m tools.bench_train --dir "$S" --device cuda --draft-layers 5 --seq 4096 --max-tokens 16384 \
    --anchors 512 --s3 --s3-latency 0.03 --s3-bandwidth-mb 100 --rounds 1 --steps 3 --warmup 1 --json
# 6. hsstore train planning for an 80 GB GPU (and held to it): without checkpointing it lowers anchors, saying
#    so; with --checkpoint-layers it keeps 512
STORE=; [[ -z $ONLY || " $ONLY " == *" train80 "* ]] && STORE=$(timeout "$T" python -m tools.bench_train --dir "$S" --device cuda --seq 4096 --samples 24 --steps 1 --warmup 1 --store-only \
    2>>"$R/store.log" | tail -1)
for ck in "" "--checkpoint-layers"; do
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
c = load("source_cold")
if isinstance(c, dict):
    src["local cold"] = c["source"]
s3 = load("source_s3")
if isinstance(s3, dict):
    src.update(s3)
for name, r in src.items():
    for e in r["epochs"]:
        rem = f"{e['remote_bytes'] / 1e9:.3f}" if "remote_bytes" in e else "-"
        print(f"| {name} | {e['epoch']} | {e['total_gbps']:.2f} | {e['min_rank_gbps']:.2f} | {e['cpu_s_per_gb']:.2f} "
              f"| {rem} | {e.get('max_in_flight', '-')} |")
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
for name in ("fed_cold", "fed_cold_ckpt", "fed_s3"):
    r = load(name)
    if isinstance(r, dict):
        rem = f"{r['remote_bytes'] / 1e9:.2f}" if "remote_bytes" in r else "-"
        print(f"| {name} | {r['loader_ms']:.0f} | {r['resident_ms']:.0f} | {r['ratio']:.3f} | {r['loader_gbps']:.2f} | "
              f"{r.get('peak_gib', float('nan')):.1f} | {rem} |")
    else:
        print(f"| {name} | failed: see {R}/{name}.log | | | | | |")
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
