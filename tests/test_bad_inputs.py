"""A catalogue of bad inputs for every command (info, verify, bench, check, show, extract, train, eval,
demo): each ends with exit code non-zero and one clear line on stderr naming the culprit (no traceback),
and nothing is committed that should not be.

Tests run as root, so "no permission" is a path under /proc (root cannot create files there) or an S3
bucket that does not exist."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

import hsstore
from hsstore.extract.tiny import demo_conversations_path
from hsstore.app.cli import main
from hsstore.app.schema import build

from conftest import make_manifest, make_samples, write_samples

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

NO_PERMISSION = "/proc/hsstore-no-permission"


def good_line(i: int = 0) -> str:
    return demo_conversations_path().read_text().splitlines()[i]


BAD_INPUTS = {  # name -> (file content, what the error must name)
    "malformed_jsonl": (good_line() + '\n{"id": "x", "messages": [\n', r"bad\.jsonl:2:\d+: malformed JSON"),
    "wrong_types": (good_line() + '\n{"id": "x", "messages": 5}\n', r"bad\.jsonl:2.*messages must be a list"),
    "unknown_role": (json.dumps({"id": "r", "messages": [{"role": "user", "content": "hi"},
                                                         {"role": "robot", "content": "beep"}]}) + "\n",
                     r"bad\.jsonl:1.*unknown role 'robot'"),
    "huge_line": ('{"id": "h", "messages": "' + "x" * (8 << 20) + "\n", r"bad\.jsonl:1:\d+: malformed JSON"),
    "empty_file": ("", r"bad\.jsonl.*no samples"),
    "not_json_lines": ("\x00\xff binary junk\n", r"bad\.jsonl:1:\d+: malformed JSON"),
}


def one_line_error(capsys, rc: int, pattern: str) -> str:
    """Assert a non-zero exit and exactly one stderr line matching ``pattern``; return that line."""
    import re

    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert rc != 0, err
    assert len(err) == 1, err
    assert "Traceback" not in err[0] and len(err[0]) < 600, err[0][:600]
    assert re.search(pattern, err[0]), err[0]
    return err[0]


def no_commits(store: Path) -> bool:
    return not list((store / "commits").glob("*.json")) if store.exists() else True


@pytest.fixture(scope="module")
def synthetic_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("synthetic") / "store"
    write_samples(str(path), make_manifest(), make_samples(6))
    return path


@pytest.fixture
def edited_store(tiny_dir, tmp_path):
    """An extracted store (two conversations) whose manifest was edited by hand afterwards (dtype)."""
    from hsstore.extract.job import ExtractSettings, run_extract

    data = tmp_path / "in.jsonl"
    data.write_text(good_line(0) + "\n" + good_line(1) + "\n")
    path = tmp_path / "edited"
    run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(data)], out=str(path), device="cpu",
                      progress=False))
    d = json.loads((path / "manifest.json").read_text())
    d["dtype"] = "float16"
    (path / "manifest.json").write_text(json.dumps(d))
    return path


@pytest.fixture(scope="module")
def broken_tokenizer(tiny_dir, tmp_path_factory):
    """The tiny target with an unreadable tokenizer.json."""
    path = tmp_path_factory.mktemp("broken") / "model"
    shutil.copytree(tiny_dir, path)
    (path / "tokenizer.json").write_text("{ this is not a tokenizer")
    return path


# ------------------------------------------------------------------------ bad input files: check, show, extract


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
@pytest.mark.parametrize("command", ["check", "show", "extract"])
def test_bad_input_file(tiny_dir, tmp_path, capsys, case, command):
    content, pattern = BAD_INPUTS[case]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content, encoding="utf-8", errors="surrogateescape")
    out = tmp_path / "store"
    argv = {"check": ["check", "--model", str(tiny_dir), "--input", str(bad)],
            "show": ["show", str(bad), "5", "--model", str(tiny_dir)],
            "extract": ["extract", "--model", str(tiny_dir), "--input", str(bad), "--out", str(out),
                        "--device", "cpu", "-q"]}[command]
    one_line_error(capsys, main(argv), pattern)
    assert no_commits(out)


# ------------------------------------------------------------------------ the model and the tokenizer


@pytest.mark.parametrize("command", ["check", "show", "extract", "eval"])
def test_unreadable_tokenizer(broken_tokenizer, synthetic_store, tmp_path, capsys, command):
    data = str(demo_conversations_path())
    out = tmp_path / "store"
    argv = {"check": ["check", "--model", str(broken_tokenizer), "--input", data],
            "show": ["show", data, "0", "--model", str(broken_tokenizer)],
            "extract": ["extract", "--model", str(broken_tokenizer), "--input", data, "--out", str(out),
                        "--device", "cpu", "-q"],
            "eval": ["eval", "--store", str(synthetic_store), "--drafter", str(tmp_path), "--model",
                     str(broken_tokenizer), "--input", data, "--device", "cpu"]}[command]
    one_line_error(capsys, main(argv), r"tokenizer|model|drafter")
    assert no_commits(out)


def test_nan_features_from_the_model(tiny_dir, tmp_path, capsys, monkeypatch):
    """NaN/Inf from the target during `hsstore extract`: one line naming the sample; nothing committed."""
    import hsstore.extract.forward as fwd

    real = fwd.run_tapped

    def poisoned(model, layers, ids, attn):
        feats = real(model, layers, ids, attn).clone()
        feats[-1, 2, 0, 1] = float("inf")
        return feats

    monkeypatch.setattr(fwd, "run_tapped", poisoned)
    out = tmp_path / "store"
    rc = main(["extract", "--model", str(tiny_dir), "--input", str(demo_conversations_path()), "--out", str(out),
               "--device", "cpu", "-q"])
    one_line_error(capsys, rc, r"sample '.+': the target produced NaN/Inf features")
    assert no_commits(out) and len(hsstore.open(str(out))) == 0


def test_missing_model_dir(tmp_path, capsys):
    rc = main(["check", "--model", str(tmp_path / "nope"), "--input", str(demo_conversations_path())])
    one_line_error(capsys, rc, r"model directory not found: .*nope")


# ------------------------------------------------------------------------ stores: info, verify, upgrade, show, train, eval


def store_argv(command: str, url: str, tmp_path: Path, tiny_dir) -> list[str]:
    data = str(demo_conversations_path())
    return {"info": ["info", url], "verify": ["verify", url, "-q"], "upgrade": ["upgrade", url, "-q"],
            "show": ["show", url, "0"],
            "train": ["train", "--store", url, "--out", str(tmp_path / "run"), "--steps", "1", "--device", "cpu",
                      "-q"],
            "eval": ["eval", "--store", url, "--drafter", str(tmp_path / "run"), "--model", str(tiny_dir),
                     "--input", data, "--device", "cpu"]}[command]


STORE_COMMANDS = ["info", "verify", "upgrade", "show", "train", "eval"]


@pytest.mark.parametrize("command", STORE_COMMANDS)
def test_not_a_store(tiny_dir, tmp_path, capsys, command):
    url = str(tmp_path / "empty")
    Path(url).mkdir()
    one_line_error(capsys, main(store_argv(command, url, tmp_path, tiny_dir)), r"empty.*no manifest\.json")
    assert not list(tmp_path.glob("run/**/*.safetensors"))


@pytest.mark.parametrize("command", STORE_COMMANDS)
def test_no_such_bucket(tiny_dir, tmp_path, capsys, s3_endpoint, command):
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:6]}/store"
    argv = store_argv(command, url, tmp_path, tiny_dir) + ["-S", f"endpoint_url={s3_endpoint}"]
    one_line_error(capsys, main(argv), rf"{url}")


def test_hand_edited_manifest(edited_store, tiny_dir, tmp_path, capsys):
    rc = main(store_argv("train", str(edited_store), tmp_path, tiny_dir))
    one_line_error(capsys, rc, r"rule 'manifest' \(written under another manifest: manifest\.json was changed")
    assert not list(tmp_path.glob("run/**/*.safetensors"))


# ------------------------------------------------------------------------ storage options and permissions


@pytest.mark.parametrize("command", ["info", "verify", "show", "extract", "train", "bench"])
@pytest.mark.parametrize("option, pattern", [("anon", r"--storage-option 'anon': expected key=value"),
                                             ("no_such_option=1", r"no_such_option")])
def test_wrong_storage_options(tiny_dir, tmp_path, capsys, s3_endpoint, command, option, pattern):
    url = f"s3://bucket-{uuid.uuid4().hex[:6]}/store"
    argv = {"extract": ["extract", "--model", str(tiny_dir), "--input", str(demo_conversations_path()), "--out", url,
                        "--device", "cpu", "-q"],
            "bench": ["bench", url, "--size-mb", "1", "--hidden", "64", "--num-taps", "2", "--rounds", "1", "-q"],
            }.get(command) or store_argv(command, url, tmp_path, tiny_dir)
    one_line_error(capsys, main(argv + ["-S", f"endpoint_url={s3_endpoint}", "-S", option]), pattern)


@pytest.mark.parametrize("command", ["extract", "train", "bench", "demo"])
def test_no_permission(tiny_dir, synthetic_store, tmp_path, capsys, command):
    out = f"{NO_PERMISSION}/{uuid.uuid4().hex[:6]}"
    argv = {"extract": ["extract", "--model", str(tiny_dir), "--input", str(demo_conversations_path()), "--out", out,
                        "--device", "cpu", "-q"],
            "train": ["train", "--store", str(synthetic_store), "--out", out, "--steps", "1", "--device", "cpu",
                      "-q"],
            "bench": ["bench", out, "--size-mb", "1", "--hidden", "64", "--num-taps", "2", "--rounds", "1", "-q"],
            "demo": ["demo", "--out", out]}[command]
    one_line_error(capsys, main(argv), rf"{NO_PERMISSION}")


def test_bench_unknown_codec(tmp_path, capsys):
    rc = main(["bench", str(tmp_path / "b"), "--size-mb", "1", "--hidden", "64", "--num-taps", "2", "--codec", "gzip9", "-q"])
    one_line_error(capsys, rc, r"codec 'gzip9'")
    assert not list(tmp_path.glob("b/**/commits/*.json"))


@pytest.mark.parametrize("command", ["info", "extract"])
def test_access_denied_says_what_to_check(tiny_dir, tmp_path, capsys, s3_store, command):
    """A 403 from the endpoint names the store, whether it was a read or a write, and what to check."""
    from hsstore.testing.faultproxy import FaultProxy

    url, options = s3_store
    if command == "info":
        write_samples(url, make_manifest(), make_samples(2), storage_options=options)
    with FaultProxy(options["endpoint_url"], faults=["403"], persistent=True) as proxy:
        argv = {"info": ["info", url],
                "extract": ["extract", "--model", str(tiny_dir), "--input", str(demo_conversations_path()),
                            "--out", url, "--device", "cpu", "-q"]}[command]
        line = one_line_error(capsys, main(argv + ["-S", f"endpoint_url={proxy.url}"]), r"access denied")
    assert proxy.injected["403"] > 0
    assert f"cannot read store {url!r}" in line and "credentials" in line and "bucket policy" in line


def test_missing_bucket_is_named(tmp_path, capsys, s3_endpoint):
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:6]}"
    one_line_error(capsys, main(["info", f"s3://{bucket}/store", "-S", f"endpoint_url={s3_endpoint}"]),
                   rf"bucket '{bucket}' does not exist")


def test_a_malformed_line_and_a_bad_role_are_skipped_alike(tiny_dir, tmp_path, capsys):
    """#38.8: one malformed JSONL line stopped check and extract (naming the wrong column) while a bad role in the
    same file was skipped and counted. Both are now skipped and counted, the malformed one named by
    file:line:column, within the same --max-skipped-share."""
    good = demo_conversations_path().read_text().splitlines()
    line = good[5]
    at = line.index('"role"')
    broken = line[:at] + "role" + line[at + 6:]  # an unquoted key: the error is at its first character
    role = json.loads(good[7])
    role["messages"][0]["role"] = "robot"
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(good[:5] + [broken] + good[6:7] + [json.dumps(role)] + good[8:]) + "\n")
    n = len(good)
    code = main(["check", "--model", str(tiny_dir), "--input", str(data), "--json", "--max-skipped-share", "0.1"])
    report = json.loads(capsys.readouterr().out)
    skipped = report["input"]["skipped"]
    assert code == 0, report["failures"]
    assert {r: v["count"] for r, v in skipped.items()} == {"malformed_json": 1, "invalid_row": 1}
    assert skipped["malformed_json"]["first"] == (f"{data}:6:{at + 1}: malformed JSON (Expecting property name "
                                                  "enclosed in double quotes)")
    assert skipped["malformed_json"]["ids"] == ["in.jsonl:6"]
    assert main(["check", "--model", str(tiny_dir), "--input", str(data), "--max-skipped-share", "0.05"]) == 1
    assert f"skipped (invalid_row 1, malformed_json 1): 2 of {n}" in capsys.readouterr().err
    out = tmp_path / "store"
    assert main(["extract", "--model", str(tiny_dir), "--input", str(data), "--out", str(out), "--device", "cpu",
                 "--max-skipped-share", "0.1", "-q"]) == 0
    assert f"wrote {report['samples']} samples" in capsys.readouterr().out  # every sample of the other rows
    assert main(["info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == {"malformed_json": 1, "invalid_row": 1}
