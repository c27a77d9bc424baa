#!/usr/bin/env bash
# The feature encodings' GPU parts (docs/PERFORMANCE.md, "Encodings below fp8"), on one GPU, from the checkout, in
# one device call of at most 300 s (each part's budget held by `timeout`):
#   tests  encode and decode on CUDA equal the host's, bit for bit; the trainer's read-ahead decodes on the device
#          and refuses a batch with a NaN there (pytest -m gpu tests/test_encodings.py tests/test_train_values.py)
#                                                                                                        (60 s)
#   seeds  the feature error at the seeds' shape (64 layers, hidden 5,120, random weights, taps 1,16,31,46,61) with
#          outlier channels planted, and each encoding's decode speed on the device
#          (tools/encoding_evidence.py --seeds-shape)                                                     (100 s)
#   bench-ENC  the trainer fed by the loader vs resident batches (tools/bench_train.py, the published drafter's
#          layer) reading an ENC store: its bytes cross to the device and are decoded there               (55 s each)
#
#   bash tools/gpu_encodings.sh OUT          # from the repository root, .whl/ beside it (tools/gpu_wheels.sh)
#
# The wheels of .whl/ (WHL) are installed into SITE (default /tmp/hs-site) unless zarr imports already; this
# checkout's code runs from a copy in SCRATCH/src (default /tmp/hs-enc) laid out as installed (hsstore/,
# hsstore/extract, hsstore/train, tools/, tests/), so the wheel's hsstore gives only its metadata; the bench's stores
# live in SCRATCH too. OUT holds only one NAME.log per part, seeds_shape.json and summary.txt.
# PY (default python3) runs each part; PARTS (a regex over tests|seeds|bench) picks them;
# ENCODINGS (default "raw nvfp4", the recommended one) the stores the bench reads; TINY=1 runs every part at toy
# sizes on the CPU (a check that the script runs end to end, no figures; budgets x 6). Exit status: the number of failed parts.
set -u
OUT=$(mkdir -p "${1:?usage: gpu_encodings.sh OUT}" && cd "$1" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-python3}
PARTS=${PARTS:-.}
ENCODINGS=${ENCODINGS:-raw nvfp4}
WHL=${WHL:-$REPO/.whl}
SITE=${SITE:-/tmp/hs-site}
TINY=${TINY:-0}
SCRATCH=${SCRATCH:-/tmp/hs-enc}
FAILED=0

if ! "$PY" -c "import zarr, numcodecs" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
SRC=$SCRATCH/src  # the package as installed: run from here, so this checkout's code is the one imported
rm -rf "$SCRATCH" && mkdir -p "$SRC"
cp -r "$REPO/hsstore" "$REPO/tools" "$REPO/tests" "$REPO/pyproject.toml" "$SRC/"
cp -r "$REPO/extract" "$SRC/hsstore/extract" && cp -r "$REPO/train" "$SRC/hsstore/train"
cd "$SRC" || exit 1
export PYTHONUNBUFFERED=1
"$PY" -c "import hsstore.train, hsstore.format.microscaling as m; print('code:', m.__file__)" | tee "$OUT/summary.txt"

part() {  # part NAME SECONDS COMMAND...: run it when PARTS picks NAME, within SECONDS, its output to OUT/NAME.log
  local name=$1 budget=$(($2 * STRETCH))
  shift 2
  [[ $name =~ $PARTS ]] || return 0
  echo "== $name (${budget}s): $*" | tee "$OUT/$name.log"
  local t0=$SECONDS
  timeout -k 5 "$budget" "$@" >> "$OUT/$name.log" 2>&1 || { FAILED=$((FAILED + 1)); echo "   FAILED (see $OUT/$name.log)"; }
  echo "   $((SECONDS - t0))s"
}

STRETCH=1
if [[ $TINY == 1 ]]; then
  STRETCH=6
  SEEDS=(--device cpu --layers-total 8 --hidden 1024 --ffn 512 --heads 4 --kv-heads 2 --head-dim 64
         --linear-k-heads 2 --linear-v-heads 4 --vocab 4096 --samples 1 --min-len 64 --max-len 96)
  BENCH=(--tiny --device cpu)
else
  SEEDS=(--samples 4 --min-len 1024 --max-len 2048)
  BENCH=(--samples 8 --rounds 2 --steps 4 --warmup 1)
fi
part tests 60 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_encodings.py tests/test_train_values.py
part seeds 100 "$PY" -m tools.encoding_evidence --seeds-shape "${SEEDS[@]}" --json "$OUT/seeds_shape.json"
for e in $ENCODINGS; do
  part "bench-$e" 55 "$PY" -m tools.bench_train --dir "$SCRATCH/bench-$e" --encoding "$e" "${BENCH[@]}" --json
  rm -rf "$SCRATCH/bench-$e"
done
{
  tail -n 3 "$OUT"/tests.log 2>/dev/null
  grep -h "^|" "$OUT"/seeds.log 2>/dev/null
  for e in $ENCODINGS; do echo "bench-$e: $(grep -ho '"ratio": [0-9.]*' "$OUT/bench-$e.log" 2>/dev/null | head -1)"; done
} | tee -a "$OUT/summary.txt"
rm -rf "$SCRATCH"
exit $FAILED
