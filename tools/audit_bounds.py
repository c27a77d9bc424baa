"""The figures behind ``extract/compare.py``'s bounds on the tiny targets (``tools/deep_bounds.py``: at 64 layers): how close a store's true layer is to the target's
recomputation, and how far a neighbour layer and another target's layer are, per dtype and encoding.

For each tiny target (the trained one and the random one) and each of float32, float16, bfloat16 and fp8 (over
bfloat16) it extracts a store in token-budget batches (right padding, as ``hsstore extract`` does), recomputes
each stored sample alone with ``audit.reference_features`` and prints, over samples and tapped layers, the worst
cosine and relative error of the true layer, the best of a neighbour layer (l - 1, l + 1) and the best of the
same layer of a target with the same config and other weights.

    python -m tools.audit_bounds [--samples 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from hsstore.app.schema import build


def other_weights(model_dir: str, out: Path, seed: int = 12345) -> str:
    """A target of ``model_dir``'s config and tokenizer with random weights (seed ``seed``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = type(model)(model.config)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return str(out)


def figures(store_url: str, model_dir: str, other_dir: str, samples: int) -> dict:
    import hsstore
    from hsstore.extract.audit import chosen_samples, reference_features, stored_features
    from hsstore.extract.compare import agreement
    from hsstore.app.target import load_target
    from hsstore.extract.target import DTYPES

    store = hsstore.open(store_url)
    m = store.manifest
    model = load_target(model_dir, DTYPES[m.dtype], torch.device("cpu"), progress=False)
    other = load_target(other_dir, DTYPES[m.dtype], torch.device("cpu"), progress=False)
    true, near, far = [], [], []
    for i in chosen_samples(store, samples):
        item = store.read(i)
        ref, alien = reference_features(model, item["input_ids"]), reference_features(other, item["input_ids"])
        for layer, stored in zip(m.layers, stored_features(item, m.layers)):
            true.append(agreement(stored, ref[:, layer]))
            near += [agreement(stored, ref[:, c]) for c in (layer - 1, layer + 1) if 0 <= c < m.target.num_layers]
            far.append(agreement(stored, alien[:, layer]))
    return {"true_min_cosine": min(a.cosine for a in true), "true_1_minus_cosine": 1 - min(a.cosine for a in true),
            "true_max_rel_err": max(a.rel_err for a in true),
            "neighbour_cosine": [min(a.cosine for a in near), max(a.cosine for a in near)],
            "neighbour_min_rel_err": min(a.rel_err for a in near),
            "other_target_cosine": [min(a.cosine for a in far), max(a.cosine for a in far)]}


def main() -> None:
    from hsstore.extract.job import ExtractSettings, run_extract
    from hsstore.extract.tiny import demo_conversations_path, tiny_target_dir, trained_files, trained_target_dir

    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=8)
    args = p.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model_dir, conversations in (
                ("trained", str(trained_target_dir()), trained_files() / "conversations.jsonl"),
                ("random", str(tiny_target_dir()), demo_conversations_path())):
            rows = Path(tmp) / f"{name}.jsonl"
            rows.write_text("".join(conversations.read_text().splitlines(keepends=True)[:args.samples * 4]))
            other = other_weights(model_dir, Path(tmp) / f"{name}-other")
            for dtype, encoding in (("float32", "raw"), ("float16", "raw"), ("bfloat16", "raw"), ("bfloat16", "fp8")):
                url = str(Path(tmp) / f"{name}-{dtype}-{encoding}")
                run_extract(build(ExtractSettings, model=model_dir, input=[str(rows)], out=url, dtype=dtype,
                                  encoding=encoding, device="cpu", progress=False, force=True))
                out[f"{name} {dtype} {encoding}"] = figures(url, model_dir, other, args.samples)
                print(json.dumps({f"{name} {dtype} {encoding}": out[f"{name} {dtype} {encoding}"]}), flush=True)


if __name__ == "__main__":
    main()
