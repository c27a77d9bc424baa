"""The target's and tokenizer's identity, as recorded in a store's manifest.

Hashes, not names: two teams that load one model from different paths get the same identity, and a
store made with another tokenizer or config is refused instead of silently mixed.
"""

from __future__ import annotations

import hashlib
import json

import torch

from hsstore import Manifest, TargetIdentity, TokenizerIdentity
from hsstore.manifest import canonical_json_hash, sha256_hex

from .capture import text_config

# Config fields that say where/how a model was loaded, not what it computes.
VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash",
                        "_attn_implementation", "_attn_implementation_autoset", "use_cache", "architectures"}


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


def build_manifest(model, tokenizer, name: str, layers: list[int], revision: str | None = None,
                   codec: str = "none", dtype: str = "bfloat16", layout: str = "zarr",
                   encoding: str = "raw", features: tuple[str, ...] = ()) -> Manifest:
    return Manifest(target=target_identity(model, name, revision), tokenizer=tokenizer_identity(tokenizer, name),
                    layers=tuple(layers), dtype=dtype, codec=codec, layout=layout, encoding=encoding,
                    features=features)
