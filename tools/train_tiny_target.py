"""Train the tiny Qwen3.5-architecture target that ``hsstore demo`` ships, and generate the demo's data with it.

Why: a random-weight target makes every drafter look the same (tau ~ 1), so a broken feature, mask or
label goes unnoticed. This target has learnt a structured synthetic corpus (``tools/tiny_corpus.py``), so
its greedy answers are predictable, and a drafter trained on its features reaches tau well above 1.

What it does, all from ``--seed``:
1. three prompt-disjoint sets from the corpus generator: the target's training conversations, the demo's
   prompts, held-out eval prompts;
2. a byte-level BPE trained on the training text (``extract.tiny.train_bpe``) and the tiny Qwen3.5 config
   (``extract.tiny.target_config``: hybrid Gated DeltaNet + gated attention, ``Qwen3_5ForCausalLM``);
3. next-token training on the assistant turns (reasoning, answer, ``<|im_end|>``), AdamW + cosine;
4. the target answers the demo prompts greedily (as ``hsstore regenerate`` would have it do), which become
   the demo's conversations; the held-out prompts are stored without answers, for ``hsstore eval``.

It writes into ``--out`` (``extract/data/tiny_trained/``, shipped with the package): ``model.safetensors``
(float32), ``tokenizer.json`` (the ``tokenizers`` BPE, wrapped at load time by ``extract.tiny``),
``target.json`` (sizes, seed, command, training time and loss, held-out accuracy), ``conversations.jsonl``,
``heldout.jsonl``. ``extract.tiny.trained_target_dir()`` turns them into a ``from_pretrained`` directory.

Regenerate the shipped files (deterministic for a given seed, torch version and ``--threads``):

    python -m tools.train_tiny_target --out extract/data/tiny_trained     # from the checkout

The shipped files come from exactly that command on the project's 2-core CPU machine (torch 2.13.0+cpu,
transformers 5.24.0, 1 thread, other jobs sharing the cores): 2,448 steps over 16,000 conversations (2.4M
tokens, 2 epochs) in 759 s, loss 6.28 -> 0.19; answering the 352 demo and held-out prompts took 73 s; 838 s
in all (``target.json`` records these). The target gets 36% of the demo answers exactly right (it is tiny),
but it answers in the corpus's format, predictably, which is what a drafter needs.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
from pathlib import Path

import torch

from hsstore.extract.tiny import save_weights, target_config, train_bpe, wrap_tokenizer
from tools.tiny_corpus import SYSTEM, Example, splits

log = logging.getLogger("train_tiny_target")

SIZES = dict(num_layers=8, full_attention_interval=4, hidden_size=64, intermediate_size=128)


def bpe_texts(train: list[Example]) -> list[str]:
    """What the BPE learns from: the strings the chat template wraps (not its markup, added as tokens)."""
    return ["system", "user", "assistant", SYSTEM] + [s for e in train for s in (e.prompt, e.reasoning, e.answer)]


def encode(tokenizer, ex: Example) -> tuple[list[int], int]:
    """(prompt + response ids, prompt length). The response ends with ``<|im_end|>``; the template's newline
    after it is dropped (generation stops at the end-of-turn token)."""
    msgs = ex.messages()
    prompt = tokenizer.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False)
    if full[: len(prompt)] != prompt:
        raise ValueError(f"chat template is not prefix-stable for {ex.prompt!r}")
    end = len(full) - 1 - full[::-1].index(tokenizer.eos_token_id)
    return full[: end + 1], len(prompt)


def make_batches(seqs: list[tuple[list[int], int]], max_tokens: int, rng: random.Random) -> list[list[int]]:
    """Index batches of similar lengths (little padding), each at most ``max_tokens`` padded tokens, shuffled."""
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i][0]), rng.random()))
    out, cur, longest = [], [], 0
    for i in order:
        n = len(seqs[i][0])
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def collate(seqs, idx: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    T = max(len(seqs[i][0]) for i in idx)
    ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
    att = torch.zeros((len(idx), T), dtype=torch.long)
    labels = torch.full((len(idx), T), -100, dtype=torch.long)
    for r, i in enumerate(idx):
        s, n_prompt = seqs[i]
        ids[r, : len(s)] = torch.tensor(s)
        att[r, : len(s)] = 1
        labels[r, n_prompt: len(s)] = torch.tensor(s[n_prompt:])  # HF shifts labels inside the loss
    return {"input_ids": ids, "attention_mask": att, "labels": labels}


def train_target(model, seqs, *, epochs: int, max_tokens: int, lr: float, seed: int, progress: bool = True) -> dict:
    from tqdm import tqdm

    rng = random.Random(seed)
    plan = [make_batches(seqs, max_tokens, rng) for _ in range(epochs)]
    total = sum(len(p) for p in plan)
    warmup = max(1, total // 30)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))))
    model.train()
    t0 = time.perf_counter()
    losses: list[float] = []
    bar = tqdm(total=total, desc="train target", unit="step", disable=not progress)
    for epoch, batches in enumerate(plan):
        for idx in batches:
            loss = model(**collate(seqs, idx, model.config.pad_token_id), use_cache=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().item())
            bar.update(1)
            recent = sum(losses[-20:]) / len(losses[-20:])
            bar.set_postfix(epoch=epoch, loss=f"{recent:.3f}", refresh=False)
            if not progress and len(losses) % 200 == 0:
                log.info("step %d/%d loss %.3f (%.0fs)", len(losses), total, recent, time.perf_counter() - t0)
    bar.close()
    model.eval()
    tail = losses[-max(1, len(losses) // 20):]
    return {"steps": total, "epochs": epochs, "train_seconds": round(time.perf_counter() - t0, 1),
            "first_loss": round(losses[0], 4), "final_loss": round(sum(tail) / len(tail), 4)}


@torch.inference_mode()
def answer(model, tokenizer, ex: Example, max_new: int) -> list[int]:
    """The target's greedy response tokens to ``ex``'s prompt (its own answer, not the corpus's)."""
    prompt = tokenizer.apply_chat_template(ex.messages()[:-1], add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return out[0, len(prompt):].tolist()


def split_response(text: str) -> tuple[str, str, bool]:
    """(reasoning, answer, well formed) of a generated ``<think>\\n...\\n</think>\\n\\nanswer<|im_end|>``."""
    ended = text.endswith("<|im_end|>")
    text = text.removesuffix("<|im_end|>")
    if text.startswith("<think>") and "</think>" in text:
        reasoning, ans = text[len("<think>"):].split("</think>", 1)
        return reasoning.strip(), ans.strip(), ended
    return "", text.strip(), False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="extract/data/tiny_trained", help="folder for the shipped files")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-examples", type=int, default=16000)
    ap.add_argument("--demo-examples", type=int, default=320)
    ap.add_argument("--heldout-examples", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=2048, help="padded tokens per batch")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--hidden-size", type=int, default=SIZES["hidden_size"])
    ap.add_argument("--intermediate-size", type=int, default=SIZES["intermediate_size"])
    ap.add_argument("--num-layers", type=int, default=SIZES["num_layers"])
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads; the weights depend on it (1: the same on any machine, and not slowed "
                         "down tenfold when other processes share the cores, as 2 threads were)")
    ap.add_argument("--quiet", "-q", "--no-progress", dest="quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    from transformers import Qwen3_5ForCausalLM

    t_start = time.perf_counter()
    train, demo, heldout = splits(args.seed, args.train_examples, args.demo_examples, args.heldout_examples)
    bpe = train_bpe(bpe_texts(train), args.vocab_size)
    tokenizer = wrap_tokenizer(bpe)
    sizes = dict(SIZES, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                 num_layers=args.num_layers)
    config = target_config(tokenizer, **sizes)
    config.dtype = "float32"
    seqs = [encode(tokenizer, e) for e in train]
    log.info("%d training conversations, %d tokens (%d in responses), vocab %d", len(seqs),
             sum(len(s) for s, _ in seqs), sum(len(s) - n for s, n in seqs), len(tokenizer))
    torch.manual_seed(args.seed)
    model = Qwen3_5ForCausalLM(config)
    stats = train_target(model, seqs, epochs=args.epochs, max_tokens=args.max_tokens, lr=args.lr, seed=args.seed,
                         progress=not args.quiet)
    log.info("trained in %.0fs: loss %.3f -> %.3f", stats["train_seconds"], stats["first_loss"], stats["final_loss"])

    # the demo's conversations: the target's own greedy answers to prompts it was not trained on
    t_gen = time.perf_counter()
    rows, correct, malformed, same_tokens = [], {"demo": 0, "heldout": 0}, 0, 0
    for split, exs in (("demo", demo), ("heldout", heldout)):
        for i, ex in enumerate(exs):
            generated = answer(model, tokenizer, ex, args.max_new_tokens)
            reasoning, ans, ok = split_response(tokenizer.decode(generated, skip_special_tokens=False))
            malformed += not ok
            correct[split] += ans == ex.answer
            if split == "demo":
                row = Example(ex.task, ex.prompt, reasoning, ans)
                ids, n_prompt = encode(tokenizer, row)
                same_tokens += ids[n_prompt:] == generated  # what extraction will see is what was generated
                rows.append({"id": f"tiny-{ex.task}-{i:04d}", "source": f"tiny/{ex.task}", "messages": row.messages()})
    gen_seconds = time.perf_counter() - t_gen

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_weights(out / "model.safetensors", model.state_dict())
    (out / "tokenizer.json").write_text(bpe.to_str(pretty=False) + "\n", encoding="utf-8")
    with open(out / "conversations.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    with open(out / "heldout.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": f"heldout-{e.task}-{i:03d}", "source": f"tiny/{e.task}",
                                 "messages": e.messages()[:-1]}, ensure_ascii=False) + "\n"
                     for i, e in enumerate(heldout))
    meta = {
        "sizes": sizes, "vocab_size": args.vocab_size, "seed": args.seed,
        "command": "python -m tools.train_tiny_target " + " ".join(sys.argv[1:] if argv is None else argv),
        "examples": {"train": len(train), "demo": len(demo), "heldout": len(heldout)},
        "training": {**stats, "max_tokens": args.max_tokens, "lr": args.lr, "threads": args.threads},
        "generate_seconds": round(gen_seconds, 1),
        "answers_equal_to_corpus": {k: f"{v}/{len(demo if k == 'demo' else heldout)}" for k, v in correct.items()},
        "malformed_responses": malformed,
        "demo_responses_retokenized_identically": f"{same_tokens}/{len(demo)}",
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "torch": torch.__version__,
    }
    (out / "target.json").write_text(json.dumps(meta, indent=2) + "\n")
    log.info("wrote %s: %s", out, json.dumps(meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
