"""A verified block through the Gated DeltaNet's token-by-token delta rule in one call (``block_states
.RECURRENT_BLOCKS``, a GPU's path: one launch per layer): the cache it leaves after any verdict is the one the
general path's copy and second forward leaves, and decoding stays lossless. Run here on a CPU by adding it to the
devices that take it."""

import pytest
import torch

from hsstore.train import block_states
from hsstore.train.speculative import TargetCache, greedy_generate, load_prompts, speculative_generate

from train_helpers import small_input  # noqa: F401  (fixture)

S = 8


@pytest.fixture(scope="module")
def target(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture
def recurrent_here(monkeypatch):
    monkeypatch.setattr(block_states, "RECURRENT_BLOCKS", ("cpu",))
    calls = []
    real = block_states.BlockStates._recorder

    def counting(self, fn, recurrent=None):  # which form each verified layer ran
        inner = real(self, fn, recurrent)

        def call(*args, **kwargs):
            out = inner(*args, **kwargs)
            calls.append(self.layers[self._current].call[0])
            return out
        return call

    monkeypatch.setattr(block_states.BlockStates, "_recorder", counting)
    return calls


@pytest.mark.parametrize("accepted", [1, 3, S])
def test_a_recurrent_block_leaves_the_cache_a_second_forward_leaves(target, tok, small_input, recurrent_here,  # noqa: F811
                                                                    accepted):
    prompt = load_prompts([str(small_input)], tok, limit=1)[0][1]
    block = [int(t) for t in torch.randint(5, 400, (S,), generator=torch.Generator().manual_seed(accepted))]
    nexts = []
    for keep in (True, False):
        t = TargetCache(target, keep_states=keep)
        t.forward(prompt, keep=1)
        t.verify(block, taps=[1, 2, 3])
        t.accept(accepted)
        assert int(t.cache.get_seq_length()) == len(prompt) + accepted
        nexts.append(t.forward([7, 8, 9], keep=3, taps=[1, 2, 3, 4, 5]))
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen

    assert recurrent_here and all(f is qwen.torch_recurrent_gated_delta_rule for f in recurrent_here)
    for a, b in zip(*nexts):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_decoding_through_recurrent_blocks_is_lossless(target, tok, small_input, recurrent_here):  # noqa: F811
    eos = {tok.eos_token_id}
    for _, prompt in load_prompts([str(small_input)], tok, limit=2):
        base = greedy_generate(target, prompt, 24, eos)

        def propose(ctx, seq, reference=base.tokens, start=len(prompt)):  # right twice, then wrong
            done = len(seq) - start
            block = list(reference[done:done + S - 1]) + [0] * S
            return block[:2] + [(t + 1) % 400 for t in block[2:S - 1]]

        spec = speculative_generate(target, propose, prompt, [1, 2, 3, 4, 5], S, 24, eos)
        assert spec.tokens == base.tokens and set(spec.accepted[:-1]) <= {3}
    assert recurrent_here
