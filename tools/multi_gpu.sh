#!/usr/bin/env bash
# Issue #8 on one host with 2 GPUs: per-GPU extraction speed with 1 vs 2 ranks, a store extracted by
# `torchrun --nproc_per_node 2`, verified, then DDP training from it on 1 and on 2 GPUs, with every
# sample's use logged (exactly once per epoch). Results: $RESULTS/*.json|txt.
#
#   RESULTS=/tmp/r SAMPLES_PER_GPU=32 bash tools/multi_gpu.sh
set -u
RESULTS=${RESULTS:-/tmp/hsstore-multi-gpu}
S=${SAMPLES_PER_GPU:-32}
STORE=${STORE:-/tmp/hsstore-multi-gpu-store}
TRAIN_EPOCHS=${TRAIN_EPOCHS:-2}
read -r -a BENCH_ARGS <<< "${BENCH_ARGS:-}"   # e.g. a tiny CPU model for a dry run
read -r -a TRAIN_ARGS <<< "${TRAIN_ARGS:-}"
mkdir -p "$RESULTS"
rm -rf "$STORE" /tmp/hs-train1 /tmp/hs-train2
step() { echo "== $(date +%T) $*" | tee -a "$RESULTS/log.txt"; }

step "1 GPU: extraction modes vs forward ($S samples)"
timeout 180 python3 -m tools.bench_extract --samples "$S" --rounds 2 \
  --modes ${MODES_1GPU:-forward_full,forward_taps,extract,extract_process} "${BENCH_ARGS[@]}" > "$RESULTS/extract_1gpu.json" \
  2>> "$RESULTS/stderr.txt"
step "2 GPUs: torchrun extraction ($((2 * S)) samples), kept as the training store"
timeout 150 torchrun --standalone --nproc_per_node 2 -m tools.bench_extract --samples $((2 * S)) --rounds 2 \
  --modes ${MODES_2GPU:-forward_full,extract_process} --keep "$STORE" "${BENCH_ARGS[@]}" > "$RESULTS/extract_2gpu.json" 2>> "$RESULTS/stderr.txt"
step "verify"
timeout 60 python3 -m hsstore verify "$STORE" > "$RESULTS/verify.txt" 2> /dev/null
python3 -m hsstore info "$STORE" > "$RESULTS/info.txt" 2>&1
TRAIN=(-m hsstore train --store "$STORE" --epochs "$TRAIN_EPOCHS" --mask-token-id 0 --log-samples --log-every 1
       --save-every 100000 --draft-layers "${DRAFT_LAYERS:-2}" "${TRAIN_ARGS[@]}")
keep_logs() { mkdir -p "$RESULTS/train$1"; cp /tmp/hs-train$1/*.jsonl "$RESULTS/train$1/" 2>/dev/null; }
step "train on 1 GPU"
timeout "${TRAIN_TIMEOUT:-100}" python3 "${TRAIN[@]}" --out /tmp/hs-train1 > "$RESULTS/train_1gpu.txt" 2>&1
keep_logs 1
step "train with DDP on 2 GPUs"
timeout "${TRAIN_TIMEOUT:-100}" torchrun --standalone --nproc_per_node 2 "${TRAIN[@]}" --out /tmp/hs-train2 \
  > "$RESULTS/train_2gpu.txt" 2>&1
keep_logs 2
step "summary"
python3 - "$STORE" "$RESULTS" <<'PY' > "$RESULTS/summary.json"
import json, statistics, sys
from collections import Counter
from pathlib import Path
import hsstore
store, results = sys.argv[1], Path(sys.argv[2])
ids = set(hsstore.open(store).sample_ids())
out = {"store_samples": len(ids)}
for n in (1, 2):
    run = Path(f"/tmp/hs-train{n}")
    m = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()] if (run / "metrics.jsonl").exists() else []
    tps = [r["tokens_per_s"] for r in m[2:]]  # the first steps hold compilation
    logs = [json.loads(l) for r in range(n) for l in (run / f"samples.rank{r:05d}.jsonl").read_text().splitlines()
            if (run / f"samples.rank{r:05d}.jsonl").exists()]
    epochs = {}
    for e in sorted({r["epoch"] for r in logs}):
        seen = Counter(s for r in logs if r["epoch"] == e for s in r["samples"])
        epochs[e] = {"distinct": len(seen), "max_uses": max(seen.values()), "all": set(seen) == ids}
    out[f"train_{n}gpu"] = {"steps": len(m), "median_tokens_per_s": statistics.median(tps) if tps else None,
                            "last_loss": m[-1]["loss"] if m else None, "epochs": epochs}
print(json.dumps(out, indent=2, default=str))
PY
cat "$RESULTS/summary.json"
