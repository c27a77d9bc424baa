"""Which short convolution is closer to the exact forward: fla's Triton kernel or transformers' PyTorch path?

Both bf16 forwards of a random Qwen3.5-architecture target (the bench's shape, fewer layers so that an fp32
copy fits) are compared, per depth and token, with the same model in float32 on PyTorch's convolution. The
smaller the distance to float32, the closer the stored features are to what the target computes.

    python -m tools.conv_precision --layers-total 24 --seq 2048 --batch 2 --json     # on a GPU with fla
"""

from __future__ import annotations

import argparse
import json

import torch

from hsstore.app.conv import torch_conv, use_fla_conv
from tools.bench_extract import add_model_args, build_model


def hidden(model, ids) -> list[torch.Tensor]:
    with torch.no_grad():
        return [h.float() for h in model(input_ids=ids, output_hidden_states=True).hidden_states]


def cosines(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    c = torch.nn.functional.cosine_similarity(a.flatten(0, 1), b.flatten(0, 1), dim=-1)
    return {"min": round(c.min().item(), 6), "mean": round(c.mean().item(), 6)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.set_defaults(layers_total=24)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = build_model(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    hooked = use_fla_conv(model, torch.device(args.device))
    fla = hidden(model, ids)
    undone = torch_conv(model)
    ref_torch = hidden(model, ids)
    exact = hidden(model.float(), ids)  # float32 weights and activations, PyTorch's convolution
    depths = sorted({1, args.layers_total // 4, args.layers_total // 2, 3 * args.layers_total // 4, args.layers_total})
    out = {"hooked": hooked, "undone": len(undone), "layers": args.layers_total, "tokens": args.batch * args.seq,
           "after_layer": {d: {"fla_bf16_vs_fp32": cosines(fla[d], exact[d]),
                               "torch_bf16_vs_fp32": cosines(ref_torch[d], exact[d]),
                               "fla_vs_torch_bf16": cosines(fla[d], ref_torch[d])} for d in depths}}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"conv on fla: {hooked}; {out['tokens']} tokens, {args.layers_total} layers")
    print("| after layer | fla bf16 vs fp32 (min / mean) | torch bf16 vs fp32 | fla vs torch |\n|---|---|---|---|")
    for d, r in out["after_layer"].items():
        cell = lambda k: f"{r[k]['min']:.5f} / {r[k]['mean']:.5f}"  # noqa: E731
        print(f"| {d} | {cell('fla_bf16_vs_fp32')} | {cell('torch_bf16_vs_fp32')} | {cell('fla_vs_torch_bf16')} |")


if __name__ == "__main__":
    main()
