#!/usr/bin/env bash
# The path a user follows on one GPU, end to end, as a table: the demo, then extract with each --device
# spelling (the compiled one checking itself against eager), verify, info, audit against the target (GPU and CPU),
# train with the GPU defaults, eval (teacher-forced and speculative), export-drafter,
# the fp8 and --final-hidden extractions, and an unusable --device (must exit 2 in one line).
#
#   bash tools/gpu_smoke.sh [WORKDIR]        # needs `hsstore` importable (pip install -e '.[gpu]'); ~7 min on an H200
#
# HSSTORE (default `python3 -m hsstore`) is the command run; RESULTS (default WORKDIR) gets smoke.md (the table)
# and smoke.log (every command's output). ROWS (a regex, default every row) picks the rows by label; the others
# show as skipped (on little device time: ROWS='demo|cuda:7|export' is the user's path in ~2.5 min).
# Run it from outside the checkout when hsstore is installed from a wheel
# (the checkout's hsstore/ would hide the installed hsstore.extract). Exit status: the number of failed rows.
set -u
W=${1:-/tmp/hsstore-smoke}
RESULTS=${RESULTS:-$W}
HS=${HSSTORE:-python3 -m hsstore}
STEPS=${TRAIN_STEPS:-100}
ROWS=${ROWS:-.}
mkdir -p "$W" "$RESULTS"
LOG="$RESULTS/smoke.log"
TABLE="$RESULTS/smoke.md"
: > "$LOG"
printf '| command | exit | seconds | key figure |\n|---|---|---|---|\n' > "$TABLE"
FAILED=0

# row LABEL EXPECTED_EXIT KEY_REGEX -- COMMAND...: run it, log its output, add a table row (the last line of
# output matching KEY_REGEX is the key figure). NEEDS="PATH|ROW" before it: the row reads what ROW writes at PATH,
# and shows as skipped, not failed, when PATH is absent (ROW left out by ROWS, or failed and counted already)
row() {
  local label=$1 want=$2 key=$3
  shift 4
  if ! [[ $label =~ $ROWS ]]; then
    printf '| `%s` | - | - | skipped (ROWS=%s) |\n' "$label" "$ROWS" >> "$TABLE"
    return 0
  fi
  if [[ -n ${NO_DEMO:-} ]]; then  # every later row runs on the demo's target and data
    printf '| `%s` | - | - | skipped (no demo in %s: add demo to ROWS) |\n' "$label" "$DEMO" >> "$TABLE"
    return 0
  fi
  if [[ -n ${NEEDS:-} && ! -e ${NEEDS%%|*} ]]; then
    printf '| `%s` | - | - | skipped (needs the row `%s`) |\n' "$label" "${NEEDS#*|}" >> "$TABLE"
    return 0
  fi
  local out="$W/.row.out" t0 t1 rc fig
  echo "== $label: $*" >> "$LOG"
  t0=$(date +%s%N)
  "$@" > "$out" 2>&1
  rc=$?
  t1=$(date +%s%N)
  cat "$out" >> "$LOG"
  fig=$(grep -E -o -- "$key" "$out" | tail -3 | tr '|\n' '/;' | sed 's/;$//' | cut -c1-140)
  [[ $rc == "$want" ]] || { FAILED=$((FAILED + 1)); fig="FAILED (wanted exit $want): $(tail -1 "$out" | cut -c1-90)"; }
  local ms=$(( (t1 - t0) / 1000000 ))
  printf '| `%s` | %s | %d.%d | %s |\n' "$label" "$rc" $((ms / 1000)) $((ms % 1000 / 100)) "$fig" >> "$TABLE"
  echo "$label: exit $rc" >&2
}

DEMO="$W/demo"
rm -rf "$W/s-"* "$W/run" "$W/drafter-export"   # this script's own outputs only
[[ -e $DEMO && ! -e $DEMO/.hsstore-demo ]] && { echo "$DEMO exists and is not a demo folder" >&2; exit 2; }
row "hsstore demo" 0 "device : [^()]*\([^)]*\)|target \+ drafter +[0-9.]+|demo done in [0-9.]+s" -- \
  $HS demo --out "$DEMO"
T="$DEMO/target"
[[ -d $T ]] || NO_DEMO=1
IN="$DEMO/data/conversations.jsonl"
HELD="$DEMO/data/heldout.jsonl"

row "extract (default device)" 0 "[0-9,]+ tokens/s[^,]*" -- $HS extract --model "$T" --input "$IN" --out "$W/s-default" -q
row "extract --device cuda" 0 "[0-9,]+ tokens/s[^,]*" -- $HS extract --model "$T" --input "$IN" --out "$W/s-cuda" --device cuda -q
row "extract --device cuda:0" 0 "[0-9,]+ tokens/s[^,]*" -- $HS extract --model "$T" --input "$IN" --out "$W/s-cuda0" --device cuda:0 -q
row "extract --device cpu" 0 "[0-9,]+ tokens/s[^,]*" -- $HS extract --model "$T" --input "$IN" --out "$W/s-cpu" --device cpu -q
row "extract --compile" 0 "[0-9,]+ tokens/s after [0-9.]+s of compile warm-up|min per-token cosine [0-9.]+" -- \
  $HS -v extract --model "$T" --input "$IN" --out "$W/s-compiled" --compile -q
row "extract --device cuda:7 (refused)" 2 "error: .*" -- $HS extract --model "$T" --input "$IN" --out "$W/s-bad" --device cuda:7
NEEDS="$W/s-cuda|extract --device cuda" row "verify" 0 "OK.*|[0-9]+ problems?.*" -- $HS verify "$W/s-cuda" --quiet
NEEDS="$W/s-cuda|extract --device cuda" row "info" 0 "samples *[0-9,]+|[0-9,]+ samples" -- $HS info "$W/s-cuda"
NEEDS="$W/s-cuda|extract --device cuda" row "audit (8 samples, default device)" 0 "audit: OK.*|FAIL .*" -- $HS audit "$W/s-cuda" --model "$T" --samples 8
NEEDS="$W/s-cuda|extract --device cuda" row "audit --device cpu (8 samples)" 0 "audit: OK.*|FAIL .*" -- $HS audit "$W/s-cuda" --model "$T" --samples 8 --device cpu
NEEDS="$W/s-compiled|extract --compile" row "audit (compiled store)" 0 "audit: OK.*|FAIL .*" -- $HS audit "$W/s-compiled" --model "$T" --samples 8
NEEDS="$W/s-cuda|extract --device cuda" row "train (GPU defaults, $STEPS steps)" 0 "[0-9,.]+ ?tok(ens)?/s|tau [0-9.]+" -- \
  $HS train --store "$W/s-cuda" --out "$W/run" --steps "$STEPS" --log-every 50 -q
NEEDS="$W/run|train (GPU defaults, $STEPS steps)" row "eval (teacher-forced)" 0 "\"tau\": [0-9.]+" -- $HS eval --store "$W/s-cuda" --drafter "$W/run" --json
NEEDS="$W/run|train (GPU defaults, $STEPS steps)" row "eval --model (speculative)" 0 "\"tau_per_prompt\": [0-9.]+|\"tau_pooled\": [0-9.]+|\"identical\": [0-9]+" -- \
  $HS eval --store "$W/s-cuda" --drafter "$W/run" --model "$T" --input "$HELD" --num-samples 4 --json
CKPT=$( (ls -d "$W/run/checkpoints/"*/ || ls -d "$DEMO/run/checkpoints/"*/) 2>/dev/null | tail -1)  # the demo's run when train was skipped
row "export-drafter" 0 "drafter: .*" -- $HS export-drafter "${CKPT:-$W/run}" "$W/drafter-export"
row "extract --encoding fp8" 0 "[0-9,]+ tokens/s[^,]*|[0-9.]+ GB" -- \
  $HS extract --model "$T" --input "$IN" --out "$W/s-fp8" --encoding fp8 -q
NEEDS="$W/s-fp8|extract --encoding fp8" row "verify (fp8)" 0 "OK.*" -- $HS verify "$W/s-fp8" --quiet
NEEDS="$W/s-fp8|extract --encoding fp8" row "audit (fp8)" 0 "audit: OK.*|FAIL .*" -- $HS audit "$W/s-fp8" --model "$T" --samples 8
row "extract --final-hidden" 0 "[0-9,]+ tokens/s[^,]*|[0-9.]+ GB" -- \
  $HS extract --model "$T" --input "$IN" --out "$W/s-final" --final-hidden -q
NEEDS="$W/s-final|extract --final-hidden" row "verify (final-hidden)" 0 "OK.*" -- $HS verify "$W/s-final" --quiet

python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" >> "$TABLE" 2>&1
python3 -c "import fla; print('fla', fla.__version__)" >> "$TABLE" 2>&1 || echo "fla not installed" >> "$TABLE"
cat "$TABLE"
exit "$FAILED"
