#!/usr/bin/env bash
# Issue #8 on one host with 2 GPUs: per-GPU extraction speed with 1 vs 2 ranks, a store extracted by
# `torchrun --nproc_per_node 2`, verified, then DDP training from it on 1 and on 2 GPUs, with every
# sample's use logged and checked (exactly once per epoch) on the machine itself; and the same training
# scaling on a larger synthetic store, next to what the loader alone delivers per rank.
#
#   RESULTS=$OUT SAMPLES_PER_GPU=32 bash tools/multi_gpu.sh                 # everything (~20 min)
#   RESULTS=$OUT PHASES="synth synth_train" bash tools/multi_gpu.sh         # a part
#
# Phases (PHASES, in this order):
#   bench1    1 GPU: tools.bench_extract, forward vs extraction modes         -> extract_1gpu.json
#   extract2  torchrun x2: forward + extraction, then a kept store; verify    -> extract_2gpu.json
#   train     hsstore train on that store: 1 GPU, then DDP on 2 GPUs           -> summary.json
#   flex      hsstore train --attn flex on the extracted store, 1 GPU, recompiles counted (FLEX_TIMEOUT)
#   synth     a synthetic store (SYNTH_ARGS); the loader alone on 1 and 2 ranks   -> loader.json
#   synth_train  hsstore train on it: 1 GPU, 2 GPUs (SYNTH_TRAIN_ARGS), and THREADS_AB runs -> summary.json
# Few result files on purpose (the device tool returns a handful): log.txt (progress, verify, info, the
# trainers' last lines), extract_1gpu.json, extract_2gpu.json, loader.json, summary.json, stderr.txt.
# Lessons of the first runs (session 2): fla autotunes each new batch shape once (~25 s on the first pass,
# so time best-of-2 rounds); the first flex-attention step of `hsstore train` did not finish within 100 s
# on a 248K-vocab store, so training defaults to SDPA here (ATTN=flex to try it).
# Needs hsstore installed. On the GPU machine (no index there): build the wheel here with
# `pip wheel --no-deps -w .whl .`, carry .whl/ with the other wheels, `pip install --target /tmp/site .whl/*.whl`,
# and run from a folder whose `tools` is a link to the checkout's tools/ (PYTHONPATH=/tmp/site:THAT_FOLDER): the
# checkout itself must not be on the path, or its hsstore/ would hide the installed hsstore.extract/train.
set -u
RESULTS=${RESULTS:-/tmp/hsstore-multi-gpu}
S=${SAMPLES_PER_GPU:-32}
STORE=${STORE:-/tmp/hsstore-multi-gpu-store}
SYNTH_DIR=${SYNTH_DIR:-/tmp/hsstore-synth}
TRAIN_EPOCHS=${TRAIN_EPOCHS:-3}
PHASES=${PHASES:-"bench1 extract2 train flex synth synth_train"}
read -r -a BENCH_ARGS <<< "${BENCH_ARGS:-}"   # e.g. a tiny CPU model for a dry run
read -r -a TRAIN_ARGS <<< "${TRAIN_ARGS:-}"
# the synthetic store: 27B-sized features (hidden 5120, 5 taps), a small vocabulary so that the drafter
# step is fast and the loader is what is stressed (~2.5 GB/s per GPU)
read -r -a SYNTH_ARGS <<< "${SYNTH_ARGS:---seq 2048 --samples 160 --vocab 32000}"
read -r -a LOADER_ARGS <<< "${LOADER_ARGS:---steps 6 --warmup 1 --rounds 2 --json}"
mkdir -p "$RESULTS"
LOG="$RESULTS/log.txt"
step() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }
quiet() { grep -v "^W\|^\*\|UserWarning\|return func" ; }  # torchrun's banner and barrier warnings
RUNS=()

# train NAME STORE GPUS [ARGS...]: one `hsstore train` run into /tmp/NAME, its last lines into the log
train() {
  local name=$1 store=$2 gpus=$3 limit=${LIMIT:-${TRAIN_TIMEOUT:-150}}
  shift 3
  local cmd=(-m hsstore train --store "$store" --out "/tmp/$name" --epochs "$TRAIN_EPOCHS" --mask-token-id 0
             --log-samples --log-every 1 --save-every 100000 --draft-layers "${DRAFT_LAYERS:-1}"
             --attn "${ATTN:-sdpa}" -q "${TRAIN_ARGS[@]}" "$@")
  rm -rf "/tmp/$name"
  step "train $name ($gpus GPU)"
  if [[ $gpus == 1 ]]; then
    timeout -s INT "$limit" python3 "${cmd[@]}" 2>&1 | tee "/tmp/$name.out" | quiet | tail -2 >> "$LOG"
  else
    timeout -s INT "$limit" torchrun --standalone --nproc_per_node "$gpus" "${cmd[@]}" 2>&1 \
      | tee "/tmp/$name.out" | quiet | tail -2 >> "$LOG"
  fi
  RUNS+=("$name:$gpus:$store")
}

if has bench1; then
  step "1 GPU: extraction modes vs forward ($S samples)"
  timeout "${BENCH1_TIMEOUT:-240}" python3 -m tools.bench_extract --samples "$S" --rounds 2 \
    --modes "${MODES_1GPU:-forward_full,forward_taps,extract,extract_process}" "${BENCH_ARGS[@]}" \
    > "$RESULTS/extract_1gpu.json" 2>> "$RESULTS/stderr.txt"
fi
if has extract2; then
  rm -rf "$STORE"
  step "2 GPUs: torchrun extraction ($((2 * S)) samples), kept as the training store"
  timeout "${EXTRACT2_TIMEOUT:-300}" torchrun --standalone --nproc_per_node 2 -m tools.bench_extract \
    --samples $((2 * S)) --rounds "${EXTRACT2_ROUNDS:-1}" --modes "${MODES_2GPU:-forward_full}" --keep "$STORE" \
    "${BENCH_ARGS[@]}" > "$RESULTS/extract_2gpu.json" 2>> "$RESULTS/stderr.txt"
  step "verify + info"
  timeout 120 python3 -m hsstore verify "$STORE" 2>&1 | grep -v "^verify:" | tail -3 >> "$LOG"
  python3 -m hsstore info "$STORE" 2>&1 | head -8 >> "$LOG"
fi
if has train; then
  train train-x1 "$STORE" 1
  train train-x2 "$STORE" 2
fi
if has flex; then  # does flex attention compile once, or per batch shape? (the extracted store's lengths vary)
  TORCH_LOGS=recompiles LIMIT=${FLEX_TIMEOUT:-240} ATTN=flex train flex-x1 "$STORE" 1
  grep -i -A3 "recompil" /tmp/flex-x1.out | head -60 > "$RESULTS/recompiles.txt"
  { echo "recompiles logged: $(grep -c -i "recompiling" /tmp/flex-x1.out)"; tail -4 /tmp/flex-x1.out; } >> "$LOG"
fi
SYN=$(ls -d "$SYNTH_DIR"/bench-train-* 2>/dev/null | head -1)
if has synth; then
  rm -rf "$SYNTH_DIR"
  step "synthetic store"
  SYN=$(python3 -m tools.bench_train --dir "$SYNTH_DIR" --store-only "${SYNTH_ARGS[@]}" 2>> "$RESULTS/stderr.txt" | tail -1)
  echo "$SYN" >> "$LOG"
  step "the loader alone: 1 rank, then 2 ranks at once"
  timeout 150 python3 -m tools.bench_train --dir "$SYNTH_DIR" --loader-only "${SYNTH_ARGS[@]}" "${LOADER_ARGS[@]}" \
    > "$RESULTS/loader.json" 2>> "$RESULTS/stderr.txt"
  timeout 150 torchrun --standalone --nproc_per_node 2 -m tools.bench_train --dir "$SYNTH_DIR" --loader-only \
    "${SYNTH_ARGS[@]}" "${LOADER_ARGS[@]}" 2>> "$RESULTS/stderr.txt" | quiet >> "$RESULTS/loader.json"
fi
if has synth_train; then
  if [[ -z "$SYN" ]]; then
    step "synthetic store"
    SYN=$(python3 -m tools.bench_train --dir "$SYNTH_DIR" --store-only "${SYNTH_ARGS[@]}" 2>> "$RESULTS/stderr.txt" | tail -1)
  fi
  read -r -a ST_ARGS <<< "${SYNTH_TRAIN_ARGS:-}"
  train synth-x1 "$SYN" 1 "${ST_ARGS[@]}"
  train synth-x2 "$SYN" 2 "${ST_ARGS[@]}"
  if [[ -n "${FLEX_SYNTH:-}" ]]; then  # flex attention on equal-length batches, FLEX_SYNTH seconds at most
    TORCH_LOGS=recompiles LIMIT=$FLEX_SYNTH ATTN=flex train flex-synth-x1 "$SYN" 1 "${ST_ARGS[@]}"
    { echo "recompiles logged: $(grep -c -i "recompiling" /tmp/flex-synth-x1.out)"; tail -4 /tmp/flex-synth-x1.out; } >> "$LOG"
  fi
  for t in ${THREADS_AB:-}; do  # e.g. THREADS_AB="1x8 2x1": --cpu-threads 8 on 1 GPU, 1 on 2 GPUs
    train "synth-x${t%x*}-t${t#*x}" "$SYN" "${t%x*}" "${ST_ARGS[@]}" --cpu-threads "${t#*x}"
  done
fi

if ((${#RUNS[@]})); then
  step "summary"
  python3 - "${RUNS[@]}" <<'PY' > "$RESULTS/summary.json" 2>> "$RESULTS/stderr.txt"
import json, statistics, sys
from collections import Counter
from pathlib import Path
import hsstore
out = {}
for spec in sys.argv[1:]:
    name, world, store = spec.split(":", 2)
    world, d = int(world), Path("/tmp") / name
    ids = set(hsstore.open(store).sample_ids())
    m = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()] if (d / "metrics.jsonl").exists() else []
    logs = [json.loads(l) for r in range(world) if (d / f"samples.rank{r:05d}.jsonl").exists()
            for l in (d / f"samples.rank{r:05d}.jsonl").read_text().splitlines()]
    epochs = {}
    for e in sorted({r["epoch"] for r in logs}):
        seen = Counter(s for r in logs if r["epoch"] == e for s in r["samples"])
        epochs[e] = {"distinct": len(seen), "max_uses": max(seen.values()), "every_sample": set(seen) == ids}
    # steady state: leave out step 1 (compile, caches) and each epoch's first step (the loader restarts)
    first = {min(r["step"] for r in m if r["epoch"] == e) for e in {r["epoch"] for r in m}}
    steady = [r for r in m if r["step"] not in first]
    secs = lambda rows: sum(r["tokens"] / r["tokens_per_s"] for r in rows if r["tokens_per_s"])
    out[name] = {"gpus": world, "store_samples": len(ids), "steps": len(m),
                 "tokens_per_s_per_step": [round(r["tokens_per_s"]) for r in m],
                 "wait_frac_per_step": [round(r["wait_frac"], 3) for r in m],
                 "steady_tokens_per_s": sum(r["tokens"] for r in steady) / secs(steady) if steady else None,
                 "steady_wait_frac": statistics.mean(r["wait_frac"] for r in steady) if steady else None,
                 "loop_tokens_per_s_after_step_1": sum(r["tokens"] for r in m[1:]) / secs(m[1:]) if len(m) > 1 else None,
                 "last_loss": m[-1]["loss"] if m else None, "epochs": epochs}
print(json.dumps(out, indent=1, default=str))
PY
  python3 - "$RESULTS/summary.json" <<'PY' | tee -a "$LOG"
import json, sys
s = json.load(open(sys.argv[1]))
for name, r in s.items():
    once = all(e["every_sample"] and e["max_uses"] == 1 for e in r["epochs"].values()) and bool(r["epochs"])
    print(f"{name}: {r['steps']} steps, steady {r['steady_tokens_per_s'] or 0:,.0f} tok/s (wait "
          f"{r['steady_wait_frac'] or 0:.2f}), after step 1 {r['loop_tokens_per_s_after_step_1'] or 0:,.0f} tok/s, "
          f"exactly once per epoch: {once} ({len(r['epochs'])} epochs)")
PY
fi
