#!/usr/bin/env bash
# Issue #40 on one H200: where the time goes, by operator class, each change paired with its baseline in one run.
#
#   cd /tmp && PYTHONPATH=/tmp/site:$REPO bash $REPO/tools/gpu_profile.sh [SCRATCH] [PARTS]
#
# SCRATCH default /tmp/hsprof; PARTS (comma-separated, default drafter,ckpt) picks what runs:
#   drafter  the drafter step (published 5 layers, 1 x 16,384 tokens, 512 anchors, blocks attention, fused CE),
#            the layers' pointwise math and the CE's chunk math eager vs fused, each with forward and backward
#            apart and one step's device time by operator class (tools/bench_attention --pointwise eager fused
#            --profile); ~300 s
#   ckpt     4 x 4,096 tokens: no recompute vs --checkpoint-layers mlp and full (time and peak); ~200 s
#   fed      the trainer fed by the loader vs resident, published recipe (4 x 4,096, 512 anchors), cold page
#            cache, 2 rounds of 5 steps (tools/bench_train); ~180 s
#   optim    the optimizer update alone on the drafter's fp32 masters: AdamW foreach vs fused; ~60 s
#   ab       the drafter step (as in drafter, fused, no profile) under the hsstore installed in $BASE_SITE (the
#            wheel of an earlier commit: pip install --no-deps --target $BASE_SITE) and under the current one,
#            alternating, 2 rounds: a code change paired with its baseline in one run; ~240 s
#   cold     4 ranks reading a 4 GB zarr store at once, page cache dropped before every epoch, beside plain reads
#            of the same files (loader/raw: the disk's limit); ~90 s
#   demo     `hsstore demo` as a user runs it on a fresh machine (the device it picks, said, and each step's
#            seconds); its folder is part eval's input; ~120 s
#   eval     speculative decoding on the GPU, the demo's target and drafter: Gated DeltaNet states kept vs the
#            cache copied and the accepted tokens run again, alternating, beside the target alone
#            (tools/bench_eval, 8 held-out prompts, 2 rounds; runs part demo's step on the CPU first when its
#            folder is missing); ~200 s
#   demogpu  `hsstore demo --device cuda`: every step on the GPU, each step's seconds; ~250 s
#   extract  the extraction forward (27B shapes, 16 of the 64 layers: the same 3:1 pattern), eager and compiled
#            with the mixers and on fla's convolution (what extract --compile runs), CUDA kernel time by kind, the
#            GEMMs by shape beside each alone (tools/profile_extract); ~200 s
#   bounds   the audit's and the compile check's bounds at the seeds' depth: 64 layers, hidden 5,120, an eager and a
#            compiled store audited, the compile check on 10 first batches, 5 planted faults per tap
#            (tools/deep_bounds; docs/PERFORMANCE.md "Bounds at the seeds' depth"); ~360 s
#   follow   the demo's extraction and its drafter training (6 epochs) on this GPU, extract-then-train vs
#            train --follow started with the extraction: time to the first step and in all (tools/bench_follow); ~240 s
#   follow27b  the same at a size where the extraction takes minutes: the 27B-shaped random target, 100 samples
#            (~364K tokens, 18.7 GB of features), a one-layer drafter held to 20 GiB beside it, one epoch
#            (tools/bench_follow --target bench); ~450 s
set -u
S=${1:-/tmp/hsprof}
PARTS=${2:-drafter,ckpt}
mkdir -p "$S"
run() {  # name, seconds, command...
    local name=$1 t=$2; shift 2
    [[ ,$PARTS, == *,$name,* ]] || return 0
    echo "== $name ($t s): $*" >&2
    timeout "$t" "$@" >"$S/$name.out" 2>"$S/$name.log" || echo "   (exit $?; see $S/$name.log)" >&2
    grep -E -- "${KEEP:-.}" "$S/$name.out" | grep -v "USDT\|profiler_st"  # KEEP: a regex of the lines to show
}
run drafter 330 python3 -m tools.bench_attention --published --seq 16384 --anchors 512 --impl blocks \
    --pointwise eager fused --profile 20
run ckpt 240 python3 -m tools.bench_attention --published --seq 4096 --batch 4 --anchors 512 --impl blocks \
    --ckpt off mlp full
run fed 200 python3 -m tools.bench_train --dir "$S/fed" --device cuda --draft-layers 5 --seq 4096 --max-tokens 16384 \
    --anchors 512 --cold --rounds 2 --steps 5 --warmup 2 --json
# ab: the step under the base wheel, then under the current one, twice (BASE_SITE first on the path: its hsstore)
AB='[[ -n ${BASE_SITE:-} ]] || { echo "ab: set BASE_SITE to a --target folder holding the base wheel" >&2; exit 2; }
for r in 1 2; do
    for side in base current; do
        echo "-- round $r, $side"
        site=$([[ $side == base ]] && echo "$BASE_SITE:")
        PYTHONPATH="$site$PYTHONPATH" python3 -m tools.bench_attention --published --seq 16384 --anchors 512 \
            --impl blocks --steps 5 --warmup 2
    done
done'
run ab 260 bash -c "$AB"
run optim 60 python3 -m tools.bench_attention --published --optim --steps 3 --warmup 1
run cold 120 python3 -m hsstore bench "$S/cold" --what source --procs 4 --size-mb 4096 --epochs 3 --cold --quiet --json
DEMO_KEEP='^device :|^\[[a-z]+: [0-9.]+s\]|target alone|target \+ drafter|greedy output|^demo done'
KEEP=$DEMO_KEEP run demo 200 python3 -m hsstore demo --out "$S/demo"
EVAL='[[ -e $0/demo/run/drafter ]] || python3 -m hsstore demo --out "$0/demo" --device cpu >"$0/demo-eval.log" 2>&1
python3 -m tools.bench_eval "$0/demo" --device cuda --samples 8 --rounds 2'
run eval 330 bash -c "$EVAL" "$S"
KEEP=$DEMO_KEEP run demogpu 330 python3 -m hsstore demo --out "$S/demo-gpu" --device cuda
run follow 400 python3 -m tools.bench_follow --dir "$S/follow" --device cuda
run follow27b 600 python3 -m tools.bench_follow --dir "$S/follow27b" --device cuda --target bench --epochs 1
run bounds 420 python3 -m tools.deep_bounds --json "$S/bounds.json"
run extract 240 python3 -m tools.profile_extract --layers-total 16 --variants nomask,mixers,flaconv --samples 16 \
    --min-len 4096 --max-len 4096 --rounds 2 --top 25
