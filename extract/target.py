"""The target: its tokenizer, its weights, and its identity as a store's manifest records it.

One home for everything that touches the target model folder, so that ``extract``, ``import``, ``check`` and
``show`` load and hash it the same way. Hashes, not names: two teams that load one model from different paths
get the same identity, and a store made with another tokenizer or config is refused instead of silently mixed.
Nothing is downloaded: the model is a local folder.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from hsstore.format.manifest import Manifest, TargetIdentity, TokenizerIdentity
from hsstore.format.manifest import canonical_json_hash, sha256_hex
from hsstore.format.serving import TapPlan, plan
from hsstore.app.target import text_config

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Config fields that say where/how a model was loaded, not what it computes.
VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash",
                        "_attn_implementation", "_attn_implementation_autoset", "use_cache", "architectures"}


# -- loading ---------------------------------------------------------------------------------------------------
def load_tokenizer(model: str):
    """The target's tokenizer from a local directory (nothing is downloaded)."""
    from transformers import AutoTokenizer

    if not Path(model).is_dir() and (model.startswith((".", "/", "~")) or model.count("/") != 1):
        raise FileNotFoundError(f"model directory not found: {model}")
    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # a damaged tokenizer.json raises whatever its parser raises: name the model
        raise ValueError(f"cannot load the tokenizer of {model}: {type(e).__name__}: {e}") from None


def planned_taps(target: str | Any, layers: list[int] | None, serve: list[str] | None = None,
                 final_hidden: bool = False) -> TapPlan | None:
    """``--layers`` (else DFlash's spacing) with what ``--serve`` needs, checked against the target's depth
    (``hsstore.format.serving.plan``, the one tap rule). ``target``: a model folder, whose ``config.json`` is read
    before the tokenizer, the gate or the weights are loaded, so a wrong id costs no time (None: the folder has no
    config), or a loaded model's config."""
    where = ""
    if isinstance(target, (str, Path)):
        path = Path(target) / "config.json"
        if not path.is_file():
            return None
        target, where = json.loads(path.read_text(encoding="utf-8")), f" ({path})"
    inner = text_config(target)
    n_layers = int(inner["num_hidden_layers"] if isinstance(inner, dict) else inner.num_hidden_layers)
    try:
        return plan(n_layers, layers, serve or (), final_hidden)
    except ValueError as e:
        given = f"--layers {','.join(map(str, layers))}: " if layers else ""
        raise ValueError(f"{given}{e}{where}") from None


def model_name(model_dir: str) -> str:
    """The name a store records for the model at ``model_dir``: its folder's name."""
    return model_dir.rstrip("/").rsplit("/", 1)[-1]


# -- assets: what a store keeps instead of the target ---------------------------------------------------------
def asset_files(embed: torch.Tensor, lm_head: torch.Tensor, config, tokenizer) -> dict[str, bytes]:
    """The files ``hsstore.format.assets`` keeps (embedding, lm_head, config, tokenizer): what ``train`` and ``show``
    use instead of the target, from ``extract`` and ``import --model`` alike."""
    import os
    import tempfile

    from hsstore.format import assets

    files = {assets.EMBED: assets.tensors_bytes({"weight": embed}),
             assets.LM_HEAD: assets.tensors_bytes({"weight": lm_head}),
             assets.CONFIG: config.to_json_string().encode()}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb") as f:
                files[f"{assets.TOKENIZER_DIR}/{name}"] = f.read()
    return files


def model_dir_assets(model_dir: str, dtype: torch.dtype) -> dict[str, bytes]:
    """``asset_files`` of a local model folder without loading the model: the embedding and lm_head read out of its
    safetensors files alone (the one tensor of shape [vocab, hidden] named ``...embed_tokens.weight``, and
    ``lm_head.weight``, or the embedding again when the config ties them), in ``dtype`` as extract stores them."""
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tc = text_config(config)
    shape = [int(tc.vocab_size), int(tc.hidden_size)]
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    where = (json.loads(index.read_text())["weight_map"] if index.is_file()
             else {k: "model.safetensors" for k in _keys(root / "model.safetensors")})

    def tensor(suffix: str) -> torch.Tensor | None:
        for key in sorted((k for k in where if k.endswith(suffix)), key=len):  # the shortest name: the text model's
            with safe_open(str(root / where[key]), framework="pt") as f:
                if list(f.get_slice(key).get_shape()) == shape:
                    return f.get_tensor(key).to(dtype)
        return None

    embed = tensor("embed_tokens.weight")
    head = tensor("lm_head.weight")
    tied = getattr(config, "tie_word_embeddings", False) or getattr(tc, "tie_word_embeddings", False)
    head = head if head is not None else (embed if tied else None)
    if embed is None or head is None:
        missing = " and ".join(n for n, t in (("embed_tokens.weight", embed), ("lm_head.weight", head)) if t is None)
        raise ValueError(f"{model_dir}: no {missing} of shape {shape} in its safetensors files: the store's assets "
                         "(what train and show use instead of the target) cannot be written from it")
    config.dtype = dtype  # as the config of a model loaded in that dtype says (extract's assets)
    return asset_files(embed, head, config, load_tokenizer(model_dir))


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    if not path.is_file():
        raise FileNotFoundError(f"{path.parent}: no model.safetensors nor model.safetensors.index.json")
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


# -- identity --------------------------------------------------------------------------------------------------
def _strip(d):
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items() if k not in VOLATILE_CONFIG_KEYS}
    return d


def config_hash(config) -> str:
    return canonical_json_hash(_strip(config.to_dict()))


def weights_hash(model: torch.nn.Module, max_bytes: int = 64 << 20) -> str:
    """A fingerprint of the input embedding (first ``max_bytes``): tells random inits of one config apart
    without hashing tens of GB."""
    w = model.get_input_embeddings().weight.detach()
    flat = w.reshape(-1)[: max_bytes // w.element_size()].contiguous().cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


FINGERPRINT = "weights_fingerprint"  # the manifest's ``extra`` key of ``weights_fingerprint``
FINGERPRINT_VALUES = 4096  # values of each parameter hashed, evenly spaced through it


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A fingerprint of every parameter of ``model``, not of the embedding alone (``weights_hash``): SHA-256 over the
    sorted digests of each parameter's shape and ``FINGERPRINT_VALUES`` values evenly spaced through it, as float32.
    A layer scaled, retrained or replaced changes nearly every value of its tensors, so any sample of them; the cost
    is a few kB per tensor whatever the model's size (no pass over its gigabytes). Names and load order are left out
    (another transformers version may rename a module); layers swapped whole are the audit's values' to see."""
    digests = []
    for p in model.parameters():
        flat = p.detach().reshape(-1)
        k = min(flat.numel(), FINGERPRINT_VALUES)
        at = torch.arange(k, device=flat.device, dtype=torch.int64) * flat.numel() // max(k, 1)
        values = flat[at].to(device="cpu", dtype=torch.float32).contiguous()
        digests.append(hashlib.sha256(repr(tuple(p.shape)).encode() + values.numpy().tobytes()).hexdigest())
    return sha256_hex("".join(sorted(digests)))


def target_identity(model, name: str, revision: str | None = None) -> TargetIdentity:
    tc = text_config(model.config)
    return TargetIdentity(name=name, num_layers=int(tc.num_hidden_layers), hidden_size=int(tc.hidden_size),
                          config_hash=config_hash(model.config), revision=revision,
                          model_type=getattr(model.config, "model_type", None), weights_hash=weights_hash(model))


def tokenizer_identity(tokenizer, name: str) -> TokenizerIdentity:
    vocab = tokenizer.get_vocab()
    special = sorted(str(t) for t in tokenizer.all_special_tokens)
    added = sorted((str(k), int(v)) for k, v in tokenizer.get_added_vocab().items())
    vocab_hash = sha256_hex(json.dumps({"vocab": sorted(vocab.items()), "special": special, "added": added}))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    return TokenizerIdentity(name=name, vocab_hash=vocab_hash,
                             chat_template_hash=sha256_hex(template) if template else None, vocab_size=len(vocab))


def identity_from_model_dir(model_dir: str) -> tuple[TargetIdentity, TokenizerIdentity]:
    """Target and tokenizer identity of a local model folder, hashed as ``extract`` hashes them (config and
    tokenizer only: no weights are loaded, so ``weights_hash`` stays unset)."""
    from transformers import AutoConfig

    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    tc = text_config(config)
    name = model_name(model_dir)
    target = TargetIdentity(name=name, num_layers=int(tc.num_hidden_layers), hidden_size=int(tc.hidden_size),
                            config_hash=config_hash(config), model_type=getattr(config, "model_type", None))
    return target, tokenizer_identity(load_tokenizer(model_dir), name)


def build_manifest(model, tokenizer, name: str, layers: list[int], revision: str | None = None,
                   codec: str = "none", dtype: str = "bfloat16", layout: str = "zarr",
                   encoding: str = "raw", features: tuple[str, ...] = ()) -> Manifest:
    return Manifest(target=target_identity(model, name, revision), tokenizer=tokenizer_identity(tokenizer, name),
                    layers=tuple(layers), dtype=dtype, codec=codec, layout=layout, encoding=encoding,
                    features=features, extra={FINGERPRINT: weights_fingerprint(model)})
