"""`hsstore extract` with and without `--compile` on the same input, then every sample's features compared.

    python -m tools.compare_compile --out /tmp/cmp [--model DIR --input FILE] [--final-hidden] [--device cuda]

Defaults: the shipped tiny trained target and its conversations. Prints JSON: per tap (and ``final_hidden``) the
minimum and mean per-token cosine and the largest absolute difference between the two stores, both stores'
verify results and the two extractions' wall times (the compiled one includes its compile time).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hsstore
from hsstore.app.cli import main as hsstore_main
from hsstore.extract.tiny import demo_conversations_path, trained_target_dir


def extract(model: str, data: str, out: Path, compiled: bool, final_hidden: bool, device: str | None) -> float:
    argv = ["extract", "--model", model, "--input", data, "--out", str(out), "--force", "-q",
            "--compile" if compiled else "--no-compile"] + (["--final-hidden"] if final_hidden else [])
    if device:
        argv += ["--device", device]
    t = time.perf_counter()
    if hsstore_main(argv) != 0:
        raise SystemExit(f"extract into {out} failed")
    return time.perf_counter() - t


def compare(a_url: str, b_url: str) -> dict:
    a, b = hsstore.open(a_url), hsstore.open(b_url)
    index_b = {sid: i for i, sid in enumerate(b.sample_ids())}
    keys = ["hidden_states"] + (["final_hidden"] if "final_hidden" in a.read(0) else [])
    cos: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    worst = {k: 0.0 for k in keys}
    for i, sid in enumerate(a.sample_ids()):
        x, y = a.read(i), b.read(index_b[sid])
        assert torch.equal(x["input_ids"], y["input_ids"]), sid
        for k in keys:
            p, q = x[k].float(), y[k].float()
            cos[k].append(torch.nn.functional.cosine_similarity(p, q, dim=-1).reshape(p.shape[0], -1))
            worst[k] = max(worst[k], float((p - q).abs().max()))
    out = {}
    for k in keys:
        c = torch.cat(cos[k])
        names = [str(l) for l in a.layers] if k == "hidden_states" else ["final_hidden"]
        for j, name in enumerate(names):
            out[name] = {"cosine_min": float(c[:, j].min()), "cosine_mean": float(c[:, j].mean())}
        out[f"{k}_max_abs_diff"] = worst[k]
    return out


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--input", default=None)
    p.add_argument("--final-hidden", action="store_true")
    p.add_argument("--device", default=None)
    args = p.parse_args()
    model = args.model or str(trained_target_dir())
    data = args.input or str(demo_conversations_path())
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty: give a new folder (nothing is deleted)")
    res = {"eager_s": extract(model, data, out / "eager", False, args.final_hidden, args.device),
           "compiled_s": extract(model, data, out / "compiled", True, args.final_hidden, args.device)}
    res["verify"] = {name: hsstore_main(["verify", str(out / name), "-q", "--json"]) for name in ("eager", "compiled")}
    res["features"] = compare(str(out / "eager"), str(out / "compiled"))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
