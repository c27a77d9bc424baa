"""How far re-tokenized text is from what the engine computed, on a set the trained tiny target answers at
temperature 1 through tools/engine_server.py (vLLM's wire format, real sampling).

Regenerates N prompts with ``hsstore regenerate`` (engine ids recorded), runs ``check`` and ``extract`` on
them, reads the store back and prints: the share of turns whose engine ids differ from re-tokenizing their
text (split by cause), the share of samples stored exactly (ids and mask bit-exact against the engine's), and
what fell back or was skipped and why. CPU only, ~1-3 minutes for 200 turns.

    PYTHONPATH=tests python -m tools.engine_ids_report --n 200 --out /tmp/engine_ids
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from collections import Counter
from pathlib import Path

from hsstore.app.schema import build


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="prompts (one generated turn each)")
    ap.add_argument("--out", default="/tmp/engine_ids", help="work folder (replaced)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from tools.engine_server import EngineServer
    from transformers import AutoTokenizer

    import hsstore
    from hsstore.extract.job import ExtractSettings, run_extract
    from hsstore.extract.gate import GateThresholds
    from hsstore.extract.regenerate import RegenerateSettings, run_regenerate
    from hsstore.extract.tiny import trained_files, trained_target_dir
    from hsstore.extract.tokenize import TokenizeStats, load_samples

    work = Path(args.out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    target = trained_target_dir()
    tok = AutoTokenizer.from_pretrained(str(target))
    eot, think_end = tok.convert_tokens_to_ids(["<|im_end|>", "</think>"])
    files = trained_files()
    rows = [json.loads(line) for f in ("conversations.jsonl", "heldout.jsonl")
            for line in (files / f).read_text().splitlines()][: args.n]
    inp = work / "prompts.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = work / "regenerated.jsonl"
    with EngineServer(target, seed=args.seed) as url:
        regen = run_regenerate(build(RegenerateSettings, input=[str(inp)], out=str(out), server=url,
                                     temperature=args.temperature,
                                     max_tokens=args.max_tokens, concurrency=1, progress=False))
    answered = [json.loads(line) for line in out.read_text().splitlines()]

    # each turn: engine ids vs re-tokenizing its own decoded text vs what the text rule gives
    stats = TokenizeStats()
    samples = {s.sample_id: s for s in load_samples([str(out)], tok, stats=stats)}
    causes: Counter[str] = Counter()
    fallback = Counter(r["generation"]["token_ids"] for r in answered)
    for r in answered:
        turn = r["messages"][-1]
        gen = turn.get("token_ids")
        if gen is None:
            continue
        body = gen[:-1] if gen[-1] == eot else gen
        canonical = tok(tok.decode(body), add_special_tokens=False)["input_ids"] + gen[len(body):]
        s = samples.get(r["id"])
        if s is None:
            causes["skipped"] += 1
        elif "non_canonical" not in s.flags:
            causes["same"] += 1
        elif canonical != gen:
            causes["non-canonical split sampled"] += 1
        elif turn["finish_reason"] == "length":
            causes["cut by max_tokens (the template closes what the model never closed)"] += 1
        elif think_end not in gen:
            causes["ended inside its think block (the template adds </think>)"] += 1
        else:
            causes["text re-rendered differently (parser split + template trim)"] += 1

    store_url = str(work / "store")
    run_extract(build(ExtractSettings, model=str(target), input=[str(out)], out=store_url, device="cpu",
                      dtype="float32", layers=[1], progress=False,
                      thresholds=GateThresholds(max_truncated_share=1.0, max_stub_share=1.0,
                                                        max_empty_thinking_share=1.0, small_loss_sum=0)))
    store = hsstore.open(store_url)
    recorded = {r["id"]: r["messages"][-1] for r in answered}
    exact = 0
    for i in range(len(store)):
        item = store.read(i, layers=store.layers[:1])
        m = recorded[item["sample_id"]]
        p, g = m.get("prompt_token_ids"), m.get("token_ids")
        exact += bool(p and g and item["input_ids"].tolist() == p + g
                      and item["loss_mask"].tolist() == [False] * len(p) + [True] * len(g))
    turns = stats.engine_turns
    report = {
        "prompts": len(rows), "generated_turns": regen.generated, "completion_tokens": regen.completion_tokens,
        "truncated_turns": regen.truncated, "temperature": args.temperature, "seed": args.seed,
        "row_token_ids": dict(fallback),
        "engine_turns": turns, "non_canonical": stats.non_canonical,
        "non_canonical_share": stats.non_canonical / turns if turns else None,
        "causes": dict(causes),
        "skipped": {k: len(v) for k, v in stats.skipped.items()},
        "stored_samples": len(store), "stored_exactly": exact,
        "stored_exactly_share": exact / len(answered) if answered else None,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{len(rows)} prompts answered at temperature {args.temperature} ({regen.completion_tokens:,} tokens, "
              f"{regen.truncated} cut by max_tokens); rows' token_ids: {dict(fallback)}")
        print(f"engine ids differ from re-tokenizing the text: {stats.non_canonical}/{turns} turns "
              f"({100 * report['non_canonical_share']:.1f}%)")
        for cause, n in causes.most_common():
            print(f"  {cause:<72} {n:>5}")
        print(f"stored exactly (ids + mask bit-exact vs the engine's): {exact}/{len(answered)} "
              f"({100 * report['stored_exactly_share']:.1f}%); skipped {report['skipped'] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
