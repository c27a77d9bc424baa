#!/usr/bin/env bash
# The feature encodings' GPU parts (docs/PERFORMANCE.md, "Encodings below fp8"), on one GPU, from the checkout:
#   1. encode and decode on CUDA equal the host's, bit for bit; the trainer's read-ahead decodes on the device
#      (pytest -m gpu tests/test_encodings.py);
#   2. the feature error at the seeds' shape (64 layers, hidden 5,120, random weights, taps 1,16,31,46,61) with
#      outlier channels planted, and each encoding's decode speed on the device (tools/encoding_evidence.py);
#   3. the trainer fed by the loader vs resident batches, per encoding (tools/bench_train.py, the published
#      drafter's layer): an encoded store's bytes cross to the device and are decoded there.
#
#   bash tools/gpu_encodings.sh [OUT]        # OUT (default /tmp/hsstore-encodings): logs, JSON and tables
#
# PY (default python3) runs each part; PARTS (a regex over tests|seeds|bench, default all) picks them;
# ENCODINGS (default "raw fp8 nvfp4 mxfp4") the stores the bench reads. Exit status: the number of failed parts.
set -u
OUT=${1:-/tmp/hsstore-encodings}
PY=${PY:-python3}
PARTS=${PARTS:-.}
ENCODINGS=${ENCODINGS:-raw fp8 nvfp4 mxfp4}
mkdir -p "$OUT"
FAILED=0

part() {  # part NAME COMMAND...: run it when PARTS picks NAME, its output to OUT/NAME.log
  local name=$1
  shift
  [[ $name =~ $PARTS ]] || return 0
  echo "== $name: $*" | tee -a "$OUT/$name.log"
  local t0=$SECONDS
  "$@" >> "$OUT/$name.log" 2>&1 || { FAILED=$((FAILED + 1)); echo "   FAILED (see $OUT/$name.log)"; }
  echo "   $((SECONDS - t0))s"
}

part tests "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_encodings.py
part seeds "$PY" -m tools.encoding_evidence --seeds-shape --samples 8 --min-len 2048 --max-len 4096 \
  --json "$OUT/seeds_shape.json"
for e in $ENCODINGS; do
  part "bench-$e" "$PY" -m tools.bench_train --dir "$OUT/bench" --encoding "$e" --samples 24 --json
done
tail -n 8 "$OUT"/seeds.log 2>/dev/null
grep -h '"ratio"' "$OUT"/bench-*.log 2>/dev/null
exit $FAILED
