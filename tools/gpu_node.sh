#!/usr/bin/env bash
# Issue #41 on one whole node (N GPUs of one host): extraction by N torchrun ranks into one store, a rank
# SIGKILLed mid-run and the run repeated, DDP training from the S3 emulation with --partition node and a node
# cache, and the loader alone on N ranks x 2 workers; every correctness figure checked on the machine
# (tools/node_checks.py), one table at the end.
#
#   RESULTS=$OUT bash tools/gpu_node.sh                                  # every phase, N = the GPUs
#   RESULTS=$OUT PHASES="kill loader" NPROC=4 bash tools/gpu_node.sh     # a part, on 4 GPUs
#   NPROC=2 DEVICE=cpu RESULTS=/tmp/node-dry bash tools/gpu_node.sh       # the CPU dry run (tiny sizes, gloo)
#
# On the GPU machine (no index there): here, `pip wheel --no-deps -w .whl .` (this project) and
# `bash tools/gpu_wheels.sh` (moto, s3fs, torchdata, ...) put the wheels into .whl/; carry .whl, then there
#   pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   mkdir -p /tmp/run && ln -sfn "$PWD/tools" /tmp/run/tools && ln -sfn "$PWD/tests" /tmp/run/tests
#   cd /tmp/run && PYTHONPATH=/tmp/site:/tmp/run RESULTS=$OUT bash tools/gpu_node.sh
# (from /tmp: the checkout's hsstore/ on the path would hide the installed hsstore.extract / hsstore.train;
# tests/ is linked for the S3 emulation's proxy, tests/faultproxy.py).
#
# Phases (PHASES, in this order), and how long each should take at N=8 on H200s (from the 1-GPU figures in
# docs/ARCHITECTURE.md: extraction ~9-11K tokens/s per GPU at 27B, a published-recipe step ~1.2 s):
#   extract  tools.bench_extract on 1 GPU, then torchrun x N into one kept store (compiled on GPU, 27B
#            architecture, random weights, 5 taps): per-GPU tokens/s N vs 1 (goal >= 0.95); hsstore verify;
#            every sample id once and exactly the ones asked for                    (~12 min: compile warm-ups)
#   kill     hsstore extract of the tiny target under torchrun x N (a tiny_corpus input, one sample per forward),
#            kill -9 of the last rank after the first committed shard, the same command again: verify, every
#            id once and equal to an uninterrupted run's (features compared bit for bit)     (~2 min)
#   train    moto + a counting proxy on loopback, the extract store uploaded; hsstore train --partition node
#            --cache-dir, published recipe, 1 rank vs N ranks over 3 epochs: per-GPU step time (goal >= 0.9),
#            waiting for data (fed/resident ~ 1 - wait, goal >= 0.95), remote shard bytes vs the store
#            (goal <= 1.1x), every sample once per epoch; then Ctrl-C of an N-rank run: every rank stops at
#            one step with one checkpoint, and the resumed run equals an uninterrupted one   (~10 min: upload)
#   loader   the loader alone, torchrun x N, 2 workers per rank (tools.node_checks loader): exactly once per
#            epoch, the same order after a mid-epoch resume, GB/s per rank; local files, and from the S3
#            emulation through a node cache when the train phase ran (remote bytes counted)    (~2 min)
#
# Sizes at N=8: the kept store is N x SAMPLES_PER_GPU samples of 3-4K tokens, ~0.18 GB each (~17 GB); the S3
# emulation holds it twice in memory (moto, and the proxy that replays it) and the node cache once on disk.
# Remote bytes: ranks that need the same chunk before it is in the node cache each fetch it (the cache has no
# cross-process fetch lock), so a store of few read units per rank reads over 1x in epoch 0: the CPU dry run's
# store in 6 shards fetched 1.165x (train, 2 ranks) and 1.33x (loader, 2 x 2 workers), in 28 shards 1.006-1.035x.
# Settings: NPROC (default: the GPUs: nvidia-smi -L, else torch), DEVICE (cuda; cpu: gloo, tiny sizes),
# BENCH_ARGS (bench_extract's model/batch flags), TRAIN_ARGS (the training recipe's flags), SAMPLES_PER_GPU,
# TRAIN_EPOCHS, RESUME_STEPS, T (the timeout of one command, seconds), WORK (its scratch folder; the store is WORK/store).
# Results in $RESULTS: log.txt (every command's output), a JSON per check, node.md (the table).
# Exit status: the number of failed rows.
set -u
DEVICE=${DEVICE:-cuda}
if [[ -z ${NPROC:-} ]]; then
  NPROC=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
  [[ $NPROC -gt 0 ]] || NPROC=$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
RESULTS=${RESULTS:-/tmp/hsstore-node}
WORK=${WORK:-/tmp/hsstore-node-work}
STORE=$WORK/store  # removed and remade by the extract phase: always under WORK, never a path from outside
PHASES=${PHASES:-"extract kill train loader"}
T=${T:-900}
N=$NPROC
if [[ $DEVICE == cpu ]]; then  # the dry run: a tiny Qwen3.5 target and drafter, the checks unchanged
  S=${SAMPLES_PER_GPU:-16}
  read -r -a BENCH_ARGS <<< "${BENCH_ARGS:---layers-total 8 --hidden 64 --ffn 128 --heads 4 --kv-heads 2 \
--head-dim 16 --linear-v-heads 4 --linear-k-heads 2 --vocab 1000 --min-len 64 --max-len 160 --token-budget 512 --shard-mb 0.1 \
--rounds 1}"
  read -r -a TRAIN_ARGS <<< "${TRAIN_ARGS:---draft-layers 1 --block-size 8 --anchors 16 --token-budget 400}"
  COMPILE=()
  KILL_ROWS=${KILL_ROWS:-48}
  RESUME_STEPS=${RESUME_STEPS:-80}  # tiny steps: enough of them that Ctrl-C lands mid-run
  LOADER_TOKENS=${LOADER_TOKENS:-400}  # several batches per rank and epoch, so that the resume is mid-epoch
else
  S=${SAMPLES_PER_GPU:-12}
  read -r -a BENCH_ARGS <<< "${BENCH_ARGS:---rounds 2}"
  # the published recipe; 1 x 16,384 tokens peaks at ~43 GiB, 4 x 4,096 at ~105-116 GiB (add
  # --checkpoint-layers on an 80 GB GPU)
  read -r -a TRAIN_ARGS <<< "${TRAIN_ARGS:---draft-layers 5 --token-budget 16384 --anchors 512}"
  COMPILE=(--compile)
  KILL_ROWS=${KILL_ROWS:-400}
fi
TRAIN_EPOCHS=${TRAIN_EPOCHS:-3}
RESUME_STEPS=${RESUME_STEPS:-12}
GOALS=(); [[ $DEVICE == cpu ]] || GOALS=(--goal)  # speed goals fail a row on GPUs only (CPU: no figure)
mkdir -p "$RESULTS" "$WORK"
LOG="$RESULTS/log.txt"
TABLE="$RESULTS/node.md"
: > "$LOG"
printf '| check | exit | seconds | key figure |\n|---|---|---|---|\n' > "$TABLE"
FAILED=0
CHECK=(python3 -m tools.node_checks)
TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc_per_node "$N")  # no `torchrun` script needed on PATH
step() { echo "== $(date +%T) $*" | tee -a "$LOG" >&2; }
has() { [[ " $PHASES " == *" $1 "* ]]; }

# row LABEL COMMAND...: run it under `timeout $T`, its output into the log, a table row (exit, seconds, and
# its last line starting OK/FAILED, or its last line)
row() {
  local label=$1 out="$WORK/.row.out" t0 rc fig ms
  shift
  step "$label: $*"
  t0=$(date +%s%N)
  timeout -s INT -k 30 "$T" "$@" > "$out" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  cat "$out" >> "$LOG"
  fig=$(grep -E "^(OK|FAILED) " "$out" | tail -1 | cut -c1-400)
  [[ -n $fig ]] || fig=$(grep -v "^W\|^\*\|Warning\|warn(" "$out" | tail -1 | cut -c1-200)
  [[ $rc == 0 ]] || FAILED=$((FAILED + 1))
  printf '| %s | %s | %d.%d | %s |\n' "$label" "$rc" $((ms / 1000)) $((ms % 1000 / 100)) "${fig//|//}" >> "$TABLE"
  echo "   exit $rc: $fig" >&2
}
# json_row LABEL FILE COMMAND...: row, with the command's stdout kept whole in FILE (the benches' JSON)
json_row() {
  local label=$1 file=$2
  shift 2
  row "$label" bash -c '"${@:2}" > "$1"; rc=$?; echo "$(wc -c < "$1") bytes of JSON in $1"; exit $rc' _ "$file" "$@"
}

S3DIR=$WORK/s3
S3PID=
s3_up() {  # the S3 emulation serving $STORE (moto + the counting proxy, a process of its own)
  [[ -n $S3PID ]] && return 0
  rm -rf "$S3DIR"
  step "S3 emulation: uploading $STORE"
  python3 -m tools.node_checks s3-serve "$STORE" --dir "$S3DIR" >> "$LOG" 2>&1 &
  S3PID=$!
  local i
  for ((i = 0; i < T; i++)); do
    [[ -e $S3DIR/s3.json ]] && break
    kill -0 "$S3PID" 2>/dev/null || { echo "S3 emulation ended; see $LOG" >&2; S3PID=; return 1; }
    sleep 1
  done
  S3URL=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['url'])" "$S3DIR/s3.json")
  S3READ=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['read_endpoint'])" "$S3DIR/s3.json")
  cat "$S3DIR/s3.json" >> "$LOG"
  export AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-testing} AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-testing-secret} \
         AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-us-east-1}
}
s3_down() { [[ -n $S3PID ]] && kill "$S3PID" 2>/dev/null && wait "$S3PID" 2>/dev/null; S3PID=; }
trap s3_down EXIT

if has extract; then
  rm -rf "$STORE" /tmp/bench-extract-store-rank*
  json_row "extract: 1 rank, $S samples" "$RESULTS/extract_1.json" python3 -m tools.bench_extract --samples "$S" \
    --modes extract_process --device "$DEVICE" "${COMPILE[@]}" "${BENCH_ARGS[@]}"
  json_row "extract: torchrun x$N, $((N * S)) samples, kept" "$RESULTS/extract_n.json" "${TORCHRUN[@]}" \
    -m tools.bench_extract --samples $((N * S)) --modes extract_process --device "$DEVICE" "${COMPILE[@]}" \
    --keep "$STORE" "${BENCH_ARGS[@]}"
  row "extract: per-GPU tokens/s, x$N vs x1 (goal >= 0.95)" "${CHECK[@]}" extract-speed "$RESULTS/extract_1.json" \
    "$RESULTS/extract_n.json" --at-least 0.95 "${GOALS[@]}" --json "$RESULTS/extract_speed.json"
  row "hsstore verify (x$N store)" python3 -m hsstore verify "$STORE" --quiet
  row "extract: every sample id once (x$N store)" "${CHECK[@]}" ids "$STORE" --bench $((N * S)) \
    --json "$RESULTS/extract_ids.json"
fi

if has kill; then
  K=$WORK/kill
  rm -rf "$K"
  mkdir -p "$K"
  row "kill: tiny target and input" bash -c "python3 -c 'from hsstore.extract.tiny import tiny_target_dir; \
print(tiny_target_dir())' > $K/target.txt && cat $K/target.txt && ${CHECK[*]} corpus $K/in.jsonl --rows $KILL_ROWS"
  TINY=$(cat "$K/target.txt")
  kcmd() {  # one sample per forward: alone, a sample's features are the same bits however the work is split
    echo "${TORCHRUN[@]}" -m hsstore extract --model "$TINY" --input "$K/in.jsonl" --out "$1" --device "$DEVICE" \
      --token-budget 1 --shard-mb 0.05 -q
  }
  read -r -a REF_CMD <<< "$(kcmd "$K/reference")"
  read -r -a KILL_CMD <<< "$(kcmd "$K/killed")"
  row "kill: uninterrupted torchrun x$N (reference)" "${REF_CMD[@]}"
  row "kill: kill -9 of one rank after a commit" "${CHECK[@]}" kill "$K/killed" --log "$K/killed.err" \
    --json "$RESULTS/kill.json" -- "${KILL_CMD[@]}"
  row "kill: the same command again" "${KILL_CMD[@]}"
  row "kill: hsstore verify" python3 -m hsstore verify "$K/killed" --quiet
  row "kill: every id once, = the reference's" "${CHECK[@]}" ids "$K/killed" --same-as "$K/reference" \
    --json "$RESULTS/kill_ids.json"
fi

# train NAME GPUS ARGS...: hsstore train from the S3 emulation into $WORK/NAME (command only; see rows below)
train_cmd() {
  local name=$1 gpus=$2
  shift 2
  local launch=(python3)
  [[ $gpus == 1 ]] || launch=(python3 -m torch.distributed.run --standalone --nproc_per_node "$gpus")
  echo "${launch[@]}" -m hsstore train --store "$S3URL" --out "$WORK/$name" --storage-option "endpoint_url=$S3READ" \
    --partition node --cache-dir "$WORK/cache-$name" --mask-token-id 0 --log-every 1 --log-samples \
    --save-every 100000 --device "$DEVICE" -q "${TRAIN_ARGS[@]}" "$@"
}
if has train && s3_up; then
  rm -rf "$WORK"/train-* "$WORK"/cache-train-*
  row "S3: counts reset after the upload" "${CHECK[@]}" s3-counts --dir "$S3DIR" --name upload
  for g in 1 "$N"; do
    read -r -a C <<< "$(train_cmd "train-x$g" "$g" --epochs "$TRAIN_EPOCHS")"
    row "train x$g: $TRAIN_EPOCHS epochs from S3, --partition node" "${C[@]}"
    row "train x$g: remote bytes over $TRAIN_EPOCHS epochs (goal <= 1.1x)" "${CHECK[@]}" s3-counts --dir "$S3DIR" \
      --name "train-x$g" --at-most 1.1 --json "$RESULTS/remote_x$g.json"
    row "train x$g: lockstep, exactly once per epoch" "${CHECK[@]}" run "$WORK/train-x$g" --world "$g" \
      --ids-from "$STORE" --json "$RESULTS/train_x$g.json"
  done
  row "train: per-GPU step time x$N vs x1 (goal >= 0.9), waiting (goal <= 0.05)" "${CHECK[@]}" train-speed \
    "$RESULTS/train_x1.json" "$RESULTS/train_x$N.json" --at-least 0.9 --max-wait 0.05 "${GOALS[@]}" \
    --json "$RESULTS/train_speed.json"
  read -r -a FULL <<< "$(train_cmd train-full "$N" --steps "$RESUME_STEPS")"
  read -r -a CUT <<< "$(train_cmd train-cut "$N" --steps "$RESUME_STEPS")"
  row "train x$N: $RESUME_STEPS steps uninterrupted" "${FULL[@]}"
  row "train x$N: Ctrl-C after step 3" "${CHECK[@]}" interrupt "$WORK/train-cut" --world "$N" --after 3 \
    --before "$RESUME_STEPS" \
    --log "$WORK/train-cut.err" --json "$RESULTS/interrupt.json" -- "${CUT[@]}"
  row "train x$N: the same command resumes" "${CUT[@]}"
  row "train x$N: resumed = uninterrupted" "${CHECK[@]}" same "$WORK/train-full" "$WORK/train-cut" --world "$N" \
    --json "$RESULTS/resume.json"
  "${CHECK[@]}" s3-counts --dir "$S3DIR" --name resume-runs >> "$LOG" 2>&1
fi

if has loader; then
  L=(-m tools.node_checks loader --workers 2 --epochs "${LOADER_EPOCHS:-3}" --device "$DEVICE"
     --token-budget "${LOADER_TOKENS:-16384}")
  row "loader x$N x 2 workers, local files" "${TORCHRUN[@]}" "${L[@]}" "$STORE" --json "$RESULTS/loader_local.json"
  if [[ -n $S3PID ]]; then
    rm -rf "$WORK/cache-loader"
    row "loader x$N x 2 workers, S3 + node cache" "${TORCHRUN[@]}" "${L[@]}" "$S3URL" \
      --storage-option "endpoint_url=$S3READ" --cache-dir "$WORK/cache-loader" --json "$RESULTS/loader_s3.json"
    row "loader: remote bytes over its epochs (goal <= 1.1x)" "${CHECK[@]}" s3-counts --dir "$S3DIR" \
      --name loader --at-most 1.1 --json "$RESULTS/remote_loader.json"
  fi
fi

s3_down
{
  echo
  python3 -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name(0) + ' x ' + \
str(torch.cuda.device_count()) if torch.cuda.is_available() else 'no GPU', '| N =', $N, '| device $DEVICE')"
} >> "$TABLE" 2>&1
cat "$TABLE"
exit "$FAILED"
