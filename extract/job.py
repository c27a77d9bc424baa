"""``hsstore extract``: input -> quality gate -> target forward -> store, resumable and rank-parallel.

Order of work is chosen so that the expensive thing happens last: the quality gate over the whole input
(refuse bad data before the model is even loaded), tokenize this rank's rows, skip what the store already
holds (resume), and only then load the target. The gate's verdict comes from ``hsstore check --report``
(``--gate-report``: each rank tokenizes only its own rows) or is computed here (one process: in the same
pass; under torchrun: every rank gates the whole input, then tokenizes its rows).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hsstore.store.process_writer import ProcessWriter
from hsstore.store.writer import StoreWriter
from hsstore.format import assets, sessions
from hsstore.app.devices import defaults_for, describe, resolve_device
from hsstore.distributed import local_rank, rank_and_world
from hsstore.store.reader import committed_ids, refuse_lookalikes
from hsstore.io import destination
from hsstore.terminal import shown
from hsstore.app import schema
from hsstore.layouts import base as layout
from hsstore.format.serving import TapPlan
from hsstore.app.target import decoder_layers, load_target, to_device
from hsstore.app.threads import threads_for_model

from .compile_check import EXTRA_KEY, CompileCheck, check_first_batch
from .forward import extract_batches, token_budget_batches
from .gate import GateReport, check
from .gate_report import GateVerdict, gate_inputs, reuse_gate_report, run_identity
from .readers import RowShard
from .sample import TokenizedSample
from .settings import ExtractSettings  # callers import it from here too
from .speed import WARMUP_S, choose_compile, compile_forward, compile_seconds, note_compile_cache
from .target import DTYPES, asset_files, build_manifest, load_tokenizer, model_name, planned_taps
from .tokenize import load_samples
from .tokenize_stats import TokenizeStats

log = logging.getLogger(__name__)


class GateRefused(RuntimeError):
    """The quality gate failed and the caller did not force extraction."""

    def __init__(self, report: GateVerdict, text: str):
        super().__init__("quality gate failed: " + "; ".join(report.failures))
        self.report, self.text = report, text


@dataclass
class ExtractResult:
    rank: int
    world_size: int
    samples: int = 0
    tokens: int = 0
    skipped_done: int = 0
    skipped_over_length: int = 0
    skipped_rows: dict[str, int] = field(default_factory=dict)  # reason -> input rows not tokenized faithfully
    seconds: float = 0.0
    bytes_written: int = 0
    gpu_wait_s: float = 0.0  # the forward waited this long for the writer (storage slower than the GPU)
    rows: int = 0  # input rows this rank read (its share: row i belongs to rank i % world size)
    gate: GateReport | None = None  # None when the verdict came from --gate-report
    compiled: bool = False  # the forward was compiled (extract/speed.py: choose_compile)
    compile_check: CompileCheck | None = None  # a compiled forward's first batch against the eager one
    warmup_s: float = 0.0  # of ``seconds``, spent compiling (torch.compile's own timer)
    taps: TapPlan | None = None  # the stored taps and features, and who they serve

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def steady_tokens_per_s(self) -> float:
        """Tokens per second outside the compile warm-up."""
        steady = self.seconds - self.warmup_s
        return self.tokens / steady if steady > 0 else 0.0


def dist_env(rank: int | None, world: int | None) -> tuple[int, int, int]:
    """(rank, world size, local rank): the config's values, else the process group's or torchrun's."""
    r, w = rank_and_world(rank, world)
    return r, w, local_rank(r, w)


def export_assets(fs, root: str, model, tokenizer) -> None:
    """The embedding, lm_head, config and tokenizer files the trainer uses instead of the target."""
    assets.write_assets(fs, root, asset_files(model.get_input_embeddings().weight,
                                              model.get_output_embeddings().weight, model.config, tokenizer))


def run_extract(settings: ExtractSettings, tokenizer=None, model=None, taps: TapPlan | None = None) -> ExtractResult:
    """Run one rank's extraction. Raises :class:`GateRefused` (before loading the model, writing nothing)
    when the quality gate fails and ``settings.gate.force`` is false. ``taps``: the plan the caller already made
    from these settings and the model folder's config (``extract``'s command line, which says it first)."""
    rank, world, local_rank = dist_env(settings.run.rank, settings.run.world_size)
    device = resolve_device(settings.forward.device, local_rank)  # an unusable --device fails before the gate
    # and so does a destination that is a user's folder (or an anonymous write): nothing there to resume
    fs, root = destination.open_destination(settings.store.out, settings.store.storage_options, layout.own_objects())
    # and so does this rank's writer tag while another session writes it (an identical command still running)
    sessions.check_slot(fs, root, settings.store.out, writer_tag(rank))
    cap = settings.capture  # and so do taps the target does not have or the asked engines cannot serve
    early = taps or planned_taps(settings.input.model, cap.layers, cap.serve, cap.final_hidden)
    if early is not None:
        warn_engines(early)
    result = ExtractResult(rank, world)
    tokenizer = tokenizer or load_tokenizer(settings.input.model)
    rows = gated_rows(settings, tokenizer, result)
    todo = not_yet_stored(settings, rows.samples, result)
    model = prepare_target(settings, model, device, todo, result)
    result.taps = early or planned_taps(model.config, cap.layers, cap.serve, cap.final_hidden)
    if early is None:
        warn_engines(result.taps)
    settings = schema.replace(settings, layers=result.taps.layers, final_hidden=result.taps.final_hidden)
    layers = result.taps.layers
    check_compiled(settings, model, layers, todo, tokenizer, device, result)
    writer = open_writer(settings, model, tokenizer, layers, rows, device, rank, result.compile_check,
                         world=world, todo=todo)
    write_features(settings, model, layers, writer, todo, rows.verdict, tokenizer, device, result)
    return result


@dataclass
class GatedRows:
    """This rank's rows once the gate has passed: the samples to extract, and what was left out of them."""

    samples: list[TokenizedSample]
    verdict: GateVerdict
    over_length: list[str]  # sample ids over --max-length (not --truncate): skipped
    stats: TokenizeStats  # its ``skipped``: rows not tokenized faithfully, by reason


def tokenize_settings(settings: ExtractSettings) -> dict[str, Any]:
    """The tokenization settings the gate and this rank's rows share (the gate report records them too): the
    tokenize section, as keywords."""
    return {f.name: getattr(settings.tokenize, f.name) for f in dataclasses.fields(settings.tokenize)}


def gated_rows(settings: ExtractSettings, tokenizer, result: ExtractResult) -> GatedRows:
    """The gate's verdict, then this rank's tokenized rows; refuses before the model is loaded. The verdict comes
    from ``--gate-report`` (this rank tokenizes only its rows), from the same pass (one process: every row is
    this rank's) or from gating the whole input on every rank (torchrun without a report)."""
    rank, world, inputs = result.rank, result.world_size, settings.input.input
    stats, tokenize_kw = TokenizeStats(), tokenize_settings(settings)

    def my_rows() -> list[TokenizedSample]:
        return list(load_samples(inputs, tokenizer, keep_over_length=True, stats=stats,
                                 shard=RowShard(rank, world), **tokenize_kw))

    samples = None
    if settings.gate.gate_report:
        identity = run_identity(inputs, tokenizer, thresholds=settings.thresholds, hash_content=False, **tokenize_kw)
        verdict = reuse_gate_report(settings.gate.gate_report, identity)
    elif world == 1:
        samples = my_rows()
        result.gate = check(samples, settings.thresholds, stats=stats)
        verdict = GateVerdict.from_report(result.gate)
    else:
        log.warning("rank %d of %d: no --gate-report, so this rank runs the quality gate over the whole input (as "
                    "every rank does); run `hsstore check --report FILE` once and pass --gate-report FILE so that "
                    "each rank tokenizes only its own rows", rank, world)
        result.gate = gate_inputs(inputs, tokenizer, thresholds=settings.thresholds, **tokenize_kw)
        verdict = GateVerdict.from_report(result.gate)
    refuse_unless_passed(settings, verdict, tokenizer)
    if samples is None:
        samples = my_rows()
    over = [s.sample_id for s in samples if "over_length" in s.flags]
    result.rows = stats.rows
    result.skipped_over_length = len(over)
    result.skipped_rows = {reason: len(v) for reason, v in stats.skipped.items()}
    return GatedRows([s for s in samples if "over_length" not in s.flags], verdict, over, stats)


def refuse_unless_passed(settings: ExtractSettings, verdict: GateVerdict, tokenizer) -> None:
    """A failed gate stops the run (unless ``--force``), and so do repeated sample ids: resume matches by id."""
    if not verdict.ok and not settings.gate.force:
        raise GateRefused(verdict, verdict.format_text(tokenizer))
    if verdict.repeated_ids:
        raise ValueError(f"sample id {shown(verdict.repeated_ids[0])} occurs more than once in the input (ids that "
                         "differ only by invisible characters count as one): ids must be unique for resume")


def not_yet_stored(settings: ExtractSettings, samples: list[TokenizedSample], result: ExtractResult
                   ) -> list[TokenizedSample]:
    """Resume: the samples whose ids the store has not committed yet."""
    done = committed_ids(settings.store.out, settings.store.storage_options)
    todo = [s for s in samples if s.sample_id not in done]
    refuse_lookalikes([s.sample_id for s in todo], done, settings.store.out)
    result.skipped_done = len(samples) - len(todo)
    if result.skipped_done:
        log.info("rank %d: %d of %d samples already in the store (resuming)", result.rank, result.skipped_done,
                 len(samples))
    return todo


def prepare_target(settings: ExtractSettings, model, device: torch.device, todo: list[TokenizedSample],
                   result: ExtractResult):
    """The target on ``device`` (loaded unless given), compiled where the expected saving pays for the warm-up."""
    rank = result.rank
    if device.type == "cuda":
        torch.cuda.set_device(device)
    log.info("rank %d: extracting on %s", rank, describe(device))
    if model is None:
        model = load_target(settings.input.model, DTYPES[settings.forward.dtype], device,
                            progress=settings.run.progress)
    model = to_device(model, device)  # a target given already loaded too gets the kernels (once per process)
    threads_for_model(settings.forward.cpu_threads, model, device, f"rank {rank}: extract")
    decoder_params = sum(p.numel() for layer in decoder_layers(model) for p in layer.parameters())
    choice = choose_compile(settings.forward.compile, device, decoder_params, sum(s.num_tokens for s in todo))
    result.compiled = choice.compile
    if choice.compile:
        note_compile_cache(rank)
        log.info("rank %d: compiling the target's norms, MLPs, attention blocks and recurrent mixers around their "
                 "kernels (%s; %s); the first batch of each new shape pays the compile time (~%.0f s at 27B scale)",
                 rank, compile_forward(model, mixers=True), choice.reason, WARMUP_S)
    elif settings.forward.compile is None and device.type == "cuda":
        log.info("rank %d: not compiling the forward (%s; --compile to compile anyway)", rank, choice.reason)
    return model


def uses_process_writer(settings: ExtractSettings, device: torch.device) -> bool:
    """The writer runs in a child process on CUDA (``auto``): encoding and uploads then never take the GIL
    from the thread that feeds the GPU."""
    return settings.store.writer == "process" or (settings.store.writer == "auto" and device.type == "cuda")


def warn_engines(taps: TapPlan) -> None:
    """One warning per tap that an engine cannot serve, naming the engines that can (before any GPU work)."""
    for line in taps.serving.engine_warnings():
        log.warning("%s", line)


def extraction_batches(settings: ExtractSettings, todo: list[TokenizedSample], device: torch.device
                       ) -> tuple[int, list[list[TokenizedSample]]]:
    """(token budget, the batches of ``todo`` in the order extraction runs them)."""
    token_budget = settings.forward.token_budget or defaults_for(device).token_budget
    return token_budget, token_budget_batches(todo, token_budget)


def check_compiled(settings: ExtractSettings, model, layers: list[int], todo: list[TokenizedSample], tokenizer,
                   device: torch.device, result: ExtractResult) -> None:
    """A compiled forward's first batch against the eager forward (``compile_check.check_first_batch``), before
    the writer is opened: beyond bf16 rounding it raises ``CompileMismatch`` naming the tap, nothing written."""
    if not result.compiled or not todo:
        return
    batch = extraction_batches(settings, todo, device)[1][0]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    compiling0 = compile_seconds()
    result.compile_check = check_first_batch(model, layers, batch, pad_id, device, settings.capture.final_hidden)
    result.seconds += result.compile_check.seconds  # the run's time: the first shape's compile is paid here
    result.warmup_s += compile_seconds() - compiling0
    log.info("rank %d: compiled forward checked against the eager one on the first batch (%d tokens): min per-token "
             "cosine %.6f, max relative error %.4f (each tap within its bound at its depth)", result.rank,
             result.compile_check.tokens, result.compile_check.min_cos, result.compile_check.max_rel)


def writer_tag(rank: int) -> str:
    """The writer tag of extraction's rank ``rank``: its shards' and session's name, and its slot (one writer of a
    tag at a time), so two identical commands into one store are refused where the second starts."""
    return f"rank{rank:05d}"


def open_writer(settings: ExtractSettings, model, tokenizer, layers: list[int], rows: GatedRows, device: torch.device,
                rank: int, compile_check: CompileCheck | None = None, world: int = 1,
                todo: list[TokenizedSample] | None = None):
    """This rank's store writer, with the manifest of the target and taps; rank 0 exports the assets the trainer
    uses instead of the target. Each rank records what it left out of its rows in its commit records, so
    ``hsstore info`` shows what never reached the store (counted once per id over all ranks and resumed runs),
    and a compiled forward's check in the manifest's ``extra.compile_check`` under its writer tag. Its session record
    names every rank's tag and what this rank still plans to write (``todo``), so a trainer that follows the store
    (``train --follow``) waits for every rank and can estimate its schedule."""
    tag = writer_tag(rank)
    store, features = settings.store, ("final_hidden",) if settings.capture.final_hidden else ()
    manifest = build_manifest(model, tokenizer, name=model_name(settings.input.model), layers=layers,
                              codec=store.codec, dtype=settings.forward.dtype, layout=store.layout,
                              encoding=store.encoding, features=features)
    if compile_check is not None:
        manifest = dataclasses.replace(manifest, extra={**manifest.extra, EXTRA_KEY: {tag: compile_check.record()}})
    # check_finite=False: extract_batches already checked every feature on the device, where it is free
    writer = (ProcessWriter if uses_process_writer(settings, device) else StoreWriter)(
        store.out, manifest, writer_tag=tag, storage_options=store.storage_options, shard_bytes=store.shard_bytes,
        check_finite=False, expects=[writer_tag(r) for r in range(world)],
        planned_samples=None if todo is None else len(todo),
        planned_tokens=None if todo is None else sum(s.num_tokens for s in todo))
    if rank == 0 and not assets.has_assets(writer.fs, writer.root):
        export_assets(writer.fs, writer.root, model, tokenizer)
    if rows.over_length:
        writer.note_skipped("over_length", rows.over_length)
    for reason, skipped_ids in rows.stats.skipped.items():
        writer.note_skipped(reason, skipped_ids)
    return writer


def write_features(settings: ExtractSettings, model, layers: list[int], writer, todo: list[TokenizedSample],
                   verdict: GateVerdict, tokenizer, device: torch.device, result: ExtractResult) -> None:
    """The forward over token-budget batches into the writer, with a progress bar; the writer commits on
    success, and on any error (Ctrl-C included) drops its open shard and keeps the committed ones."""
    from hsstore.progress import progress_bar

    use_process = uses_process_writer(settings, device)
    token_budget, batches = extraction_batches(settings, todo, device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    bar = progress_bar(total=sum(s.num_tokens for s in todo), unit="tok", unit_scale=True,
                       desc=f"extract rank {result.rank}", disable=not settings.run.progress, smoothing=0.1)
    t0, compiling0 = time.perf_counter(), compile_seconds()

    def sink(s: TokenizedSample, feats: torch.Tensor, feature_stats) -> None:
        writer.add(s.sample_id, s.input_ids, s.loss_mask, feats, source=s.source,
                   thinking_tokens=s.thinking_tokens, flags=verdict.flags(s), feature_stats=feature_stats)
        result.samples += 1
        result.tokens += s.num_tokens

    def on_batch(batch: list[TokenizedSample]) -> None:
        if use_process:
            writer.sync()  # the child has taken the batch: its staging buffer may be reused
        bar.update(sum(s.num_tokens for s in batch))
        bar.set_postfix(samples=f"{result.samples}/{len(todo)}", written=f"{writer.bytes_written / 1e9:.2f}GB",
                        refresh=False)

    try:
        stats = extract_batches(model, layers, batches, sink, pad_id, device, on_batch=on_batch,
                                staging_tokens=token_budget, encoding=writer.manifest.encoding,
                                host_alloc=writer.staging if use_process else None,
                                final_hidden=settings.capture.final_hidden)
        writer.close()
        result.gpu_wait_s = stats.slot_wait_s
    except BaseException as e:
        writer.close(commit=False)
        if isinstance(e, KeyboardInterrupt):
            log.warning("interrupted: the shards committed so far are kept, the open one is dropped; re-run the "
                        "same command to resume (committed samples are skipped)")
        raise
    finally:
        bar.close()
    result.seconds += time.perf_counter() - t0  # (+=: after the compile check's seconds)
    result.warmup_s += compile_seconds() - compiling0
    result.bytes_written = writer.bytes_written
