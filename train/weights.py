"""Read the target's embedding and lm_head matrices straight from its safetensors files.

Only those two tensors are read (safetensors opens lazily); the target model is never built.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
              "language_model.model.embed_tokens.weight")
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")


def _key_to_file(model_dir: Path) -> dict[str, str]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: f.name for k in sf.keys()})
    return out


def _pick(keys: dict[str, str], preferred, suffix: str) -> str | None:
    for k in preferred:
        if k in keys:
            return k
    hits = [k for k in keys if k.endswith(suffix) and "mtp" not in k]
    if len(hits) > 1:
        raise KeyError(f"ambiguous {suffix}: {hits}")
    return hits[0] if hits else None


def load_frozen_head(model_dir, dtype: torch.dtype | None = None, device="cpu"):
    """(embed_tokens [V, H], lm_head [V, H]) of a HF checkpoint directory; tied embeddings are handled."""
    model_dir = Path(model_dir)
    keys = _key_to_file(model_dir)
    ek = _pick(keys, EMBED_KEYS, "embed_tokens.weight")
    if ek is None:
        raise KeyError(f"no embed_tokens weight in {model_dir}")
    hk = _pick(keys, LM_HEAD_KEYS, "lm_head.weight")

    def read(k):
        with safe_open(str(model_dir / keys[k]), framework="pt", device=str(device)) as sf:
            t = sf.get_tensor(k)
        return t if dtype is None else t.to(dtype)

    embed = read(ek)
    head = read(hk) if hk is not None else embed  # tie_word_embeddings
    return embed, head
