"""The drafter's decoding step in fixed-shape buffers (``graphs.StaticDraft``): on a CPU its eager steps, the code a
GPU captures as one CUDA graph, draft what ``DraftContext`` drafts, token for token, and speculative decoding with
it stays lossless with the same tau; on a GPU the replayed graph drafts what the same steps draft eagerly."""

import pytest
import torch

from hsstore.train import graphs
from hsstore.train.graphs import StaticDraft
from hsstore.train.model import DFlashDrafter, DrafterConfig
from hsstore.train.speculative import (DraftContext, block_of, drafter_proposer, greedy_generate, load_prompts,
                                       read_block, speculative_generate)

from train_helpers import small_input  # noqa: F401  (fixture)

S = 8


def tiny_drafter(tiny_dir, device="cpu", dtype=torch.float32, window=6, layers=(1, 3, 5)):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    embed, head = model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()
    cfg = DrafterConfig.from_target_config(model.config, mask_token_id=3, target_layers=list(layers), num_layers=2,
                                           sliding_window=[window, None], block_size=S)
    torch.manual_seed(0)
    return DFlashDrafter(cfg, embed, head).to(device=device, dtype=dtype).eval()


def steps(p0: int, end: int, seed: int = 0) -> list[int]:
    """Anchor positions as decoding reaches them: a prompt, then 1 .. S accepted tokens a step."""
    g = torch.Generator().manual_seed(seed)
    out, p = [p0], p0
    while p < end:
        p += int(torch.randint(1, S + 1, (1,), generator=g))
        out.append(p)
    return out


@pytest.mark.parametrize("p0", [3, 40])  # a prompt shorter than a block (added in the step), one longer (outside it)
def test_static_steps_draft_what_the_drafter_context_drafts(tiny_dir, monkeypatch, p0):
    monkeypatch.setattr(graphs, "MIN_CAPACITY", 32)  # the buffers grow twice on the way, keeping what they hold
    drafter = tiny_drafter(tiny_dir)
    T = 160
    feats, ids = torch.randn(T + S, 3, drafter.config.hidden_size), torch.randint(5, 500, (T + S,))
    static, context = StaticDraft(drafter), DraftContext(drafter)
    assert not static.graphs  # on a CPU: the same steps, eagerly
    for generation in range(2):  # reset between generations: the buffers' old values are hidden, not cleared
        static.reset()
        context.reset()
        for p in steps(p0 + generation, T, seed=generation):
            drafted = static(feats[:p], ids[:p + 1])
            assert drafted.tolist() == context(feats[:p], ids[:p + 1]), p
    assert static.capacity > 32


def test_a_step_that_cannot_be_captured_runs_eagerly_said_once(tiny_dir, monkeypatch, caplog):
    def refuse(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(StaticDraft, "capture", refuse)
    drafter = tiny_drafter(tiny_dir)
    static, context = StaticDraft(drafter, graphs=True), DraftContext(drafter)
    feats, ids = torch.randn(60, 3, drafter.config.hidden_size), torch.randint(5, 500, (60,))
    for p in steps(20, 50):
        assert static(feats[:p], ids[:p + 1]).tolist() == context(feats[:p], ids[:p + 1])
    assert not static.graphs
    assert caplog.text.count("could not be captured as a CUDA graph") == 1


def test_a_draft_on_the_device_is_verified_as_a_list_would_be():
    logits = torch.randn(S, 50)
    drafts = logits.argmax(-1)[: S - 1].clone()
    drafts[3] = (drafts[3] + 1) % 50
    as_list = read_block(drafts.tolist(), logits, S)
    assert read_block(drafts, logits, S) == as_list and as_list[0] == drafts.tolist()
    assert block_of(7, drafts, S).tolist() == block_of(7, drafts.tolist(), S) == [7, *drafts.tolist()]


def test_decoding_with_static_steps_is_lossless_with_the_same_tau(tiny_dir, tok, small_input):  # noqa: F811
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    drafter = tiny_drafter(tiny_dir, window=32)
    prompts = [p for _, p in load_prompts([str(small_input)], tok, limit=2)]
    eos = {tok.eos_token_id}
    static = drafter_proposer(drafter, graphs=True)
    assert isinstance(static, StaticDraft) and isinstance(drafter_proposer(drafter), DraftContext)
    for prompt in prompts:
        base = greedy_generate(target, prompt, 24, eos)
        spec = speculative_generate(target, static, prompt, [1, 3, 5], S, 24, eos)
        eager = speculative_generate(target, DraftContext(drafter), prompt, [1, 3, 5], S, 24, eos)
        assert spec.tokens == eager.tokens == base.tokens
        assert spec.accepted == eager.accepted


@pytest.mark.gpu
def test_the_replayed_graph_drafts_what_its_steps_draft_eagerly(tiny_dir):
    drafter = tiny_drafter(tiny_dir, device="cuda", dtype=torch.bfloat16)
    T = 300
    feats = torch.randn(T + S, 3, drafter.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(5, 500, (T + S,))
    graphed, eager = StaticDraft(drafter, graphs=True), StaticDraft(drafter, graphs=False)
    assert graphed.graphs and not eager.graphs
    for p in steps(30, T):
        assert graphed(feats[:p], ids[:p + 1]).tolist() == eager(feats[:p], ids[:p + 1]).tolist(), p
    assert graphed.graph is not None
