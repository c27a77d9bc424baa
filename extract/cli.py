"""The extraction family's commands: ``check``, ``show``, ``audit``, ``extract``, ``import``, ``export``,
``regenerate`` and ``demo``, mounted on the ``hsstore`` command line through the ``hsstore.commands`` entry point.

Every command's flags come from its schema in ``settings.py`` (one argument group per section; the flags all
families share, ``--storage-option``, ``--quiet``, ``--shard-mb`` and ``--config``, placed in those groups by the
``COMMANDS`` list below, which ``hsstore.app.commands`` registers); each handler turns the parsed flags into its
settings object and passes that on.
transformers is imported only inside the handlers: the ``hsstore`` CLI imports this module at startup
and must stay fast for commands that never touch a tokenizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from dataclasses import fields

from hsstore.app.commands import (Command, add_commands, command_settings, config, json_flag, quiet, shard_mb,
                                  storage_flags)
from hsstore.redaction import recordable_url
from hsstore.app.schema import from_args
from hsstore.app.schema import replace as schema_replace
from hsstore.terminal import escape

from .gate import GateThresholds
from .settings import (AuditSettings, CheckSettings, DemoSettings, ExportSettings, ExtractSettings, ImportSettings,
                       RegenerateSettings, ShowSettings, regenerate_settings)

logger = logging.getLogger(__name__)


def thresholds_from_args(args: argparse.Namespace) -> GateThresholds:
    """The gate thresholds alone, for callers that parsed a command with them but need nothing else."""
    return GateThresholds(**{f.name: getattr(args, f.name) for f in fields(GateThresholds)})


class EstimateUnavailable(ValueError):
    """The estimate cannot choose taps for the target (too shallow for DFlash's default count): ``check`` prints
    this one line and leaves the estimate out, the gate's verdict standing; ``--estimate-only`` fails with it."""


def cost_estimate(settings: CheckSettings, samples: int, tokens: int) -> dict:
    """``hsstore.ops.estimate`` for ``check``: taps and hidden size from the flags, else the model's config.
    Raises :class:`EstimateUnavailable`, saying what it needs, when the config's depth gives no default taps."""
    import json
    from pathlib import Path

    from hsstore.ops.estimate import REFERENCE_TOKENS_PER_S, estimate
    from hsstore.format.taps import default_taps
    from hsstore.app.target import text_config

    est, model = settings.estimate, settings.input.model
    hidden, layers = est.hidden, est.layers
    if model and (hidden is None or layers is None):
        target = text_config(json.loads((Path(model) / "config.json").read_text()))
        hidden = hidden or target["hidden_size"]
        try:
            layers = layers or default_taps(target["num_hidden_layers"])
        except ValueError as e:  # "a 4-layer target has too few layers for 5 DFlash taps (...); give the ..."
            raise EstimateUnavailable(f"{str(e).split(';')[0]}; give --layers L,L to estimate") from None
    if hidden is None or layers is None:
        raise ValueError("the estimate needs --hidden and --layers (or --model, whose config has them)")
    return estimate(samples=samples, tokens=tokens, layers=layers, hidden=hidden, final_hidden=est.final_hidden,
                    tokens_per_s=est.tokens_per_s or REFERENCE_TOKENS_PER_S)


def taps_json(taps) -> dict:
    """A tap plan (``hsstore.format.serving.TapPlan``) as ``check --json`` reports it."""
    from hsstore.format.serving import TAP_TENSOR

    sv = taps.serving
    return {"layers": taps.layers, "final_hidden": taps.final_hidden, "tap_tensor": TAP_TENSOR,
            "serves": sv.served, "not_served": {n: sv.reasons[n] for n in sv.unserved},
            "warnings": sv.engine_warnings()}


def register(subparsers) -> None:
    """Add the family's subcommands; each sets ``func=handler(args) -> int``."""
    add_commands(subparsers, COMMANDS)


def _use_color(choice: str) -> bool:
    return choice == "always" or (choice == "auto" and sys.stdout.isatty())


def run_check(args: argparse.Namespace) -> int:
    import json

    from hsstore.ops.estimate import format_text
    from .gate_report import gate_inputs
    from .target import load_tokenizer, planned_taps

    settings = from_args(CheckSettings, args)
    est, out, tok = settings.estimate, settings.report, settings.tokenize
    taps = None
    if settings.input.model and (est.layers or est.serve):  # given taps checked before any tokenizing
        taps = planned_taps(settings.input.model, est.layers, est.serve, est.final_hidden)
    elif settings.input.model:  # DFlash's default taps, when the target is deep enough for them
        try:
            taps = planned_taps(settings.input.model, None, None, est.final_hidden)
        except ValueError:
            taps = None  # the estimate says what it needs (EstimateUnavailable)
    if taps is not None:
        settings = schema_replace(settings, layers=taps.layers, final_hidden=taps.final_hidden)
        est = settings.estimate
    if est.estimate_only:
        if est.tokens is None or est.samples is None:
            raise ValueError("--estimate-only needs --tokens and --samples")
        figures = cost_estimate(settings, int(est.samples), int(est.tokens))
        print(json.dumps({"estimate": figures}, indent=2) if out.json else format_text(figures),
              end="\n" if out.json else "")
        return 0
    if not settings.input.model or not settings.input.input:
        raise ValueError("check needs --model and --input (or --estimate-only with counts)")
    tokenizer = load_tokenizer(settings.input.model)
    report = gate_inputs(settings.input.input, tokenizer, thresholds=settings.thresholds,
                         chat_template_kwargs=tok.chat_template_kwargs, max_length=tok.max_length,
                         truncate=tok.truncate, expand=tok.expand, report_url=out.report,
                         trust_engine_ids=tok.trust_engine_ids, learn_not_generated=tok.learn_not_generated)
    kept = [s for s in report.samples if tok.truncate or "over_length" not in s.flags]
    try:  # optional: what it cannot do is one line, never the gate's verdict
        figures, omitted = cost_estimate(settings, len(kept), sum(s.tokens for s in kept)), None
    except EstimateUnavailable as e:
        figures, omitted = None, str(e)
    if out.json:
        print(json.dumps({**report.to_dict(), "estimate": figures,
                          **({"estimate_omitted": omitted} if omitted else {}),
                          **({"taps": taps_json(taps)} if taps else {})}, indent=2, ensure_ascii=False))
    else:
        print(report.format_text(tokenizer, n_examples=out.examples, color=_use_color(out.color)), end="")
        print(format_text(figures) if figures else f"estimate omitted: {omitted}\n", end="")
        if taps:
            print("\n".join(taps.lines()))
    if report.ok:
        return 0
    more = f" (+{len(report.failures) - 1} more in the report)" if len(report.failures) > 1 else ""
    print(f"hsstore check: gate failed: {report.failures[0]}{more}", file=sys.stderr)
    return 1


def run_show(args: argparse.Namespace) -> int:
    from hsstore.io import storage
    from hsstore.io.backends import backend_for

    from .show import format_input_sample, format_store_sample, input_sample
    from .target import load_tokenizer

    settings = command_settings(ShowSettings, args)
    where, tok, color = settings.input, settings.tokenize, _use_color(settings.output.color)
    options = storage.interactive_options(where.input, where.storage_options)  # a person waits for it
    fs, root = storage.resolve(where.input, options)  # bad URL or options: their own error
    if storage.store_exists(fs, root, where.input):
        print(format_store_sample(where.input, where.n, options, model=where.model, color=color,
                                  max_chars=settings.output.max_chars))
        return 0
    if backend_for(fs).local_paths and not os.path.exists(root):
        raise ValueError(f"{recordable_url(where.input)} does not exist (neither a store nor an input file)")
    if not where.model:
        raise ValueError(f"{recordable_url(where.input)}: not a store (no manifest.json there); to show a sample of "
                         "an input file, give --model")
    tokenizer = load_tokenizer(where.model)
    sample = input_sample(where.input, where.n, tokenizer, expand=tok.expand,
                          chat_template_kwargs=tok.chat_template_kwargs, trust_engine_ids=tok.trust_engine_ids,
                          learn_not_generated=tok.learn_not_generated)
    print(format_input_sample(sample, tokenizer, color=color, max_chars=settings.output.max_chars))
    return 0


def run_audit_cmd(args: argparse.Namespace) -> int:
    import json

    from .audit import audit

    settings = command_settings(AuditSettings, args)
    a = settings.input
    report = audit(a.url, a.model, samples=a.samples, device=a.device, storage_options=a.storage_options,
                   progress=settings.run.progress, cpu_threads=a.cpu_threads)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, allow_nan=False))
    else:
        print(report.format_text(), end="")
    if not report.ok:
        print(f"hsstore audit: {escape(report.failures()[0])}", file=sys.stderr)
    return 0 if report.ok else 1


def run_extract_cmd(args: argparse.Namespace) -> int:
    from .job import GateRefused, run_extract

    from .target import planned_taps

    settings = command_settings(ExtractSettings, args)
    cap = settings.capture
    taps = planned_taps(settings.input.model, cap.layers, cap.serve, cap.final_hidden)
    if taps is not None and settings.run.progress:  # who the store will serve, before the gate and the GPU hours
        print(f"hsstore extract: {taps.lines()[0]}", file=sys.stderr)
    try:
        result = run_extract(settings, taps=taps)
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
    from .peers import get
    from .peers.importing import import_files, import_manifest, peer_files

    settings = command_settings(ImportSettings, args)
    src, store = settings.files, settings.store
    peer = get(src.format, "import")
    manifest = import_manifest(peer, path=src.path, final_hidden=src.final_hidden, codec=store.codec,
                               **dataclasses.asdict(settings.identity))
    files_of_target = None
    if settings.identity.model:  # what train and show use instead of the target, read before any sample is written
        from .target import DTYPES, model_dir_assets

        files_of_target = model_dir_assets(settings.identity.model, DTYPES[settings.identity.dtype])
    missing: list[str] = []
    files = peer_files(peer, src.path, n_layers=len(manifest.layers), hidden=manifest.hidden_size,
                       id_prefix=src.id_prefix, source=src.source, hs_dir=src.hidden_states_dir, missing=missing,
                       pad_id=None if src.keep_padding else src.pad_token_id,
                       final_hidden=bool(manifest.features), num_rows=src.num_rows)
    r = import_files(files, store.out, manifest, storage_options=store.storage_options,
                     shard_bytes=store.shard_bytes, missing=missing, progress=settings.run.progress,
                     keep_unhealthy=src.keep_unhealthy)
    assets_note = import_assets(store.out, store.storage_options, files_of_target)
    print(f"import {src.format} {src.path} -> {recordable_url(store.out)}: {r.samples} samples, {r.tokens:,} tokens "
          f"written ({r.bytes_written / 1e9:.2f} GB); {r.already} already in the store"
          + (f"; {r.missing} rows without a hidden-state file skipped ({_some(missing)})" if r.missing else "")
          + (f"; batch padding trimmed from {r.padded_rows} rows ({r.pad_tokens:,} tokens)" if r.padded_rows else "")
          + ("; final_hidden kept" if manifest.features else ""))
    if r.pad_ambiguous:
        print(f"  {len(r.pad_ambiguous)} rows whose padding cannot be told from real tokens (trimmed, flagged "
              f"padding_ambiguous): {_some(r.pad_ambiguous)}")
    if assets_note:
        print(f"  {assets_note}")
    if r.unhealthy and src.keep_unhealthy:
        print(f"  {len(r.unhealthy)} samples with an all-zero or non-finite feature, flagged feature_zero / "
              f"feature_nonfinite: {_some([str(u) for u in r.unhealthy], 3)}")
    elif r.unhealthy:
        raise ValueError(f"{len(r.unhealthy)} of {len(files)} samples have an all-zero or non-finite feature and "
                         f"were not imported (first: {r.unhealthy[0]}; a capture that returned zeros?); the "
                         f"{r.samples} healthy ones are in the store; --keep-unhealthy imports the rest, flagged")
    return 0


def import_assets(url: str, options: dict, files: dict[str, bytes] | None) -> str:
    """Write the target's files (``--model``) as the store's assets unless it has them; what to tell the user."""
    from hsstore.io import storage
    from hsstore.format import assets

    fs, root = storage.resolve(url, options)
    if not storage.store_exists(fs, root, url):
        return ""
    if assets.has_assets(fs, root):
        return "assets: the store has them (config, tokenizer, embedding, lm_head)"
    if files is None:
        return ("note: the store has no assets (the target's config, tokenizer, embedding and lm_head), which "
                "`hsstore train` and `hsstore show` need: run this import again with --model DIR (the target's "
                "folder), which writes them and nothing else")
    assets.write_assets(fs, root, files, url=url)
    return "assets: the target's config, tokenizer, embedding and lm_head written from --model"


def _some(ids: list[str], n: int = 10) -> str:
    return ", ".join(map(escape, ids[:n])) + (f", ... ({len(ids) - n} more)" if len(ids) > n else "")


def run_export_cmd(args: argparse.Namespace) -> int:
    import json

    from .peers import get

    settings = command_settings(ExportSettings, args)
    x = settings.export
    r = get(x.format, "export").export(x.url, x.out, storage_options=x.storage_options,
                                       progress=settings.run.progress, layout=x.layout, layers=x.layers)
    where = f"{recordable_url(x.url)} -> {recordable_url(x.out)}"
    if args.json:
        print(json.dumps({"format": x.format, "url": recordable_url(x.url), "out": recordable_url(x.out),
                          **dataclasses.asdict(r)}, indent=2))
        return 0
    print(f"export {x.format} ({r.layout}) {where}: {r.samples} samples, {r.tokens:,} tokens "
          f"({r.bytes_written / 1e9:.2f} GB written)" + (f", {r.skipped} left out" if r.skipped else "")
          + (f"; {r.already} already there (resumed)" if r.already else ""))
    for note in r.notes:
        print(f"  {note}")
    return 0


def run_regenerate_cmd(args: argparse.Namespace) -> int:
    from .regenerate import run_regenerate, skipped_text

    res = run_regenerate(regenerate_settings(args))
    print(f"regenerated {res.generated} of {res.prompts} prompts ({res.done_before} already in "
          f"{recordable_url(args.out)}) in {res.seconds:.1f}s: {res.completion_tokens:,} tokens "
          f"({res.tokens_per_s:,.0f} tokens/s), {res.truncated} cut by --max-tokens")
    if res.skipped:
        print(f"skipped {skipped_text(res.skipped)} that cannot be prompted (the log names the first of each)")
    return 0


def run_demo_cmd(args: argparse.Namespace) -> int:
    from .demo import run_demo

    demo = from_args(DemoSettings, args).demo
    return run_demo(demo.out, device=demo.device, cpu_threads=demo.cpu_threads, quiet=args.quiet)


COMMANDS = (
    Command("check", CheckSettings, run_check, help="quality gate on training data, before any GPU work",
            description="Tokenize the input with the target's chat template and check per-sample loss-mask "
            "distributions. Exit 0 when the gate passes, 1 when it fails, 2 on errors.",
            shared=(quiet("report"),)),
    Command("show", ShowSettings, run_show, help="print one decoded sample with its loss mask marked",
            description="Decode sample N (0-based position, or a sample id) of an input with loss-masked "
            "tokens highlighted (color on a terminal, ⟦ ⟧ otherwise).",
            shared=(quiet("output"), storage_flags("input"))),
    Command("audit", AuditSettings, run_audit_cmd,
            help="recompute a few stored samples with the target and compare every feature",
            description="Re-run the target's eager reference forward on N stored samples (chosen from their "
            "input_ids, the same in every copy of the store) and compare each stored feature with the recomputed one "
            "against the bound of the store's dtype and encoding at the feature's depth (rounding grows with the "
            "layers a value went through); it must also be closer to its own layer than to those beside it. Exit 0 "
            "when every feature holds it, 1 naming the feature and what it looks like (zeros, a different layer, "
            "shifted tokens, scaled values, a different target, different tokens) when one does not, 2 on errors.",
            shared=(storage_flags("input"), quiet("run"), json_flag("run", "the report"))),
    Command("extract", ExtractSettings, run_extract_cmd,
            help="run the target over the input and write the tapped hidden states to a store",
            description="Tokenize with the target's chat template, run the quality gate (refusing bad data before "
            "the model is loaded), then extract. Under torchrun each rank writes its own shards; re-running "
            "the same command resumes (committed samples are skipped).",
            shared=(shard_mb("store"), storage_flags("store"), quiet("run"), config())),
    Command("import", ImportSettings, run_import_cmd,
            help="convert the peers' per-sample files (SpecForge .ckpt, speculators hs_{i}.safetensors) into a "
                 "store",
            description="Read a SpecForge folder of torch.save files (torch.load with weights_only=True only) or a "
            "speculators Arrow dataset with hidden_states/hs_{i}.safetensors, and write a store. The peers' files "
            "do not say which model, tokenizer and layers made them: give --layers and either --model DIR (a local "
            "model folder, hashed like extract does; no weights are loaded) or the identity flags. Re-running "
            "resumes (committed sample ids are skipped).",
            shared=(shard_mb("store"), storage_flags("store"), quiet("run"))),
    Command("export", ExportSettings, run_export_cmd,
            help="write a store as the peers' per-sample files (SpecForge .ckpt, speculators hs_{i}.safetensors + "
                 "Arrow)",
            description="The peers' current on-disk formats, so their trainers read a store: SpecForge's "
            "rows_A-B/data_{i}.ckpt (--layout dflash: hidden_states with every tap, leaving out the samples without "
            "two consecutive loss tokens, which its DFlash reader refuses; --layout eagle3: aux_hidden_state with "
            "three taps + hidden_state, from a store with final_hidden), or speculators' Arrow dataset with "
            "hidden_states/hs_{i}.safetensors (the store must hold the last layer, which speculators' trainer takes "
            "as the verifier's last hidden state). OUT must be new or empty. hsstore import of the result gives back "
            "the exported samples and layers bit-exact.",
            shared=(quiet("run"), json_flag("run"), storage_flags("export"))),
    Command("regenerate", RegenerateSettings, run_regenerate_cmd,
            help="have the target answer the prompts (thinking on) through an OpenAI-compatible server",
            description="Send each conversation's prompt to /v1/chat/completions (vLLM, SGLang, transformers serve) "
            "with thinking enabled and write JSONL rows with reasoning_content, ready for check/extract. Rows are "
            "written as they complete; re-running the same command resumes (ids already written are skipped).",
            shared=(quiet("run"),)),
    Command("demo", DemoSettings, run_demo_cmd, defaults_in_help=True,
            help="the main job on an embedded default: a tiny trained Qwen3.5 target and conversations it "
                 "answered, check, extract, info, verify, train a drafter, eval on held-out prompts (about 2 minutes "
                 "on 2 CPU cores)",
            shared=(quiet("demo"),)),
)
