"""The value check: what a tensor that enters training or leaves as a drafter may hold, and what the numbers of a
store's or a drafter's config may be, checked before anything is built from them.

Checksums prove that bytes are the bytes written. An embedding of NaN, a drafter's weights stored as integers and a
config that says ``rms_norm_eps: -1`` pass them, and then train NaN without a word, fail mid-step or ask for
terabytes. Features are held to ``health``'s rules (per sample, from the records' statistics); everything else a
trainer, an evaluation or an export takes in is held here, each rule one line naming the input:

* a tensor: a floating dtype of those allowed (assets and drafter files hold bf16, fp16 or fp32; a drafter's
  files the dtype its config names), the shape its config names, every value finite; the frozen embedding and
  lm_head not all zero either (a head of zeros trains nothing, as a feature of zeros does);
* a config's numbers: sizes positive integers of at most ``MAX_SIZE`` and equal to those of the tensors present,
  an eps finite and in (0, 1), a RoPE base finite and positive, token ids (eos, bos, pad, mask) inside the
  vocabulary. What a drafter of a config would take in memory is refused before it is built
  (``io.memory.check_fits``, by the drafter's own code).

torch is imported by the caller: the tensors come from it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    import torch

FLOAT_DTYPES = ("float32", "bfloat16", "float16")  # what a store's assets and a drafter's files hold
MAX_SIZE = 1 << 31  # any size of a model's config (hidden, FFN, vocabulary, heads, layers, positions)
CHUNK_VALUES = 1 << 26  # values counted at once: the temporaries of an embedding of gigabytes stay small
TOKEN_ID_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id")
# what a trainer reads of a target's config (``DrafterConfig.from_target_config``): present, and sizes; the optional
# ones sizes where present (a mixture-of-experts target may name no dense FFN width: --intermediate-size gives it)
TARGET_SIZES = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads")
TARGET_OPTIONAL_SIZES = ("intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings")


def dtype_name(t: "torch.Tensor") -> str:
    """``bfloat16``, ``int64``: a tensor's dtype as the rules and messages name it."""
    return str(t.dtype).removeprefix("torch.")


def value_counts(t: "torch.Tensor") -> tuple[int, int]:
    """(non-finite values, exact zeros) of a floating tensor on any device, counted a chunk at a time."""
    import torch

    flat = t.detach().reshape(-1)
    bad = torch.zeros((), dtype=torch.int64, device=flat.device)
    nonzero = torch.zeros_like(bad)
    for start in range(0, flat.numel(), CHUNK_VALUES):
        chunk = flat[start:start + CHUNK_VALUES]
        bad += (~torch.isfinite(chunk)).sum()
        nonzero += chunk.count_nonzero()
    return int(bad), flat.numel() - int(nonzero)


def tensor_problem(t: Any, *, dtypes: Sequence[str] = FLOAT_DTYPES, shape: Sequence[int] | None = None,
                   nonzero: bool = False) -> str | None:
    """What is wrong with tensor ``t`` by the rules above (None: nothing): its dtype not one of ``dtypes``, its
    shape not ``shape``, a non-finite value, or (``nonzero``) every value zero."""
    import torch

    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}, not a tensor"
    if dtype_name(t) not in dtypes:
        return f"dtype {dtype_name(t)}, expected {' or '.join(dtypes)}"
    if shape is not None and tuple(t.shape) != tuple(shape):
        return f"shape {list(t.shape)}, expected {list(shape)}"
    bad, zeros = value_counts(t)
    if bad:
        return f"non-finite values ({bad:,} of {t.numel():,})"
    if nonzero and zeros == t.numel():
        return f"all zero ({t.numel():,} values)"
    return None


def check_tensors(tensors: Mapping[str, Any], where: str, *, dtypes: Sequence[str] = FLOAT_DTYPES,
                  shapes: Mapping[str, Sequence[int]] | None = None, nonzero: bool = False,
                  error: type[Exception] = ValueError) -> None:
    """Refuse (``error``, one line naming ``where`` and the tensor) the first tensor of ``tensors`` that breaks a
    rule of ``tensor_problem``."""
    for name in sorted(tensors):
        problem = tensor_problem(tensors[name], dtypes=dtypes, shape=(shapes or {}).get(name), nonzero=nonzero)
        if problem:
            raise error(f"{where}: tensor {name!r}: {problem}")


# -- a config's numbers --------------------------------------------------------------------------------------------
def size(value: Any, name: str, where: str, *, error: type[Exception] = ValueError, most: int = MAX_SIZE) -> int:
    """``value`` when it is a positive integer of at most ``most``, else ``error`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise error(f"{where}: {name} {value!r} is not a positive integer of at most {most:,}")
    return value


def real(value: Any, name: str, where: str, *, above: float = 0.0, below: float = math.inf,
         error: type[Exception] = ValueError) -> float:
    """``value`` when it is a finite number strictly between ``above`` and ``below``, else ``error`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not above < value < below:
        bound = f"in ({above:g}, {below:g})" if math.isfinite(below) else f"above {above:g}"
        raise error(f"{where}: {name} {value!r} is not a finite number {bound}")
    return float(value)


def token_ids(value: Any, name: str, vocab: int, where: str, *, error: type[Exception] = ValueError) -> None:
    """A config's token id (or list of them, as ``eos_token_id`` may be), each inside the vocabulary; None passes."""
    if value is None:
        return
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab:
            raise error(f"{where}: {name} {value!r} is outside the vocabulary (ids 0..{vocab - 1})")


def check_target_config(cfg: Any, expect: Mapping[str, tuple[int, str]], where: str, *,
                        error: type[Exception] = ValueError) -> dict[str, Any]:
    """The target config a store keeps (``assets/config.json``), its text part returned once every number a trainer
    reads is bounded: ``TARGET_SIZES`` present, each size a positive integer of at most ``MAX_SIZE`` and equal to
    ``expect[name]`` (a value and what it is, e.g. the embedding's rows), ``rms_norm_eps`` in (0, 1), the RoPE base
    positive, the token ids inside the vocabulary."""
    if not isinstance(cfg, dict):
        raise error(f"{where}: a JSON {type(cfg).__name__}, not a model config")
    tc = cfg.get("text_config") or cfg  # multimodal configs nest the decoder's
    if not isinstance(tc, dict):
        raise error(f"{where}: text_config is a {type(tc).__name__}, not an object")
    for key in TARGET_SIZES:
        size(tc.get(key), key, where, error=error)
    for key in TARGET_OPTIONAL_SIZES:
        if tc.get(key) is not None:
            size(tc[key], key, where, error=error)
    for key, (value, what) in expect.items():
        if tc[key] != value:
            raise error(f"{where}: {key} {tc[key]}, but {what} {value}")
    if "rms_norm_eps" in tc:
        real(tc["rms_norm_eps"], "rms_norm_eps", where, below=1.0, error=error)
    rope = tc.get("rope_parameters") if isinstance(tc.get("rope_parameters"), dict) else {}
    for key, value in (("rope_theta", tc.get("rope_theta")), ("rope_parameters.rope_theta", rope.get("rope_theta"))):
        if value is not None:
            real(value, key, where, error=error)
    for part in (cfg, tc):
        for key in TOKEN_ID_KEYS:
            token_ids(part.get(key), key, tc["vocab_size"], where, error=error)
    return tc
