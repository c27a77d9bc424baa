"""The tiny offline Qwen3.5 target: deterministic, loadable with Auto*, Qwen-shaped tokenizer and template."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hsstore.extract.tiny import MARKUP_TOKENS, SPECIAL_TOKENS, build_tiny_target, tiny_target_dir

FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = build_tiny_target(tmp_path / "a", seed=0)
    b = build_tiny_target(tmp_path / "b", seed=0)
    c = build_tiny_target(tmp_path / "c", seed=1)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_build_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_target(tmp_path / "t", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_cache_dir_reused(tmp_path):
    first = tiny_target_dir(cache_dir=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = tiny_target_dir(cache_dir=tmp_path)
    assert first == second
    assert (second / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging leftovers


def test_qwen3_5_architecture_loads_and_runs(tiny_dir, tok):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text"
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    types = config["layer_types"]
    assert types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert config["vocab_size"] == len(tok)

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    ids = tok("The sky is blue because of Rayleigh scattering.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == config["num_hidden_layers"] + 1
    for h in out.hidden_states:
        assert h.shape == (1, ids.shape[1], config["hidden_size"])
        assert torch.isfinite(h).all()
    assert out.logits.shape == (1, ids.shape[1], len(tok))


def test_tokenizer_specials_and_byte_fallback(tok):
    for t in SPECIAL_TOKENS + MARKUP_TOKENS:
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1, t
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert 1000 <= len(tok) <= 2100
    text = "Zürich 東京 🚀 naïve \t\n x²"  # mostly unseen in training: byte-level BPE must still round-trip
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_chat_template_drops_earlier_reasoning(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer", "reasoning_content": "EARLY-REASONING"},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": "second answer", "reasoning_content": "LATE-REASONING"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert "EARLY-REASONING" not in text
    assert "<|im_start|>assistant\nfirst answer<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\nLATE-REASONING\n</think>\n\nsecond answer<|im_end|>\n")
    assert "{% generation %}" not in tok.chat_template and "{%- generation" not in tok.chat_template
    prompt = tok.apply_chat_template(messages[:4], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("second question<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_tools_and_inline_think(tok):
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"c": 1}}}],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "<think>\nR\n</think>\n\nIt is sunny."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert '<tool_call>\n{"name": "w", "arguments": {"c": 1}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<think>\nR\n</think>\n\nIt is sunny.<|im_end|>\n")


# --------------------------------------------------------------------------- the trained tiny target


def test_trained_target_loads_with_the_random_targets_architecture_and_template(tmp_path):
    from hsstore.extract.tiny import CHAT_TEMPLATE, build_trained_target, trained_files

    d = build_trained_target(tmp_path / "t")
    config = json.loads((d / "config.json").read_text())
    meta = json.loads((trained_files() / "target.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["model_type"] == "qwen3_5_text"
    assert config["hidden_size"] == meta["sizes"]["hidden_size"]
    assert "linear_attention" in config["layer_types"] and "full_attention" in config["layer_types"]
    t = AutoTokenizer.from_pretrained(d)
    assert t.chat_template == CHAT_TEMPLATE and t.eos_token == "<|im_end|>" and t.pad_token == "<|endoftext|>"
    for s in SPECIAL_TOKENS + MARKUP_TOKENS:
        assert len(t(s, add_special_tokens=False)["input_ids"]) == 1, s
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)  # strict: every weight present
    assert model.get_input_embeddings().weight.shape[0] == len(t) == config["vocab_size"]
    assert (trained_files() / "model.safetensors").stat().st_size < 4 * 2**20  # ships with the package


def test_trained_target_answers_a_held_out_prompt_as_trained(tmp_path):
    """Greedy on a held-out prompt gives the corpus's format: reasoning in <think>, then an answer, then <|im_end|>."""
    from hsstore.extract.tiny import trained_files, trained_target_dir

    d = trained_target_dir(cache_dir=tmp_path)
    t = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    row = json.loads((trained_files() / "heldout.jsonl").read_text().splitlines()[0])
    ids = t.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=120, do_sample=False, eos_token_id=t.eos_token_id)
    text = t.decode(out[0, len(ids):])
    assert text.startswith("<think>\n") and "\n</think>\n\n" in text and text.endswith("<|im_end|>"), text


def test_held_out_prompts_are_in_no_training_set():
    from hsstore.extract.tiny import trained_files
    from tools.tiny_corpus import examples, splits

    meta = json.loads((trained_files() / "target.json").read_text())
    n = meta["examples"]
    target_train, demo, heldout = splits(meta["seed"], n["train"], n["demo"], n["heldout"])
    rows = lambda name: [json.loads(x) for x in (trained_files() / name).read_text().splitlines()]  # noqa: E731
    shipped_demo = [r["messages"][1]["content"] for r in rows("conversations.jsonl")]
    shipped_heldout = [r["messages"][1]["content"] for r in rows("heldout.jsonl")]
    assert shipped_demo == [e.prompt for e in demo] and shipped_heldout == [e.prompt for e in heldout]
    train_prompts = {e.prompt for e in target_train}
    assert len(train_prompts) == n["train"]
    assert not train_prompts & set(shipped_heldout) and not set(shipped_demo) & set(shipped_heldout)
    assert not train_prompts & set(shipped_demo)
    assert [e.prompt for e in examples(meta["seed"], 50)] == [e.prompt for e in target_train[:50]]  # seeded


@pytest.mark.slow
def test_train_tiny_target_is_deterministic(tmp_path):
    """The tool regenerates the same files from the same seed (a short run; the shipped one is longer)."""
    from tools.train_tiny_target import main

    argv = ["--train-examples", "60", "--demo-examples", "2", "--heldout-examples", "2", "--epochs", "1",
            "--max-new-tokens", "8", "-q"]
    for name in ("a", "b"):
        assert main([*argv, "--out", str(tmp_path / name)]) == 0
    for f in ("model.safetensors", "tokenizer.json", "conversations.jsonl", "heldout.jsonl"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    meta = json.loads((tmp_path / "a" / "target.json").read_text())
    assert meta["examples"] == {"train": 60, "demo": 2, "heldout": 2} and meta["training"]["steps"] >= 1
