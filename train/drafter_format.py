"""The DFlash drafter directory: what SGLang, vLLM and z-lab's ``dflash`` load (``--speculative-draft-model-path``,
``"method": "dflash"``), in the format of SpecForge's and z-lab's released drafters, written and read without
pickle (safetensors for tensors, JSON for the rest):

    config.json                   Qwen3-style config: architectures ["DFlashDraftModel"], model_type qwen3,
                                  layer_types, sliding_window + use_sliding_window, block_size,
                                  num_target_layers, dflash_config {target_layer_ids, mask_token_id}, rope_theta
    model.safetensors             bf16 drafter weights: fc, hidden_norm, layers.N.*, norm (no embedding, no
                                  lm_head: the engines use the target's)
    model.safetensors.index.json  lists model.safetensors only, so engines skip any other *.safetensors here
    hsstore_drafter.json          this project's metadata: store/target identity, taps, tokenizer, attn_impl
    modeling_dflash.py            what config.json's ``auto_map`` names, as in z-lab's released drafters: it
                                  imports z-lab's ``dflash`` package's DFlashDraftModel, so
                                  ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` builds that drafter
                                  or fails naming ``dflash`` -- never a plain Qwen3 model without fc and norms
    README.md                     the model card: shape, taps, how SGLang, vLLM and dflash serve it

Directories written before this format (config.json ``{"architecture": "DFlashDrafter", "drafter": {...}}``
with fp32 model.safetensors) still read. A config is checked against its weights file's header before any
weight is built (a config is data from elsewhere). Where a drafter is in a training run (OUT/drafter, a
checkpoint) and the checkpoints themselves: ``checkpoint.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from hsstore.errors import StoreError
from hsstore.format import values
from hsstore.io import door, memory, sinks
from hsstore.io.tensorfiles import save_safetensors

from .model import DFlashDrafter, DrafterConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
META = "hsstore_drafter.json"
ARCHITECTURE = "DFlashDraftModel"
LEGACY_ARCHITECTURE = "DFlashDrafter"  # this project's format before the DFlash HF one
FULL, SLIDING = "full_attention", "sliding_attention"
MODELING = "modeling_dflash.py"
MODEL_CARD = "README.md"
FILES = (CONFIG, WEIGHTS, WEIGHTS_INDEX, META, MODELING, MODEL_CARD)  # everything write_drafter writes
# a drafter folder comes from elsewhere: its JSON files are small, its shape within what any drafter has (published
# DFlash drafters have 1-8 layers; a config asking for 2e6 layers would build 2e6 modules before any check)
JSON_CAP = 1 << 20
MAX_DRAFT_LAYERS = 256
MAX_TARGET_LAYERS = 1024
# model_type stays qwen3: SGLang, vLLM and dflash build their Qwen3Config from it (an unknown type fails there)
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
MODELING_SOURCE = '''"""Loads this folder as z-lab's DFlash drafter: AutoModel.from_pretrained(dir, trust_remote_code=True).

Written by hsstore. The model is the one in z-lab's published `dflash` package (pip install dflash);
without it, loading fails here instead of building a plain Qwen3 model without fc, hidden_norm and norm.
"""

from dflash.model import DFlashDraftModel

__all__ = ["DFlashDraftModel"]
'''


def hf_config(cfg: DrafterConfig) -> dict[str, Any]:
    """The DFlash config.json of a drafter: the fields of SpecForge's configs/qwen3.6-27b-dflash.json."""
    windows = sorted({w for w in cfg.sliding_window or [] if w is not None})
    if len(windows) > 1:
        raise ValueError(f"the DFlash format has one sliding_window for all sliding layers, not {windows}")
    window = windows[0] if windows else None
    out = {
        "architectures": [ARCHITECTURE],
        "auto_map": dict(AUTO_MAP),
        "model_type": "qwen3",
        "dtype": "bfloat16",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "layer_types": [FULL if cfg.window(i) is None else SLIDING for i in range(cfg.num_layers)],
        # transformers' Qwen3Config drops sliding_window unless use_sliding_window is true
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": cfg.num_layers,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"target_layer_ids": list(cfg.target_layers), "mask_token_id": cfg.mask_token_id},
    }
    if window is not None and not cfg.sliding_causal:
        out["is_causal"] = False  # SGLang and vLLM then run every layer non-causally (their default: sliding causal)
    return out


def mixes_attention(cfg: DrafterConfig) -> bool:
    """Whether the drafter has both sliding-window and full-attention layers."""
    kinds = {cfg.window(i) is None for i in range(cfg.num_layers)}
    return len(kinds) == 2


def serving_notes(cfg: DrafterConfig) -> list[str]:
    """What an engine needs beyond the folder: vLLM serves a drafter that mixes sliding and full layers only with
    its V2 model runner (vllm/model_executor/models/qwen3_dflash.py raises NotImplementedError otherwise)."""
    if not mixes_attention(cfg):
        return []
    kinds = ["sliding" if cfg.window(i) is not None else "full" for i in range(cfg.num_layers)]
    return [f"vLLM: this drafter mixes sliding-window and full-attention layers ({', '.join(kinds)}); vLLM serves "
            "it only with its V2 model runner: set VLLM_USE_V2_MODEL_RUNNER=1 (SGLang and dflash need nothing)"]


def model_card(cfg: DrafterConfig, meta: dict[str, Any]) -> str:
    """README.md of a drafter folder: what it is and how the engines serve it (their commands, in their terms)."""
    target = (meta.get("target") or {}).get("name") or "the target model"
    kinds = [("sliding " + str(cfg.window(i))) if cfg.window(i) is not None else "full"
             for i in range(cfg.num_layers)]
    v2 = "VLLM_USE_V2_MODEL_RUNNER=1 " if mixes_attention(cfg) else ""
    lines = [
        "---", "library_name: transformers", "tags: [dflash, speculative-decoding, hsstore]", "---", "",
        f"# DFlash drafter for {target}", "",
        f"- {cfg.num_layers} draft layers ({', '.join(kinds)}), hidden {cfg.hidden_size}, {cfg.num_heads} heads x "
        f"{cfg.head_dim}, {cfg.num_kv_heads} KV heads; block size {cfg.block_size}, mask token {cfg.mask_token_id}.",
        f"- Target layers {list(cfg.target_layers)} (`dflash_config.target_layer_ids`: the output of decoder layer "
        "l, as SpecForge and z-lab's dflash count). The drafter uses the target's embedding and lm_head.",
        "- Trained by hsstore; `hsstore_drafter.json` records the store, target and tokenizer identity.", "",
        "## Serving", "",
        f"- SGLang: `python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path THIS_DIR`",
        f"- vLLM: `{v2}vllm serve TARGET --speculative-config '{{\"method\": \"dflash\", \"model\": "
        f"\"THIS_DIR\", \"num_speculative_tokens\": {cfg.block_size - 1}}}'`",
        *(f"  ({n})" for n in serving_notes(cfg)),
        "- Transformers: `pip install dflash`, then `AutoModel.from_pretrained(THIS_DIR, trust_remote_code=True)` "
        "builds dflash's `DFlashDraftModel` (`modeling_dflash.py` imports it). Without `trust_remote_code` "
        "transformers reads `model_type: qwen3` and builds a plain Qwen3 model that is not this drafter.",
        "- speculators: `speculators convert` takes this folder as a z-lab DFlash checkpoint. Its trainer (0.9.0) "
        "lets sliding layers see context from p - W for every block row, where SGLang, vLLM, dflash, SpecForge and "
        "hsstore use p + i - (W - 1) (row i of the block at anchor p); fine-tuning there changes the window edge.",
        ""]
    return "\n".join(lines)


def config_from_hf(d: dict[str, Any], attn_impl: str = "sdpa", source: str = CONFIG) -> DrafterConfig:
    """The DrafterConfig of a DFlash config.json (ours, SpecForge's or z-lab's); refuses what this drafter
    cannot run exactly as the engines would."""
    def refuse(why):
        raise ValueError(f"{source}: {why}")

    if ARCHITECTURE not in (d.get("architectures") or []):
        refuse(f"not a DFlash drafter (architectures {d.get('architectures')!r}, expected [{ARCHITECTURE!r}])")
    if d.get("attention_bias"):
        refuse("attention_bias is true; this drafter has no attention biases")
    if d.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {d['hidden_act']!r}; this drafter's MLP is SwiGLU (silu)")
    rope = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default" or scaling.get("rope_type", scaling.get("type", "default")) \
            not in ("default", None):
        refuse("RoPE scaling is not supported (rope_type must be default)")
    if (d.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0) != 1.0:
        refuse("partial rotary is not supported (the drafter rotates whole heads)")
    dflash = d.get("dflash_config") or {}
    for key in ("target_layer_ids", "mask_token_id"):
        if dflash.get(key) is None:
            refuse(f"dflash_config.{key} is missing")
    n = d.get("num_hidden_layers")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_DRAFT_LAYERS:
        refuse(f"num_hidden_layers {n!r}: a drafter has 1 to {MAX_DRAFT_LAYERS} layers")
    types = d.get("layer_types") or [FULL] * n
    if len(types) != n or set(types) - {FULL, SLIDING}:
        refuse(f"layer_types {types} must hold {n} entries of {FULL!r} / {SLIDING!r}")
    window = d.get("sliding_window")
    if SLIDING in types and not (isinstance(window, int) and window > 0):
        refuse(f"sliding layers need a positive sliding_window (got {window!r})")
    if isinstance(window, bool):
        refuse(f"sliding_window {window!r} is not a window of tokens")
    causal = d.get("is_causal", dflash.get("causal"))
    if causal is True:
        refuse("is_causal: true (causal full-attention layers) is not supported")

    def count(key: str, default: int | None = None, part: dict = d) -> int:
        """A size of the config as written: absent (None) takes ``default``; 0, a float, a bool or a string is
        refused, never rounded or replaced (the engines read the file as it stands)."""
        if part.get(key) is None:
            if default is None:
                raise KeyError(key)  # a required size missing: not a drafter config
            return default
        return values.size(part.get(key), key, source)

    heads = count("num_attention_heads")
    hidden = count("hidden_size")
    block = count("block_size", part=dflash) if dflash.get("block_size") is not None else count("block_size", 16)
    theta = next((v for v in (d.get("rope_theta"), rope.get("rope_theta")) if v is not None), 1_000_000.0)
    return DrafterConfig(
        hidden_size=hidden, intermediate_size=count("intermediate_size"),
        vocab_size=count("vocab_size"), target_layers=layer_ids(dflash["target_layer_ids"], source),
        mask_token_id=token_id(dflash["mask_token_id"], "dflash_config.mask_token_id", source), num_heads=heads,
        num_kv_heads=count("num_key_value_heads", heads), head_dim=count("head_dim", hidden // heads), num_layers=n,
        block_size=block, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        sliding_window=[window if t == SLIDING else None for t in types], sliding_causal=causal is not False,
        max_position=count("max_position_embeddings", 40960), num_target_layers=d.get("num_target_layers"),
        attn_impl=attn_impl)


def layer_ids(value: Any, source: str) -> list[int]:
    """A drafter config's target layer ids as written: a list of integers (1.5 or true is no layer id, and is
    refused rather than rounded into one)."""
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise ValueError(f"{source}: target layer ids {value!r} are not a list of integers")
    return value


def token_id(value: Any, name: str, source: str) -> int:
    """A drafter config's token id as written: an integer (3.7 or true is no token, and is refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{source}: {name} {value!r} is not a token id")
    return value


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a drafter of this config (built on the meta device: no memory)."""
    meta = torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta")
    with torch.device("meta"):
        model = DFlashDrafter(cfg, meta, meta)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_tensors(cfg: DrafterConfig, tensors: dict[str, Any], source: str) -> None:
    """ValueError naming the first few missing / unexpected / misshapen tensors of ``source`` (tensors, or
    their shapes)."""
    want = expected_shapes(cfg)
    have = {k: tuple(v) if isinstance(v, (tuple, list)) else tuple(v.shape) for k, v in tensors.items()}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    shapes = [f"{k} {have[k]} != {want[k]}" for k in sorted(set(want) & set(have)) if have[k] != want[k]]
    problems = [f"missing {missing[:3]}" if missing else "", f"unexpected {extra[:3]}" if extra else "",
                f"shape {shapes[:3]}" if shapes else ""]
    if any(problems):
        raise ValueError(f"{source} does not match its config: {'; '.join(x for x in problems if x)}")


SAFETENSORS_HEADER_MAX = 100 << 20  # the safetensors format's own limit on its JSON header


def file_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header alone (8-byte length, then JSON): what a config can
    be checked against before any weight is built or read. The file is opened through the door (a regular file
    beneath its folder, never a link, a FIFO or a device)."""
    try:
        with door.opened(str(file.parent), file.name, where=str(file.parent)) as (fd, size):
            head = os.pread(fd, 8, 0)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(SAFETENSORS_HEADER_MAX, size - 8):
                raise ValueError(f"{file}: not a safetensors file (header length {n}, file {size:,} bytes)")
            raw = os.pread(fd, n, 8)
    except door.Refused as e:
        raise ValueError(str(e)) from None
    try:
        header = door.load_json(raw, str(file), error=ValueError)
        return {k: tuple(int(x) for x in v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{file}: malformed safetensors header ({type(e).__name__}: {e})") from None


def weights_bound(cfg: DrafterConfig, header_bytes: int = SAFETENSORS_HEADER_MAX) -> int:
    """The most bytes a weights file of a drafter of ``cfg`` may hold: its header and every tensor at 8 bytes a value
    (the files hold bf16 or fp32: a larger file is not this drafter's)."""
    return 8 + header_bytes + 8 * sum(math.prod(s) for s in expected_shapes(cfg).values())


def check_bounds(cfg: DrafterConfig, source: str) -> None:
    """Refuse a config whose numbers no drafter has, before anything is built from it (``expected_shapes`` builds
    the model's modules, on the meta device), by the value check's rules (``hsstore.format.values``): sizes
    positive integers of at most ``values.MAX_SIZE``, eps in (0, 1), a positive RoPE base, the mask token and
    taps inside the vocabulary and the target; then a drafter of this config must fit this machine's memory
    (its fp32 parameters: refused in one line, never attempted)."""
    if not 1 <= cfg.num_layers <= MAX_DRAFT_LAYERS:
        raise ValueError(f"{source}: {cfg.num_layers} layers; a drafter has 1 to {MAX_DRAFT_LAYERS}")
    if not 1 <= len(cfg.target_layers) <= MAX_TARGET_LAYERS:
        raise ValueError(f"{source}: {len(cfg.target_layers)} target layers; at most {MAX_TARGET_LAYERS}")
    for name in ("hidden_size", "intermediate_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim",
                 "block_size", "max_position"):
        values.size(getattr(cfg, name), name, source)
    values.real(cfg.rms_norm_eps, "rms_norm_eps", source, below=1.0)
    values.real(cfg.rope_theta, "rope_theta", source)
    values.token_ids(cfg.mask_token_id, "mask_token_id", cfg.vocab_size, source)
    depth = values.MAX_SIZE if cfg.num_target_layers is None else values.size(cfg.num_target_layers,
                                                                               "num_target_layers", source)
    wrong = [t for t in cfg.target_layers if not 0 <= t < depth]
    if wrong:
        raise ValueError(f"{source}: target layers {wrong} outside the target's {depth:,} layers")
    params = sum(math.prod(s) for s in expected_shapes(cfg).values())
    memory.check_fits(4 * params, f"{source}: a drafter of {params:,} parameters",
                      why="its config asks for more than this machine can hold")


def weight_dtypes(file: Path, is_master: bool = False) -> tuple[str, ...]:
    """The dtypes a drafter's weights file may hold: a checkpoint's master weights (``is_master``) fp32; the served
    file the dtype its ``config.json`` names (``dtype`` or ``torch_dtype``, as released drafters say), else any of
    ``values.FLOAT_DTYPES`` (the format before the DFlash one wrote fp32 and named none)."""
    if is_master:
        return ("float32",)
    d = door.read_json_beneath(file.parent, CONFIG, bound=JSON_CAP) if door.is_file_beneath(file.parent, CONFIG) \
        else {}
    named = (d.get("dtype") or d.get("torch_dtype")) if isinstance(d, dict) else None
    return (named,) if named in values.FLOAT_DTYPES else values.FLOAT_DTYPES


def check_weights(tensors: dict[str, Any], file: Path, is_master: bool = False) -> None:
    """The value check of a drafter's weights as loaded from ``file``: the dtype ``weight_dtypes`` allows, every
    value finite (one line naming the file and the tensor)."""
    values.check_tensors(tensors, str(file), dtypes=weight_dtypes(file, is_master))


def write_drafter(path: str | os.PathLike, cfg: DrafterConfig, tensors: dict[str, torch.Tensor],
                  meta: dict[str, Any] | None = None) -> Path:
    """A drafter directory (see the module doc) from a config, its weights and this project's metadata."""
    path = Path(path)
    os.close(sinks.open_folder(path, what=f"writing drafter {path}"))  # made when missing
    meta = dict(meta or {})
    if cfg.num_target_layers is None and (meta.get("target") or {}).get("num_layers"):
        cfg = dataclasses.replace(cfg, num_target_layers=int(meta["target"]["num_layers"]))
    check_tensors(cfg, tensors, "drafter weights")
    bf16 = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in tensors.items()}
    # a run that diverged leaves no drafter an engine would serve: values checked as every reader checks them
    values.check_tensors(bf16, f"writing drafter {path}")
    save_safetensors(bf16, path / WEIGHTS, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in bf16.values())},
             "weight_map": {k: WEIGHTS for k in sorted(bf16)}}
    files = {WEIGHTS_INDEX: json.dumps(index, indent=2),
             META: json.dumps({"format": "hsstore-drafter", "attn_impl": cfg.attn_impl, **meta}, indent=2),
             MODELING: MODELING_SOURCE, MODEL_CARD: model_card(cfg, meta), CONFIG: json.dumps(hf_config(cfg), indent=2)}
    for name, text in files.items():  # a link planted at a name is replaced, never written through
        sinks.write_atomic(path, name, text.encode(), what=f"writing drafter {path}", durable=False)
    return path


def written_by_hsstore(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a drafter folder ``write_drafter`` wrote and nothing else: only its files, regular files
    (no link), its metadata saying so. What ``export-drafter`` may replace with a new export."""
    path = Path(path)
    try:
        entries = set(os.listdir(path))
    except OSError:
        return False
    if not entries or not entries <= set(FILES) or not all(door.is_file_beneath(path, n) for n in entries):
        return False
    try:
        meta = door.read_json_beneath(path, META, bound=JSON_CAP)
    except (OSError, ValueError, StoreError):  # unreadable: not one to replace
        return False
    return isinstance(meta, dict) and meta.get("format") == "hsstore-drafter"


def save_drafter(path: str | os.PathLike, model: DFlashDrafter, extra: dict[str, Any] | None = None) -> Path:
    """The drafter directory of a live model: everything ``load_drafter`` and the engines need."""
    return write_drafter(path, model.config, model.state_dict(), extra)


def read_config(directory: Path) -> tuple[DrafterConfig, dict[str, Any]]:
    """(config, this project's metadata) of one drafter directory: the DFlash format (with or without
    hsstore_drafter.json: released drafters have none) and the legacy one."""
    source = str(directory / CONFIG)
    d = door.read_json_beneath(directory, CONFIG, bound=JSON_CAP)
    meta = door.read_json_beneath(directory, META, bound=JSON_CAP) if door.is_file_beneath(directory, META) else {}
    try:
        if not isinstance(d, dict) or not isinstance(meta, dict):
            raise TypeError(f"expected JSON objects, got {type(d).__name__} / {type(meta).__name__}")
        cfg, meta = _config_of(d, meta, source)
        if not isinstance(meta.get("target") or {}, dict):
            raise TypeError(f"its target is a {type(meta['target']).__name__}, not an object")
    except (KeyError, TypeError, AttributeError, IndexError, OverflowError, ZeroDivisionError) as e:
        raise ValueError(f"{source}: not a drafter config ({type(e).__name__}: {str(e)[:200]})") from None
    except ValueError as e:  # DrafterConfig's own rules (heads by KV heads, even head_dim) name no file
        raise ValueError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None
    check_bounds(cfg, source)
    return cfg, meta


def _config_of(d: dict[str, Any], meta: dict[str, Any], source: str) -> tuple[DrafterConfig, dict[str, Any]]:
    if d.get("architecture") == LEGACY_ARCHITECTURE:  # sliding layers were trained non-causally then
        meta = {k: v for k, v in d.items() if k not in ("architecture", "drafter")}
        legacy = d["drafter"]
        n = legacy.get("num_layers", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_DRAFT_LAYERS:
            raise ValueError(f"{source}: num_layers {n!r}: a drafter has 1 to {MAX_DRAFT_LAYERS} layers")
        layer_ids(legacy.get("target_layers"), source)
        cfg = DrafterConfig(**{"sliding_causal": False, **legacy})
        if cfg.num_target_layers is None and (meta.get("target") or {}).get("num_layers"):
            cfg = dataclasses.replace(cfg, num_target_layers=int(meta["target"]["num_layers"]))
        return cfg, meta
    meta = dict(meta)
    meta.pop("format", None)
    return config_from_hf(d, meta.pop("attn_impl", "sdpa"), source), meta
