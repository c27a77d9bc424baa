"""Engine-faithful tokenization with templates that behave like the official Qwen3, Qwen3.5 and Qwen3.6 ones.

Every expected sample is written out here as text segments, each encoded on its own with the tokenizer:
the prompt the engine rendered (``add_generation_prompt=True``) and the text the model generated, so the
expected ids are ``encode(prompt) + encode(generated)`` computed without the code under test. The
behaviours of the templates are listed in tests/chat_templates.py.
"""

import json

import pytest
from transformers import AutoTokenizer

from chat_templates import QWEN3_LIKE, QWEN35_LIKE, QWEN35_SMALL_LIKE, QWEN36_LIKE
from hsstore.extract.readers import ChatRecord
from hsstore.extract.tiny import tiny_target_dir
from hsstore.extract.chat_tokenizer import ChatTokenizer
from hsstore.extract.messages import RowError, split_reasoning
from hsstore.extract.tokenize import TokenizeStats, load_samples

SYS = "<|im_start|>system\nYou are terse.<|im_end|>\n"
USER = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
ASST = "<|im_start|>assistant\n"
EOT = "<|im_end|>"


def tokenizer_with(template):
    tok = AutoTokenizer.from_pretrained(tiny_target_dir())
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def q3():
    return tokenizer_with(QWEN3_LIKE)


@pytest.fixture(scope="module")
def q35():
    return tokenizer_with(QWEN35_LIKE)


@pytest.fixture(scope="module")
def q35_small():
    return tokenizer_with(QWEN35_SMALL_LIKE)


@pytest.fixture(scope="module")
def q36():
    return tokenizer_with(QWEN36_LIKE)


def encode(tok, text, split_special=False):
    return tok(text, add_special_tokens=False, split_special_tokens=split_special)["input_ids"]


def expected(tok, *segments):
    """(ids, mask) of (text, masked) segments, each encoded separately; a masked segment ends with the
    end-of-turn token, encoded on its own (text before it as ordinary text, as the model produced it)."""
    ids, mask = [], []
    eot = tok.convert_tokens_to_ids(EOT)
    for text, masked in segments:
        if masked and text.endswith(EOT):
            part = encode(tok, text[: -len(EOT)], split_special=True) + [eot]
        else:
            part = encode(tok, text)
        ids += part
        mask += [int(masked)] * len(part)
    return ids, mask


def tokenize(tok, messages, kwargs=None, tools=None, row_kwargs=None, sid="c"):
    record = ChatRecord(sid, "test", messages, tools, "", row_kwargs)
    return ChatTokenizer(tok, template_kwargs=kwargs).tokenize(record)


def assert_sample(sample, ids_mask):
    ids, mask = ids_mask
    assert sample.input_ids.tolist() == ids
    assert sample.loss_mask.tolist() == mask


def single(system=True, reasoning="Add them: 5.", answer="5", **extra):
    msgs = [{"role": "system", "content": "You are terse."}] if system else []
    return msgs + [{"role": "user", "content": "What is 2+3?"},
                   {"role": "assistant", "content": answer, "reasoning_content": reasoning, **extra}]


# ---------------------------------------------------------------------------------------------- thinking


def test_qwen35_thinking_turn_is_prompt_then_generated(q35):
    (s,) = tokenize(q35, single())
    assert_sample(s, expected(q35, (SYS + USER + ASST + "<think>\n", 0), ("Add them: 5.\n</think>\n\n5" + EOT, 1)))
    assert s.sample_id == "c" and s.thinking_tokens > 0 and "empty_thinking" not in s.flags


def test_empty_reasoning_keeps_the_engines_token_boundary(q35):
    """The prompt ends in <think>\\n and the model generated \\n</think>: not the merged \\n\\n of one string."""
    (s,) = tokenize(q35, single(reasoning=""))
    prompt, generated = SYS + USER + ASST + "<think>\n", "\n</think>\n\n5" + EOT
    want = expected(q35, (prompt, 0), (generated, 1))
    assert_sample(s, want)
    assert encode(q35, prompt + generated) != want[0]  # the case the old tokenizer aborted on
    assert "empty_thinking" in s.flags


def test_thinking_off_scaffolding_is_prompt_not_loss(q35, q3):
    off = {"enable_thinking": False}
    (s,) = tokenize(q35, single(reasoning=""), kwargs=off)
    assert_sample(s, expected(q35, (SYS + USER + ASST + "<think>\n\n</think>\n\n", 0), ("5" + EOT, 1)))
    (s,) = tokenize(q3, single(reasoning=""), kwargs=off)
    assert_sample(s, expected(q3, (SYS + USER + ASST + "<think>\n\n</think>\n\n", 0), ("5" + EOT, 1)))
    # Without the argument a Qwen3 row is rendered as if the model had written the empty block itself:
    (s,) = tokenize(q3, single(reasoning=""))
    assert_sample(s, expected(q3, (SYS + USER + ASST, 0), ("<think>\n\n</think>\n\n5" + EOT, 1)))


def test_small_qwen35_defaults_to_thinking_off(q35_small):
    # A thinking row rendered with the template's default (off) cannot be what the engine saw: skipped, named.
    with pytest.raises(RowError, match="does not render as a continuation of its generation prompt") as e:
        tokenize(q35_small, single())
    assert e.value.reason == "prompt_mismatch"
    want = expected(q35_small, (SYS + USER + ASST + "<think>\n", 0), ("Add them: 5.\n</think>\n\n5" + EOT, 1))
    (s,) = tokenize(q35_small, single(), kwargs={"enable_thinking": True})
    assert_sample(s, want)
    # The row's own chat_template_kwargs override the command line's.
    (s,) = tokenize(q35_small, single(), kwargs={"enable_thinking": False}, row_kwargs={"enable_thinking": True})
    assert_sample(s, want)
    (s,) = tokenize(q35_small, single(reasoning=""))
    assert_sample(s, expected(q35_small, (SYS + USER + ASST + "<think>\n\n</think>\n\n", 0), ("5" + EOT, 1)))


# ---------------------------------------------------------------------------------------------- answers


def test_literal_think_end_in_an_answer_is_kept(q35):
    code = "Use re.sub(r'<think>.*?</think>', '', s) to drop them."
    (s,) = tokenize(q35, single(answer=code))
    assert_sample(s, expected(q35, (SYS + USER + ASST + "<think>\n", 0),
                              ("Add them: 5.\n</think>\n\n" + code + EOT, 1)))
    # Without a reasoning field the reasoning ends at the first </think>; the rest is answer.
    inline = [{"role": "user", "content": "What is 2+3?"},
              {"role": "assistant", "content": "<think>Add them: 5.</think>\n\nStrip </think> tags."}]
    (s,) = tokenize(q35, inline)
    assert_sample(s, expected(q35, (USER + ASST + "<think>\n", 0),
                              ("Add them: 5.\n</think>\n\nStrip </think> tags." + EOT, 1)))


def test_split_reasoning_rule():
    assert split_reasoning({"content": "a </think> b", "reasoning_content": "r"}) == ("r", "a </think> b", True)
    assert split_reasoning({"content": "a </think> b", "reasoning_content": ""}) == ("", "a </think> b", True)
    assert split_reasoning({"content": "<think>r</think>a </think> b"}) == ("r", "a </think> b", True)
    assert split_reasoning({"content": "<think>r", "reasoning_content": None}) == ("r", "", False)
    assert split_reasoning({"content": "plain"}) == ("", "plain", True)


def test_literal_end_of_turn_text_in_an_answer_is_ordinary_text(q35):
    answer = "The marker <|im_end|> closes a turn."
    (s,) = tokenize(q35, single(answer=answer))
    want = expected(q35, (SYS + USER + ASST + "<think>\n", 0), ("Add them: 5.\n</think>\n\n" + answer + EOT, 1))
    assert_sample(s, want)
    eot = q35.convert_tokens_to_ids(EOT)
    assert s.input_ids.tolist().count(eot) == 3  # system, user, and the one real end of the answer


def test_unicode(q35):
    msgs = [{"role": "user", "content": "Grüße aus Köln 🌍"},
            {"role": "assistant", "content": "ça va ✓ — 你好", "reasoning_content": "日本語で考える…"}]
    (s,) = tokenize(q35, msgs)
    assert_sample(s, expected(q35, ("<|im_start|>user\nGrüße aus Köln 🌍<|im_end|>\n" + ASST + "<think>\n", 0),
                              ("日本語で考える…\n</think>\n\nça va ✓ — 你好" + EOT, 1)))


def test_conversation_ending_on_a_user_turn(q35):
    msgs = single() + [{"role": "user", "content": "And 3+4?"}]
    (s,) = tokenize(q35, msgs)
    assert_sample(s, expected(q35, (SYS + USER + ASST + "<think>\n", 0), ("Add them: 5.\n</think>\n\n5" + EOT, 1)))


def test_cut_turn_has_no_end_of_turn(q35):
    (s,) = tokenize(q35, single(finish_reason="length"))
    ids, mask = expected(q35, (SYS + USER + ASST + "<think>\n", 0), ("Add them: 5.\n</think>\n\n5", 1))
    assert_sample(s, (ids, mask))
    assert "truncated" in s.flags


# ---------------------------------------------------------------------------------------------- multi-turn


def two_exchanges():
    return [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "5", "reasoning_content": "Add them."},
        {"role": "user", "content": "Times 4?"},
        {"role": "assistant", "content": "20", "reasoning_content": "5 x 4."},
    ]


def test_multi_turn_drops_history_reasoning_so_each_exchange_is_a_sample(q35):
    s0, s1 = tokenize(q35, two_exchanges())
    assert (s0.sample_id, s1.sample_id) == ("c#t0", "c#t1")
    assert_sample(s0, expected(q35, (USER + ASST + "<think>\n", 0), ("Add them.\n</think>\n\n5" + EOT, 1)))
    prompt1 = USER + ASST + "5" + EOT + "\n<|im_start|>user\nTimes 4?<|im_end|>\n" + ASST + "<think>\n"
    assert_sample(s1, expected(q35, (prompt1, 0), ("5 x 4.\n</think>\n\n20" + EOT, 1)))


def test_qwen36_preserved_thinking_is_one_sample(q36):
    s0, s1 = tokenize(q36, two_exchanges())  # without preserve_thinking: as Qwen3.5
    assert (s0.sample_id, s1.sample_id) == ("c#t0", "c#t1")
    (s,) = tokenize(q36, two_exchanges(), kwargs={"preserve_thinking": True})
    assert s.sample_id == "c"
    assert_sample(s, expected(
        q36, (USER + ASST + "<think>\n", 0), ("Add them.\n</think>\n\n5" + EOT, 1),
        ("\n<|im_start|>user\nTimes 4?<|im_end|>\n" + ASST + "<think>\n", 0), ("5 x 4.\n</think>\n\n20" + EOT, 1)))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def call(name, args, as_string):
    return {"id": f"call_{name}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, separators=(",", ":")) if as_string else args}}


def weather_loop(as_string, reasoning="Need the tool."):
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": reasoning,
         "tool_calls": [call("get_weather", {"city": "Paris", "days": 2}, as_string)]},
        {"role": "tool", "tool_call_id": "call_get_weather", "content": "Sunny"},
        {"role": "assistant", "content": "Sunny in Paris.", "reasoning_content": "It is sunny."},
    ]


def q35_tools_header():
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in TOOLS)  # jinja's tojson: json.dumps defaults
    return ("<|im_start|>system\n# Functions\n<tools>" + lines + "\n</tools>\nCall one as <tool_call>\n"
            "<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n")


XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n" \
           "</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize("as_string", [True, False], ids=["string-arguments", "object-arguments"])
def test_qwen35_tool_loop_string_and_object_arguments(q35, as_string):
    (s,) = tokenize(q35, weather_loop(as_string), tools=TOOLS)
    assert_sample(s, expected(
        q35,
        (q35_tools_header() + "<|im_start|>user\nWeather in Paris?<|im_end|>\n" + ASST + "<think>\n", 0),
        ("Need the tool.\n</think>\n\n" + XML_CALL + EOT, 1),
        ("\n<|im_start|>user\n<tool_response>\nSunny\n</tool_response><|im_end|>\n" + ASST + "<think>\n", 0),
        ("It is sunny.\n</think>\n\nSunny in Paris." + EOT, 1)))


def test_string_arguments_crash_the_template_unless_parsed(q35):
    """What vLLM/SGLang do (parse the OpenAI JSON string) is what makes the Qwen3.5 template render at all."""
    raw = weather_loop(as_string=True)
    with pytest.raises(Exception, match="mapping"):
        q35.apply_chat_template(raw, tools=TOOLS, tokenize=False)
    assert tokenize(q35, raw, tools=TOOLS)


def test_invalid_tool_arguments_are_the_rows_error(q35):
    msgs = weather_loop(as_string=True)
    msgs[1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris",'
    with pytest.raises(RowError, match=r"id=c: message 1 tool call 0 \(get_weather\): arguments is not valid JSON"):
        tokenize(q35, msgs, tools=TOOLS)


def test_empty_reasoning_tool_loop_splits_where_tokens_merge(q35):
    """Turn 1 was generated as <think>\\n + \\n</think>...; turn 2's prompt re-tokenizes it as <think>, \\n\\n,
    </think>. Each turn keeps exactly what the engine saw, so turn 2 gets its own sample."""
    header = q35_tools_header() + "<|im_start|>user\nWeather in Paris?<|im_end|>\n" + ASST + "<think>\n"
    s0, s1 = tokenize(q35, weather_loop(False, reasoning=""), tools=TOOLS)
    assert (s0.sample_id, s1.sample_id) == ("c#t0", "c#t1")
    assert_sample(s0, expected(q35, (header, 0), ("\n</think>\n\n" + XML_CALL + EOT, 1)))
    prompt1 = (header + "\n</think>\n\n" + XML_CALL + EOT
               + "\n<|im_start|>user\n<tool_response>\nSunny\n</tool_response><|im_end|>\n" + ASST + "<think>\n")
    assert_sample(s1, expected(q35, (prompt1, 0), ("It is sunny.\n</think>\n\nSunny in Paris." + EOT, 1)))


def test_qwen35_parallel_calls(q35):
    msgs = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two cities.",
         "tool_calls": [call("get_weather", {"city": "Paris"}, True), call("get_weather", {"city": "Rome"}, True)]},
        {"role": "tool", "content": "Sunny"},
        {"role": "tool", "content": "Rain"},
        {"role": "assistant", "content": "Paris sunny, Rome rain.", "reasoning_content": "Report."},
    ]
    one = "<tool_call>\n<function=get_weather>\n<parameter=city>\n{}\n</parameter>\n</function>\n</tool_call>"
    (s,) = tokenize(q35, msgs, tools=TOOLS)
    assert_sample(s, expected(
        q35,
        (q35_tools_header() + "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n" + ASST + "<think>\n", 0),
        ("Two cities.\n</think>\n\nChecking both.\n\n" + one.format("Paris") + "\n" + one.format("Rome") + EOT, 1),
        ("\n<|im_start|>user\n<tool_response>\nSunny\n</tool_response>\n<tool_response>\nRain\n</tool_response>"
         "<|im_end|>\n" + ASST + "<think>\n", 0),
        ("Report.\n</think>\n\nParis sunny, Rome rain." + EOT, 1)))


def test_qwen3_json_tool_calls_and_dropped_empty_think(q3):
    """Qwen3 renders a non-final turn without reasoning as content only, so a tool loop whose first turn had
    an empty think block cannot share a sample with the answer; with reasoning it can."""
    tools_json = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in TOOLS)
    header = ("<|im_start|>system\n# Functions\n<tools>" + tools_json + "\n</tools>\nAnswer a call as <tool_call>\n"
              '{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n'
              "<|im_start|>user\nWeather in Paris?<|im_end|>\n" + ASST)
    json_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    tool_turn = "\n<|im_start|>user\n<tool_response>\nSunny\n</tool_response><|im_end|>\n" + ASST
    (s,) = tokenize(q3, weather_loop(True), tools=TOOLS)
    assert_sample(s, expected(q3, (header, 0), ("<think>\nNeed the tool.\n</think>\n\n" + json_call + EOT, 1),
                              (tool_turn, 0), ("<think>\nIt is sunny.\n</think>\n\nSunny in Paris." + EOT, 1)))
    s0, s1 = tokenize(q3, weather_loop(True, reasoning=""), tools=TOOLS)
    assert_sample(s0, expected(q3, (header, 0), ("<think>\n\n</think>\n\n" + json_call + EOT, 1)))
    assert_sample(s1, expected(q3, (header + json_call + EOT + tool_turn, 0),
                               ("<think>\nIt is sunny.\n</think>\n\nSunny in Paris." + EOT, 1)))


# ---------------------------------------------------------------------------------------------- bad rows


def test_bad_rows_are_skipped_and_counted_never_abort(tmp_path, q35):
    good = {"id": "good", "messages": single()}
    rows = [
        good,
        {"id": "bad-json", "messages": weather_loop(True)[:2] + [{"role": "tool", "content": "x"}]},
        {"id": "no-assistant", "messages": [{"role": "user", "content": "hi"}]},
        {"id": "bad-kwargs", "messages": single(), "chat_template_kwargs": [1]},
        {"id": "good2", "messages": single(reasoning="")},
    ]
    rows[1]["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{nope"
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = TokenizeStats()
    samples = list(load_samples(path, q35, stats=stats))
    assert [s.sample_id for s in samples] == ["good", "good2"]
    assert stats.skipped == {"tool_arguments": ["bad-json"], "invalid_row": ["no-assistant", "bad-kwargs"]}
    assert stats.rows == 5 and stats.skipped_rows == 3
    small = tokenizer_with(QWEN35_SMALL_LIKE)
    stats = TokenizeStats()
    assert [s.sample_id for s in load_samples(path, small, stats=stats)] == ["good2"]
    assert stats.skipped["prompt_mismatch"] == ["good"]
