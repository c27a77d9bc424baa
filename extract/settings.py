"""The extraction commands' settings: one schema per command, built from shared sections.

Each setting is written once, below, with its flag, help and default. From a command's schema come its flags
in their ``--help`` groups (``cli.py``), the sections of its ``--config`` file (``hsstore.app.config``: the groups'
titles, the flags' keys) and the object its handler reads. ``check``, ``show`` and ``extract`` share the
sections they have in common (how rows are tokenized, the gate's thresholds); a section whose help differs
by command is a subclass that restates only that field. Handlers and API callers read the sections as
written (``settings.forward.token_budget``, ``settings.thresholds``); ``hsstore.app.schema.build`` makes settings
from field names (``build(ExtractSettings, model=..., input=[...], out=...)``).

Flags that every family has (``--storage-option``, ``--quiet``, ``--shard-mb``) are placed by each command
(``cli.py``'s ``Command`` list) into the groups named here, and reach the settings declared for them
(``hsstore.app.sections``; ``shard_bytes`` here) through ``hsstore.app.commands.command_settings``. A config
file may also give extract's keys under ``options`` (the one section of files from releases without these
groups): ``hsstore.app.config`` reads such a key as the flag of its group.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from hsstore.format import encodings, layout_spec
from hsstore.format.serving import parse_serve
from hsstore.app.devices import device_option
from hsstore.app.threads import cpu_threads_option
from hsstore.app import commands, sections
from hsstore.app.commands import command_settings
from hsstore.app.schema import moved_names, option, section
from hsstore.app.sections import Progress

from .gate import GateThresholds
from .peers import names as peer_names

# the shared flags' helpers, now in hsstore.app.commands: still read from here, with a DeprecationWarning
__getattr__ = moved_names(__name__, commands, ("add_shard_mb_flag", "shared_overrides", "mib_bytes"))

DTYPE_CHOICES = ("bfloat16", "float16", "float32")
COLOR_CHOICES = ("auto", "always", "never")


def parse_layers(value: str | None) -> list[int] | None:
    """``--layers 1,16,31`` as a list of layer ids (None: the default spacing)."""
    from .peers.base import parse_ids

    return parse_ids(value, "--layers") if value else None


SERVE_HELP = ("engines, trainers and exports the store must serve, comma-separated: taps are added so that all "
              "of them can (train, specforge-dflash, specforge-eagle3, speculators, sglang, vllm, dflash); "
              "refused where no tap set serves them all")


def template_kwargs(value: str | None) -> dict:
    """``--chat-template-kwargs`` JSON as a dict (an error names the flag)."""
    from .messages import template_kwargs_of

    return template_kwargs_of(value, "--chat-template-kwargs")


def _input() -> Any:
    return option(nargs="+", required=True, path=True, was="inputs", help="JSONL/Parquet/Arrow files or directories")


def _store_url() -> Any:
    return option(required=True, path=True, help="store URL (local path or s3://bucket/prefix)")


def _shard_bytes() -> Any:
    return option(1 << 30, cli=False, help="feature bytes per shard (the flag: --shard-mb)")


# --- sections shared by check, show and extract -------------------------------------------------------------


@dataclass
class Rendering:
    """How a row becomes tokens: the chat template's arguments and the engine's recorded ids."""

    expand: bool = option(True, old_negated="--no-expand",
                          help="every exchange of a multi-turn conversation as a sample (--no-expand: only the final "
                               "one)")
    chat_template_kwargs: dict = option(
        default_factory=dict, type=str, metavar="JSON", convert=template_kwargs,
        help="arguments for the chat template, as the engine got them, e.g. '{\"enable_thinking\": false}' "
             "or '{\"preserve_thinking\": true}'; a row's own chat_template_kwargs object overrides them")
    trust_engine_ids: bool = option(
        False, help="use the token ids a row recorded from the serving engine (prompt_token_ids + token_ids) even "
                    "where the prompt ids differ from this tokenizer's render of the chat template (default: such "
                    "rows are skipped as engine_prompt_mismatch)")
    learn_not_generated: bool = option(
        False, help="also learn the assistant turns marked \"generated\": false (hand-written ones that regenerate "
                    "--turns last kept as context); their samples are flagged not_generated (default: context only)")


@dataclass
class Tokenize(Rendering):
    """The rendering, and what happens to samples over ``--max-length``."""

    max_length: int | None = option(None, help="skip (and count) longer samples")
    truncate: bool = option(False, help="cut over-length samples instead of skipping them")


@dataclass
class CheckTokenize(Tokenize):
    max_length: int | None = option(None, help="flag samples longer than this many tokens")
    truncate: bool = option(False, help="cut over-length samples instead (as extract --truncate)")


# --- extract ------------------------------------------------------------------------------------------------


@dataclass
class ExtractInput:
    model: str = option(required=True, help="target model directory")
    input: list[str] = _input()


@dataclass
class StoreOutput:
    """Where and how the features are written (``--shard-mb`` and ``--storage-option`` join this group)."""

    out: str = _store_url()
    layout: str = option(layout_spec.DEFAULT, choices=list(layout_spec.names()),
                         help="shard layout: " + " or ".join(f"{s.name} ({s.help})" for s in layout_spec.SPECS.values()))
    codec: str = option("none", help="chunk codec: none, zstd[:level], blosc-zstd[:level], lz4")
    encoding: str = option("raw", choices=list(encodings.NAMES),
                           help="raw: features bit-exact in --dtype; the others encoded on the device: "
                                + "; ".join(f"{e.name}: {e.help}" for e in encodings.ENCODINGS.values() if e.quantised))
    writer: str = option("auto", choices=["auto", "thread", "process"],
                         help="where the store writer runs: a child process fed through shared memory (auto: on "
                              "CUDA), or threads of this process")
    shard_bytes: int = _shard_bytes()
    storage_options: dict[str, Any] = sections.storage_options()


@dataclass
class Capture:
    layers: list[int] | None = option(None, type=str, convert=parse_layers,
                                      help="tapped layer ids, e.g. 1,16,31,46,61 (default: DFlash spacing)")
    final_hidden: bool = option(
        False, help="also store the final norm's output (what the lm_head reads; EAGLE-3's training target) as "
                    "the feature final_hidden, captured in the same forward (which then runs to the norm)")
    serve: list[str] | None = option(None, type=str, metavar="NAME,NAME", convert=parse_serve, help=SERVE_HELP)


@dataclass
class Forward:
    device: str | None = device_option()
    cpu_threads: int | None = cpu_threads_option("the target's forward on a CPU")
    dtype: str = option("bfloat16", choices=DTYPE_CHOICES, help="the target's dtype, and the stored features'")
    token_budget: int | None = sections.token_budget(None, metavar=None, old=None,
                                                     help="padded tokens per forward batch (default: 16384 on a GPU, "
                                                          "4096 on a CPU)")
    compile: bool | None = option(
        None, help="compile the target's norms, MLPs, attention blocks and recurrent mixers (torch.compile, per "
                   "layer kind; features equal to the eager forward's within bf16 rounding, faster at 27B scale; "
                   "the first batches pay the compiling). Default: on CUDA when the "
                   "expected saving exceeds that warm-up (the log says which and why)")


@dataclass
class Gate:
    force: bool = option(False, help="extract even when the quality gate fails")
    gate_report: str | None = option(
        None, metavar="FILE", path=True,
        help="the verdict of `hsstore check --report FILE` on this input: reused when the input files, tokenizer "
             "and settings match (refused naming what differs), so each rank tokenizes only its own rows; "
             "without it every rank runs the gate over the whole input")


@dataclass
class ExtractRun(Progress):
    """This process's part of the job."""

    rank: int | None = option(None, cli=False, help="this rank (default: the process group's or torchrun's)")
    world_size: int | None = option(None, cli=False, help="ranks in all (default: the process group's)")


@dataclass
class ExtractSettings:
    input: ExtractInput = section(ExtractInput, "input")
    store: StoreOutput = section(StoreOutput, "store")
    tokenize: Tokenize = section(Tokenize, "tokenize")
    gate: Gate = section(Gate, "gate")
    thresholds: GateThresholds = section(GateThresholds, "gate thresholds")
    capture: Capture = section(Capture, "capture")
    forward: Forward = section(Forward, "forward")
    run: ExtractRun = section(ExtractRun, "run")


# --- check and show -----------------------------------------------------------------------------------------


@dataclass
class CheckInput:
    model: str | None = option(None, help="target model directory (its tokenizer and chat template); required")
    input: list[str] | None = option(None, nargs="+", was="inputs",
                                     help="JSONL/Parquet/Arrow files or directories; required")


@dataclass
class CheckReport:
    json: bool = option(False, help="print the report as JSON")
    report: str | None = option(
        None, metavar="FILE",
        help="also write the verdict with the input's and tokenizer's hashes and these settings to FILE (local "
             "path or URL), for extract --gate-report: the gate then runs once, not on every rank")
    examples: int = option(3, help="flagged samples to decode in the text report")
    color: str = option("auto", choices=COLOR_CHOICES, help="color the decoded samples (auto: on a terminal)")


@dataclass
class CheckEstimate:
    layers: list[int] | None = option(None, type=str, metavar="L,L", convert=parse_layers,
                                      help="taps to estimate for (default: DFlash spacing)")
    final_hidden: bool = option(False, help="extract would add the final norm's output")
    serve: list[str] | None = option(None, type=str, metavar="NAME,NAME", convert=parse_serve,
                              help="as extract's --serve: the taps that serve these")
    tokens_per_s: float | None = option(
        None, metavar="X", help="extraction throughput per GPU (default: the reference rate of a 27B-scale Qwen3.5 "
                                "target on one GPU, 11,049; other targets differ)")
    estimate_only: bool = option(False, help="no input: the estimate for --tokens, --samples and --hidden (or "
                                             "--model) and --layers")
    tokens: float | None = option(None, help="with --estimate-only: tokens, e.g. 1.87e9")
    samples: float | None = option(None, help="with --estimate-only: samples, e.g. 914000")
    hidden: int | None = option(None, help="with --estimate-only: the target's hidden size")


@dataclass
class CheckSettings:
    input: CheckInput = section(CheckInput, "input")
    tokenize: CheckTokenize = section(CheckTokenize, "tokenize")
    report: CheckReport = section(CheckReport, "report")
    thresholds: GateThresholds = section(GateThresholds, "gate thresholds")
    estimate: CheckEstimate = section(
        CheckEstimate, "cost estimate", about="the store's size, extraction GPU-hours and bytes read per training "
        "epoch for the checked samples (over-length ones left out unless --truncate), taps and hidden size from "
        "--model")


@dataclass
class ShowInput:
    input: str = option(positional=True, help="a store URL, or a JSONL/Parquet/Arrow file or directory")
    n: str = option(positional=True, help="sample position (0-based, after multi-turn expansion) or sample id")
    model: str | None = option(None, help="target model directory (its tokenizer and chat template); for a store, "
                                          "its own tokenizer is used unless this is given")
    storage_options: dict[str, Any] = sections.storage_options()


@dataclass
class ShowOutput:
    color: str = option("auto", choices=COLOR_CHOICES, help="color the loss-masked tokens (auto: on a terminal)")
    max_chars: int | None = option(None, help="show only the last N characters")


@dataclass
class ShowSettings:
    input: ShowInput = section(ShowInput, "input")
    tokenize: Rendering = section(Rendering, "tokenize")
    output: ShowOutput = section(ShowOutput, "output")


# --- audit --------------------------------------------------------------------------------------------------


def audit_samples(value: float | None) -> int:
    """``audit --samples N``: a whole number (read as a float, as ``check --samples 9.14e5`` is: one flag, one type;
    unset: 8). ``audit`` itself refuses one below 1."""
    if value is None:
        return 8
    if value != int(value):
        raise ValueError(f"--samples must be a whole number, got {value:g}")
    return int(value)


@dataclass
class AuditInput:
    url: str = option(positional=True, help="store URL (local path or s3://bucket/prefix); any store, imported ones "
                                            "included")
    model: str = option(required=True, help="the target model directory to recompute the features with")
    samples: int = option(8, type=float, convert=audit_samples,
                          help="samples to recompute: the N whose input_ids hash lowest, the same in every copy of "
                               "the store (default 8)")
    device: str | None = device_option("for the reference forward")
    cpu_threads: int | None = cpu_threads_option("the reference forward on a CPU")
    storage_options: dict[str, Any] = sections.storage_options()


@dataclass
class AuditSettings:
    input: AuditInput = section(AuditInput, "input")
    run: Progress = section(Progress, "run")



# --- regenerate ---------------------------------------------------------------------------------------------


def json_object(value: str | None) -> dict:
    """``--extra-body`` JSON as a dict."""
    import json

    out = json.loads(value) if value else {}
    if not isinstance(out, dict):
        raise ValueError("--extra-body must be a JSON object")
    return out


@dataclass
class RegenData:
    input: list[str] = _input()
    out: str = option(required=True, help="output JSONL file (appended to; resumed)")


@dataclass
class RegenServer:
    server: str = option(required=True, help="server URL, e.g. http://127.0.0.1:8000 (or .../v1)")
    model: str | None = option(None, help="model name to request (default: the server's only model)")
    concurrency: int = option(16, help="requests in flight (default 16)")
    retries: int = option(8, help="per request, on answers that say \"later\": timeouts, broken connections, 408, "
                                  "425, 429, 503, 504 (other answers fail at once)")
    connect_wait: float = option(5.0, metavar="SECONDS",
                                 help="how long a server that refuses connections or whose host name does not "
                                      "resolve is asked again before regenerate stops with one line (a server "
                                      "still starting: give it the time it takes)")
    backoff_s: float = option(1.0, cli=False, help="first retry delay; doubles per attempt, up to backoff_max_s")
    backoff_max_s: float = option(60.0, cli=False, help="longest retry delay")
    timeout: float = option(600.0, was="timeout_s", help="seconds per request, generation included (default 600)")
    extra_body: dict = option(
        default_factory=dict, type=str, convert=json_object,
        help='JSON object merged into every request, e.g. \'{"skip_special_tokens": false, "top_p": 0.95}\'')
    api_key_env: str = option("OPENAI_API_KEY", help="environment variable holding the API key, if the server "
                                                     "needs one")
    api_key: str | None = option(None, cli=False, help="the key itself (default: from --api-key-env)")


@dataclass
class RegenGeneration:
    turns: str = option("last", choices=("last", "all"),
                        help="last: answer the last user message (later turns dropped); all: regenerate every "
                             "exchange in order (default last)")
    max_tokens: int = option(4096, help="per response, reasoning included (default 4096)")
    temperature: float = option(0.6, help="sampling temperature (default 0.6)")
    chat_template_kwargs: dict = option(
        default_factory=dict, type=str, metavar="JSON", convert=template_kwargs,
        help="template arguments sent with every request, over {\"enable_thinking\": true} (e.g. "
             "'{\"preserve_thinking\": true}'); recorded in each output row for check/extract")


@dataclass
class RegenerateSettings:
    data: RegenData = section(RegenData, "input and output")
    server: RegenServer = section(RegenServer, "server")
    generation: RegenGeneration = section(RegenGeneration, "generation")
    run: Progress = section(Progress, "run")


def regenerate_settings(args: argparse.Namespace) -> RegenerateSettings:
    """The parsed flags as settings, the API key read from the variable ``--api-key-env`` names."""
    import os

    settings = command_settings(RegenerateSettings, args)
    settings.server.api_key = os.environ.get(settings.server.api_key_env) or None
    return settings


# --- import, export, demo -----------------------------------------------------------------------------------

PEER_FORMATS = peer_names("import")


@dataclass
class PeerFiles:
    format: str = option(positional=True, choices=PEER_FORMATS, help="the peer whose files these are")
    path: str = option(positional=True,
                       help="SpecForge: the folder of .ckpt files; speculators: the Arrow dataset folder")
    pad_token_id: int = option(0, help="SpecForge: the id its collator right-pads rows with (0, whatever the "
                                       "tokenizer says); trailing pad tokens outside the loss mask are trimmed")
    keep_padding: bool = option(False, help="SpecForge: store rows with their batch padding")
    num_rows: int | None = option(None, help="SpecForge: rows of the dataset the files were made from; data_{i} "
                                             "files missing below it (NaN rows, the dropped last partial batch) "
                                             "are named")
    final_hidden: bool = option(True, help="SpecForge: keep the files' hidden_state (the final-norm output) as the "
                                           "store's final_hidden feature (--no-final-hidden: drop it)")
    id_prefix: str = option("", help="prepended to sample ids (data_17, hs_17) to keep several imports into one "
                                     "store apart")
    source: str | None = option(None, help="source column of every sample (default: the row's source or the "
                                           "folder name)")
    hidden_states_dir: str | None = option(None, help="speculators: folder of hs_{i}.safetensors (default "
                                                      "PATH/hidden_states)")
    keep_unhealthy: bool = option(False, help="import samples with an all-zero or non-finite feature, flagged "
                                              "feature_zero / feature_nonfinite (`hsstore subset --exclude-flag` "
                                              "drops them); by default they are refused, named and counted")


@dataclass
class PeerIdentity:
    """What the peers' files do not say: the taps, the target and the tokenizer (``peers.importing``)."""

    layers: str | None = option(
        None, help="tapped layer ids of the files' features, in their order, e.g. 1,16,31, in hsstore's convention "
                   "(output of decoder layer l, 0-based). A list that reads like the peer's own ids "
                   "(speculators/vLLM: its launch ids [2, N//2, N-3, N], or N) is refused: use --peer-layers, or "
                   "--hsstore-ids if it really is meant as hsstore ids")
    peer_layers: str | None = option(
        None, help="the same, in the peer's own convention, e.g. 2,4,5,8 as passed to speculators' launch_vllm.py "
                   "(vLLM id i = output of decoder layer i-1; hsstore id = i-1) or SpecForge's "
                   "aux_hidden_state_layer_ids (= hsstore ids); both lists go into the manifest's extra.peer_layers")
    hsstore_ids: bool = option(False, help="--layers is meant in hsstore's convention even where it looks like the "
                                           "peer's")
    model: str | None = option(None, help="local target model folder: identity from its config and tokenizer")
    model_name: str | None = option(None, help="the target's name when --model is not given")
    num_layers: int | None = option(None, help="decoder layers of the target")
    hidden_size: int | None = option(None, help="the target's hidden size when --model is not given")
    config_hash: str | None = option(None, help="target identity when --model is not given")
    tokenizer_hash: str | None = option(None, help="vocab hash of the tokenizer when --model is not given")
    tokenizer_name: str | None = option(None, help="the tokenizer's name when --model is not given")
    chat_template_hash: str | None = option(None, help="the chat template's hash when --model is not given")
    dtype: str = option("bfloat16", choices=DTYPE_CHOICES,
                        help="the files' feature dtype (stored bit-exact; other dtypes are refused)")


@dataclass
class ImportStore:
    """The store written (``--shard-mb`` and ``--storage-option`` join this group)."""

    out: str = _store_url()
    codec: str = option("none", help="chunk codec: none, zstd[:level], blosc-zstd[:level], lz4")
    shard_bytes: int = _shard_bytes()
    storage_options: dict[str, Any] = sections.storage_options()


@dataclass
class ImportSettings:
    files: PeerFiles = section(PeerFiles, "peer files")
    identity: PeerIdentity = section(PeerIdentity, "identity")
    store: ImportStore = section(ImportStore, "store")
    run: Progress = section(Progress, "run")


@dataclass
class ExportFiles:
    format: str = option(positional=True, choices=peer_names("export"), help="the peer whose files to write")
    url: str = option(positional=True, help="store URL")
    out: str = option(positional=True, help="output folder (local; must not exist or be empty)")
    layout: str | None = option(None, choices=["dflash", "eagle3"],
                                help="specforge only: dflash (default; hidden_states, every tap) or eagle3 "
                                     "(aux_hidden_state with the three taps its EAGLE-3 model takes + hidden_state, "
                                     "the final norm's output: the store must hold final_hidden)")
    layers: list[int] | None = option(None, type=str, metavar="A,B,C", convert=parse_layers,
                                      help="--layout eagle3: the three store layers to export (hsstore ids; default: "
                                           "all of a 3-tap store, else the taps nearest SpecForge's defaults "
                                           "[1, N//2-1, N-4], named in the summary)")
    storage_options: dict[str, Any] = sections.storage_options()


@dataclass
class ExportSettings:
    export: ExportFiles = section(ExportFiles, "export")
    run: Progress = section(Progress, "run")


@dataclass
class Demo:
    out: str = option("hsstore-demo",
                      help="working folder (target, data, store, run); created if missing. A non-empty folder the "
                           "demo did not create is refused; on a re-run only what the demo created there is replaced")
    device: str | None = device_option("for extraction, training and eval",
                                       default="the device the demo runs fastest on, said with why: the CPU, also "
                                               "beside a GPU, for its tiny models")
    cpu_threads: int | None = cpu_threads_option("extraction, training and eval on a CPU")


@dataclass
class DemoSettings:
    demo: Demo = section(Demo, "demo")
