"""hsstore eval: greedy speculative decoding is lossless (its output equals target-only greedy decoding,
whatever the drafter proposes) and tau counts accepted drafts + 1."""

import json

import pytest
import torch

import hsstore
from hsstore.app.cli import main as hsstore_cli
from hsstore.app.schema import build
from hsstore.train.checkpoint import load_drafter
from hsstore.train.speculative import drafter_proposer, greedy_generate, load_prompts, speculative_generate
from hsstore.train.build import load_frozen
from hsstore.train.trainer import TrainSettings, train
from train_helpers import FAST, small_input, store32  # noqa: F401  (fixtures)

S, NEW = 8, 24


@pytest.fixture(scope="module")
def target(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tok, small_input):  # noqa: F811
    return [p for _, p in load_prompts([str(small_input)], tok, limit=2)]


@pytest.fixture(scope="module")
def eos(tok):
    return {tok.eos_token_id}


def oracle(prompt, reference, right: int | None = None, wrong_token: int = 0):
    """Proposes the reference continuation; only its first ``right`` tokens when given (then garbage)."""
    def propose(ctx, seq):
        done = len(seq) - len(prompt)
        block = list(reference[done:done + S - 1])
        block += [wrong_token] * (S - 1 - len(block))
        if right is not None:
            block = block[:right] + [(t + 1) % 1000 for t in block[right:]]
        return block
    return propose


@pytest.mark.parametrize("right", [None, 0, 2])
def test_speculative_equals_greedy_for_any_proposer(target, prompts, eos, right):
    taps = [1, 2, 3, 4, 5]
    for prompt in prompts:
        base = greedy_generate(target, prompt, NEW, eos)
        spec = speculative_generate(target, oracle(prompt, base.tokens, right), prompt, taps, S, NEW, eos)
        assert spec.tokens == base.tokens
        assert all(1 <= a <= S for a in spec.accepted) and 1 <= spec.tau <= S
        if right is None:  # everything accepted: S tokens per target forward
            assert spec.accepted[0] == S and spec.forwards < base.forwards / 2
        else:  # the last step may end at the eos or the length limit, inside its block
            assert set(spec.accepted[:-1]) <= {right + 1} and 1 <= spec.accepted[-1] <= right + 1


def test_trained_drafter_eval_is_lossless(store32, target, prompts, eos, tmp_path):  # noqa: F811
    train(build(TrainSettings, store=[store32], out=str(tmp_path), steps=3, **FAST))
    store = hsstore.open(store32)
    _, embed, head = load_frozen(store)
    drafter = load_drafter(tmp_path, embed, head).eval()
    propose = drafter_proposer(drafter)
    for prompt in prompts:
        base = greedy_generate(target, prompt, NEW, eos)
        spec = speculative_generate(target, propose, prompt, store.layers, drafter.config.block_size, NEW, eos)
        assert spec.tokens == base.tokens
        assert 1 <= spec.tau <= drafter.config.block_size


def test_eval_cli(store32, tiny_dir, small_input, tmp_path, capsys):  # noqa: F811
    train(build(TrainSettings, store=[store32], out=str(tmp_path), steps=2, **FAST))
    rc = hsstore_cli(["eval", "--store", store32, "--drafter", str(tmp_path), "--model", str(tiny_dir),
                      "--input", str(small_input), "--num-samples", "2", "--max-new-tokens", "12", "--device", "cpu"])
    captured = capsys.readouterr()
    out = captured.out
    assert rc == 0, out
    assert "speculative output == target greedy output: 2/2" in out and "tau" in out
    assert "Average Acceptance length" in out and "accept len" in out  # both conventions, named
    assert "eval: 100%" in captured.err and "2/2" in captured.err and "tau_per_prompt=" in captured.err  # the bar
    rc = hsstore_cli(["eval", "--store", store32, "--drafter", str(tmp_path), "--model", str(tiny_dir),
                      "--input", str(small_input), "--num-samples", "2", "--max-new-tokens", "12", "--device", "cpu",
                      "--json", "-q"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0 and "tau" not in r  # no tau without its convention
    # the two conventions from the report's own counts: the prefill is no step and its token is not counted
    assert r["verify_steps"] == r["spec_forwards"] - r["samples"]
    assert r["tau_per_prompt"] == pytest.approx(sum(r["tau_per_sample"]) / len(r["tau_per_sample"]))
    assert r["tau_pooled"] == pytest.approx((r["spec_tokens"] - r["samples"]) / r["verify_steps"])


def scripted(prompt, reference, plan: list[int]):
    """A proposer whose step k gets exactly ``plan[k]`` drafts right (the reference's next tokens), then wrong."""
    steps = iter(plan)

    def propose(ctx, seq):
        done, right = len(seq) - len(prompt), next(steps)
        block = list(reference[done:done + SMALL_S - 1])
        return block[:right] + [(t + 1) % 1000 for t in block[right:]]
    return propose


SMALL_S = 4


def test_tau_in_both_conventions_on_a_hand_counted_case(target, prompts):
    """Two prompts, block 4, 10 new tokens, no eos; the drafter gets a scripted number right at each step. Counted by
    hand: the prefill gives token 1 (no step); prompt A's steps add 3, 1, 4 and then 1 (2 accepted, but only 1 token
    is left of the 10): 9 tokens in 4 steps, mean 2.25; prompt B's add 4, 4, 1: 9 in 3, mean 3. So z-lab's
    per-prompt mean is (2.25 + 3) / 2 = 2.625 and SGLang's pooled count 18 / 7."""
    from hsstore.train.speculative import tau_conventions

    taps, new = [1, 2, 3, 4, 5], 10
    got = []
    for prompt, plan in zip(prompts, ([2, 0, 3, 1], [3, 3, 3])):
        ref = greedy_generate(target, prompt, new + SMALL_S, set()).tokens
        spec = speculative_generate(target, scripted(prompt, ref, plan), prompt, taps, SMALL_S, new, set())
        assert spec.tokens == ref[:new]
        got.append(spec.accepted)
    assert got == [[3, 1, 4, 1], [4, 4, 1]]
    per_prompt, pooled = tau_conventions(got)
    assert per_prompt == pytest.approx(2.625) and pooled == pytest.approx(18 / 7)
    assert tau_conventions([[2], []]) == (2.0, 2.0)  # a prompt done at its prefill counts in neither


def test_a_step_cut_by_eos_counts_the_tokens_it_adds(target, prompts):
    """An eos inside an accepted block ends the output there: the step counts the tokens up to the eos, as z-lab's
    ``dflash_generate`` and SGLang's verify count them, not the block's accepted length."""
    taps, prompt = [1, 2, 3, 4, 5], prompts[0]
    ref = greedy_generate(target, prompt, 20, set()).tokens
    j = next(j for j in range(5, 12) if ref[j] not in ref[:j])  # the output's 7th..12th token, new there
    spec = speculative_generate(target, scripted(prompt, ref, [3, 3, 3, 3]), prompt, taps, SMALL_S, 20, {ref[j]})
    assert spec.tokens == ref[:j + 1]
    assert sum(spec.accepted) == j and spec.accepted[:-1] == [4] * (len(spec.accepted) - 1)


def test_eval_refuses_another_target(store32, tmp_path, small_input):  # noqa: F811
    from hsstore.extract.tiny import build_tiny_target

    other = build_tiny_target(tmp_path / "other", seed=1)
    train(build(TrainSettings, store=[store32], out=str(tmp_path / "run"), steps=1, **FAST))
    rc = hsstore_cli(["eval", "--store", store32, "--drafter", str(tmp_path / "run"), "--model", str(other),
                      "--input", str(small_input), "--num-samples", "1", "--device", "cpu"])
    assert rc == 2


def test_eval_refuses_what_needs_no_target_before_loading_it_and_q_shows_no_loading_bar(store32, tiny_dir, small_input,
                                                                                        tmp_path):  # noqa: F811
    """#53.12: a missing --input was refused after the target had loaded (9-14 s on a user's target), and
    ``eval -q`` still showed transformers' weight-loading bar. The refused run's target has weights that cannot
    load: the input's refusal must come first."""
    import shutil
    import subprocess
    import sys

    train(build(TrainSettings, store=[store32], out=str(tmp_path / "run"), steps=1, **FAST))
    broken = tmp_path / "target"
    shutil.copytree(tiny_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")  # a header, no weights

    def eval_cli(inp: str, *extra: str, model=tiny_dir) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hsstore", "eval", "--store", store32, "--drafter",
                               str(tmp_path / "run"), "--model", str(model), "--input", inp, "--num-samples", "1",
                               "--max-new-tokens", "4", "--device", "cpu", *extra],
                              capture_output=True, text=True, timeout=300)

    missing = eval_cli(str(tmp_path / "nope.jsonl"), model=broken)
    assert missing.returncode == 2 and "nope.jsonl" in missing.stderr, missing.stderr
    quiet = eval_cli(str(small_input), "-q")
    assert quiet.returncode == 0 and "speculative output == target greedy output: 1/1" in quiet.stdout, quiet.stderr
    assert "Loading weights" not in quiet.stderr and "%|" not in quiet.stderr
    loads = eval_cli(str(small_input), "-q", model=broken)  # the broken target does stop a run that loads it
    assert loads.returncode != 0 and "nope.jsonl" not in loads.stderr, loads.stderr


def test_bench_train_smoke(tmp_path):
    """tools/bench_train.py runs end to end at tiny sizes on a CPU (the real run is on a GPU)."""
    import json
    import subprocess
    import sys

    from train_helpers import REPO

    proc = subprocess.run([sys.executable, "-m", "tools.bench_train", "--dir", str(tmp_path), "--tiny", "--rounds", "1",
                           "--json", "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert result["ratio"] > 0 and result["loader_tokens_per_s"] > 0
    assert not list(tmp_path.iterdir())  # the scratch store is removed


def test_bench_train_reads_emulated_s3_served_from_another_process(tmp_path):
    """--s3: the trainer reads the store through the proxy, whose server runs in a process of its own (its
    threads would otherwise take the trainer's GIL); the shard bytes it fetched are counted there."""
    import json
    import subprocess
    import sys

    from train_helpers import REPO

    proc = subprocess.run([sys.executable, "-m", "tools.bench_train", "--dir", str(tmp_path), "--tiny", "--s3",
                           "--s3-latency", "0", "--rounds", "1", "--steps", "1", "--warmup", "1", "--json",
                           "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert result["source"] == "s3 (emulated)" and result["remote_bytes"] > 0 and result["max_in_flight"] >= 1
    assert result["server_pid"] != result["trainer_pid"]


def test_prompts_thinking_setting(tok, small_input):  # noqa: F811
    """Thinking on by default (DFlash's benchmark setting for thinking targets); --no-thinking renders the
    chat template's empty thinking block, as DFlash's non-thinking Qwen3 numbers do."""
    on = load_prompts([str(small_input)], tok, limit=2)
    off = load_prompts([str(small_input)], tok, limit=2, enable_thinking=False)
    for (_, a), (_, b) in zip(on, off):
        assert not tok.decode(a).endswith("</think>\n\n") and tok.decode(b).endswith("<think>\n\n</think>\n\n")
        assert b[:len(a)] == a


def no_cache_greedy(model, prompt, max_new, eos) -> list[int]:
    """Greedy decoding with no cache at all: the whole sequence through the target for every token (what
    `hsstore eval` did before it kept the target's cache), the reference the cached paths must equal."""
    out: list[int] = []
    with torch.inference_mode():
        while True:
            logits = model(input_ids=torch.tensor([list(prompt) + out]), use_cache=False).logits[0, -1]
            out.append(int(logits.argmax()))
            if out[-1] in eos or len(out) >= max_new:
                return out


@pytest.mark.slow
def test_cached_decoding_equals_decoding_without_any_cache(target, tok, eos, small_input):  # noqa: F811
    """#38.4: the target decodes from its own cache (attention keys/values, Gated DeltaNet conv and recurrent
    states) and, after a rejected draft suffix, from the state saved before the verification: on a random tiny
    Qwen3.5 target, over several prompts, with steps that accept every draft and steps that reject at every
    block position, both greedy and speculative output equal a reference that never caches anything."""
    prompts = [p for _, p in load_prompts([str(small_input)], tok, limit=4)]
    new, taps, accepted = 40, [1, 2, 3, 4, 5], set()
    for prompt in prompts:
        reference = no_cache_greedy(target, prompt, new, eos)
        assert greedy_generate(target, prompt, new, eos).tokens == reference
        steps = []

        def propose(ctx, seq):  # the reference continuation, its draft k (step-dependent) made wrong; k = S-1: none
            done, k = len(seq) - len(prompt), len(steps) % S
            steps.append(k)
            block = list(reference[done:done + S - 1]) + [0] * S
            return [t if i != k else (t + 1) % 1000 for i, t in enumerate(block[:S - 1])]

        spec = speculative_generate(target, propose, prompt, taps, S, new, eos)
        assert spec.tokens == reference
        accepted |= set(spec.accepted)
    assert S in accepted and len(accepted & set(range(1, S))) >= 4, accepted  # both kinds of step happened


def test_drafter_context_drafts_what_the_whole_context_drafts(tiny_dir):
    """The drafter's context kept between steps (DraftContext: each position projected once) gives the states
    ``draft_hidden`` computes over the whole context, in a sliding-window and a full-attention layer, for anchors
    before and past the window."""
    from transformers import AutoModelForCausalLM

    from hsstore.train.model import DFlashDrafter, DrafterConfig
    from hsstore.train.speculative import DraftContext

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    embed, head = model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()
    cfg = DrafterConfig.from_target_config(model.config, mask_token_id=3, target_layers=[1, 3, 5], num_layers=2,
                                           sliding_window=[6, None], block_size=8)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, embed, head).eval()
    T = 40
    feats, ids = torch.randn(T, 3, cfg.hidden_size), torch.randint(5, 900, (T,))
    ctx = DraftContext(drafter)
    for p in (3, 4, 11, 12, 25, 39):  # the context grown a few positions at a time, as decoding grows it
        ctx(feats[:p], ids[:p + 1])
        hs = torch.zeros(1, p + 1, 3, cfg.hidden_size)
        hs[0, :p] = feats[:p]
        want = drafter.draft_hidden(hs, ids[None, :p + 1], torch.tensor([[p]]))[0, 0, 1:]
        torch.testing.assert_close(ctx.block_hidden(int(ids[p]), p), want, rtol=1e-4, atol=1e-5)


def test_decoding_runs_each_token_through_the_target_about_once(target, prompts, eos):
    """#38.4: with the cache, greedy decoding feeds the prompt once and then one token per forward, its lm_head
    only at that token; speculative decoding feeds each step's block and, after a rejection, the accepted part
    again, never the sequence so far (what made a 2,048-token generation quadratic)."""
    fed, rows = [], []
    h1 = target.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].shape[1]), with_kwargs=True)
    h2 = target.get_output_embeddings().register_forward_hook(lambda m, a, out: rows.append(out.shape[1]))
    try:
        prompt = prompts[0]
        base = greedy_generate(target, prompt, NEW, eos)
        assert fed == [len(prompt)] + [1] * (len(base.tokens) - 1) and rows == [1] * len(base.tokens)
        fed.clear(), rows.clear()
        spec = speculative_generate(target, oracle(prompt, base.tokens, 2), prompt, [1, 2, 3, 4, 5], S, NEW, eos)
        assert fed[0] == len(prompt) and fed[1:] == [S] * (spec.forwards - 1)  # each block once: states kept
        assert rows[1:] == [S] * (spec.forwards - 1) and spec.reruns == 0
        fed.clear(), rows.clear()
        spec = speculative_generate(target, oracle(prompt, base.tokens, 2), prompt, [1, 2, 3, 4, 5], S, NEW, eos,
                                    keep_states=False)
        assert fed[0] == len(prompt) and max(fed[1:]) == S  # block tokens, then the 3 accepted ones again
        assert fed[1:] == [S, 3] * (spec.forwards - 1) and rows[1:] == [S, 1] * (spec.forwards - 1)
        assert spec.reruns == spec.forwards - 1
    finally:
        h1.remove(), h2.remove()


def cache_tensors(cache) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a Qwen3.5 cache that the next forward reads, named by layer."""
    out = []
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "conv_states", None):
            out += [(f"{i}.conv", layer.conv_states[0]), (f"{i}.recurrent", layer.recurrent_states[0])]
        else:
            out += [(f"{i}.keys", layer.keys), (f"{i}.values", layer.values)]
    return out


@pytest.mark.parametrize("accepted", [1, 2, 5, S - 1, S])
def test_kept_block_states_equal_the_recompute_path(target, prompts, accepted):
    """After a verified block whose first ``accepted`` tokens stay, the cache the states path leaves (the Gated
    DeltaNet states replayed from what the verification recorded, attention cut back: no second forward) holds
    what the general path's copy + forward over the accepted tokens holds, within fp32 rounding: every conv and
    recurrent state, every key and value, the cached length, and the logits and features of the next forward."""
    from hsstore.train.speculative import TargetCache

    prompt = prompts[0]
    block = [int(t) for t in torch.randint(5, 900, (S,), generator=torch.Generator().manual_seed(accepted))]
    caches, nexts = [], []
    for keep in (True, False):
        t = TargetCache(target, keep_states=keep)
        t.forward(prompt, keep=1)
        t.verify(block, taps=[1, 2, 3])
        t.accept(accepted)
        assert (t.reruns == 0) == (keep or accepted == S) and bool(t.states) == keep
        caches.append(([(n, x.clone()) for n, x in cache_tensors(t.cache)], int(t.cache.get_seq_length())))
        nexts.append(t.forward([7, 8, 9], keep=3, taps=[1, 2, 3, 4, 5]))
    (kept, kept_len), (redone, redone_len) = caches
    assert kept_len == redone_len == len(prompt) + accepted
    assert [n for n, _ in kept] == [n for n, _ in redone] and any(n.endswith("recurrent") for n, _ in kept)
    for (name, a), (_, b) in zip(kept, redone):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for a, b in zip(nexts[0], nexts[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_cache_without_gated_deltanet_layers_takes_the_general_path(tmp_path, tok):
    """A pure-attention target (tiny random Qwen3) has no Gated DeltaNet state to keep: its verifications copy the
    cache and re-run the accepted tokens, and speculative output still equals greedy output."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hsstore.train import block_states

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    assert block_states.gdn_mixers(model) == []
    prompt = list(range(10, 30))
    base = greedy_generate(model, prompt, NEW, set())
    spec = speculative_generate(model, oracle(prompt, base.tokens, 2), prompt, [0, 1], S, NEW, set())
    assert spec.tokens == base.tokens and spec.reruns == spec.forwards - 1 > 0


def test_a_difference_is_weighed_by_the_targets_own_logits(tiny_dir, prompts):
    """On a GPU in bf16 the cached 1-token and S-token forwards may break a near-tie of the target's two best
    tokens differently (an H200 demo: 13 of 16 outputs identical). ``divergence`` finds where two outputs first
    differ and calls it a tie only when the target's logits of the two tokens there are within the dtype's
    rounding; a token far below is a decoding error. Expected logits from a forward of the test's own."""
    from transformers import AutoModelForCausalLM

    from hsstore.train.speculative import TIE_SHARE, divergence, divergence_note

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    prompt = prompts[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    best = int(logits.argmax())
    others = (logits - logits[best]).abs()
    others[best] = float("inf")
    near, far = int(others.argmin()), int(logits.argmin())
    share = TIE_SHARE[torch.bfloat16]
    near_is_tie = float(others[near]) <= share * max(abs(float(logits[best])), abs(float(logits[near])))

    d = divergence(model, prompt, [best, 7], [near, 7], block=8)
    assert d["position"] == 0 and d["tie"] == near_is_tie
    assert d["margin"] == pytest.approx(float(others[near]), abs=1e-6)
    d = divergence(model, prompt, [best, 3], [far, 3], block=8)
    assert not d["tie"] and d["margin"] == pytest.approx(float(logits[best] - logits[far]), abs=1e-6)
    d = divergence(model, prompt, [best, 5, 6], [best, 5], block=8)  # one output ended where the other goes on
    assert d["position"] == 2 and not d["tie"]
    tie = {"tie": True, "margin": 0.0625, "dtype": "bfloat16", "block": 16, "position": 44}
    assert "1 first differs at a near-tie" in divergence_note([tie])
    assert "1 differs beyond rounding: a decoding error" in divergence_note([tie, d])


def test_bench_eval_pairs_kept_states_with_the_recompute_path(store32, tiny_dir, small_input, tmp_path):  # noqa: F811
    """tools.bench_eval on a demo-shaped folder: one row per mode, all lossless with the same tau and forwards,
    re-runs only on the recompute path; the parts timed alone give the ceiling and the bound beside the rows."""
    from tools.bench_eval import ceilings, costs, run, table

    demo = tmp_path / "demo"
    (demo / "data").mkdir(parents=True)
    train(build(TrainSettings, store=[store32], out=str(demo / "run"), steps=2, **FAST))
    (demo / "store").symlink_to(store32)
    (demo / "target").symlink_to(tiny_dir)
    (demo / "data" / "heldout.jsonl").symlink_to(small_input)
    modes = ["graphs", "chunk", "eager", "recompute"]
    rows = run(demo, "cpu", samples=1, rounds=1, warmup=0, max_new=12, modes=modes)
    by = {r["mode"]: r for r in rows}
    assert sorted(by) == sorted(modes)
    assert all(r["identical"] == r["samples"] == 1 for r in rows)
    for tau in ("tau_per_prompt", "tau_pooled"):
        assert by["graphs"][tau] == by["chunk"][tau] == by["eager"][tau] == by["recompute"][tau]
    assert by["eager"]["spec_forwards"] == by["recompute"]["spec_forwards"]
    assert by["eager"]["reruns"] == by["graphs"]["reruns"] == 0 < by["recompute"]["reruns"]
    parts = costs(demo, "cpu", reps=2, modes=["graphs", "eager"])
    assert all(parts[k] > 0 for k in ("target_ms", "draft_ms_graphs", "draft_ms_eager", "verify_ms_graphs",
                                      "verify_ms_eager"))
    c = ceilings(rows, parts)["eager"]
    ceiling = by["eager"]["tau_pooled"] / (1 + parts["draft_ms_eager"] / parts["target_ms"])
    assert c["ceiling"] == pytest.approx(ceiling)
    assert "graphs / eager" in table(rows, parts) and "ceiling" in table(rows, parts)
