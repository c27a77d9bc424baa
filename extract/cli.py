"""``hsstore check`` and ``hsstore show``: the quality gate and the sample reader, on input files.

transformers is imported only inside the handlers: the ``hsstore`` CLI imports this module at startup
and must stay fast for commands that never touch a tokenizer.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from .gate import GateThresholds
from hsstore.cli import add_json_option, add_quiet_option, add_storage_option
from hsstore.config import add_config_option
from hsstore.redaction import recordable_url
from hsstore.storage import parse_storage_options

logger = logging.getLogger(__name__)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_threshold_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`GateThresholds` field, defaulting to the dataclass default."""
    group = parser.add_argument_group("gate thresholds")
    for f in fields(GateThresholds):
        group.add_argument(
            _flag(f.name),
            dest=f.name,
            type=type(f.default),
            default=f.default,
            metavar="N" if isinstance(f.default, int) else "X",
            help=f"{f.metadata.get('help', '')} (default {f.default})",
        )


def add_template_kwargs_flag(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    parser.add_argument(
        "--chat-template-kwargs", default=None, metavar="JSON",
        help=help or "arguments for the chat template, as the engine got them, e.g. '{\"enable_thinking\": false}' "
                     "or '{\"preserve_thinking\": true}'; a row's own chat_template_kwargs object overrides them")


def add_trust_engine_ids_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust-engine-ids", action="store_true",
        help="use the token ids a row recorded from the serving engine (prompt_token_ids + token_ids) even where "
             "the prompt ids differ from this tokenizer's render of the chat template (default: such rows are "
             "skipped as engine_prompt_mismatch)")


def template_kwargs_from_args(args: argparse.Namespace) -> dict:
    from .tokenize import template_kwargs_of

    return template_kwargs_of(args.chat_template_kwargs, "--chat-template-kwargs")


def thresholds_from_args(args: argparse.Namespace) -> GateThresholds:
    return GateThresholds(**{f.name: getattr(args, f.name) for f in fields(GateThresholds)})


def add_estimate_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cost estimate", "the store's size, extraction GPU-hours and bytes read per "
                                  "training epoch for the checked samples (over-length ones left out unless "
                                  "--truncate), taps and hidden size from --model")
    g.add_argument("--layers", default=None, metavar="L,L", help="taps to estimate for (default: DFlash spacing)")
    g.add_argument("--final-hidden", action="store_true", help="extract would add the final norm's output")
    g.add_argument("--tokens-per-s", type=float, default=None, metavar="X",
                   help="extraction throughput per GPU (default: this project's H200 figure for a 27B-scale "
                        "Qwen3.5 target, 11,049; other targets differ)")
    g.add_argument("--estimate-only", action="store_true",
                   help="no input: the estimate for --tokens, --samples and --hidden (or --model) and --layers")
    g.add_argument("--tokens", type=float, default=None, help="with --estimate-only: tokens, e.g. 1.87e9")
    g.add_argument("--samples", type=float, default=None, help="with --estimate-only: samples, e.g. 914000")
    g.add_argument("--hidden", type=int, default=None, help="with --estimate-only: the target's hidden size")


def cost_estimate(args: argparse.Namespace, samples: int, tokens: int) -> dict:
    """``hsstore.estimate`` for ``check``: taps and hidden size from the flags, else the model's config."""
    import json
    from pathlib import Path

    from hsstore.estimate import H200_27B_TOKENS_PER_S, estimate
    from hsstore.taps import default_taps, text_config

    hidden, layers = args.hidden, [int(x) for x in args.layers.split(",")] if args.layers else None
    if args.model and (hidden is None or layers is None):
        cfg = text_config(json.loads((Path(args.model) / "config.json").read_text()))
        hidden = hidden or cfg["hidden_size"]
        layers = layers or default_taps(cfg["num_hidden_layers"])
    if hidden is None or layers is None:
        raise ValueError("the estimate needs --hidden and --layers (or --model, whose config has them)")
    return estimate(samples=samples, tokens=tokens, layers=layers, hidden=hidden, final_hidden=args.final_hidden,
                    tokens_per_s=args.tokens_per_s or H200_27B_TOKENS_PER_S)


def register(subparsers) -> None:
    """Add the ``check`` and ``show`` subcommands; each sets ``func=handler(args) -> int``."""
    p = subparsers.add_parser(
        "check",
        help="quality gate on training data, before any GPU work",
        description="Tokenize the input with the target's chat template and check per-sample loss-mask "
        "distributions. Exit 0 when the gate passes, 1 when it fails, 2 on errors.",
    )
    p.add_argument("--model", help="target model directory (its tokenizer and chat template); required")
    p.add_argument("--input", nargs="+", help="JSONL/Parquet/Arrow files or directories; required")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--max-length", type=int, default=None, help="flag samples longer than this many tokens")
    p.add_argument("--truncate", action="store_true", help="cut over-length samples instead (as extract --truncate)")
    p.add_argument("--no-expand", action="store_true", help="only the final exchange of multi-turn conversations")
    p.add_argument("--report", default=None, metavar="FILE",
                   help="also write the verdict with the input's and tokenizer's hashes and these settings to FILE "
                        "(local path or URL), for extract --gate-report: the gate then runs once, not on every rank")
    p.add_argument("--examples", type=int, default=3, help="flagged samples to decode in the text report")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    add_template_kwargs_flag(p)
    add_trust_engine_ids_flag(p)
    add_threshold_flags(p)
    add_estimate_flags(p)
    p.set_defaults(func=run_check)

    s = subparsers.add_parser(
        "show",
        help="print one decoded sample with its loss mask marked",
        description="Decode sample N (0-based position, or a sample id) of an input with loss-masked "
        "tokens highlighted (color on a terminal, ⟦ ⟧ otherwise).",
    )
    s.add_argument("input", help="a store URL, or a JSONL/Parquet/Arrow file or directory")
    s.add_argument("n", help="sample position (0-based, after multi-turn expansion) or sample id")
    s.add_argument("--model", default=None,
                   help="target model directory (its tokenizer and chat template); for a store, its own "
                   "tokenizer is used unless this is given")
    s.add_argument("--no-expand", action="store_true", help="only the final exchange of multi-turn conversations")
    s.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    s.add_argument("--max-chars", type=int, default=None, help="show only the last N characters")
    add_template_kwargs_flag(s)
    add_trust_engine_ids_flag(s)
    add_storage_option(s)
    s.set_defaults(func=run_show)

    e = subparsers.add_parser(
        "extract",
        help="run the target over the input and write the tapped hidden states to a store",
        description="Tokenize with the target's chat template, run the quality gate (refusing bad data before "
        "the model is loaded), then extract. Under torchrun each rank writes its own shards; re-running "
        "the same command resumes (committed samples are skipped).",
    )
    e.add_argument("--model", required=True, help="target model directory")
    e.add_argument("--input", required=True, nargs="+", help="JSONL/Parquet/Arrow files or directories")
    e.add_argument("--out", required=True, help="store URL (local path or s3://bucket/prefix)")
    e.add_argument("--layers", default=None, help="tapped layer ids, e.g. 1,16,31,46,61 (default: DFlash spacing)")
    e.add_argument("--device", default=None,
                   help="cpu, cuda (this process's GPU: cuda:LOCAL_RANK) or cuda:N (default: the GPU when there is one)")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    e.add_argument("--max-length", type=int, default=None, help="skip (and count) longer samples")
    e.add_argument("--truncate", action="store_true", help="cut over-length samples instead of skipping them")
    e.add_argument("--token-budget", type=int, default=None, help="padded tokens per forward batch")
    e.add_argument("--layout", default="zarr", choices=["zarr", "wds"],
                   help="shard layout: zarr (chunked arrays, codecs) or wds (WebDataset tars of .npy members)")
    e.add_argument("--codec", default="none", help="chunk codec: none, zstd[:level], blosc-zstd[:level], lz4")
    e.add_argument("--encoding", default="raw", choices=["raw", "fp8"],
                   help="raw: features bit-exact in --dtype; fp8: e4m3 + a scale per token per layer, quantised "
                        "on the device (half the bytes)")
    e.add_argument("--final-hidden", action="store_true",
                   help="also store the final norm's output (what the lm_head reads; EAGLE-3's training target) as "
                        "the feature final_hidden, captured in the same forward (which then runs to the norm)")
    e.add_argument("--no-expand", action="store_true", help="only the final exchange of multi-turn conversations")
    e.add_argument("--writer", choices=["auto", "thread", "process"], default="auto",
                   help="where the store writer runs: a child process fed through shared memory (auto: on CUDA), "
                        "or threads of this process")
    e.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the target's norms, MLPs, attention blocks and recurrent mixers (torch.compile, per "
                        "layer kind; features equal to the eager forward's within bf16 rounding, 1.28x faster at 27B "
                        "scale on an H200; the first batches pay ~40 s of compiling). Default: on CUDA when the "
                        "expected saving exceeds that warm-up (the log says which and why)")
    e.add_argument("--shard-mb", type=float, default=1024, help="feature bytes per shard (MiB; default 1024)")
    e.add_argument("--force", action="store_true", help="extract even when the quality gate fails")
    e.add_argument("--gate-report", default=None, metavar="FILE",
                   help="the verdict of `hsstore check --report FILE` on this input: reused when the input files, "
                        "tokenizer and settings match (refused naming what differs), so each rank tokenizes only "
                        "its own rows; without it every rank runs the gate over the whole input")
    add_quiet_option(e)
    add_template_kwargs_flag(e)
    add_trust_engine_ids_flag(e)
    add_threshold_flags(e)
    add_storage_option(e)
    add_config_option(e)
    e.set_defaults(func=run_extract_cmd)

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
    m.add_argument("--shard-mb", type=float, default=1024, help="feature bytes per shard (MiB; default 1024)")
    add_quiet_option(m)
    add_storage_option(m)
    m.set_defaults(func=run_import_cmd)

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

    if args.estimate_only:
        if args.tokens is None or args.samples is None:
            raise ValueError("--estimate-only needs --tokens and --samples")
        est = cost_estimate(args, int(args.samples), int(args.tokens))
        print(json.dumps({"estimate": est}, indent=2) if args.json else format_text(est), end="\n" if args.json
              else "")
        return 0
    if not args.model or not args.input:
        raise ValueError("check needs --model and --input (or --estimate-only with counts)")
    kwargs = template_kwargs_from_args(args)
    tokenizer = load_tokenizer(args.model)
    report = gate_inputs(args.input, tokenizer, thresholds=thresholds_from_args(args), chat_template_kwargs=kwargs,
                         max_length=args.max_length, truncate=args.truncate, expand=not args.no_expand,
                         report_url=args.report, trust_engine_ids=args.trust_engine_ids)
    kept = [s for s in report.samples if args.truncate or "over_length" not in s.flags]
    est = cost_estimate(args, len(kept), sum(s.tokens for s in kept))
    if args.json:
        print(json.dumps({**report.to_dict(), "estimate": est}, indent=2, ensure_ascii=False))
    else:
        print(report.format_text(tokenizer, n_examples=args.examples, color=_use_color(args.color)), end="")
        print(format_text(est), end="")
    if report.ok:
        return 0
    more = f" (+{len(report.failures) - 1} more in the report)" if len(report.failures) > 1 else ""
    print(f"hsstore check: gate failed: {report.failures[0]}{more}", file=sys.stderr)
    return 1


def run_show(args: argparse.Namespace) -> int:
    from hsstore import storage

    from .show import format_input_sample, format_store_sample, input_sample
    from .target import load_tokenizer

    options = parse_storage_options(args.storage_option)
    fs, root = storage.resolve(args.input, options)  # bad URL or options: their own error
    color = _use_color(args.color)
    if storage.store_exists(fs, root, args.input):
        print(format_store_sample(args.input, args.n, options, model=args.model, color=color,
                                  max_chars=args.max_chars))
        return 0
    if not args.model:
        raise ValueError(f"{recordable_url(args.input)}: not a store (no manifest.json there); to show a sample of an input "
                         "file, give --model")
    tokenizer = load_tokenizer(args.model)
    sample = input_sample(args.input, args.n, tokenizer, expand=not args.no_expand,
                          chat_template_kwargs=template_kwargs_from_args(args), trust_engine_ids=args.trust_engine_ids)
    print(format_input_sample(sample, tokenizer, color=color, max_chars=args.max_chars))
    return 0


def run_extract_cmd(args: argparse.Namespace) -> int:
    from .job import ExtractConfig, GateRefused, run_extract

    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    cfg = ExtractConfig(
        model=args.model, inputs=args.input, out=args.out, layers=layers, device=args.device, dtype=args.dtype,
        max_length=args.max_length, truncate=args.truncate, token_budget=args.token_budget, codec=args.codec,
        layout=args.layout, encoding=args.encoding, final_hidden=args.final_hidden,
        expand=not args.no_expand, force=args.force, thresholds=thresholds_from_args(args),
        storage_options=parse_storage_options(args.storage_option), progress=not args.quiet,
        shard_bytes=max(1, int(args.shard_mb * (1 << 20))), writer=args.writer, compile=args.compile,
        chat_template_kwargs=template_kwargs_from_args(args), gate_report=args.gate_report,
        trust_engine_ids=args.trust_engine_ids)
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
                     shard_bytes=max(1, int(args.shard_mb * (1 << 20))), missing=missing,
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
        progress=not args.quiet, chat_template_kwargs=template_kwargs_from_args(args))
    res = run_regenerate(cfg)
    print(f"regenerated {res.generated} of {res.prompts} prompts ({res.done_before} already in {recordable_url(args.out)}) in "
          f"{res.seconds:.1f}s: {res.completion_tokens:,} tokens ({res.tokens_per_s:,.0f} tokens/s), "
          f"{res.truncated} cut by --max-tokens")
    return 0


def run_demo_cmd(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.out, device=args.device)
