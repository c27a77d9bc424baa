"""Errors that say where (#38): a bad flag is named with what is wrong with it, before anything is loaded; a
mistyped path is told apart from a folder that is not a store."""

from __future__ import annotations

import json
import shutil

import pytest

from hsstore.app.cli import main


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def config_only(tiny_dir, tmp_path):
    """The tiny target's folder with its config.json and nothing else: a command that reaches the tokenizer,
    the input or the weights fails on their absence, so only one that checks the flags first says the flag."""
    d = tmp_path / "config-only"
    d.mkdir()
    shutil.copy(tiny_dir / "config.json", d / "config.json")
    return d


@pytest.mark.parametrize("command", ["extract", "check"])
def test_layers_that_are_not_numbers_name_the_flag(capsys, config_only, tmp_path, command):
    extra = ["--out", str(tmp_path / "s")] if command == "extract" else []
    code, _, err = run(capsys, command, "--model", str(config_only), "--input", str(tmp_path / "none.jsonl"),
                       "--layers", "1,two", *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--layers '1,two': 'two' is not a layer id" in err, err


@pytest.mark.parametrize("command", ["extract", "check"])
def test_layers_out_of_range_refused_before_anything_loads(capsys, config_only, tmp_path, command):
    """`--layers 1,99` on an 8-layer target: refused from config.json alone (no tokenizer, input or weights
    there to load), where it used to be refused after the gate and the model load."""
    extra = ["--out", str(tmp_path / "s")] if command == "extract" else []
    code, _, err = run(capsys, command, "--model", str(config_only), "--input", str(tmp_path / "none.jsonl"),
                       "--layers", "1,99", *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--layers 1,99: layer ids [99] out of range: the target has 8 decoder layers" in err, err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("command", ["info", "verify", "index", "report"])
def test_a_mistyped_store_path_says_it_does_not_exist(capsys, tmp_path, command):
    from conftest import make_manifest, make_samples, write_samples

    store = tmp_path / "stores" / "run1"
    write_samples(str(store), make_manifest(), make_samples(2))
    extra = ["--out", str(tmp_path / "r.html")] if command == "report" else []
    code, _, err = run(capsys, command, str(tmp_path / "stores" / "rnu1"), *extra)
    assert code == 2
    assert "does not exist" in err and f"the nearest folder that exists is {tmp_path / 'stores'}" in err, err
    assert "manifest.json" not in err
    (tmp_path / "plain").mkdir()  # a folder that exists and is not a store still says so
    code, _, err = run(capsys, command, str(tmp_path / "plain"), *extra)
    assert code == 2 and "is not an hsstore store: no manifest.json there" in err


def test_show_of_a_path_that_does_not_exist(capsys, tmp_path):
    code, _, err = run(capsys, "show", str(tmp_path / "nowhere.jsonl"), "0")
    assert code == 2 and "does not exist (neither a store nor an input file)" in err, err


def test_interactive_commands_size_s3_timeouts_and_retries(monkeypatch):
    """#38.6: info, index, report and show give an object store a short connect timeout, one retry and no second
    round from s3fs (where the user set none); jobs keep the long-haul retries. Asserted on the botocore client
    the filesystem ends up with."""
    import fsspec.asyn
    import s3fs

    from hsstore.io import storage

    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    url = "s3://bucket/store"
    fs, _ = storage.resolve(url, storage.interactive_options(url, {}))
    client = fsspec.asyn.sync(fs.loop, fs.set_session)
    assert (client.meta.config.connect_timeout, client.meta.config.read_timeout) == (3, 15)
    assert client.meta.config.retries == {"mode": "standard", "total_max_attempts": 2}  # one try, one retry
    assert fs.retries == storage.S3FS_INTERACTIVE_RETRIES == 1
    mine = storage.interactive_options(url, storage.parse_storage_options(["config_kwargs.connect_timeout=30"]))
    assert mine["config_kwargs"]["connect_timeout"] == 30 and mine["config_kwargs"]["read_timeout"] == 15
    job, _ = storage.resolve(url, {})  # extract, train, verify ...: hsstore's retry policy, s3fs's own rounds
    assert job.config_kwargs["retries"] == storage.S3_RETRIES and job.retries == 5
    assert storage.interactive_options("/local/store", {}) == {}


def _s3_env(port: int) -> dict:
    import os

    return {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "x",
            "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}


def test_info_against_a_closed_port_is_one_line_naming_the_url():
    import subprocess
    import sys

    from hsstore.testing.ports import free_port

    p = subprocess.run([sys.executable, "-m", "hsstore", "info", "s3://bucket/x"], env=_s3_env(free_port()),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "cannot reach store 's3://bucket/x'" in p.stderr


def test_info_says_what_it_waits_for():
    """An endpoint that accepts connections and never answers: a line says what is awaited (the endpoint, the
    timeouts in force) while it waits, then the error is one line naming the URL."""
    import socket
    import subprocess
    import sys

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # connections complete in the kernel's backlog; nothing ever reads them
        port = silent.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "hsstore", "info", "s3://bucket/x", "-S",
                            "config_kwargs.read_timeout=4"], env=_s3_env(port), capture_output=True, text=True,
                           timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 2, p.stderr
    assert lines[0].startswith("WARNING") and f"waiting for s3://bucket/x: no answer yet from http://127.0.0.1:{port}" in lines[0]
    assert "3 s to connect, 4 s to answer" in lines[0]
    assert lines[1].startswith("hsstore info: error: cannot read store 's3://bucket/x'")


def test_a_mistyped_flag_or_command_is_one_line_naming_the_near_one(capsys):
    """#38.10: `train --stpes 3` printed the top-level usage and suggested nothing."""
    code, _, err = run(capsys, "train", "--store", "s", "--out", "o", "--stpes", "3")
    assert code == 2 and err.strip() == ("hsstore train: error: unknown flag --stpes (did you mean --steps?); "
                                         "usage: hsstore train --store URL --out OUT [options]; "
                                         "`hsstore train --help` lists the flags")
    code, _, err = run(capsys, "trian", "--store", "s")
    assert code == 2 and "unknown command 'trian' (did you mean train?)" in err and len(err.splitlines()) == 1
    code, _, err = run(capsys, "info", "--jsn", "somewhere")
    assert code == 2 and "unknown flag --jsn (did you mean --json?)" in err


def test_an_unknown_config_key_is_one_line_naming_the_near_one(tmp_path, capsys):
    """#38.10: an unknown key printed 20 lines of usage before the error, and no near name."""
    f = tmp_path / "c.yaml"
    f.write_text("run:\n  stores: [s]\n  stpes: 3\ntrainin:\n  lr: 0.1\n")
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(f), "--out", "o"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "usage" not in err
    assert "run.stores (did you mean run.store?)" in err and "run.stpes (did you mean run.steps?)" in err
    assert "trainin (did you mean training?)" in err
