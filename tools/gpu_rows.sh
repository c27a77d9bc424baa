#!/usr/bin/env bash
# The speed rows one GPU can measure, each beside its baseline in the same run, in two parts of at most 530 s each
# (one device call each; an H100 or an H200: name the card with the figures, never compare two machines' rows).
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   cd /tmp && PYTHONPATH=/tmp/site:$REPO bash $REPO/tools/gpu_rows.sh PART [SCRATCH]      # PART 1 or 2
#
# As one device call per part, from the repository root with .whl carried (the results, more files than a call
# brings back, in one archive):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && R=$PWD && cd /tmp && \
#     bash $R/tools/gpu_rows.sh 1 /tmp/hsrows; tar czf $OUT/rows1.tgz -C /tmp/hsrows results
#
# (.whl/ holding hsstore's wheel, `pip wheel --no-deps -w .whl .`, and the wheels tools/gpu_speed.sh reads; run from
# outside the checkout, whose hsstore/ would hide the wheel's hsstore.train.) SCRATCH default /tmp/hsrows; the
# results land in RESULTS (default SCRATCH/results): one NAME.out (stdout) and NAME.log (stderr) per row, and the
# summary on stdout. DEVICE=cpu TINY=1 runs every row at toy sizes on a CPU (a check that the script runs end to
# end, no figures; its budgets STRETCH times the GPU's, default 4). Each row has its time budget (printed; `timeout`
# holds it), within the part's 530 s:
#
# part 1
#   demo     `hsstore demo --device cpu`: the target, store and trained drafter the eval row decodes with (~70 s);
#            DEMO_DIR names a demo folder made on this machine already (the smoke's, which chose the CPU too) instead
#   eval     `eval --model` on the GPU, demo's target + drafter vs the target alone, three modes alternating over 2
#            rounds: graphs (eval's default now: the drafter's step as one CUDA graph, the verified block through
#            the delta rule's one-kernel recurrent form), chunk (the graph, the chunked form) and eager (before);
#            tau, tokens/s, and the ceiling tau / (1 + drafter cost / target cost) with each part timed alone
#            (tools/bench_eval)
#   drafter  the drafter step, published 5 layers, 1 x 16,384 tokens, 512 anchors, blocks attention, fused CE, three
#            times in one process: the median of 3 (tools/bench_attention)
#   graphtest  the GPU test of the graphed drafter against its eager steps, token for token (pytest, when present)
# part 2
#   fed      trainer fed / resident, published recipe 4 x 4,096, 512 anchors asked, cold page cache, the step as the
#            trainer's memory plan makes it for this card (tools/bench_train: the plan's choice, estimate, peak)
#   train    `hsstore train` with the published recipe on the synthetic 27B-shaped store (bench_train --store-only):
#            the plan's line and estimate vs the peak metrics.jsonl reports (torch.cuda.max_memory_allocated over
#            the whole steps, AdamW's moments included), tokens/s of steps 3..; OUT on /dev/shm (the last
#            checkpoint: 24 GB)
#   source8  8 loader ranks, warm page cache, 4 GB, 3 epochs, beside plain reads of the same files (hsstore bench)
#   source8-nvfp4  the same samples stored nvfp4 (--encoding nvfp4): tokens/s and CPU-s per M tokens beside source8's
#   extract  extraction, 27B architecture, 5 taps, writer process, eager then compiled (tools.bench_extract)
set -u
PART=${1:?PART: 1 or 2}
S=${2:-/tmp/hsrows}
R=${RESULTS:-$S/results}
DEVICE=${DEVICE:-cuda}
TINY=${TINY:-}
STRETCH=${STRETCH:-$([[ -n $TINY ]] && echo 4 || echo 1)}
mkdir -p "$S" "$R"
T0=$SECONDS
python3 -c "import hsstore.train.graphs, hsstore.train.sharding" || {
    echo "the hsstore on the path lacks hsstore.train.graphs (rebuild its wheel: pip wheel --no-deps -w .whl .)" >&2; exit 2; }
run() {  # name, seconds, command...: stdout to NAME.out, stderr to NAME.log, held to its budget
    local name=$1 t=$(($2 * STRETCH)); shift 2
    echo "== $name (budget ${t} s, $((SECONDS - T0)) s elapsed): $*" >&2
    local t1=$SECONDS
    timeout "$t" "$@" >"$R/$name.out" 2>"$R/$name.log" || echo "   (exit $?; see $R/$name.log)" >&2
    echo "   $name took $((SECONDS - t1)) s" >&2
}
left() { echo $((530 - (SECONDS - T0) / STRETCH)); }  # of the part's budget, in the GPU's seconds
at_most() { local a=$1 b; b=$(left); echo $((a < b ? a : b)); }
if [[ -n $TINY ]]; then  # toy sizes: every row's command as on the GPU, small enough for a CPU
    # a demo-shaped folder from 8 of the demo's conversations: its target, store and a drafter trained 3 steps
    DEMO=(bash -c 'set -e; mkdir -p "$0/data"; src=$(python3 -c "from hsstore.extract.tiny import trained_files as f; print(f())")
        python3 -c "import sys; from hsstore.extract.tiny import build_trained_target as b; b(sys.argv[1])" "$0/target"
        head -8 "$src/conversations.jsonl" >"$0/data/conversations.jsonl"; head -2 "$src/heldout.jsonl" >"$0/data/heldout.jsonl"
        python3 -m hsstore extract --model "$0/target" --input "$0/data/conversations.jsonl" --out "$0/store" --device cpu -q
        python3 -m hsstore train --store "$0/store" --out "$0/run" --steps 3 --draft-layers 2 --sliding-window 32 \
            --anchors 8 --token-budget 1024 --device cpu -q' "$S/demo")
    EVAL=(--samples 1 --rounds 1 --warmup 0 --max-new-tokens 12 --reps 2)
    DRAFTER=(--tiny --steps 1 --warmup 1)
    FED=(--tiny --rounds 1 --steps 1 --warmup 1)
    STORE=(--tiny)
    TRAIN=(--steps 3 --draft-layers 1 --token-budget 1024 --anchors 16)
    SRC=(--procs 2 --size-mb 16 --epochs 2)
    EXTRACT=(--layers-total 8 --hidden 64 --ffn 128 --heads 4 --kv-heads 2 --head-dim 16 --linear-v-heads 4
             --linear-k-heads 2 --vocab 512 --samples 2 --min-len 64 --max-len 96 --token-budget 256 --rounds 1)
else
    DEMO=(python3 -m hsstore demo --out "$S/demo" --device cpu)
    EVAL=(--samples 4 --rounds 2 --warmup 1 --reps 50)
    DRAFTER=(--published --seq 16384 --anchors 512 --impl blocks --steps 5 --warmup 2)
    FED=(--draft-layers 5 --seq 4096 --max-tokens 16384 --anchors 512 --cold --rounds 2 --steps 4 --warmup 1
         --samples 20)
    STORE=(--seq 4096 --samples 12 --steps 1 --warmup 1)
    TRAIN=(--steps 6)
    SRC=(--procs 8 --size-mb 4096 --epochs 3)
    EXTRACT=(--samples 12 --rounds 1)
fi

if [[ $PART == 1 ]]; then
    D=$S/demo
    if [[ -n ${DEMO_DIR:-} && -e $DEMO_DIR/.hsstore-demo ]]; then  # a demo this machine made already (the smoke's)
        D=$DEMO_DIR; echo "== demo: the one in $D (DEMO_DIR)" >&2
    else
        rm -rf "$D"
        run demo 150 "${DEMO[@]}"
    fi
    run eval "$(at_most 220)" python3 -m tools.bench_eval "$D" --device "$DEVICE" --json "${EVAL[@]}"
    run drafter "$(at_most 150)" python3 -m tools.bench_attention --device "$DEVICE" --pointwise fused fused fused \
        --json "${DRAFTER[@]}"
    if python3 -c "import pytest" 2>/dev/null && [[ $DEVICE == cuda && $(left) -gt 40 ]]; then
        REPO=$(python3 -c "import tools, pathlib; print(pathlib.Path(tools.__file__).parents[1])")
        run graphtest "$(at_most 90)" python3 -m pytest -q -p no:cacheprovider -m gpu "$REPO/tests/test_draft_graphs.py"
    fi
elif [[ $PART == 2 ]]; then
    run fed "$(at_most 120)" python3 -m tools.bench_train --dir "$S/fed" --device "$DEVICE" --json "${FED[@]}"
    rm -rf "$S/fed"
    OUTDIR=$([[ -d /dev/shm && -z $TINY ]] && echo /dev/shm/hsrows-train || echo "$S/train")
    rm -rf "$OUTDIR" "$S/store"
    STORE_TRAIN='store=$(python3 -m tools.bench_train --dir "$0" --device "$1" --store-only "${@:4}" | tail -1) &&
        python3 -m hsstore train --store "$store" --out "$2" --device "$1" --log-every 1 --save-every 100000 $3'
    run train "$(at_most 180)" bash -c "$STORE_TRAIN" "$S/store" "$DEVICE" "$OUTDIR" "${TRAIN[*]}" "${STORE[@]}"
    cp "$OUTDIR/metrics.jsonl" "$R/train.metrics.jsonl" 2>/dev/null
    rm -rf "$OUTDIR" "$S/store"
    run source8 "$(at_most 70)" python3 -m hsstore bench "$S/source" --what source "${SRC[@]}" --quiet --json
    rm -rf "$S/source"
    run source8-nvfp4 "$(at_most 60)" python3 -m hsstore bench "$S/source" --what source "${SRC[@]}" \
        --encoding nvfp4 --quiet --json
    rm -rf "$S/source"
    if [[ $DEVICE == cuda ]]; then
        run extract "$(at_most 240)" python3 -m tools.bench_extract --out "$S/bench-extract" --modes extract_process \
            --compile "${EXTRACT[@]}"
    else  # the compiled forward is a GPU row: on a CPU the eager pass only
        run extract "$(at_most 240)" python3 -m tools.bench_extract --out "$S/bench-extract" --modes extract_process \
            --device cpu "${EXTRACT[@]}"
    fi
    rm -rf "$S/bench-extract"
else
    echo "PART: 1 or 2" >&2; exit 2
fi

python3 - "$R" "$PART" <<'EOF'
import json, pathlib, re, statistics, sys
R, part = pathlib.Path(sys.argv[1]), sys.argv[2]
def load(name):
    try:
        t = (R / f"{name}.out").read_text()
        return json.loads(t[t.index("{"):])
    except (OSError, ValueError):
        return None
def lines(name):
    try:
        return [json.loads(l) for l in (R / f"{name}.out").read_text().splitlines() if l.startswith("{")]
    except (OSError, ValueError):
        return []
def log(name):
    try:
        return (R / f"{name}.log").read_text()
    except OSError:
        return ""
if part == "1":
    e = load("eval")
    if e:
        print("| eval --model mode | round | target tok/s | spec tok/s | speed-up | tau per prompt | tau pooled | "
              "identical |\n|---|---|---|---|---|---|---|---|")
        for r in e["rows"]:
            print(f"| {r['mode']} | {r['round']} | {r['target_tokens_per_s']:.1f} | {r['spec_tokens_per_s']:.1f} | "
                  f"{r['speedup']:.2f}x | {r['tau_per_prompt']:.2f} | {r['tau_pooled']:.2f} | "
                  f"{r['identical']}/{r['samples']} (+{r['ties']} ties) |")
        p = e.get("parts") or {}
        print("parts (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in p.items()))
        for m, c in (e.get("ceilings") or {}).items():
            print(f"{m}: speed-up {c['speedup']:.2f}x, ceiling tau pooled/(1+draft/target) {c['ceiling']:.2f}x, "
                  f"bound tau*target/(draft+verify) {c['bound']:.2f}x")
    else:
        print("eval: no result (see eval.log)")
    d = [r for r in lines("drafter") if "ms_per_step" in r]
    if d:
        ms = statistics.median(r["ms_per_step"] for r in d)
        each = ", ".join("%.1f" % r["ms_per_step"] for r in d)
        mfu = ", ".join("%.3f" % r.get("mfu", 0) for r in d)
        print(f"\ndrafter step, median of {len(d)}: {ms:.1f} ms ({each}); tokens/s "
              f"{statistics.median(r['tokens_per_s'] for r in d):,.0f}; MFU {mfu}; peak {d[0].get('peak_gib', 'n/a')} GiB")
    else:
        print("drafter: no result (see drafter.log)")
    g = (R / "graphtest.out").read_text() if (R / "graphtest.out").exists() else ""
    if g:
        print("\ngraph test: " + (re.findall(r"\d+ (?:passed|failed|skipped|error)[^\n]*", g) or ["see graphtest.out"])[-1])
else:
    f = load("fed")
    if f:
        print(f"fed / resident (4 x 4,096, asked {f['asked']}): plan {f['anchors']} anchors, --checkpoint-layers "
              f"{f['checkpoint_layers']}; ratio {f['ratio']:.3f} (loader {f['loader_ms']:.0f} vs resident "
              f"{f['resident_ms']:.0f} ms; rounds {', '.join('%.3f' % x for x in f['rounds_ratio'])}); "
              f"{f['resident_tokens_per_s']:,.0f} tokens/s resident; estimate {f['estimate_gib']:.1f} GiB vs "
              f"peak {f.get('peak_gib', float('nan')):.1f} GiB")
    else:
        print("fed: no result (see fed.log)")
    said = [l.strip() for l in log("train").splitlines()
            if re.search(r"estimated GPU peak|needs about|lowering anchors|training on|Error", l)]
    print("\ntrain, the plan's lines:\n  " + "\n  ".join(said or ["(none; see train.log)"]))
    try:
        rows = [json.loads(l) for l in (R / "train.metrics.jsonl").read_text().splitlines()]
    except OSError:
        rows = []
    est = re.search(r"estimated GPU peak ([0-9.]+) GiB", log("train"))
    if rows:
        peak = max(r.get("gpu_mem_gib", 0) for r in rows)
        later = [r["tokens_per_s"] for r in rows if r["step"] >= 3] or [rows[-1]["tokens_per_s"]]
        print(f"train: {len(rows)} steps, tokens/s (steps 3..) median {statistics.median(later):,.0f}; peak "
              f"{peak:.1f} GiB" + (f" vs estimate {est.group(1)} GiB: estimate/peak {float(est.group(1)) / peak:.3f}"
                                  if est and peak else ""))
    for name in ("source8", "source8-nvfp4"):
        s = load(name)
        for e in (s or {}).get("source", {}).get("epochs", []):
            raw = e["raw"]["read"]
            print(f"{name} epoch {e['epoch']}: {e['total_gbps']:.2f} GB/s, slowest rank {e['min_rank_gbps']:.2f}, "
                  f"{e['cpu_s_per_gb']:.3f} CPU-s/GB; plain {raw['total_gbps']:.2f} GB/s; loader/plain "
                  f"{e['vs_raw']['read']['total']:.2f}; {e['tokens_per_s'] / 1e6:.2f} M tokens/s, slowest rank "
                  f"{e['min_rank_tokens_per_s'] / 1e6:.2f}, {e['cpu_s_per_mtok']:.2f} CPU-s/M tokens")
    x = load("extract")
    if x:
        for m, v in x.get("tokens_per_s", {}).items():
            print(f"extract {m}: {v:,.0f} tokens/s, MFU {x.get('mfu_vs_989', {}).get(m, float('nan')):.3f}")
        print(f"compile warm-up {x.get('compile', {}).get('warm_up_s', 0):.0f} s")
    else:
        print("extract: no JSON (see extract.log)")
EOF
echo "part $PART done in $((SECONDS - T0)) s" >&2
