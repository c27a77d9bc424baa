"""Tiny Qwen3.5-architecture targets built offline: a random-weight one and a trained one.

Tests, ``hsstore demo`` and CI need a real target (hybrid Gated DeltaNet + gated full attention, a
ChatML tokenizer with reasoning markers, a Qwen3-style chat template) without downloading anything.
The random one (``build_tiny_target`` / ``tiny_target_dir``) is derived from a seed and the bundled demo
text, so two builds with the same seed give byte-identical files. Its drafters cannot learn anything
(tau ~ 1), so ``hsstore demo`` uses the trained one (``build_trained_target`` / ``trained_target_dir``):
same architecture and template, its weights and BPE shipped in ``data/tiny_trained/`` by
``tools/train_tiny_target.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Iterable

from hsstore import env

logger = logging.getLogger(__name__)

#: Bump when the build recipe changes, so cached directories are rebuilt.
BUILD_VERSION = 1

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Added as non-special tokens (like Qwen's), so ``skip_special_tokens`` keeps them in decoded text.
MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Written for hsstore. Assistant turns after the last user message keep their reasoning; earlier ones drop it,
# as Qwen3's templates do, so the tokenizer code must cope with a template that is not prefix-stable across
# user turns. No {% generation %} markers on purpose: masks come from diffing rendered prefixes.
CHAT_TEMPLATE = r"""{#- hsstore tiny target chat template (ChatML turns, Qwen3-style reasoning).
    Assistant turns after the last user message ("current" turns) render
    "<think>\n{reasoning}\n</think>\n\n{answer}"; earlier assistant turns render only
    their answer, i.e. their reasoning is dropped, as Qwen3 templates do.
    No generation markers: hsstore derives loss masks by diffing rendered prefixes. -#}
{%- set state = namespace(last_user=-1) -%}
{%- for msg in messages -%}
    {%- if msg.role == 'user' -%}
        {%- set state.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- set first_is_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if first_is_system -%}
        {{- messages[0].content | trim + '\n\n' -}}
    {%- endif -%}
    {{- 'Functions you can call, one JSON schema per line:\n<tools>\n' -}}
    {%- for tool in tools -%}
        {{- (tool.function if tool.function is defined else tool) | tojson + '\n' -}}
    {%- endfor -%}
    {{- '</tools>\nTo call one, write <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n' -}}
{%- endif -%}
{%- for msg in messages -%}
    {%- if msg.role == 'system' -%}
        {%- if not (loop.first and tools) -%}
            {{- '<|im_start|>system\n' + msg.content | trim + '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif msg.role == 'user' -%}
        {{- '<|im_start|>user\n' + msg.content | trim + '<|im_end|>\n' -}}
    {%- elif msg.role == 'assistant' -%}
        {%- set answer = msg.content if msg.content is string else '' -%}
        {%- set reasoning = msg.reasoning_content if msg.reasoning_content is string else '' -%}
        {%- if '</think>' in answer -%}
            {%- set reasoning = answer.split('</think>')[0].split('<think>')[-1] -%}
            {%- set answer = answer.split('</think>')[-1] -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > state.last_user -%}
            {{- '<think>\n' + reasoning | trim + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- answer | trim -}}
        {%- for call in (msg.tool_calls or []) -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if answer | trim or not loop.first -%}
                {{- '\n' -}}
            {%- endif -%}
            {{- '<tool_call>\n{"name": ' + fn.name | tojson + ', "arguments": ' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- fn.arguments | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif msg.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + msg.content | trim + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('unsupported role: ' + msg.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}"""

# Pre-tokenizer split pattern: the one Qwen3.5's tokenizer uses (imported when available so the tiny
# tokenizer segments text the way the real target does); GPT-2's byte-level pattern otherwise.
try:  # pragma: no cover - depends on the installed transformers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX as _SPLIT_PATTERN
except Exception:  # pragma: no cover
    _SPLIT_PATTERN = None


#: Where the trained tiny target's files live inside the package, and the ones its build reads.
TRAINED_DATA = "data/tiny_trained"
TRAINED_FILES = ("model.safetensors", "tokenizer.json", "target.json")


def demo_conversations_path() -> Path:
    """Path of the bundled demo conversations (JSONL)."""
    return Path(str(resources.files(__package__).joinpath("data/demo_conversations.jsonl")))


def _training_texts() -> list[str]:
    """Text the BPE is trained on: every string of the bundled conversations plus the template's literals."""
    texts = [CHAT_TEMPLATE]
    with open(demo_conversations_path(), encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            for msg in row["messages"]:
                texts.append(msg.get("role", ""))
                for key in ("content", "reasoning_content"):
                    if isinstance(msg.get(key), str):
                        texts.append(msg[key])
                for call in msg.get("tool_calls") or []:
                    texts.append(json.dumps(call, ensure_ascii=False))
            for tool in row.get("tools") or []:
                texts.append(json.dumps(tool, ensure_ascii=False))
    return texts


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on ``texts``, with the special and markup tokens added.

    Byte-level means any string tokenizes (unknown text falls back to single bytes). Training is
    deterministic for a given corpus and ``vocab_size``.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    if _SPLIT_PATTERN is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:  # pragma: no cover
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tok


def wrap_tokenizer(tok):
    """A transformers fast tokenizer around a ``tokenizers.Tokenizer``: Qwen's eos/pad and the chat template."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_tokenizer(vocab_size: int = 1024):
    """The random target's tokenizer: a byte-level BPE trained on the bundled demo text (see ``train_bpe``)."""
    return wrap_tokenizer(train_bpe(_training_texts(), vocab_size))


def target_config(
    tokenizer,
    *,
    num_layers: int = 8,
    full_attention_interval: int = 4,
    hidden_size: int = 64,
    intermediate_size: int = 128,
):
    """The tiny ``Qwen3_5TextConfig``: ``full_attention_interval - 1`` Gated DeltaNet layers then one gated full
    attention layer, repeated (3 + 1 like the real 27B), partial rotary like Qwen3.5."""
    from transformers import Qwen3_5TextConfig

    layer_types = [
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention" for i in range(num_layers)
    ]
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=32768,
        # Partial rotary (1/4 of head_dim) with a text-only mrope split summing to rotary_dim / 2, like Qwen3.5.
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    return config


def save_weights(path: Path, state: dict) -> Path:
    """safetensors directly (not save_pretrained): no progress bars or volatile metadata, same bytes each time."""
    from hsstore.io.tensorfiles import save_safetensors

    state = {k: v.detach().contiguous().clone() for k, v in state.items()}
    return save_safetensors(state, path, metadata={"format": "pt"})


def save_target(out: Path, state: dict | None, config, tokenizer) -> Path:
    """Write weights (unless ``state`` is None: the caller provides them), config, generation config (greedy)
    and tokenizer: a directory ``from_pretrained`` loads."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    if state is not None:
        save_weights(out / "model.safetensors", state)
    config.save_pretrained(out)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_target(
    out_dir: str | os.PathLike,
    seed: int = 0,
    *,
    num_layers: int = 8,
    full_attention_interval: int = 4,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    vocab_size: int = 1024,
    dtype: str = "float32",
) -> Path:
    """Write a tiny random-weight Qwen3.5 (``qwen3_5_text``) model plus tokenizer to ``out_dir``.

    The layer pattern is ``full_attention_interval - 1`` Gated DeltaNet layers then one gated full
    attention layer, repeated (3 + 1 like the real 27B). Loadable with
    ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``. Same arguments give
    byte-identical files. Weights are float32 by default so CPU tests can compare features exactly.
    """
    import torch
    from transformers import Qwen3_5ForCausalLM

    tokenizer = build_tokenizer(vocab_size)
    config = target_config(tokenizer, num_layers=num_layers, full_attention_interval=full_attention_interval,
                           hidden_size=hidden_size, intermediate_size=intermediate_size)
    config.dtype = dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(config)
    model.to(getattr(torch, dtype))
    out = save_target(Path(out_dir), model.state_dict(), config, tokenizer)
    logger.info("built tiny Qwen3.5 target in %s (%d layers, vocab %d)", out, num_layers, len(tokenizer))
    return out


def trained_files() -> Path:
    """The shipped files of the trained tiny target (``tools/train_tiny_target.py`` writes them): weights,
    ``tokenizer.json`` (its BPE), ``target.json`` (sizes, provenance), ``conversations.jsonl`` (prompts it answered
    greedily: the demo's extraction input) and ``heldout.jsonl`` (eval prompts in neither training set)."""
    return Path(str(resources.files(__package__).joinpath(TRAINED_DATA)))


def build_trained_target(out_dir: str | os.PathLike) -> Path:
    """Write the trained tiny target as a ``from_pretrained`` directory: the shipped weights, the tokenizer
    wrapped around the shipped BPE, the config rebuilt from the recorded sizes with ``target_config``."""
    from tokenizers import Tokenizer

    src = trained_files()
    meta = json.loads((src / "target.json").read_text(encoding="utf-8"))
    tokenizer = wrap_tokenizer(Tokenizer.from_str((src / "tokenizer.json").read_text(encoding="utf-8")))
    config = target_config(tokenizer, **meta["sizes"])
    config.dtype = "float32"
    out = save_target(Path(out_dir), None, config, tokenizer)
    shutil.copyfile(src / "model.safetensors", out / "model.safetensors")  # a new file: the umask's mode
    return out


def _cache_key(seed: int, kwargs: dict) -> str:
    import transformers

    h = hashlib.sha256()
    h.update(
        json.dumps(
            {"v": BUILD_VERSION, "seed": seed, "kw": kwargs, "tf": transformers.__version__}, sort_keys=True
        ).encode()
    )
    h.update(Path(__file__).read_bytes())
    h.update(demo_conversations_path().read_bytes())
    return h.hexdigest()[:16]


def _cached(name: str, build, cache_dir: str | os.PathLike | None = None) -> Path:
    """``build(dir)`` once into ``cache_dir`` (default ``$HSSTORE_CACHE_DIR`` or the temp dir) under ``name`` and
    reuse it. Builds go to a private directory renamed into place, which makes concurrent callers
    (pytest-xdist, parallel demos) safe."""
    root = Path(cache_dir or env.CACHE_DIR.get() or Path(tempfile.gettempdir()) / "hsstore-cache")
    target = root / name
    if (target / "model.safetensors").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its build is identical
            if not (target / "model.safetensors").exists():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def tiny_target_dir(seed: int = 0, cache_dir: str | os.PathLike | None = None, **kwargs) -> Path:
    """Build the tiny random-weight target once and reuse it (``$HSSTORE_CACHE_DIR`` or the temp dir).

    The cache key covers the arguments, this file, the demo data and the transformers version, so a
    stale build is never reused.
    """
    return _cached(f"tiny-qwen3_5-{_cache_key(seed, kwargs)}", lambda d: build_tiny_target(d, seed=seed, **kwargs),
                   cache_dir)


def trained_target_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The trained tiny target (``build_trained_target``) as a cached ``from_pretrained`` directory; the key covers
    the shipped files, this file and the transformers version."""
    import transformers

    h = hashlib.sha256(json.dumps({"v": BUILD_VERSION, "tf": transformers.__version__}).encode())
    h.update(Path(__file__).read_bytes())
    for name in TRAINED_FILES:
        h.update((trained_files() / name).read_bytes())
    return _cached(f"tiny-qwen3_5-trained-{h.hexdigest()[:16]}", build_trained_target, cache_dir)
