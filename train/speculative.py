"""``hsstore eval``: greedy speculative decoding with the target and a trained drafter.

One step, with the anchor x_p = the last token emitted (the target has not run on it yet):

    1. the drafter reads the target's tapped features of positions < p and the block
       [x_p, MASK, ...] and proposes d_1 .. d_{S-1} (its argmax at each block position);
    2. the target runs on prefix + x_p + d_1 .. d_{S-1} and gives its own greedy token g_k at every
       draft position (g_k is what it would emit after x_p, d_1 .. d_{k-1});
    3. accept the longest prefix with d_k == g_k (n tokens), then the target's g_{n+1} as a bonus:
       n + 1 tokens for one target forward. tau (acceptance length) = n + 1, between 1 and S.

The same forward also yields the features of every accepted position for the next step (the target
is causal: features at positions <= p + n depend only on accepted tokens).

Deliberately simple: the target re-runs the whole sequence every step (no KV cache). With Gated
DeltaNet layers a cache would have to be rolled back to the accepted prefix, which a recurrent state
cannot do without snapshots. It is correct and fine for small models and short generations; the
target-only baseline runs the same way, so the speedup measures what tau buys, not a serving stack.
The output must equal target-only greedy decoding token for token: that is the test of this code.

Settings comparable with published acceptance lengths (DFlash's benchmark, z-lab ``dflash/benchmark.py``):
greedy (temperature 0; the only mode here), up to 2048 new tokens (``hsstore eval`` default), prompts
rendered with the chat template's generation prompt and ``enable_thinking`` (on by default, as DFlash runs its
Qwen3.5/3.6 thinking targets; its Qwen3-8B numbers are non-thinking: ``--no-thinking``), and tau averaged as
there: per prompt the mean acceptance length over its speculative steps (the prefill's first token is no
step), then the mean over prompts. The teacher-forced estimate that needs no target is ``evaluate.py``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from hsstore.devices import resolve_device, route_cpu_kernels

log = logging.getLogger(__name__)

# propose(context features [p, L, H], tokens [p + 1] (the anchor last)) -> S - 1 draft tokens
Proposer = Callable[[torch.Tensor, torch.Tensor], list[int]]


@dataclass
class Generation:
    tokens: list[int]  # the generated tokens (prompt excluded)
    accepted: list[int] = field(default_factory=list)  # per speculative step: accepted drafts + 1
    forwards: int = 0  # target forward passes
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        return sum(self.accepted) / len(self.accepted) if self.accepted else float("nan")


@torch.inference_mode()
def target_step(model, ids: torch.Tensor, taps: Sequence[int], keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tapped features [T, L, H], logits of the last ``keep`` positions [keep, V]) for tokens ``ids`` [T].
    Layer id l is HF ``hidden_states[l + 1]`` (index 0 is the embeddings)."""
    out = model(input_ids=ids[None], output_hidden_states=True, logits_to_keep=keep, use_cache=False)
    feats = torch.stack([out.hidden_states[l + 1][0] for l in taps], dim=1)
    return feats, out.logits[0, -keep:]


def _finish(tokens: list[int], eos: set[int], max_new: int) -> tuple[list[int], bool]:
    """Cut at the first eos (kept) or at max_new; whether generation is over."""
    for i, t in enumerate(tokens[:max_new]):
        if t in eos:
            return tokens[: i + 1], True
    return tokens[:max_new], len(tokens) >= max_new


@torch.inference_mode()
def greedy_generate(model, prompt: Sequence[int], max_new: int, eos: set[int]) -> Generation:
    """Target-only greedy decoding, re-running the full sequence each token (the baseline)."""
    t0 = time.perf_counter()
    dev = next(model.parameters()).device
    ids = torch.tensor(list(prompt), dtype=torch.long, device=dev)
    out: list[int] = []
    gen = Generation(out)
    while True:
        logits = model(input_ids=ids[None], logits_to_keep=1, use_cache=False).logits[0, -1]
        gen.forwards += 1
        tok = int(logits.argmax())
        out.append(tok)
        ids = torch.cat([ids, ids.new_tensor([tok])])
        out[:], done = _finish(out, eos, max_new)
        if done:
            break
    gen.seconds = time.perf_counter() - t0
    return gen


@torch.inference_mode()
def speculative_generate(model, propose: Proposer, prompt: Sequence[int], taps: Sequence[int], block_size: int,
                         max_new: int, eos: set[int]) -> Generation:
    """Greedy speculative decoding (see the module doc); lossless: equals ``greedy_generate``."""
    t0 = time.perf_counter()
    dev = next(model.parameters()).device
    S = block_size
    seq = torch.tensor(list(prompt), dtype=torch.long, device=dev)
    feats, logits = target_step(model, seq, taps, keep=1)  # prefill: the first token, features of the prompt
    out = [int(logits[-1].argmax())]
    gen = Generation(out, forwards=1)
    out[:], done = _finish(out, eos, max_new)
    while not done:
        seq = torch.tensor(list(prompt) + out, dtype=torch.long, device=dev)
        p = len(seq) - 1  # the anchor's position
        draft = propose(feats[:p], seq)[: S - 1]
        cand = torch.cat([seq, seq.new_tensor(draft)])
        feats, logits = target_step(model, cand, taps, keep=len(draft) + 1)
        gen.forwards += 1
        target = logits.argmax(-1).tolist()  # target[k]: its token after x_p, d_1 .. d_k
        n = 0
        while n < len(draft) and draft[n] == target[n]:
            n += 1
        gen.accepted.append(n + 1)
        out.extend(draft[:n] + [target[n]])
        out[:], done = _finish(out, eos, max_new)
    gen.seconds = time.perf_counter() - t0
    return gen


def drafter_proposer(drafter) -> Proposer:
    """A Proposer from a DFlashDrafter: its argmax at block positions 1 .. S-1 for the anchor at p."""

    @torch.inference_mode()
    def propose(ctx: torch.Tensor, seq: torch.Tensor) -> list[int]:
        p = seq.shape[0] - 1
        L, H = ctx.shape[1], ctx.shape[2]
        hs = torch.zeros(1, p + 1, L, H, dtype=ctx.dtype, device=ctx.device)
        hs[0, :p] = ctx  # position p (the anchor) has no features yet; the mask never reads it
        h = drafter.draft_hidden(hs, seq[None], torch.tensor([[p]], device=seq.device))
        logits = F.linear(h[0, 0, 1:].to(drafter.lm_head.dtype), drafter.lm_head)
        return logits.argmax(-1).tolist()

    return propose


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
    tau: float  # mean over samples of each sample's mean acceptance length
    tau_per_sample: list[float]
    target_tokens: int
    target_seconds: float
    spec_tokens: int
    spec_seconds: float
    identical: int  # samples whose speculative output equals target-only greedy output
    target_forwards: int
    spec_forwards: int

    @property
    def target_tps(self) -> float:
        return self.target_tokens / self.target_seconds if self.target_seconds else float("nan")

    @property
    def spec_tps(self) -> float:
        return self.spec_tokens / self.spec_seconds if self.spec_seconds else float("nan")

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(target_tokens_per_s=self.target_tps, spec_tokens_per_s=self.spec_tps,
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
            f"  tau (mean acceptance length, 1..{self.block_size}): {self.tau:.2f}",
            f"  speculative output == target greedy output: {self.identical}/{self.samples}",
        ])


def evaluate(model, drafter, prompts: Sequence[Sequence[int]], taps: Sequence[int], max_new: int,
             eos: set[int], progress: bool = False) -> EvalReport:
    """Each prompt twice (target alone, then speculative); slow without a KV cache, so a bar shows tau so far."""
    from tqdm import tqdm

    propose = drafter_proposer(drafter)
    S = drafter.config.block_size
    taus, identical = [], 0
    tt = ts = 0.0
    nt = ns = ft = fs = 0
    if prompts:  # warm up both models so the first timing is not the allocator's
        speculative_generate(model, propose, prompts[0], taps, S, 2, eos)
    bar = tqdm(prompts, desc="eval", unit="prompt", disable=not progress)
    for prompt in bar:
        base = greedy_generate(model, prompt, max_new, eos)
        spec = speculative_generate(model, propose, prompt, taps, S, max_new, eos)
        identical += int(base.tokens == spec.tokens)
        if base.tokens != spec.tokens:
            log.warning("speculative output differs from greedy output (first %d tokens agree)",
                        next((i for i, (a, b) in enumerate(zip(base.tokens, spec.tokens)) if a != b),
                             min(len(base.tokens), len(spec.tokens))))
        if spec.accepted:
            taus.append(spec.tau)
        tt, nt, ft = tt + base.seconds, nt + len(base.tokens), ft + base.forwards
        ts, ns, fs = ts + spec.seconds, ns + len(spec.tokens), fs + spec.forwards
        bar.set_postfix(tau=f"{sum(taus) / max(len(taus), 1):.2f}", target_tok_s=f"{nt / max(tt, 1e-9):.1f}",
                        spec_tok_s=f"{ns / max(ts, 1e-9):.1f}", refresh=False)
    tau = sum(taus) / len(taus) if taus else float("nan")
    return EvalReport(len(prompts), S, max_new, tau, taus, nt, tt, ns, ts, identical, ft, fs)


def evaluate_target(store_url: str, drafter_dir: str, model_dir: str, inputs: Sequence[str], *,
                    storage_options: dict | None = None, device: str | None = None, dtype: str | None = None,
                    num_samples: int | None = None, thinking: bool = True, max_new_tokens: int = 2048,
                    progress: bool = False) -> EvalReport:
    """``hsstore eval --model``: the drafter at ``drafter_dir`` decoding the prompts of ``inputs`` with the
    target at ``model_dir``, which must be the one the store was extracted from (same input embedding): the
    drafter's frozen embedding and head come from the store."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hsstore

    from .checkpoint import load_drafter, read_drafter_config
    from .build import load_frozen

    dev = resolve_device(device)
    dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    store = hsstore.open(store_url, **(storage_options or {}))
    dcfg, _ = read_drafter_config(drafter_dir)
    if list(dcfg.target_layers) != list(store.manifest.layers):
        raise ValueError(f"drafter taps {dcfg.target_layers} differ from the store's {list(store.manifest.layers)}")
    _, embed, head = load_frozen(store)  # in the dtype extraction ran in

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt, local_files_only=True, trust_remote_code=False)
    route_cpu_kernels(model)  # on CPU, transformers' torch paths even where fla is installed
    model = model.to(dev).eval()
    mine = model.get_input_embeddings().weight.detach()
    if mine.shape != embed.shape or not torch.equal(mine.to(embed.dtype).cpu(), embed):
        raise ValueError(f"{model_dir} is not the target the store {store_url} was extracted from "
                         "(its input embedding differs from the store's)")
    embed, head = embed.to(dev, dt), head.to(dev, dt)
    drafter = load_drafter(drafter_dir, embed, head, attn_impl="sdpa").to(device=dev, dtype=dt).eval()

    prompts = load_prompts(inputs, tokenizer, limit=num_samples, enable_thinking=thinking)
    if not prompts:
        raise ValueError(f"no prompts in {inputs}")
    eos_ids = model.generation_config.eos_token_id
    eos = {int(x) for x in ([eos_ids] if isinstance(eos_ids, int) else (eos_ids or []))}
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return evaluate(model, drafter, [p for _, p in prompts], dcfg.target_layers, max_new_tokens, eos,
                    progress=progress)
