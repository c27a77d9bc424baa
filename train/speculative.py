"""``hsstore eval``: greedy speculative decoding with the target and a trained drafter.

One step, with the anchor x_p = the last token emitted (the target has not run on it yet):

    1. the drafter reads the target's tapped features of positions < p and the block
       [x_p, MASK, ...] and proposes d_1 .. d_{S-1} (its argmax at each block position);
    2. the target runs on x_p, d_1 .. d_{S-1} after its cached prefix and gives its own greedy token g_k at
       every draft position (g_k is what it would emit after x_p, d_1 .. d_{k-1});
    3. accept the longest prefix with d_k == g_k (n tokens), then the target's g_{n+1} as a bonus:
       n + 1 tokens for one target forward (fewer when an eos or the length limit ends the output inside them:
       the tokens the step adds to the output, as both peers below count them), between 1 and S.

The same forward also yields the features of every accepted position for the next step (the target
is causal: features at positions <= p + n depend only on accepted tokens).

Caches. The target decodes with its own Hugging Face cache (``past_key_values``): attention keys/values and,
for Qwen3.5/3.6 hybrids, each Gated DeltaNet layer's conv and recurrent state. A verification forward
advances that cache over all S block tokens; when a suffix is rejected the cache must go back to p + n + 1
tokens. Attention keys can be cut, but a recurrent state cannot be un-applied: as serving engines do for
hybrid targets, the verification keeps what each GDN layer needs to give its state at any block position
(``block_states``), and after the verdict the accepted one is put back in the cache by one delta-rule call per
GDN layer over the same block, its rejected tokens switched off: no copy of the cache, no second forward. A
cache of another layout (``block_states.for_model`` says which) takes the general path: a copy of the cache
before verifying (``copy.deepcopy``), restored after a rejection and advanced over x_p, d_1 .. d_n by a second,
shorter forward. The drafter keeps its own context: the projection of each position's features (``fc``, norm)
and every draft layer's keys and values of it are computed once, when the position is accepted
(``DraftContext``), instead of over the whole context at every step. Logits are computed only where they
are read (``logits_to_keep``: 1 token when decoding alone, the S block positions when verifying).

The output must equal target-only greedy decoding token for token (``tests/test_train_eval.py``, also
against a reference that re-runs the whole sequence without any cache).

Settings comparable with published acceptance lengths (DFlash's benchmark, z-lab ``dflash/benchmark.py``):
greedy (temperature 0; the only mode here), up to 2048 new tokens (``hsstore eval`` default), prompts
rendered with the chat template's generation prompt and ``enable_thinking`` (on by default, as DFlash runs its
Qwen3.5/3.6 thinking targets; its Qwen3-8B numbers are non-thinking: ``--no-thinking``).

tau, the acceptance length, is averaged two ways in the field, and both are reported (``tau_conventions``); in
both the prefill's forward is no step and its first token is not counted:

    tau_per_prompt  per prompt the mean over its steps, then the mean over prompts: what z-lab's benchmark prints
                    as "Average Acceptance length" (``dflash_generate`` records each step's tokens, the summary
                    takes the mean of the per-prompt means);
    tau_pooled      the tokens of every step of every prompt over the number of steps: what SGLang's server logs
                    as "accept len" and exports as ``sglang:spec_accept_length`` (the scheduler adds each verify
                    step's accepted drafts + 1 per request and counts one step per request, over all requests).

Short prompts weigh as much as long ones in the first, so the two differ when acceptance varies with the
output's length. (SGLang's per-request ``meta_info`` ``spec_accept_length`` is ``completion_tokens /
spec_verify_ct``: it counts the prefill's token among the tokens but not its forward among the steps, so it is
``tau_pooled`` of one request plus 1 / its steps.) The teacher-forced estimate that needs no target is
``evaluate.py``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from hsstore import env
from hsstore.app.devices import resolve_device
from hsstore.app.target import load_target, tapped

from . import block_states
from .masks import attend, block_attention_mask
from .model import rope_cos_sin
from .pointwise import apply_rope

log = logging.getLogger(__name__)

# propose(context features [p, L, H], tokens [p + 1] on the host (the anchor last)) -> S - 1 draft tokens. A
# proposer with a ``reset()`` method has it called before each generation (``DraftContext`` keeps state per
# generation).
Proposer = Callable[[torch.Tensor, torch.Tensor], list[int]]


@dataclass
class Generation:
    tokens: list[int]  # the generated tokens (prompt excluded)
    accepted: list[int] = field(default_factory=list)  # per speculative step: the tokens it added (accepted + 1)
    forwards: int = 0  # target forward passes (a verification and its re-run after a rejection count once)
    reruns: int = 0  # of them, forwards over accepted tokens again after a rejection (the general path only)
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        """This prompt's mean tokens per speculative step."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else float("nan")


def tau_conventions(accepted: Sequence[Sequence[int]]) -> tuple[float, float]:
    """(tau_per_prompt, tau_pooled) of the per-step token counts of each prompt (see the module doc): the mean of
    each prompt's mean, and all steps' tokens over all steps. Prompts without a step (done at the prefill) count in
    neither."""
    steps = [a for a in accepted if len(a)]
    if not steps:
        return float("nan"), float("nan")
    per_prompt = sum(sum(a) / len(a) for a in steps) / len(steps)
    return per_prompt, sum(map(sum, steps)) / sum(map(len, steps))


class TargetCache:
    """One generation's target state: the model's own cache (``past_key_values``) over the tokens committed so
    far, advanced by ``forward``; ``verify`` runs a block whose suffix may be rejected and ``accept`` keeps its
    first tokens. A Gated DeltaNet hybrid keeps them from what the verification recorded (``block_states``:
    no copy of the cache, no second forward); any other cache is copied before the block and, after a rejection,
    restored and advanced over the accepted tokens again (``keep_states=False`` forces that general path)."""

    def __init__(self, model, keep_states: bool = True):
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.kwarg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
        self.cache = None
        self.saved = None
        self.block: list[int] = []
        self.states = None if keep_states else False  # BlockStates, False: the general path, None: not yet known
        self.proven = False  # a verification recorded every GDN layer: no copy needed as a safety net
        self.reruns = 0  # forwards over accepted tokens again (the general path's rejections)

    @torch.inference_mode()
    def forward(self, ids: Sequence[int], keep: int, taps: Sequence[int] | None = None):
        """(logits of the last ``keep`` of ``ids`` [keep, V], tapped features of ``ids`` [len, L, H] or None),
        the cache advanced over ``ids``. Tap l is captured as extraction captures it (``hsstore.app.target.tapped``):
        the output of decoder layer l before the final norm, the last layer's too (HF's last ``hidden_states``
        entry is the norm's output, which the drafter was not trained on)."""
        dev = next(self.model.parameters()).device
        x = ids.view(1, -1) if isinstance(ids, torch.Tensor) else torch.tensor([list(ids)], dtype=torch.long, device=dev)
        with tapped(self.model, list(taps or [])) if taps else contextlib.nullcontext({}) as captured:
            out = self.model(input_ids=x, use_cache=True, logits_to_keep=keep,
                             **({self.kwarg: self.cache} if self.cache is not None else {}))
        if self.cache is None:  # the model made its cache in the prefill
            made = getattr(out, "cache", None)
            self.cache = made if made is not None else out.past_key_values
        feats = None if not taps else torch.stack([captured[l][0] for l in taps], dim=1)
        return out.logits[0, -keep:], feats

    @torch.inference_mode()
    def verify(self, ids: Sequence[int], taps: Sequence[int] | None = None):
        """``forward`` over a block (logits at every block position), ready for ``accept``."""
        self.block = ids if isinstance(ids, torch.Tensor) else list(ids)
        if self.states is None:
            self.states = block_states.for_model(self.model, self.cache) or False
        if not self.states or not self.proven:  # the first recorded block keeps a copy until it proves complete
            self.saved = copy.deepcopy(self.cache)
        if not self.states:
            return self.forward(ids, keep=len(ids), taps=taps)
        with self.states.recording(self.cache, len(ids)):
            out = self.forward(ids, keep=len(ids), taps=taps)
        if self.states.complete():
            self.proven = True
        elif self.saved is not None:
            log.info("eval: the target's Gated DeltaNet layers were not all recorded; rejected drafts are undone "
                     "by running the accepted tokens again")
            self.states = False
        else:
            raise RuntimeError("a verified block's Gated DeltaNet states were not all recorded")
        return out

    @torch.inference_mode()
    def accept(self, n: int) -> None:
        """Keep the first ``n`` tokens of the block just verified in the cache."""
        if n < len(self.block):
            if self.states:
                self.states.keep(self.cache, n)
            else:
                self.cache = self.saved
                self.forward(self.block[:n], keep=1)
                self.reruns += 1
        self.saved = None


def _finish(tokens: list[int], eos: set[int], max_new: int) -> tuple[list[int], bool]:
    """Cut at the first eos (kept) or at max_new; whether generation is over."""
    for i, t in enumerate(tokens[:max_new]):
        if t in eos:
            return tokens[: i + 1], True
    return tokens[:max_new], len(tokens) >= max_new


@torch.inference_mode()
def greedy_generate(model, prompt: Sequence[int], max_new: int, eos: set[int]) -> Generation:
    """Target-only greedy decoding with the target's cache, one token per forward (the baseline)."""
    t0 = time.perf_counter()
    target = TargetCache(model)
    logits, _ = target.forward(prompt, keep=1)
    out = [int(logits[-1].argmax())]
    gen = Generation(out, forwards=1)
    out[:], done = _finish(out, eos, max_new)
    while not done:
        logits, _ = target.forward(out[-1:], keep=1)
        gen.forwards += 1
        out.append(int(logits[-1].argmax()))
        out[:], done = _finish(out, eos, max_new)
    gen.seconds = time.perf_counter() - t0
    return gen


@torch.inference_mode()
def speculative_generate(model, propose: Proposer, prompt: Sequence[int], taps: Sequence[int], block_size: int,
                         max_new: int, eos: set[int], keep_states: bool = True) -> Generation:
    """Greedy speculative decoding (see the module doc); lossless: equals ``greedy_generate``. ``keep_states``:
    see ``TargetCache``."""
    t0 = time.perf_counter()
    S = block_size
    if hasattr(propose, "reset"):
        propose.reset()
    target = TargetCache(model, keep_states)
    logits, feats = target.forward(prompt, keep=1, taps=taps)  # prefill: the first token, the prompt's features
    # every committed position's features, in one buffer (the proposer reads a view of its first p rows)
    buf = feats.new_empty((len(prompt) + max_new + S, *feats.shape[1:]))
    buf[:len(prompt)] = feats
    out = [int(logits[-1].argmax())]
    gen = Generation(out, forwards=1)
    out[:], done = _finish(out, eos, max_new)
    while not done:
        p = len(prompt) + len(out) - 1  # the anchor's position: committed tokens < p are in the target's cache
        seq = torch.tensor(list(prompt) + out, dtype=torch.long)  # on the host: no copy to the device per step
        proposed = propose(buf[:p], seq)  # tokens, or a tensor on the device (verified without a wait for it)
        logits, feats = target.verify(block_of(out[-1], proposed, S), taps=taps)
        gen.forwards += 1
        draft, verdict = read_block(proposed, logits, S)  # verdict[k]: the target's token after x_p, d_1 .. d_k
        n = 0
        while n < len(draft) and draft[n] == verdict[n]:
            n += 1
        target.accept(n + 1)  # x_p, d_1 .. d_n stay in the cache; a rejected suffix leaves it
        buf[p:p + n + 1] = feats[:n + 1]  # causal: the accepted positions' features are final
        before = len(out)
        out.extend(draft[:n] + [verdict[n]])
        out[:], done = _finish(out, eos, max_new)
        gen.accepted.append(len(out) - before)  # an eos or the limit inside the block ends the step's count there
    gen.reruns = target.reruns
    gen.seconds = time.perf_counter() - t0
    return gen


def block_of(anchor: int, proposed, S: int):
    """The block the target verifies: the anchor then the S - 1 drafts, as a list, or on the drafts' device when
    they are a tensor there (no host round trip between drafting and verifying)."""
    if not isinstance(proposed, torch.Tensor):
        return [anchor, *[int(t) for t in proposed[: S - 1]]]
    block = torch.empty(S, dtype=torch.long, device=proposed.device)
    block[0] = anchor
    block[1:] = proposed[: S - 1]
    return block


def read_block(proposed, logits: torch.Tensor, S: int) -> tuple[list[int], list[int]]:
    """(the drafts, the target's verdict at every block position) on the host, in one transfer."""
    verdict = logits.argmax(-1)
    if not isinstance(proposed, torch.Tensor):
        return [int(t) for t in proposed[: S - 1]], verdict.tolist()
    both = torch.cat([proposed[: S - 1].to(verdict.device), verdict]).tolist()
    return both[: S - 1], both[S - 1:]


class DraftContext:
    """A DFlash drafter proposing for one generation at a time, its context kept between steps: per position,
    once, the context vector (``fc`` of the concatenated features, then ``hidden_norm``) and every draft layer's
    keys (RoPE at the position) and values of it. A step then runs only the S block tokens, attending to those
    keys under the training mask (``masks.block_attention_mask``, one anchor), so it drafts what
    ``DFlashDrafter.draft_hidden`` drafts over the whole context (tests/test_train_eval.py)."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.reset()

    def reset(self) -> None:
        self.keys: list[torch.Tensor | None] = [None] * len(self.drafter.layers)
        self.values: list[torch.Tensor | None] = [None] * len(self.drafter.layers)
        self.n = 0  # context positions held

    @torch.inference_mode()
    def extend(self, feats: torch.Tensor) -> None:
        """Add the features [t, L, H] of the next t positions."""
        d, c = self.drafter, self.drafter.config
        t = feats.shape[0]
        ctx = d.context(feats[None])  # [1, t, H]
        rope = rope_cos_sin(torch.arange(self.n, self.n + t, device=ctx.device)[None], c.head_dim, c.rope_theta,
                            ctx.dtype)
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            k = apply_rope(a.k_norm(a.k_proj(ctx).view(1, t, c.num_kv_heads, c.head_dim)), *rope)
            v = a.v_proj(ctx).view(1, t, c.num_kv_heads, c.head_dim)
            self.keys[i] = k if self.keys[i] is None else torch.cat([self.keys[i], k], dim=1)
            self.values[i] = v if self.values[i] is None else torch.cat([self.values[i], v], dim=1)
        self.n += t

    @torch.inference_mode()
    def __call__(self, ctx: torch.Tensor, seq: torch.Tensor) -> list[int]:
        """The Proposer: ``ctx`` the features of positions < p (those not yet held are added), ``seq`` the
        tokens with the anchor last."""
        p = seq.shape[0] - 1
        if ctx.shape[0] != p or self.n > p:
            raise ValueError(f"drafter context: {ctx.shape[0]} feature rows for anchor {p}, {self.n} held "
                             "(call reset() between generations)")
        if self.n < p:
            self.extend(ctx[self.n:p])
        h = self.block_hidden(int(seq[-1]), p)
        return F.linear(h.to(self.drafter.lm_head.dtype), self.drafter.lm_head).argmax(-1).tolist()

    @torch.inference_mode()
    def block_hidden(self, anchor: int, p: int) -> torch.Tensor:
        """The drafter's final-normed states [S-1, H] at block positions 1 .. S-1 for ``anchor`` at position ``p``
        (the context held: positions < p); ``draft_hidden``'s ``[0, 0, 1:]`` for the same anchor."""
        d, c = self.drafter, self.drafter.config
        S, nh, nkv, hd = c.block_size, c.num_heads, c.num_kv_heads, c.head_dim
        dev = d.lm_head.device
        ids = torch.full((1, S), c.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = anchor
        x = F.embedding(ids, d.embed_tokens).to(d.fc.weight.dtype)
        rope = rope_cos_sin(torch.arange(p, p + S, device=dev)[None], hd, c.rope_theta, x.dtype)
        anchors = torch.tensor([[p]], device=dev)
        valid = torch.ones(1, p, dtype=torch.bool, device=dev)
        masks = {}
        for i, layer in enumerate(d.layers):
            w = c.window(i)
            if w not in masks:
                masks[w] = block_attention_mask(anchors, valid, S, w, c.sliding_causal)
            a, h = layer.self_attn, layer.input_layernorm(x)
            q = apply_rope(a.q_norm(a.q_proj(h).view(1, S, nh, hd)), *rope)
            k_blk = apply_rope(a.k_norm(a.k_proj(h).view(1, S, nkv, hd)), *rope)
            v_blk = a.v_proj(h).view(1, S, nkv, hd)
            k = k_blk if self.keys[i] is None else torch.cat([self.keys[i][:, :p], k_blk], dim=1)
            v = v_blk if self.values[i] is None else torch.cat([self.values[i][:, :p], v_blk], dim=1)
            o = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), masks[w])
            x = x + a.o_proj(o.transpose(1, 2).reshape(1, S, nh * hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return d.norm(x)[0, 1:]


def drafter_proposer(drafter, graphs: bool | None = None):
    """A Proposer from a DFlashDrafter: its argmax at block positions 1 .. S-1 for the anchor at p, with the
    context kept between steps. ``graphs`` (default: on a GPU): in fixed-shape buffers, each step one CUDA graph
    replayed (``graphs.StaticDraft``; on a CPU the same steps eagerly); else ``DraftContext``."""
    on_gpu = drafter.lm_head.device.type == "cuda"
    if not (on_gpu if graphs is None else graphs):
        return DraftContext(drafter)
    from .graphs import StaticDraft

    return StaticDraft(drafter, graphs=on_gpu)


def eval_threads(model) -> int:
    """torch threads for decoding with ``model`` on the CPU: a small model's ops are too small to split (on a
    busy machine extra threads only wait on each other: docs/PERFORMANCE.md, "Design choices"), a large one's
    matmuls use every core. ``env.EVAL_THREADS`` overrides."""
    chosen = env.EVAL_THREADS.get()
    if chosen is not None:
        return chosen
    params = sum(p.numel() for p in model.parameters())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, SMALL_MODEL_THREADS) if params < SMALL_MODEL_PARAMS else cores


SMALL_MODEL_PARAMS = 50_000_000
SMALL_MODEL_THREADS = 1


# ---------------------------------------------------------------------------------------------- prompts


def load_prompts(paths: Sequence[str], tokenizer, limit: int | None = None,
                 enable_thinking: bool = True) -> list[tuple[str, list[int]]]:
    """(id, prompt token ids) from JSONL rows: ``messages`` (everything before the last assistant turn,
    rendered with the chat template and its generation prompt) or a plain ``prompt`` string.
    ``enable_thinking`` goes to the chat template (Qwen3/3.5/3.6 read it; other templates ignore it)."""
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.glob("*.jsonl")) if p.is_dir() else [p])
    out = []
    for f in files:
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            row = json.loads(line)
            if "messages" in row:
                msgs = list(row["messages"])
                while msgs and msgs[-1].get("role") == "assistant":
                    msgs.pop()
                if not msgs:
                    continue
                ids = tokenizer.apply_chat_template(msgs, tools=row.get("tools"), add_generation_prompt=True,
                                                    tokenize=True, return_dict=False, enable_thinking=enable_thinking)
            elif "prompt" in row:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                    add_generation_prompt=True, tokenize=True, return_dict=False,
                                                    enable_thinking=enable_thinking)
            else:
                raise ValueError(f"{f}:{i + 1}: expected a 'messages' or 'prompt' field")
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            out.append((str(row.get("id", f"{f.name}:{i}")), [int(t) for t in ids]))
            if limit is not None and len(out) >= limit:
                return out
    return out


# ---------------------------------------------------------------------------------------------- the evaluation


@dataclass
class EvalReport:
    samples: int
    block_size: int
    max_new_tokens: int
    tau_per_prompt: float  # mean over prompts of each prompt's mean tokens per step (z-lab's benchmark)
    tau_pooled: float  # every step's tokens over the steps, all prompts pooled (SGLang's server)
    tau_per_sample: list[float]
    target_tokens: int
    target_seconds: float
    spec_tokens: int
    spec_seconds: float
    identical: int  # samples whose speculative output equals target-only greedy output
    target_forwards: int
    spec_forwards: int
    # per sample that is not identical: where the outputs first differ and the target's logit margin there
    # between the two tokens (``divergence``); ``ties`` of them are within the dtype's rounding
    divergences: list[dict] = field(default_factory=list)
    spec_reruns: int = 0  # of spec_forwards, re-runs of accepted tokens after a rejection (the general path)
    verify_steps: int = 0  # speculative steps of all prompts (spec_forwards less the prefills)

    @property
    def ties(self) -> int:
        return sum(d["tie"] for d in self.divergences)

    @property
    def target_tps(self) -> float:
        return self.target_tokens / self.target_seconds if self.target_seconds else float("nan")

    @property
    def spec_tps(self) -> float:
        return self.spec_tokens / self.spec_seconds if self.spec_seconds else float("nan")

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(ties=self.ties, divergence_note=divergence_note(self.divergences), target_tokens_per_s=self.target_tps, spec_tokens_per_s=self.spec_tps,
                 speedup=self.spec_tps / self.target_tps if self.target_tps else float("nan"))
        return d

    def format_text(self) -> str:
        speed = self.spec_tps / self.target_tps if self.target_tps else float("nan")
        return "\n".join([
            f"eval: {self.samples} prompt(s), greedy, up to {self.max_new_tokens} new tokens, block {self.block_size}",
            f"  target only : {self.target_tokens:,} tokens in {self.target_seconds:.2f}s = "
            f"{self.target_tps:,.1f} tokens/s ({self.target_forwards} target forwards)",
            f"  speculative : {self.spec_tokens:,} tokens in {self.spec_seconds:.2f}s = "
            f"{self.spec_tps:,.1f} tokens/s ({self.spec_forwards} target forwards) -> {speed:.2f}x",
            f"  tau (tokens per verification step, accepted drafts + the target's own, 1..{self.block_size}; "
            "the prefill is no step):",
            f"    per prompt {self.tau_per_prompt:.2f}  (z-lab dflash benchmark's \"Average Acceptance length\": each "
            "prompt's mean, averaged over the prompts)",
            f"    pooled     {self.tau_pooled:.2f}  (SGLang server's \"accept len\": "
            f"{self.spec_tokens - self.samples:,} tokens / {self.verify_steps:,} steps of all prompts)",
            f"  speculative output == target greedy output: {self.identical}/{self.samples}"
            + (f" ({divergence_note(self.divergences)})" if self.divergences else ""),
        ])


def divergence_note(divergences: list[dict]) -> str:
    """What the samples whose outputs differ look like: ties of the target's two best tokens within rounding
    (two forwards of different shapes may break them differently) or real differences (a decoding error)."""
    ties = [d for d in divergences if d["tie"]]
    real = len(divergences) - len(ties)
    parts = []
    if ties:
        parts.append(f"{len(ties)} first differ{'s' if len(ties) == 1 else ''} at a near-tie of the target's two candidate tokens (logit margin "
                     + ", ".join(f"{d['margin']:.3g}" for d in ties[:5]) + (", ..." if len(ties) > 5 else "")
                     + f", within {ties[0]['dtype']} rounding): the cached 1-token and {ties[0]['block']}-token "
                     "forwards round differently, not a decoding error")
    if real:
        parts.append(f"{real} differ{'s' if real == 1 else ''} beyond rounding: a decoding error")
    return "; ".join(parts)


# a tie: the two tokens' logits closer than this share of the larger |logit| (bf16 keeps 8 significant bits; the
# cached 1-token and S-token forwards take different kernels through every layer, so a few of its roundings)
TIE_SHARE = {torch.bfloat16: 2 ** -5, torch.float16: 2 ** -8, torch.float32: 2 ** -16}


@torch.inference_mode()
def divergence(model, prompt: Sequence[int], base: list[int], spec: list[int], block: int) -> dict:
    """Where greedy output ``base`` and speculative output ``spec`` first differ, and the target's logits of
    the two tokens there, from one forward without any cache over the prompt and the common prefix: a margin
    within the dtype's rounding is a tie that the two decodings' forwards broke differently."""
    i = next((k for k, (a, b) in enumerate(zip(base, spec)) if a != b), min(len(base), len(spec)))
    dtype = next(model.parameters()).dtype
    out = {"position": i, "dtype": str(dtype).removeprefix("torch."), "block": block, "margin": float("nan"),
           "tie": False}
    if i >= min(len(base), len(spec)):  # one output ended (eos) where the other goes on: no two tokens to weigh
        return out
    dev = next(model.parameters()).device
    x = torch.tensor([list(prompt) + base[:i]], dtype=torch.long, device=dev)
    logits = model(input_ids=x, use_cache=False, logits_to_keep=1).logits[0, -1].float()
    a, b = float(logits[base[i]]), float(logits[spec[i]])
    margin = abs(a - b)
    out.update(margin=margin, logit=max(a, b), tie=margin <= TIE_SHARE.get(dtype, 2 ** -16) * max(abs(a), abs(b)))
    return out


def evaluate(model, drafter, prompts: Sequence[Sequence[int]], taps: Sequence[int], max_new: int,
             eos: set[int], progress: bool = False, keep_states: bool = True,
             graphs: bool | None = None) -> EvalReport:
    """Each prompt twice (target alone, then speculative), a bar showing tau and tokens/s so far.
    ``keep_states``: see ``TargetCache``; ``graphs``: see ``drafter_proposer``."""
    from tqdm import tqdm

    propose = drafter_proposer(drafter, graphs)
    S = drafter.config.block_size
    taus, steps, identical = [], [], 0
    divergences = []
    tt = ts = 0.0
    nt = ns = ft = fs = reruns = 0
    if prompts:  # warm up both models and both paths so the first timing is not the allocator's (or a compile)
        greedy_generate(model, prompts[0], 2, eos)
        speculative_generate(model, propose, prompts[0], taps, S, 2, eos, keep_states)
    bar = tqdm(prompts, desc="eval", unit="prompt", disable=not progress)
    for k, prompt in enumerate(bar):
        base = greedy_generate(model, prompt, max_new, eos)
        spec = speculative_generate(model, propose, prompt, taps, S, max_new, eos, keep_states)
        reruns += spec.reruns
        identical += int(base.tokens == spec.tokens)
        if base.tokens != spec.tokens:
            d = divergence(model, prompt, base.tokens, spec.tokens, S)
            divergences.append({"sample": k, **d})
            (log.info if d["tie"] else log.warning)(
                "speculative output differs from greedy output after %d equal tokens: target logit margin %.3g "
                "between the two tokens (%s)", d["position"], d["margin"],
                f"a tie within {d['dtype']} rounding" if d["tie"] else "beyond rounding: a decoding error")
        if spec.accepted:
            taus.append(spec.tau)
            steps.append(spec.accepted)
        tt, nt, ft = tt + base.seconds, nt + len(base.tokens), ft + base.forwards
        ts, ns, fs = ts + spec.seconds, ns + len(spec.tokens), fs + spec.forwards
        bar.set_postfix(tau_per_prompt=f"{sum(taus) / max(len(taus), 1):.2f}",
                        target_tok_s=f"{nt / max(tt, 1e-9):.1f}", spec_tok_s=f"{ns / max(ts, 1e-9):.1f}", refresh=False)
    per_prompt, pooled = tau_conventions(steps)
    return EvalReport(len(prompts), S, max_new, per_prompt, pooled, taus, nt, tt, ns, ts, identical, ft, fs,
                      divergences, reruns, verify_steps=sum(map(len, steps)))


def evaluate_target(store_url: str, drafter_dir: str, model_dir: str, inputs: Sequence[str], *,
                    storage_options: dict | None = None, device: str | None = None, dtype: str | None = None,
                    num_samples: int | None = None, thinking: bool = True, max_new_tokens: int = 2048,
                    progress: bool = False, keep_states: bool = True, graphs: bool | None = None) -> EvalReport:
    """``hsstore eval --model``: the drafter at ``drafter_dir`` decoding the prompts of ``inputs`` with the
    target at ``model_dir``, which must be the one the store was extracted from (same input embedding): the
    drafter's frozen embedding and head come from the store."""
    from transformers import AutoTokenizer

    from hsstore.store import reader

    from .checkpoint import load_drafter, read_drafter_config
    from .build import load_frozen

    dev = resolve_device(device)
    dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    store = reader.open(store_url, **(storage_options or {}))
    store.admit()  # the admission's store-wide rules (each shard's: when read)
    dcfg, _ = read_drafter_config(drafter_dir)
    if list(dcfg.target_layers) != list(store.manifest.layers):
        raise ValueError(f"drafter taps {dcfg.target_layers} differ from the store's {list(store.manifest.layers)}")
    _, embed, head = load_frozen(store)  # in the dtype extraction ran in

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    # what can be refused without the target (the prompts, the drafter's weights) is, before it loads
    prompts = load_prompts(inputs, tokenizer, limit=num_samples, enable_thinking=thinking)
    if not prompts:
        raise ValueError(f"no prompts in {inputs}")
    drafter = load_drafter(drafter_dir, embed.to(dev, dt), head.to(dev, dt), attn_impl="sdpa").to(device=dev,
                                                                                                 dtype=dt).eval()
    model = load_target(model_dir, dt, dev, progress)  # extraction's loader: the same kernels
    log.info("eval: the drafter is fed taps %s, each its target layer's output before the final norm (as "
             "extracted)", dcfg.target_layers)
    mine = model.get_input_embeddings().weight.detach()
    if mine.shape != embed.shape or not torch.equal(mine.to(embed.dtype).cpu(), embed):
        raise ValueError(f"{model_dir} is not the target the store {store_url} was extracted from "
                         "(its input embedding differs from the store's)")
    eos_ids = model.generation_config.eos_token_id
    eos = {int(x) for x in ([eos_ids] if isinstance(eos_ids, int) else (eos_ids or []))}
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    before = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(eval_threads(model))
        log.info("eval: decoding on %d CPU thread(s) (%s; HSSTORE_EVAL_THREADS to choose)", torch.get_num_threads(),
                 "a small target's ops are too small to split" if torch.get_num_threads() < os.cpu_count()
                 else "every core")
    try:
        return evaluate(model, drafter, [p for _, p in prompts], dcfg.target_layers, max_new_tokens, eos,
                        progress=progress, keep_states=keep_states, graphs=graphs)
    finally:
        torch.set_num_threads(before)
