"""The extraction family's commands: ``check``, ``show``, ``extract``, ``import``, ``export``, ``regenerate``
and ``demo``, mounted on the ``hsstore`` command line through the ``hsstore.commands`` entry point.

The flags of check, show and extract come from their schemas in ``settings.py`` (one argument group per
section); each handler turns the parsed flags into its settings object and passes that on.
transformers is imported only inside the handlers: the ``hsstore`` CLI imports this module at startup
and must stay fast for commands that never touch a tokenizer.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from hsstore.cli import add_json_option, add_quiet_option, add_storage_option
from hsstore.config import add_config_option
from hsstore.redaction import recordable_url
from hsstore.schema import add_arguments, from_args
from hsstore.storage import parse_storage_options

from .gate import GateThresholds
from .settings import (CheckSettings, ExtractSettings, ShowSettings, add_shard_mb_flag, extract_config,
                       mib_bytes, shared_overrides, template_kwargs)

logger = logging.getLogger(__name__)


def add_template_kwargs_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """``--chat-template-kwargs`` of ``regenerate``, whose arguments go to the server."""
    parser.add_argument("--chat-template-kwargs", default=None, metavar="JSON", help=help)


def thresholds_from_args(args: argparse.Namespace) -> GateThresholds:
    return GateThresholds(**{f.name: getattr(args, f.name) for f in fields(GateThresholds)})


def cost_estimate(cfg: CheckSettings, samples: int, tokens: int) -> dict:
    """``hsstore.estimate`` for ``check``: taps and hidden size from the flags, else the model's config."""
    import json
    from pathlib import Path

    from hsstore.estimate import H200_27B_TOKENS_PER_S, estimate
    from hsstore.taps import default_taps, text_config

    est, model = cfg.estimate, cfg.input.model
    hidden, layers = est.hidden, est.layers
    if model and (hidden is None or layers is None):
        target = text_config(json.loads((Path(model) / "config.json").read_text()))
        hidden = hidden or target["hidden_size"]
        layers = layers or default_taps(target["num_hidden_layers"])
    if hidden is None or layers is None:
        raise ValueError("the estimate needs --hidden and --layers (or --model, whose config has them)")
    return estimate(samples=samples, tokens=tokens, layers=layers, hidden=hidden, final_hidden=est.final_hidden,
                    tokens_per_s=est.tokens_per_s or H200_27B_TOKENS_PER_S)


def register(subparsers) -> None:
    """Add the family's subcommands; each sets ``func=handler(args) -> int``."""
    for add in (add_check, add_show, add_extract, add_import, add_export, add_regenerate, add_demo):
        add(subparsers)


def add_check(subparsers) -> None:
    p = subparsers.add_parser(
        "check",
        help="quality gate on training data, before any GPU work",
        description="Tokenize the input with the target's chat template and check per-sample loss-mask "
        "distributions. Exit 0 when the gate passes, 1 when it fails, 2 on errors.",
    )
    add_arguments(p, CheckSettings)
    p.set_defaults(func=run_check)


def add_show(subparsers) -> None:
    s = subparsers.add_parser(
        "show",
        help="print one decoded sample with its loss mask marked",
        description="Decode sample N (0-based position, or a sample id) of an input with loss-masked "
        "tokens highlighted (color on a terminal, ⟦ ⟧ otherwise).",
    )
    groups = add_arguments(s, ShowSettings)
    add_storage_option(groups["input"])
    s.set_defaults(func=run_show)


def add_extract(subparsers) -> None:
    e = subparsers.add_parser(
        "extract",
        help="run the target over the input and write the tapped hidden states to a store",
        description="Tokenize with the target's chat template, run the quality gate (refusing bad data before "
        "the model is loaded), then extract. Under torchrun each rank writes its own shards; re-running "
        "the same command resumes (committed samples are skipped).",
    )
    groups = add_arguments(e, ExtractSettings)
    add_shard_mb_flag(groups["store"])
    add_storage_option(groups["store"])
    add_quiet_option(groups["run"])
    add_config_option(e)
    e.set_defaults(func=run_extract_cmd)


def add_import(subparsers) -> None:
    m = subparsers.add_parser(
        "import",
        help="convert the peers' per-sample files (SpecForge .ckpt, speculators hs_{i}.safetensors) into a store",
        description="Read a SpecForge folder of torch.save files (torch.load with weights_only=True only) or a "
        "speculators Arrow dataset with hidden_states/hs_{i}.safetensors, and write a store. The peers' files do "
        "not say which model, tokenizer and layers made them: give --layers and either --model DIR (a local "
        "model folder, hashed like extract does; no weights are loaded) or the identity flags. Re-running "
        "resumes (committed sample ids are skipped).",
    )
    m.add_argument("format", choices=["specforge", "speculators"])
    m.add_argument("path", help="SpecForge: the folder of .ckpt files; speculators: the Arrow dataset folder")
    m.add_argument("--out", required=True, help="store URL (local path or s3://bucket/prefix)")
    m.add_argument("--layers", default=None, help="tapped layer ids of the files' features, in their order, e.g. "
                   "1,16,31, in hsstore's convention (output of decoder layer l, 0-based). A list that reads like "
                   "the peer's own ids (speculators/vLLM: its launch ids [2, N//2, N-3, N], or N) is refused: use "
                   "--peer-layers, or --hsstore-ids if it really is meant as hsstore ids")
    m.add_argument("--peer-layers", default=None, help="the same, in the peer's own convention, e.g. 2,4,5,8 as "
                   "passed to speculators' launch_vllm.py (vLLM id i = output of decoder layer i-1; hsstore id = "
                   "i-1) or SpecForge's aux_hidden_state_layer_ids (= hsstore ids); both lists go into the "
                   "manifest's extra.peer_layers")
    m.add_argument("--hsstore-ids", action="store_true", help="--layers is meant in hsstore's convention even "
                   "where it looks like the peer's")
    m.add_argument("--pad-token-id", type=int, default=0, help="SpecForge: the id its collator right-pads rows "
                   "with (0, whatever the tokenizer says); trailing pad tokens outside the loss mask are trimmed")
    m.add_argument("--keep-padding", action="store_true", help="SpecForge: store rows with their batch padding")
    m.add_argument("--num-rows", type=int, default=None, help="SpecForge: rows of the dataset the files were made "
                   "from; data_{i} files missing below it (NaN rows, the dropped last partial batch) are named")
    m.add_argument("--no-final-hidden", action="store_true", help="SpecForge: drop the files' hidden_state (the "
                   "final-norm output; kept as the store's final_hidden feature by default)")
    m.add_argument("--model", default=None, help="local target model folder: identity from its config and tokenizer")
    m.add_argument("--model-name", default=None)
    m.add_argument("--num-layers", type=int, default=None, help="decoder layers of the target")
    m.add_argument("--hidden-size", type=int, default=None)
    m.add_argument("--config-hash", default=None, help="target identity when --model is not given")
    m.add_argument("--tokenizer-hash", default=None, help="vocab hash of the tokenizer when --model is not given")
    m.add_argument("--tokenizer-name", default=None)
    m.add_argument("--chat-template-hash", default=None)
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="the files' feature dtype (stored bit-exact; other dtypes are refused)")
    m.add_argument("--codec", default="none", help="chunk codec: none, zstd[:level], blosc-zstd[:level], lz4")
    m.add_argument("--id-prefix", default="", help="prepended to sample ids (data_17, hs_17) to keep several "
                   "imports into one store apart")
    m.add_argument("--source", default=None, help="source column of every sample (default: the row's source or "
                   "the folder name)")
    m.add_argument("--hidden-states-dir", default=None, help="speculators: folder of hs_{i}.safetensors "
                   "(default PATH/hidden_states)")
    add_shard_mb_flag(m)
    add_quiet_option(m)
    add_storage_option(m)
    m.set_defaults(func=run_import_cmd)


def add_export(subparsers) -> None:
    x = subparsers.add_parser(
        "export",
        help="write a store as the peers' per-sample files (SpecForge .ckpt, speculators hs_{i}.safetensors + Arrow)",
        description="The peers' current on-disk formats, so their trainers read a store: SpecForge's "
        "rows_A-B/data_{i}.ckpt (EAGLE-3 keys aux_hidden_state + hidden_state when the store holds final_hidden, "
        "else DFlash's hidden_states), or speculators' Arrow dataset with hidden_states/hs_{i}.safetensors (the "
        "store must hold the last layer, which speculators' trainer takes as the verifier's last hidden state). "
        "OUT must be new or empty. hsstore import of the result gives back the store bit-exact.",
    )
    x.add_argument("format", choices=["specforge", "speculators"])
    x.add_argument("url", help="store URL")
    x.add_argument("out", help="output folder (local; must not exist or be empty)")
    add_quiet_option(x)
    add_json_option(x)
    add_storage_option(x)
    x.set_defaults(func=run_export_cmd)


def add_regenerate(subparsers) -> None:
    r = subparsers.add_parser(
        "regenerate",
        help="have the target answer the prompts (thinking on) through an OpenAI-compatible server",
        description="Send each conversation's prompt to /v1/chat/completions (vLLM, SGLang, transformers serve) "
        "with thinking enabled and write JSONL rows with reasoning_content, ready for check/extract. Rows are "
        "written as they complete; re-running the same command resumes (ids already written are skipped).",
    )
    r.add_argument("--server", required=True, help="server URL, e.g. http://127.0.0.1:8000 (or .../v1)")
    r.add_argument("--input", required=True, nargs="+", help="JSONL/Parquet/Arrow files or directories")
    r.add_argument("--out", required=True, help="output JSONL file (appended to; resumed)")
    r.add_argument("--model", default=None, help="model name to request (default: the server's only model)")
    r.add_argument("--turns", choices=("last", "all"), default="last",
                   help="last: answer the last user message (later turns dropped); all: regenerate every "
                   "exchange in order (default last)")
    r.add_argument("--max-tokens", type=int, default=4096, help="per response, reasoning included (default 4096)")
    r.add_argument("--temperature", type=float, default=0.6)
    r.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    r.add_argument("--retries", type=int, default=8, help="per request, on connection errors, 429 and 5xx")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    r.add_argument("--extra-body", default=None,
                   help='JSON object merged into every request, e.g. \'{"skip_special_tokens": false, "top_p": 0.95}\'')
    r.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="environment variable holding the API key, if the server needs one")
    add_template_kwargs_flag(r, help="template arguments sent with every request, over {\"enable_thinking\": true} "
                             "(e.g. '{\"preserve_thinking\": true}'); recorded in each output row for check/extract")
    add_quiet_option(r)
    r.set_defaults(func=run_regenerate_cmd)


def add_demo(subparsers) -> None:
    d = subparsers.add_parser(
        "demo",
        help="the main job on an embedded default: a tiny trained Qwen3.5 target and conversations it answered, "
        "check, extract, info, verify, train a drafter, eval on held-out prompts (about 80 s on 2 CPU cores)",
    )
    d.add_argument("--out", default="hsstore-demo",
                   help="working folder (target, data, store, run); created if missing. A non-empty folder the demo "
                        "did not create is refused; on a re-run only what the demo created there is replaced")
    d.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N for extraction, training and eval (default: the GPU when there is one)")
    d.set_defaults(func=run_demo_cmd)


def _use_color(choice: str) -> bool:
    return choice == "always" or (choice == "auto" and sys.stdout.isatty())


def run_check(args: argparse.Namespace) -> int:
    import json

    from hsstore.estimate import format_text
    from .gate_report import gate_inputs
    from .target import load_tokenizer

    cfg = from_args(CheckSettings, args)
    est, out, tok = cfg.estimate, cfg.report, cfg.tokenize
    if est.estimate_only:
        if est.tokens is None or est.samples is None:
            raise ValueError("--estimate-only needs --tokens and --samples")
        figures = cost_estimate(cfg, int(est.samples), int(est.tokens))
        print(json.dumps({"estimate": figures}, indent=2) if out.json else format_text(figures),
              end="\n" if out.json else "")
        return 0
    if not cfg.input.model or not cfg.input.inputs:
        raise ValueError("check needs --model and --input (or --estimate-only with counts)")
    tokenizer = load_tokenizer(cfg.input.model)
    report = gate_inputs(cfg.input.inputs, tokenizer, thresholds=cfg.thresholds,
                         chat_template_kwargs=tok.chat_template_kwargs, max_length=tok.max_length,
                         truncate=tok.truncate, expand=tok.expand, report_url=out.report,
                         trust_engine_ids=tok.trust_engine_ids)
    kept = [s for s in report.samples if tok.truncate or "over_length" not in s.flags]
    figures = cost_estimate(cfg, len(kept), sum(s.tokens for s in kept))
    if out.json:
        print(json.dumps({**report.to_dict(), "estimate": figures}, indent=2, ensure_ascii=False))
    else:
        print(report.format_text(tokenizer, n_examples=out.examples, color=_use_color(out.color)), end="")
        print(format_text(figures), end="")
    if report.ok:
        return 0
    more = f" (+{len(report.failures) - 1} more in the report)" if len(report.failures) > 1 else ""
    print(f"hsstore check: gate failed: {report.failures[0]}{more}", file=sys.stderr)
    return 1


def run_show(args: argparse.Namespace) -> int:
    from hsstore import storage

    from .show import format_input_sample, format_store_sample, input_sample
    from .target import load_tokenizer

    cfg = from_args(ShowSettings, args, **shared_overrides(args))
    where, tok, color = cfg.input, cfg.tokenize, _use_color(cfg.output.color)
    fs, root = storage.resolve(where.input, where.storage_options)  # bad URL or options: their own error
    if storage.store_exists(fs, root, where.input):
        print(format_store_sample(where.input, where.n, where.storage_options, model=where.model, color=color,
                                  max_chars=cfg.output.max_chars))
        return 0
    if not where.model:
        raise ValueError(f"{recordable_url(where.input)}: not a store (no manifest.json there); to show a sample of "
                         "an input file, give --model")
    tokenizer = load_tokenizer(where.model)
    sample = input_sample(where.input, where.n, tokenizer, expand=tok.expand,
                          chat_template_kwargs=tok.chat_template_kwargs, trust_engine_ids=tok.trust_engine_ids)
    print(format_input_sample(sample, tokenizer, color=color, max_chars=cfg.output.max_chars))
    return 0


def run_extract_cmd(args: argparse.Namespace) -> int:
    from .job import GateRefused, run_extract

    cfg = extract_config(from_args(ExtractSettings, args, **shared_overrides(args)))
    try:
        result = run_extract(cfg)
    except GateRefused as e:
        print(e.text, end="")
        print(f"hsstore extract: refused: {e} (nothing was written; --force to extract anyway)", file=sys.stderr)
        return 1
    print(f"rank {result.rank}/{result.world_size}: wrote {result.samples} samples, {result.tokens:,} tokens in "
          f"{result.seconds:.1f}s ({result.tokens_per_s:,.0f} tokens/s"
          + (f"; {result.steady_tokens_per_s:,.0f} tokens/s after {result.warmup_s:.1f}s of compile warm-up"
             if result.compiled else "; not compiled")
          + f", {result.bytes_written / 1e9:.2f} GB); "
          f"{result.skipped_done} already in the store, {result.skipped_over_length} over --max-length skipped"
          + "".join(f", {n} rows skipped ({r})" for r, n in sorted(result.skipped_rows.items())) + "; "
          f"the forward waited {result.gpu_wait_s:.1f}s on the writer")
    return 0


def run_import_cmd(args: argparse.Namespace) -> int:
    from .peers import import_files, import_manifest, peer_files

    manifest = import_manifest(
        args.format, args.layers, peer_layers=args.peer_layers, hsstore_ids=args.hsstore_ids, path=args.path,
        final_hidden=not args.no_final_hidden, dtype=args.dtype, codec=args.codec, model=args.model,
        model_name=args.model_name, num_layers=args.num_layers, hidden_size=args.hidden_size,
        config_hash=args.config_hash, tokenizer_hash=args.tokenizer_hash, tokenizer_name=args.tokenizer_name,
        chat_template_hash=args.chat_template_hash)
    missing: list[str] = []
    files = peer_files(args.format, args.path, n_layers=len(manifest.layers), hidden=manifest.hidden_size,
                       id_prefix=args.id_prefix, source=args.source, hs_dir=args.hidden_states_dir, missing=missing,
                       pad_id=None if args.keep_padding else args.pad_token_id,
                       final_hidden=bool(manifest.features), num_rows=args.num_rows)
    r = import_files(files, args.out, manifest, storage_options=parse_storage_options(args.storage_option),
                     shard_bytes=mib_bytes(args.shard_mb), missing=missing,
                     progress=not args.quiet)
    print(f"import {args.format} {args.path} -> {recordable_url(args.out)}: {r.samples} samples, {r.tokens:,} tokens written "
          f"({r.bytes_written / 1e9:.2f} GB); {r.already} already in the store"
          + (f"; {r.missing} rows without a hidden-state file skipped ({_some(missing)})" if r.missing else "")
          + (f"; batch padding trimmed from {r.padded_rows} rows ({r.pad_tokens:,} tokens)" if r.padded_rows else "")
          + (f"; final_hidden kept" if manifest.features else ""))
    if r.pad_ambiguous:
        print(f"  {len(r.pad_ambiguous)} rows whose padding cannot be told from real tokens (trimmed, flagged "
              f"padding_ambiguous): {_some(r.pad_ambiguous)}")
    return 0


def _some(ids: list[str], n: int = 10) -> str:
    return ", ".join(ids[:n]) + (f", ... ({len(ids) - n} more)" if len(ids) > n else "")


def run_export_cmd(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from .export import export_store

    r = export_store(args.format, args.url, args.out, storage_options=parse_storage_options(args.storage_option),
                     progress=not args.quiet)
    if args.json:
        print(json.dumps({"format": args.format, "url": recordable_url(args.url), "out": recordable_url(args.out), **dataclasses.asdict(r)},
                         indent=2))
        return 0
    print(f"export {args.format} ({r.layout}) {recordable_url(args.url)} -> {recordable_url(args.out)}: {r.samples} samples, {r.tokens:,} tokens "
          f"({r.bytes_written / 1e9:.2f} GB)")
    for note in r.notes:
        print(f"  {note}")
    return 0


def run_regenerate_cmd(args: argparse.Namespace) -> int:
    import json
    import os

    from .regenerate import RegenConfig, run_regenerate

    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    cfg = RegenConfig(
        inputs=args.input, out=args.out, server=args.server, model=args.model, max_tokens=args.max_tokens,
        temperature=args.temperature, turns=args.turns, concurrency=args.concurrency, retries=args.retries,
        timeout_s=args.timeout, extra_body=extra, api_key=os.environ.get(args.api_key_env) or None,
        progress=not args.quiet, chat_template_kwargs=template_kwargs(args.chat_template_kwargs))
    res = run_regenerate(cfg)
    print(f"regenerated {res.generated} of {res.prompts} prompts ({res.done_before} already in {recordable_url(args.out)}) in "
          f"{res.seconds:.1f}s: {res.completion_tokens:,} tokens ({res.tokens_per_s:,.0f} tokens/s), "
          f"{res.truncated} cut by --max-tokens")
    return 0


def run_demo_cmd(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.out, device=args.device)
