"""``hsstore regenerate`` against a real OpenAI-compatible server on loopback: ``transformers serve`` with the
tiny local target (offline). Random weights answer gibberish; the tests assert structure: every id once,
roles, reasoning/finish_reason fields, resume after kill -9, retries, and that ``hsstore check`` reads it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hsstore.testing.ports import free_port

from hsstore.extract.messages import RowError
from hsstore.extract.readers import read_records
from hsstore.extract.regenerate import (RegenerateError, RegenerateSettings, assistant_turn, build_prompt, resume_output,
                                        run_regenerate)
from hsstore.extract.tiny import demo_conversations_path
from hsstore.app.cli import main
from hsstore.app.schema import build

REPO = Path(__file__).resolve().parents[1]


def start_server(model_dir, port: int) -> subprocess.Popen:
    """``transformers serve`` on 127.0.0.1:port, the tiny target preloaded, nothing downloaded. One torch
    thread: on a busy 2-core machine more threads make each token ~10x slower."""
    for mod in ("fastapi", "uvicorn", "openai"):
        pytest.importorskip(mod, reason="transformers serve needs transformers[serving]")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--device", "cpu", "--dtype", "float32", str(model_dir)]
    log = tempfile.TemporaryFile("w+")  # not a pipe: a full pipe buffer would stall the server
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    return proc


def wait_ready(proc: subprocess.Popen, url: str, limit_s: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            proc.log.seek(0)
            pytest.fail(f"transformers serve exited with {proc.returncode}: {proc.log.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail("transformers serve did not become ready")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.log.close()


@pytest.fixture(scope="module")
def server(tiny_dir):
    port = free_port()
    proc = start_server(tiny_dir, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        yield url
    finally:
        stop_server(proc)


def demo_rows(n: int) -> list[dict]:
    return [json.loads(line) for line in demo_conversations_path().read_text().splitlines()[:n]]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_out(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def regenerate_cmd(server: str, inp: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hsstore", "regenerate", "--server", server, "--input", str(inp), "--out",
            str(out), "-q", *extra]


# ------------------------------------------------------------------------------------ against the server


def test_every_prompt_answered_once_and_check_reads_it(server, tiny_dir, tmp_path, capsys):
    """The CLI on chats of every shape: each input id comes back once with the prompt (up to the last user
    message) and a new assistant turn carrying reasoning_content and finish_reason; `hsstore check --json`
    parses the output and counts exactly the turns cut by --max-tokens as truncated."""
    multi = {"id": "multi", "messages": [
        {"role": "user", "content": "First question?"}, {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "Second question?"}, {"role": "assistant", "content": "OK."}]}
    rows = demo_rows(4) + [
        multi,
        {"id": "prompt-only", "messages": [{"role": "user", "content": "Only a question, no answer yet."}]},
        {"conversations": [{"from": "human", "value": "A ShareGPT row without id."}, {"from": "gpt", "value": "x"}]},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert main(regenerate_cmd(server, inp, out, "--max-tokens", "8", "--concurrency", "3",
                               "--chat-template-kwargs", '{"preserve_thinking": true}')[3:]) == 0
    stdout = capsys.readouterr().out
    records = {r.sample_id: r for r in read_records(inp)}
    got = read_out(out)
    assert sorted(r["id"] for r in got) == sorted(records) and len(got) == len(records)
    for row in got:
        record = records[row["id"]]
        prompt = build_prompt(record, "last").messages
        *head, turn = row["messages"]
        assert [(m["role"], m["content"]) for m in head] == [(m["role"], m["content"]) for m in prompt]
        assert head[-1]["role"] == "user"
        assert turn["role"] == "assistant" and isinstance(turn["content"], str)
        assert isinstance(turn["reasoning_content"], str)
        assert turn["finish_reason"] in ("stop", "length")
        assert row["generation"]["finish_reasons"] == [turn["finish_reason"]]
        assert row["source"] == record.source
        assert row["chat_template_kwargs"] == {"enable_thinking": True, "preserve_thinking": True}  # as sent
        # transformers serve answers 422 to return_token_ids: asked again without it, text only
        assert row["generation"]["token_ids"] == "refused by the server" and "token_ids" not in turn
    assert [m["content"] for m in next(r for r in got if r["id"] == "multi")["messages"][:3]] == [
        "First question?", "First answer.", "Second question?"]  # earlier turns kept, the old last one dropped
    n_cut = sum(r["messages"][-1]["finish_reason"] == "length" for r in got)
    assert f"{n_cut} cut by --max-tokens" in stdout

    rc = main(["check", "--model", str(tiny_dir), "--input", str(out), "--json", "--no-expand"])
    assert rc in (0, 1)  # the gibberish may fail the gate; the output must parse
    report = json.loads(capsys.readouterr().out)
    assert report["samples"] == len(records)
    assert report["flag_counts"].get("truncated", 0) == n_cut


def test_all_turns_are_regenerated_in_order(server, tmp_path):
    """turns=all: one new assistant turn after every answered user message, the old answers gone."""
    conv = {"id": "two-exchanges", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "OLD-ANSWER-1"},
        {"role": "user", "content": "And a number?"}, {"role": "assistant", "content": "OLD-ANSWER-2"}]}
    inp = write_jsonl(tmp_path / "in.jsonl", [conv, demo_rows(1)[0]])
    out = tmp_path / "out.jsonl"
    res = run_regenerate(build(RegenerateSettings, input=[str(inp)], out=str(out), server=server, max_tokens=6,
                               turns="all", concurrency=2, progress=False))
    assert (res.prompts, res.generated) == (2, 2)
    row = next(r for r in read_out(out) if r["id"] == "two-exchanges")
    msgs = row["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert [msgs[1]["content"], msgs[3]["content"]] == ["Name a colour.", "And a number?"]
    assert not any(m["content"].startswith("OLD-ANSWER") for m in msgs)
    assert all("reasoning_content" in m and m["finish_reason"] for m in msgs if m["role"] == "assistant")
    assert len(row["generation"]["finish_reasons"]) == 2


def test_resume_after_kill_9(server, tmp_path):
    """kill -9 the client mid-run, leave a torn line as a crash inside a write would: the re-run keeps the
    rows already written byte for byte, redoes the rest, and every id ends up in the output exactly once."""
    rows = demo_rows(8)
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(regenerate_cmd(server, inp, out, "--max-tokens", "8", "--concurrency", "2"),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= 2:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "regenerate finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    kept = out.read_bytes()
    kept = kept[: kept.rfind(b"\n") + 1]
    n_kept = kept.count(b"\n")
    assert 2 <= n_kept < len(rows)
    with open(out, "ab") as f:
        f.write(b'{"id": "demo-torn", "messages": [{"ro')  # a write cut by the crash
    again = subprocess.run(regenerate_cmd(server, inp, out, "--max-tokens", "8"), cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"({n_kept} already in" in again.stdout
    assert out.read_bytes().startswith(kept)
    ids = [r["id"] for r in read_out(out)]
    assert sorted(ids) == sorted(r["id"] for r in rows)


def test_server_refusal_names_the_prompt(server, tmp_path):
    """A request the server rejects (422 for an unknown field) fails at once, not after retries, naming the
    prompt, and nothing is written for it."""
    inp = write_jsonl(tmp_path / "in.jsonl", demo_rows(1))
    out = tmp_path / "out.jsonl"
    cfg = build(RegenerateSettings, input=[str(inp)], out=str(out), server=server, max_tokens=4, retries=5,
                extra_body={"no_such_field": 1}, progress=False)
    with pytest.raises(RegenerateError, match=r"prompt demo-math-001 \(.*in\.jsonl:1\): the server refused the "
                                              r"request \(HTTP 422"):
        run_regenerate(cfg)
    assert out.read_text() == ""


def test_retries_until_the_server_comes_up(tiny_dir, tmp_path, caplog):
    """The client starts before the server: connection errors are retried with backoff until the server
    answers, then every prompt is done."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    inp = write_jsonl(tmp_path / "in.jsonl", demo_rows(3))
    out = tmp_path / "out.jsonl"
    cfg = build(RegenerateSettings, input=[str(inp)], out=str(out), server=url, max_tokens=4, concurrency=2,
                retries=60, backoff_s=0.2, backoff_max_s=1.0, progress=False)
    result: dict = {}

    def client():
        try:
            result["res"] = run_regenerate(cfg)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            result["err"] = e

    with caplog.at_level("WARNING", logger="hsstore.extract.regenerate"):
        t = threading.Thread(target=client)
        t.start()
        while not any("retry" in r.getMessage() for r in caplog.records) and t.is_alive():
            time.sleep(0.05)
        proc = start_server(tiny_dir, port)
        try:
            t.join(timeout=240)
        finally:
            stop_server(proc)
    assert not t.is_alive() and "err" not in result, result.get("err")
    assert result["res"].generated == 3
    assert any("ConnectError" in r.getMessage() for r in caplog.records)
    assert sorted(r["id"] for r in read_out(out)) == sorted(r["id"] for r in demo_rows(3))


def test_retries_exhausted_name_the_prompt(tmp_path, capsys):
    """Nothing listening and no retries left: one line naming the prompt, exit 2, no row written."""
    inp = write_jsonl(tmp_path / "in.jsonl", demo_rows(1))
    out = tmp_path / "out.jsonl"
    rc = main(["regenerate", "--server", f"http://127.0.0.1:{free_port()}", "--model", "m", "--input", str(inp),
               "--out", str(out), "--retries", "0", "-q"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "prompt demo-math-001" in err and "failed after 1 attempts" in err and "ConnectError" in err
    assert out.read_text() == ""


# ------------------------------------------------------------------------------------ without a server


def test_resume_output_drops_only_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    good = b'{"id": "a", "messages": []}\n{"id": "b", "messages": []}\n'
    out.write_bytes(good + b'{"id": "c", "mess')
    assert resume_output(out) == {"a", "b"}
    assert out.read_bytes() == good
    out.write_bytes(b'{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=r"out\.jsonl:2: unreadable output row"):
        resume_output(out)
    assert out.read_bytes() == b'{"id": "a"}\nnot json\n{"id": "b"}\n'  # nothing changed


@pytest.mark.parametrize("message, finish, want", [
    ({"content": "4", "reasoning_content": "2+2"}, "stop", ("2+2", "4", "stop")),  # SGLang / older vLLM
    ({"content": "4", "reasoning": "2+2"}, "stop", ("2+2", "4", "stop")),  # newer vLLM
    ({"content": "<think>\n2+2\n</think>\n\n4"}, "stop", ("2+2", "4", "stop")),  # no reasoning parser
    ({"content": "2+2\n</think>\n\n4"}, "stop", ("2+2", "4", "stop")),  # the template opened <think>
    ({"content": "<think>\n2+2 is"}, "stop", ("2+2 is", "", "length")),  # stopped inside the reasoning
    ({"content": None, "reasoning_content": "2+2 is"}, "length", ("2+2 is", "", "length")),
    ({"content": "4"}, "stop", ("", "4", "stop")),
    # a reasoning parser gave the reasoning: a literal </think> in the answer is the answer's
    ({"content": "Strip </think> with re.sub.", "reasoning_content": "r"}, "stop",
     ("r", "Strip </think> with re.sub.", "stop")),
    ({"content": "Strip </think> tags.", "reasoning_content": ""}, "stop", ("", "Strip </think> tags.", "stop")),
])
def test_assistant_turn_normalises_reasoning(message, finish, want):
    turn = assistant_turn(message, finish)
    assert (turn["reasoning_content"], turn["content"], turn["finish_reason"]) == want
    assert turn["role"] == "assistant"


def test_build_prompt_modes_and_refusals(tmp_path):
    rows = [
        {"id": "a", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                                 {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
                                 {"role": "user", "content": "u3"}, {"role": "assistant", "content": "a2"}]},
        {"id": "tools", "messages": [{"role": "user", "content": "u"},
                                     {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
                                     {"role": "tool", "content": "r"}, {"role": "assistant", "content": "done"}]},
        {"id": "no-user", "messages": [{"role": "system", "content": "s"}]},
    ]
    recs = list(read_records(write_jsonl(tmp_path / "in.jsonl", rows)))
    last = build_prompt(recs[0], "last")
    assert [m["content"] for m in last.messages] == ["s", "u1", "a1", "u2", "u3"] and last.points == [4]
    every = build_prompt(recs[0], "all")
    assert [m["content"] for m in every.messages] == ["s", "u1", "u2", "u3"] and every.points == [1, 3]
    assert [m["content"] for m in build_prompt(recs[1], "last").messages] == ["u"]
    with pytest.raises(RowError, match=r"id=tools\): tool results answer the original tool calls") as e:
        build_prompt(recs[1], "all")
    assert e.value.reason == "tool_results"
    with pytest.raises(RowError, match=r"in\.jsonl:3 \(id=no-user\): no user message"):
        build_prompt(recs[2], "last")
    # rows none of which can be prompted: the run fails before any request, counting them by reason
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[2]) + "\n" + json.dumps({"id": "t", "input_ids": [1, 2], "loss_mask": [0, 1]})
                   + "\n{not json\n")
    with pytest.raises(ValueError, match=r"no row to answer: 3 row\(s\) \(invalid_row 1, malformed_json 1, "
                                         r"pre_tokenized 1\) skipped; first: .*bad\.jsonl:1 \(id=no-user\)"):
        run_regenerate(build(RegenerateSettings, input=[str(bad)], out=str(tmp_path / "o.jsonl"),
                             server="http://127.0.0.1:9", retries=0, progress=False))
    assert not (tmp_path / "o.jsonl").exists()
    (tmp_path / "o.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"o\.jsonl: the output is also an input"):
        run_regenerate(build(RegenerateSettings, input=[str(tmp_path)], out=str(tmp_path / "o.jsonl"),
                             server="http://127.0.0.1:9", progress=False))


# ------------------------------------------------------------------ the rows that showed it (tools/engine_server.py)


@pytest.fixture(scope="module")
def trained():
    from hsstore.extract.tiny import trained_target_dir

    return trained_target_dir()


SYSTEM = {"role": "system", "content": "You are a helpful assistant. Think step by step before you answer."}


def engine_regenerate(url: str, inp: Path, out: Path, capsys, *extra: str) -> str:
    """``hsstore regenerate`` through the CLI; its stdout."""
    assert main(["regenerate", "--server", url, "--input", str(inp), "--out", str(out), "--max-tokens", "120",
                 "--temperature", "0", "--concurrency", "2", "-q", *extra]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("cli", ['{"preserve_thinking": true}', '{"enable_thinking": true, "preserve_thinking": true}'],
                         ids=["default", "command line"])
def test_a_rows_own_template_arguments_win(trained, tmp_path, capsys, cli):
    """Thinking-off rows (their own chat_template_kwargs) are asked with thinking off and recorded so, the other
    rows with the run's, whether thinking on is the default or the command line's own --chat-template-kwargs; check
    renders each with what was sent (no prompt_mismatch) and the engine's prompt ids agree with it."""
    from tools.engine_server import EngineServer

    off = {"enable_thinking": False}
    rows = [{"id": f"off-{i}", "chat_template_kwargs": off,
             "messages": [SYSTEM, {"role": "user", "content": q}]} for i, q in enumerate(["What is 2 + 3?",
                                                                                         "Count from 3 to 6."])]
    rows.append({"id": "on-0", "messages": [SYSTEM, {"role": "user", "content": "What is 4 + 4?"}]})
    inp, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    server = EngineServer(trained, script={"2 + 3": "5.", "3 to 6": "3, 4, 5, 6."})  # the tiny model always thinks
    with server as url:
        engine_regenerate(url, inp, out, capsys, "--chat-template-kwargs", cli)
    sent = {r["messages"][-1]["content"]: r["chat_template_kwargs"] for r in server.requests}
    assert sent["What is 2 + 3?"] == sent["Count from 3 to 6."] == {"enable_thinking": False,
                                                                     "preserve_thinking": True}
    assert sent["What is 4 + 4?"] == {"enable_thinking": True, "preserve_thinking": True}
    got = {r["id"]: r for r in read_out(out)}
    for i in range(2):
        row = got[f"off-{i}"]
        assert row["chat_template_kwargs"] == {"enable_thinking": False, "preserve_thinking": True}
        turn = row["messages"][-1]
        assert turn["reasoning_content"] == "" and turn["finish_reason"] == "stop"  # thinking off: no reasoning
    assert got["on-0"]["chat_template_kwargs"] == {"enable_thinking": True, "preserve_thinking": True}
    main(["check", "--model", str(trained), "--input", str(out), "--json"])  # the short answers may fail the gate
    report = json.loads(capsys.readouterr().out)
    assert report["samples"] == 3 and report["input"]["skipped_rows"] == 0
    assert report["input"]["engine_turns"] == 3  # each recorded prompt equals the render with the row's arguments


def test_hand_written_turns_are_context_unless_asked(trained, tmp_path, capsys):
    """--turns last keeps a multi-turn row's hand-written earlier answer as context, marked generated: false.
    With a server that gives no ids (it refuses return_token_ids, as transformers serve does), check and
    extract re-tokenize the text: by default only the regenerated turn is learnt (one sample, the row's id);
    --learn-not-generated learns the hand-written one too, flagged not_generated, which info counts and
    subset --exclude-flag drops."""
    import hsstore
    from tools.engine_server import EngineServer

    multi = {"id": "my-multi-1", "messages": [
        SYSTEM, {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "HAND-WRITTEN: it is five.", "reasoning_content": "I wrote this myself."},
        {"role": "user", "content": "What is 4 + 4?"}]}
    single = {"id": "single", "messages": [SYSTEM, {"role": "user", "content": "Count from 3 to 6."}]}
    inp, out = write_jsonl(tmp_path / "in.jsonl", [multi, single]), tmp_path / "out.jsonl"
    with EngineServer(trained, strict=True) as url:
        engine_regenerate(url, inp, out, capsys)
    row = next(r for r in read_out(out) if r["id"] == "my-multi-1")
    assert row["generation"]["token_ids"] == "refused by the server"
    assert row["messages"][2]["content"] == "HAND-WRITTEN: it is five." and row["messages"][2]["generated"] is False
    assert "generated" not in row["messages"][-1]

    main(["check", "--model", str(trained), "--input", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["samples"] == 2 and "not_generated" not in report["flag_counts"]
    main(["check", "--model", str(trained), "--input", str(out), "--json", "--learn-not-generated"])
    report = json.loads(capsys.readouterr().out)
    assert report["samples"] == 3 and report["flag_counts"]["not_generated"] == 1
    assert report["flagged_ids"]["not_generated"] == ["my-multi-1#t0"]
    assert any("did not generate" in w for w in report["warnings"])

    for name, extra in (("default", []), ("asked", ["--learn-not-generated"])):
        assert main(["extract", "--model", str(trained), "--input", str(out), "--out", str(tmp_path / name),
                     "--device", "cpu", "--dtype", "float32", "--layers", "1,4", "-q", "--force", *extra]) == 0
        capsys.readouterr()
    store = hsstore.open(str(tmp_path / "default"))
    ids = sorted(store.read(i, layers=store.layers[:1])["sample_id"] for i in range(len(store)))
    assert ids == ["my-multi-1", "single"]
    mine = next(store.read(i, layers=store.layers[:1]) for i in range(len(store))
                if store.read(i, layers=store.layers[:1])["sample_id"] == "my-multi-1")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(trained))
    learnt = tok.decode(mine["input_ids"][mine["loss_mask"]])
    assert "HAND-WRITTEN" not in learnt and "HAND-WRITTEN" in tok.decode(mine["input_ids"])  # context only
    assert main(["info", str(tmp_path / "asked"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["flags"]["not_generated"] == 1
    assert main(["subset", str(tmp_path / "asked"), str(tmp_path / "generated-only"), "--exclude-flag",
                 "not_generated", "-q", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["written"] == 2
    assert main(["subset", str(tmp_path / "default"), str(tmp_path / "x"), "--exclude-flag", "not_generated",
                 "-q"]) == 0  # a flag name writers record, though this store has none of it
    capsys.readouterr()


def test_a_tool_row_is_skipped_and_counted_with_turns_all(trained, tmp_path, capsys):
    """--turns all on a file with a tool-call row whose tool results answer the original calls: that row is
    skipped and counted (its reason named), every other row regenerated."""
    from tools.engine_server import EngineServer

    tool = {"id": "tool-row", "messages": [
        SYSTEM, {"role": "user", "content": "Add 2 and 3 with the tool."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}, {"role": "assistant", "content": "5."}]}
    rows = [tool] + [{"id": f"plain-{i}", "messages": [SYSTEM, {"role": "user", "content": f"What is {i} + 1?"},
                                                       {"role": "assistant", "content": "OLD"}]} for i in range(3)]
    inp, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    with EngineServer(trained) as url:
        text = engine_regenerate(url, inp, out, capsys, "--turns", "all")
    assert "regenerated 3 of 3 prompts" in text and "skipped 1 row(s) (tool_results 1)" in text
    assert sorted(r["id"] for r in read_out(out)) == ["plain-0", "plain-1", "plain-2"]
