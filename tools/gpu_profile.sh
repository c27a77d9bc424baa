#!/usr/bin/env bash
# Issue #40 on one H200, in one call of <= 540 s: where the time goes, by operator class.
#
#   cd /tmp && PYTHONPATH=/tmp/site:$REPO bash $REPO/tools/gpu_profile.sh [SCRATCH]    # SCRATCH default /tmp/hsprof
#
#  1. the drafter step (published 5 layers, 1 x 16,384 tokens, 512 anchors, blocks attention, fused CE): forward
#     and backward apart, one step's device time by operator class (tools/bench_attention --profile);
#  2. the optimizer update alone on the drafter's fp32 masters: AdamW foreach (PyTorch's default) vs fused;
#  3. the extraction forward (27B shapes, 16 of the 64 layers: the same 3:1 pattern), eager and compiled with the
#     mixers, CUDA kernel time by kind (tools/profile_extract).
set -u
S=${1:-/tmp/hsprof}
mkdir -p "$S"
run() {  # name, seconds, command...
    local name=$1 t=$2; shift 2
    echo "== $name ($t s): $*" >&2
    timeout "$t" "$@" >"$S/$name.out" 2>"$S/$name.log" || echo "   (exit $?; see $S/$name.log)" >&2
    grep -v "USDT\|profiler_st" "$S/$name.out"
}
run drafter 170 python3 -m tools.bench_attention --published --seq 16384 --anchors 512 --impl blocks --profile 20
run optim 60 python3 -m tools.bench_attention --published --optim --steps 3 --warmup 1
run extract 280 python3 -m tools.profile_extract --layers-total 16 --variants eager,mixers --samples 8 \
    --min-len 4096 --max-len 4096 --rounds 1 --top 25
