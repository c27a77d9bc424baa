"""One name, one meaning across commands; old spellings keep working with a deprecation line; --json summaries."""

from __future__ import annotations

import argparse
import json

import pytest

import hsstore
from hsstore.app.cli import build_parser, main

from train_helpers import small_input, store32  # noqa: F401  (fixtures)


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _visible_options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions if a.help != argparse.SUPPRESS for s in a.option_strings}


def test_every_flag_has_one_meaning_across_commands():
    commands = _commands()
    meanings: dict[str, set] = {}
    for name, p in commands.items():
        for flag, action in _visible_options(p).items():
            meanings.setdefault(flag, set()).add((action.dest, getattr(action.type, "__name__", action.type)))
    drift = {flag: m for flag, m in meanings.items() if len(m) > 1 and flag not in ("-h", "--help")}
    assert not drift, drift
    # the batch budget is --token-budget wherever a command batches tokens; --max-tokens is only the generation
    # length of regenerate (the OpenAI request field of that name); --layers is always a list of layer ids
    for name, p in commands.items():
        opts = _visible_options(p)
        if "--max-tokens" in opts:
            assert name == "regenerate", name
        if "--layers" in opts:
            assert opts["--layers"].type in (None, str), name
        if any(a.dest == "quiet" or "--no-progress" in a.option_strings for a in p._actions):
            assert "--quiet" in opts and "-q" in opts, name


@pytest.mark.parametrize("command", ["verify", "subset", "merge", "info"])
def test_store_commands_have_json(command):
    assert "--json" in _visible_options(_commands()[command])


def test_old_spellings_still_work_and_say_the_new_name(tmp_path, new_manifest, new_samples, write, capsys, caplog):
    src, a, b = str(tmp_path / "src"), str(tmp_path / "a"), str(tmp_path / "b")
    samples = new_samples(12, min_len=3, max_len=120)
    write(src, new_manifest(), samples)
    assert main(["subset", src, a, "--min-length", "20", "--max-length", "100", "-q"]) == 0
    capsys.readouterr()
    with caplog.at_level("WARNING", logger="hsstore"):
        assert main(["subset", src, b, "--min-tokens", "20", "--max-tokens", "100", "--no-progress"]) == 0
    said = caplog.text
    assert "--min-tokens is deprecated, use --min-length" in said and "--max-tokens is deprecated" in said
    assert "--no-progress is deprecated, use --quiet" in said
    assert hsstore.open(a).sample_ids() == hsstore.open(b).sample_ids()
    want = sum(20 <= len(s["input_ids"]) <= 100 for s in samples)
    assert 0 < want < len(samples) and len(hsstore.open(b)) == want


def test_verify_subset_merge_json(tmp_path, new_manifest, new_samples, write, capsys):
    src, sub, merged = str(tmp_path / "src"), str(tmp_path / "sub"), str(tmp_path / "merged")
    write(src, new_manifest(), new_samples(9, min_len=3, max_len=60))
    capsys.readouterr()
    assert main(["verify", src, "-q", "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert v["ok"] is True and v["shards"] >= 1 and v["problems"] == [] and v["bytes"] > 0
    assert main(["subset", src, sub, "--min-length", "30", "-q", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["written"] == len(hsstore.open(sub)) and s["dst"] == sub
    assert main(["merge", merged, sub, "-q", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["samples"] == s["written"] and m["by"] == "copy"


def test_bench_shows_progress_unless_quiet(tmp_path, capsys):
    argv = ["bench", str(tmp_path), "--size-mb", "1", "--hidden", "64", "--num-taps", "2", "--rounds", "1", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "bench store (zarr)" in captured.err and "1/1" in captured.err
    assert json.loads(captured.out)["store_read"]["bytes"] > 0
    assert main([*argv, "-q"]) == 0
    assert "bench store" not in capsys.readouterr().err


def test_train_json_summary_and_the_old_budget_flag(store32, tmp_path, capsys, caplog):  # noqa: F811
    argv = ["train", "--store", store32, "--out", str(tmp_path / "run"), "--steps", "2", "--draft-layers", "1",
            "--block-size", "8", "--anchors", "8", "--device", "cpu", "-q", "--json"]
    with caplog.at_level("WARNING", logger="hsstore"):
        assert main([*argv, "--max-tokens", "512"]) == 0
    assert "--max-tokens is deprecated, use --token-budget" in caplog.text
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 2 and summary["last"]["step"] == 2 and summary["drafter"].endswith("drafter")
    settings = json.loads((tmp_path / "run" / "checkpoints" / "step_00000002" / "trainer.json").read_text())
    assert "512" in json.dumps(settings)  # the old spelling set the budget


def test_extract_flags_make_its_config():
    """The handler's config comes from the schema: every flag lands in its setting, converted."""
    from hsstore.app.commands import command_settings
    from hsstore.app.config import apply
    from hsstore.extract.settings import ExtractSettings

    argv = ["extract", "--model", "m", "--input", "a.jsonl", "b.jsonl", "--out", "s3://b/x", "--layers", "1,3",
            "--shard-mb", "2", "-S", "anon=true", "--no-expand", "--chat-template-kwargs", '{"enable_thinking": false}',
            "--max-stub-share", "0.5", "--no-compile", "-q", "--token-budget", "512", "--encoding", "fp8"]
    p = build_parser()
    apply(p, argv)
    args = p.parse_args(argv)
    settings = command_settings(ExtractSettings, args)
    inp, store, tok, fwd = settings.input, settings.store, settings.tokenize, settings.forward
    assert (inp.model, inp.input, store.out, settings.capture.layers) == ("m", ["a.jsonl", "b.jsonl"], "s3://b/x",
                                                                          [1, 3])
    assert store.shard_bytes == 2 * 1024 * 1024 and store.storage_options == {"anon": True}
    assert tok.expand is False and tok.chat_template_kwargs == {"enable_thinking": False}
    assert settings.thresholds.max_stub_share == 0.5 and settings.thresholds.small_loss_sum == 32
    assert fwd.compile is False and settings.run.progress is False and fwd.token_budget == 512
    assert store.encoding == "fp8" and store.writer == "auto" and fwd.dtype == "bfloat16"
    assert settings.run.rank is None and settings.run.world_size is None


def test_help_lists_commands_in_workflow_order_and_every_argument_says_what_it_is(capsys):
    """#38.13: `hsstore --help` lists the commands as the work runs (regenerate -> check -> extract -> info/verify
    -> train -> eval -> sharing), every positional and flag of every command has help text, and `demo --help`
    shows --out's default."""
    import re

    with pytest.raises(SystemExit):
        main(["--help"])
    listed = re.findall(r"^    (\S+)", capsys.readouterr().out, re.M)
    assert set(_commands()) <= set(listed)
    at = {name: listed.index(name) for name in _commands()}
    chain = ["regenerate", "check", "extract", "info", "verify", "train", "eval", "subset", "merge"]
    assert [at[c] for c in chain] == sorted(at[c] for c in chain), listed
    missing = [f"{name} {a.option_strings[0] if a.option_strings else a.dest}"
               for name, p in _commands().items() for a in p._actions
               if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS and not (a.help or "").strip()]
    assert missing == []
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "(default: hsstore-demo)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow  # every flag of every command
def test_abbreviated_flags_are_refused_naming_the_flag(capsys):
    """argparse would take ``--step 300`` as ``--steps 300``: every command refuses a prefix of any of its flags,
    in one line naming the flag meant, before any work."""
    assert main(["train", "--store", "s", "--out", "o", "--step", "300"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hsstore train: error: unknown flag --step (did you mean --steps?)"), err
    assert main(["info", "store", "--js"]) == 2
    assert "unknown flag --js (did you mean --json?)" in capsys.readouterr().err
    for name, p in _commands().items():  # whatever the words before it, a prefix is never taken
        flags = {f for a in p._actions for f in a.option_strings}
        for flag in sorted(f for f in flags if f.startswith("--") and len(f) > 4):
            cut = flag[:-1]
            if cut not in flags:
                assert main([name, cut, "1"]) == 2, (name, cut)
                assert "unknown flag " + cut in capsys.readouterr().err
    for name, p in _commands().items():
        assert p.allow_abbrev is False, name  # argparse itself too (a --config file's keys, parse_known_args)
