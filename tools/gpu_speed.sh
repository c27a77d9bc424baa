#!/usr/bin/env bash
# Issue #40 on one H200 (16 cores), in one call of <= 540 s: each row beside its baseline, paired in this run.
#
#   cd /tmp && PYTHONPATH=/tmp/site:$REPO bash $REPO/tools/gpu_speed.sh [SCRATCH]     # SCRATCH default /tmp/hs40
#
# (the wheels, hsstore's among them, installed into /tmp/site first;
# $REPO on the path for tools/). Results: SCRATCH/results/*.json and *.log, and the table on stdout.
#  1. 8 ranks reading a 4 GB store at once, warm page cache, 3 epochs (epoch 0 faults the buffers in), with the
#     plain-read baseline the bench prints (loader/raw): the chunk CRC32C folded in per 1 MB block as it is read,
#     twice (~40 s each, 70 s at most). The former whole-read-then-check path (HSSTORE_READ_BLOCK=0) is gone from
#     the package; its paired rows are in docs/PERFORMANCE.md.
#  2. extraction, 27B architecture, 5 taps, writer process, eager then compiled: the Gated DeltaNet short
#     convolution on fla's Triton kernel (extract_process) vs transformers' PyTorch path
#     (extract_process_torchconv), alternating in every round; the compiled forward's features against the eager
#     forward on PyTorch's convolution (compile.per_tap), and the eager forward on fla's kernel against the same
#     (compile.fla_conv_eager_vs_torch_eager). The time left, at most 330 s.
set -u
S=${1:-/tmp/hs40}
R=$S/results
mkdir -p "$S" "$R"
T0=$SECONDS
python3 -c "import hsstore.app.conv" || { echo "hsstore in /tmp/site lacks hsstore/app/conv.py (rebuild the wheel: pip wheel --no-deps -w .whl .)" >&2; exit 2; }
run() {  # name, seconds, command...
    local name=$1 t=$2; shift 2
    echo "== $name ($t s): $*" >&2
    timeout "$t" "$@" >"$R/$name.json" 2>"$R/$name.log" || echo "   (exit $?; see $R/$name.log)" >&2
}
SRC=(python3 -m hsstore bench "$S" --what source --procs "${PROCS:-8}" --size-mb "${SIZE_MB:-4096}" --epochs 3 --quiet --json)
run source8 70 "${SRC[@]}"
run source8_again 70 "${SRC[@]}"
LEFT=$((530 - (SECONDS - T0)))
run extract_conv $((LEFT < 330 ? LEFT : 330)) python3 -m tools.bench_extract --out "$S/bench-extract" --samples 20 \
    --rounds 2 --modes extract_process,extract_process_torchconv --compile
python3 - "$R" <<'EOF'
import json, pathlib, sys
R = pathlib.Path(sys.argv[1])
def load(n):
    try:
        t = (R / f"{n}.json").read_text()
        return json.loads(t[t.index("{"):])
    except (OSError, ValueError):
        return None
print("| 8 ranks, warm, 4 GB | epoch | GB/s total | slowest rank | CPU-s/GB | raw read GB/s | raw CPU-s/GB | loader/raw |")
print("|---|---|---|---|---|---|---|---|")
for n in ("source8", "source8_again"):
    r = load(n)
    for e in (r or {}).get("source", {}).get("epochs", []):
        raw = e["raw"]["read"]
        print(f"| {n} | {e['epoch']} | {e['total_gbps']:.2f} | {e['min_rank_gbps']:.2f} | {e['cpu_s_per_gb']:.3f} | "
              f"{raw['total_gbps']:.2f} | {raw['cpu_s_per_gb']:.3f} | {e['vs_raw']['read']['total']:.2f} |")
x = load("extract_conv")
if x:
    print("\n| extraction mode | tokens/s | MFU |\n|---|---|---|")
    for m, v in x["tokens_per_s"].items():
        print(f"| {m} | {v:,.0f} | {x['mfu_vs_989'][m]:.3f} |")
    c = x.get("compile", {})
    print(f"\nconv on fla: {x.get('conv_on_fla')}; fla/torch speedup eager {x.get('fla_conv_speedup', 0):.3f}, "
          f"compiled {x.get('fla_conv_speedup+compile', 0):.3f}; warm-up {c.get('warm_up_s', 0):.0f} s")
    for tap, v in c.get("per_tap", {}).items():
        f = c.get("fla_conv_eager_vs_torch_eager", {}).get(tap, {})
        print(f"tap {tap}: compiled(fla) vs eager(torch) min {v['compiled_vs_eager_min']:.5f} mean "
              f"{v['compiled_vs_eager_mean']:.5f}; eager(fla) vs eager(torch) min {f.get('min', float('nan')):.5f} "
              f"mean {f.get('mean', float('nan')):.5f}; eager alone vs in batch min {v['eager_alone_vs_in_batch_min']:.5f}")
else:
    print("\nextraction: no JSON (timed out?); per-pass tokens/s lines:")
    print("".join(l for l in open(R / "extract_conv.log") if l.startswith('{"rank"')))
EOF
