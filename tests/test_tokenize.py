"""Tokenization: exact loss masks from the chat template, multi-turn expansion, readers, errors."""

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hsstore.extract.readers import derive_id, read_records
from hsstore.extract.response import masked_spans
from hsstore.extract.tiny import CHAT_TEMPLATE, demo_conversations_path, tiny_target_dir
from hsstore.extract.chat_tokenizer import ChatTokenizer
from hsstore.extract.messages import RowError, TemplateError, split_inline_think
from hsstore.extract.readers import ChatRecord
from hsstore.extract.tokenize import TokenizeStats, load_samples, tokenize_conversation

SYSTEM = {"role": "system", "content": "You are terse."}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny_target_dir())


@pytest.fixture(scope="module")
def chat(tok):
    return ChatTokenizer(tok)


def spans_text(tok, sample):
    """Each loss-masked run decoded on its own."""
    return [tok.decode(sample.input_ids[a:b].tolist()) for a, b in masked_spans(sample.loss_mask)]


def unmasked_text(tok, sample):
    return tok.decode(sample.input_ids[sample.loss_mask == 0].tolist())


def turn(reasoning, answer):
    return f"<think>\n{reasoning}\n</think>\n\n{answer}<|im_end|>"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------- masks


def test_single_turn_mask_is_exactly_the_assistant_turn(tok, chat):
    messages = [
        SYSTEM,
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "It is 4.", "reasoning_content": "Two plus two makes four."},
    ]
    [s] = chat.tokenize(ChatRecord("one", "src", messages))
    assert s.sample_id == "one" and s.source == "src"
    assert s.input_ids.dtype == np.int32 and s.loss_mask.dtype == np.uint8
    assert spans_text(tok, s) == [turn("Two plus two makes four.", "It is 4.")]
    # Context = everything before the turn, header included, nothing of the turn itself.
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert unmasked_text(tok, s) == prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # The sample ends with the turn's end-of-turn token, which is masked.
    assert s.input_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") and s.loss_mask[-1] == 1
    assert s.loss_tokens == int(s.loss_mask.sum()) > 0
    assert s.thinking_tokens > 0 and s.answer_tokens > 0 and s.flags == []


def test_multi_turn_expansion_keeps_every_reasoning_block(tok, chat):
    turns = [("Q1?", "R-one", "A-one"), ("Q2?", "R-two", "A-two"), ("Q3?", "R-three", "A-three")]
    messages = [SYSTEM]
    for q, r, a in turns:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a, "reasoning_content": r}]
    samples = chat.tokenize(ChatRecord("conv", "src", messages))
    assert [s.sample_id for s in samples] == ["conv#t0", "conv#t1", "conv#t2"]
    for k, s in enumerate(samples):
        _, r, a = turns[k]
        assert spans_text(tok, s) == [turn(r, a)]  # only this exchange is masked
        context = unmasked_text(tok, s)
        for _, r_prev, a_prev in turns[:k]:  # history: answer visible, reasoning dropped, unmasked
            assert f"<|im_start|>assistant\n{a_prev}<|im_end|>" in context
            assert r_prev not in context
    masked = "".join("".join(spans_text(tok, s)) for s in samples)
    assert all(r in masked for _, r, _ in turns)

    [last] = chat.tokenize(ChatRecord("conv", "src", messages), expand=False)
    assert last.sample_id == "conv#t2"
    assert np.array_equal(last.input_ids, samples[-1].input_ids)


def test_turns_marked_not_generated_are_context(tok, chat):
    """An assistant turn marked generated: false (hand-written) is in the ids, never in the loss; a row with no
    other turn is skipped (invalid_row); ChatTokenizer(learn_not_generated=True) learns it, flagged."""
    messages = [SYSTEM, {"role": "user", "content": "Q1?"},
                {"role": "assistant", "content": "A-hand", "reasoning_content": "R-hand", "generated": False},
                {"role": "user", "content": "Q2?"},
                {"role": "assistant", "content": "A-gen", "reasoning_content": "R-gen"}]
    [s] = chat.tokenize(ChatRecord("conv", "src", messages))
    assert s.sample_id == "conv" and spans_text(tok, s) == [turn("R-gen", "A-gen")] and s.flags == []
    assert "A-hand" in unmasked_text(tok, s)
    asked = ChatTokenizer(tok, learn_not_generated=True).tokenize(ChatRecord("conv", "src", messages))
    assert [(x.sample_id, x.flags) for x in asked] == [("conv#t0", ["not_generated"]), ("conv#t1", [])]
    assert spans_text(tok, asked[0]) == [turn("R-hand", "A-hand")]
    with pytest.raises(RowError, match="no assistant turn the target generated") as e:
        chat.tokenize(ChatRecord("hand", "src", messages[:3]))
    assert e.value.reason == "invalid_row"
    with pytest.raises(RowError, match="generated must be true or false"):
        chat.tokenize(ChatRecord("bad", "src", [*messages[:2], {**messages[2], "generated": "no"}]))


def test_tool_turns_are_context_not_loss(tok, chat):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need the tool.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
        },
        {"role": "tool", "content": "TOOL-SAYS-RAIN"},
        {"role": "assistant", "content": "Take an umbrella.", "reasoning_content": "It rains."},
    ]
    [s] = chat.tokenize(ChatRecord("tool", "src", messages))  # one exchange: both assistant turns in one sample
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert spans_text(tok, s) == [
        f"<think>\nNeed the tool.\n</think>\n\n{call}<|im_end|>",
        turn("It rains.", "Take an umbrella."),
    ]
    assert "TOOL-SAYS-RAIN" in unmasked_text(tok, s)
    assert "<tool_response>" in unmasked_text(tok, s)


def _variant(condition):
    """The tiny tokenizer with the think-block condition of its template replaced."""
    t = AutoTokenizer.from_pretrained(tiny_target_dir())
    old = "{%- if loop.index0 > state.last_user -%}"
    assert CHAT_TEMPLATE.count(old) == 1
    t.chat_template = CHAT_TEMPLATE.replace(old, "{%- if " + condition + " -%}")
    return t


TOOL_LOOP = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
    },
    {"role": "tool", "content": "rain"},
    {"role": "assistant", "content": "Take an umbrella.", "reasoning_content": "It rains."},
]


def test_turn_rendered_differently_gets_its_own_sample():
    """Qwen3's real template shows a non-final turn's think block only if its reasoning is non-empty, so an
    empty-reasoning tool call renders bare once the conversation continues: it must get its own sample."""
    t = _variant("loop.index0 > state.last_user and (loop.last or reasoning | trim)")
    first, second = ChatTokenizer(t).tokenize(ChatRecord("q", "s", TOOL_LOOP))
    assert (first.sample_id, second.sample_id) == ("q#t0", "q#t1")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
    assert spans_text(t, first) == ["<think>\n\n</think>\n\n" + call]  # as generated
    assert spans_text(t, second) == [turn("It rains.", "Take an umbrella.")]
    assert "<|im_start|>assistant\n<tool_call>" in unmasked_text(t, second)  # bare history, not learned twice


def test_template_keeping_all_reasoning_needs_no_expansion():
    t = _variant("true")
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "R2"},
    ]
    [s] = ChatTokenizer(t).tokenize(ChatRecord("all", "s", messages))
    assert s.sample_id == "all"
    assert spans_text(t, s) == [turn("R1", "A1"), turn("R2", "A2")]


def test_inline_think_is_split_into_reasoning(tok, chat):
    base = [{"role": "user", "content": "Hi"}]
    inline = base + [{"role": "assistant", "content": "<think>\nSay hello.\n</think>\n\nHello!"}]
    field = base + [{"role": "assistant", "content": "Hello!", "reasoning_content": "Say hello."}]
    [a] = chat.tokenize(ChatRecord("a", "s", inline))
    [b] = chat.tokenize(ChatRecord("b", "s", field))
    assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
    assert spans_text(tok, a) == [turn("Say hello.", "Hello!")]


def test_split_inline_think_cases():
    assert split_inline_think("<think>\nR\n</think>\n\nA") == ("R", "A", True)
    assert split_inline_think("R</think>A") == ("R", "A", True)  # servers that put <think> in the prompt
    assert split_inline_think("plain answer") == (None, "plain answer", True)
    assert split_inline_think("<think>\nstill thinking") == ("still thinking", "", False)


def test_unclosed_think_and_length_finish_are_truncated(chat):
    cut = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>\nlong reasoning that was cut"}]
    [s] = chat.tokenize(ChatRecord("cut", "s", cut))
    assert "truncated" in s.flags
    length = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "finish_reason": "length"}]
    assert "truncated" in chat.tokenize(ChatRecord("len", "s", length))[0].flags


def test_stub_gets_empty_thinking_flag(chat):
    [s] = chat.tokenize(
        ChatRecord("stub", "s", [{"role": "user", "content": "ok?"}, {"role": "assistant", "content": "OK."}])
    )
    assert s.thinking_tokens == 0 and "empty_thinking" in s.flags
    assert 0 < s.answer_tokens < 4


def test_sharegpt_rows_and_reasoning_alias(tok, chat):
    messages = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]
    [s] = chat.tokenize(ChatRecord("sg", "s", messages))
    assert spans_text(tok, s) == ["<think>\n\n</think>\n\nHello!<|im_end|>"]
    vllm = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning": "greet"}]
    assert spans_text(tok, chat.tokenize(ChatRecord("v", "s", vllm))[0]) == [turn("greet", "Hello!")]


# ---------------------------------------------------------------------------------------------- ids


def test_stable_derived_ids(tmp_path, tok):
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    other = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [row, other, {**row, "id": "given"}])
    ids1 = [s.sample_id for s in load_samples(path, tok)]
    ids2 = [s.sample_id for s in load_samples(path, tok)]
    assert ids1 == ids2
    assert ids1[0] != ids1[1] and ids1[2] == "given"
    assert ids1[0] == derive_id({"messages": row["messages"], "tools": None})
    assert ids1[0].startswith("h") and len(ids1[0]) == 17


def test_demo_set_tokenizes(tok):
    stats = TokenizeStats()
    samples = list(load_samples(demo_conversations_path(), tok, stats=stats))
    assert stats.rows == 27 and stats.samples == len(samples) == 31 and stats.expanded == 4
    assert len({s.sample_id for s in samples}) == len(samples)
    assert {s.source for s in samples} >= {"regen/math", "regen/code", "regen/general", "regen/tools", "legacy/stub"}
    # Every reasoning text of the file ends up inside some loss mask.
    masked = "".join("".join(spans_text(tok, s)) for s in samples)
    for line in demo_conversations_path().read_text(encoding="utf-8").splitlines():
        for m in json.loads(line)["messages"]:
            reasoning = m.get("reasoning_content") or split_inline_think(m.get("content") or "")[0]
            if m["role"] == "assistant" and reasoning:
                assert reasoning.strip() in masked


# ---------------------------------------------------------------------------------------------- readers


def _pretokenized_table():
    ids = [[5, 6, 7, 8, 9], [10, 11, 12]]
    mask = [[0, 0, 1, 1, 1], [0, 1, 1]]
    return pa.table({"input_ids": ids, "loss_mask": mask, "seq_len": [5, 3]}), ids, mask


def test_pretokenized_arrow_dataset_dir_without_datasets(tmp_path, tok):
    table, ids, mask = _pretokenized_table()
    d = tmp_path / "shards"
    d.mkdir()
    with pa.OSFile(str(d / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)  # stream format, as datasets.save_to_disk writes it
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    samples = list(load_samples(d, tok))
    assert [s.input_ids.tolist() for s in samples] == ids
    assert [s.loss_mask.tolist() for s in samples] == mask
    assert samples[0].input_ids.dtype == np.int32 and samples[0].loss_mask.dtype == np.uint8
    assert samples[0].source == "shards"
    again = [s.sample_id for s in load_samples(d, tok)]
    assert [s.sample_id for s in samples] == again and again[0] != again[1]


def test_pretokenized_arrow_file_format_and_parquet(tmp_path, tok):
    table, ids, mask = _pretokenized_table()
    table = table.append_column("id", pa.array(["x", "y"]))
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    pq.write_table(table, tmp_path / "f.parquet")
    for name in ("f.arrow", "f.parquet"):
        samples = list(load_samples(tmp_path / name, None))  # no tokenizer needed for pre-tokenized rows
        assert [s.sample_id for s in samples] == ["x", "y"]
        assert [s.loss_mask.tolist() for s in samples] == mask
        assert samples[0].answer_tokens is None  # not analysed without a tokenizer


def test_pretokenized_gets_counts_from_tokenizer(tmp_path, tok):
    [ref] = tokenize_conversation(
        tok,
        [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A b c", "reasoning_content": "think hard"},
        ],
    )
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"id": "p", "input_ids": ref.input_ids.tolist(), "loss_mask": ref.loss_mask.tolist()}]
    )
    [s] = load_samples(path, tok)
    assert (s.thinking_tokens, s.answer_tokens, s.flags) == (ref.thinking_tokens, ref.answer_tokens, [])
    cut = write_jsonl(
        tmp_path / "c.jsonl", [{"input_ids": ref.input_ids[:-3].tolist(), "loss_mask": ref.loss_mask[:-3].tolist()}]
    )
    assert "truncated" in next(load_samples(cut, tok)).flags


def test_chat_rows_from_parquet(tmp_path, tok):
    rows = [json.loads(line) for line in demo_conversations_path().read_text(encoding="utf-8").splitlines()[:3]]
    ids = [r["id"] for r in rows]
    pq.write_table(
        pa.Table.from_pylist([{"id": r["id"], "messages": r["messages"]} for r in rows]), tmp_path / "y.parquet"
    )
    assert [s.sample_id for s in load_samples(tmp_path / "y.parquet", tok)] == ids
    # Message lists stored as JSON strings (common in exports) are accepted; other strings are not.
    pq.write_table(
        pa.Table.from_pylist([{"id": r["id"], "messages": json.dumps(r["messages"])} for r in rows]),
        tmp_path / "x.parquet",
    )
    assert [s.sample_id for s in load_samples(tmp_path / "x.parquet", tok)] == ids
    pq.write_table(pa.Table.from_pylist([{"id": "q", "messages": "hello"}]), tmp_path / "z.parquet")
    with pytest.raises(RowError, match=r"z\.parquet row 0 \(id=q\): messages is a string"):
        ChatTokenizer(tok).tokenize(next(read_records(tmp_path / "z.parquet")))


def test_malformed_jsonl_is_skipped_naming_file_line_and_column(tmp_path, tok):
    """#38.8: a line that is not JSON is skipped and counted like a row the template cannot render, named by
    file:line:column (the column of the error in that line, counted in characters)."""
    good = {"id": "a", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    path = tmp_path / "bad.jsonl"
    broken = '{"id": "b", "messages": [{"role": "user", "content": "é"}, }'  # column 60: the "}" after ", "
    path.write_text(json.dumps(good) + "\n\n" + broken + "\n" + json.dumps({**good, "id": "c"}) + "\n")
    stats = TokenizeStats()
    assert [s.sample_id for s in load_samples(path, tok, stats=stats)] == ["a", "c"]
    assert stats.skipped == {"malformed_json": ["bad.jsonl:3"]} and stats.rows == 3
    assert stats.first_skipped["malformed_json"] == f"{path}:3:{broken.index(', }') + 3}: malformed JSON (Expecting value)"
    with pytest.raises(ValueError, match=r"bad\.jsonl:3:60: malformed JSON"):  # readers without a counter: an error
        list(read_records(path))


@pytest.mark.parametrize(
    "messages, error",
    [
        ([], "empty conversation"),
        ([{"content": "no role"}, {"role": "assistant", "content": "x"}], "message 0 has no role"),
        ([{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}], "unknown role 'robot'"),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "no assistant turn"),
        ([{"role": "assistant", "content": "y"}], "starts with an assistant turn"),
        ([{"role": "user", "content": 42}, {"role": "assistant", "content": "y"}], "content must be a string"),
    ],
)
def test_bad_conversations_are_skipped_and_counted_by_line_and_id(tmp_path, tok, messages, error, caplog):
    path = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"id": "ok", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            {"id": "broken", "messages": messages},
        ],
    )
    stats = TokenizeStats()
    assert [s.sample_id for s in load_samples(path, tok, stats=stats)] == ["ok"]
    assert stats.skipped == {"invalid_row": ["broken"]} and stats.rows == 2
    assert any(re.search(rf"in\.jsonl:2 \(id=broken\): .*{error}", r.getMessage()) for r in caplog.records)
    with pytest.raises(RowError, match=rf"in\.jsonl:2 \(id=broken\): .*{error}") as e:
        ChatTokenizer(tok).tokenize(list(read_records(path))[1])
    assert e.value.reason == "invalid_row"


def test_row_without_messages_or_tokens(tmp_path, tok):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"text": "hello"}])
    with pytest.raises(ValueError, match=r"odd\.jsonl:1: row has neither"):
        list(read_records(path))


def test_conversations_need_a_tokenizer(tmp_path):
    path = write_jsonl(
        tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    )
    with pytest.raises(ValueError, match="need a tokenizer"):
        list(load_samples(path, None))


# ---------------------------------------------------------------------------------------------- tokenizer checks


def test_tokenizer_lacking_template_tokens_is_refused(tok):
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in ("<think>", "</think>")]
    broken = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|im_end|>")
    broken.chat_template = CHAT_TEMPLATE
    with pytest.raises(ValueError, match=r"lacks special token\(s\) </think>, <think>"):
        ChatTokenizer(broken)


def test_template_that_is_not_prefix_stable_is_refused(tok):
    unstable = AutoTokenizer.from_pretrained(tiny_target_dir())
    # A header that depends on the conversation length changes every earlier render.
    unstable.chat_template = "{{ messages | length }}\n" + CHAT_TEMPLATE
    with pytest.raises(TemplateError, match=r"id=z: assistant message 1 does not render as a continuation"):
        ChatTokenizer(unstable).tokenize(
            ChatRecord("z", "s", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
        )


def test_tokenizer_without_template_is_refused(tok):
    bare = AutoTokenizer.from_pretrained(tiny_target_dir())
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatTokenizer(bare)


# ---------------------------------------------------------------------------------------------- max length


def test_max_length_skips_or_truncates(tok):
    full = list(load_samples(demo_conversations_path(), tok))
    limit = 256
    n_long = sum(s.num_tokens > limit for s in full)
    assert 0 < n_long < len(full)

    stats = TokenizeStats()
    kept = list(load_samples(demo_conversations_path(), tok, max_length=limit, stats=stats))
    assert len(kept) == len(full) - n_long and stats.skipped_over_length == n_long
    assert all(s.num_tokens <= limit for s in kept)

    flagged = list(load_samples(demo_conversations_path(), tok, max_length=limit, keep_over_length=True))
    assert sum("over_length" in s.flags for s in flagged) == n_long and len(flagged) == len(full)

    stats = TokenizeStats()
    cut = list(load_samples(demo_conversations_path(), tok, max_length=limit, truncate=True, stats=stats))
    assert stats.truncated == n_long and len(cut) == len(full)
    for s in cut:
        if "truncated" in s.flags:
            assert s.num_tokens == limit and s.input_ids[-1] != tok.convert_tokens_to_ids("<|im_end|>")
