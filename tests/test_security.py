"""Security: no pickle is ever loaded (``torch.load`` only with ``weights_only=True``), and credentials never
appear in logs, stored objects or error messages. (Manifest schema: test_store_errors; tar member names:
tests/test_wds.py.)"""

from __future__ import annotations

import ast
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import s3fs

import hsstore

from conftest import make_manifest, make_samples, write_samples

REPO = Path(__file__).resolve().parents[1]
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
PICKLE_LOADERS = {"load", "loads", "Unpickler", "read_pickle"}
KEY, SECRET, PASSWORD = "AKIDSECRETKEY42", "s3cr3t-value-xyz", "pa55word-xyz"


def unsafe_loads(source: str, name: str = "<src>") -> list[str]:
    """Places in ``source`` that may unpickle: torch.load without weights_only=True, imports of the
    pickle family other than the plain ``pickle`` module (whose exception classes are harmless), pickle's
    loaders (``pickle.load[s]``, ``Unpickler``, imported or called), numpy.load(allow_pickle=True),
    pandas.read_pickle."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            names = {a.name for a in node.names} if isinstance(node, ast.ImportFrom) else set()
            if any(m.split(".")[0] in PICKLE_MODULES - {"pickle"} for m in mods) or (
                    any(m.split(".")[0] == "pickle" for m in mods) and names & PICKLE_LOADERS):
                found.append(f"{name}:{node.lineno}: imports {mods} {sorted(names)}")
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        kw = {k.arg: k.value for k in node.keywords}
        if func.endswith("torch.load"):
            w = kw.get("weights_only")
            if not (isinstance(w, ast.Constant) and w.value is True):
                found.append(f"{name}:{node.lineno}: torch.load without weights_only=True")
        if func.split(".")[-1] == "load" and func.split(".")[0] in ("np", "numpy"):
            a = kw.get("allow_pickle")
            if a is not None and not (isinstance(a, ast.Constant) and a.value is False):
                found.append(f"{name}:{node.lineno}: numpy.load with allow_pickle")
        if func.split(".")[-1] in PICKLE_LOADERS and func.split(".")[0] in PICKLE_MODULES | {"pd", "pandas"}:
            found.append(f"{name}:{node.lineno}: {func}")
    return found


def test_scanner_finds_what_it_looks_for():
    bad = ("import pickle\npickle.loads(b)\nimport torch\nx = torch.load(f)\ny = torch.load(f, weights_only=False)\n"
           "import numpy as np\nz = np.load(f, allow_pickle=True)\nfrom dill import loads\nfrom pickle import Unpickler\n")
    assert len(unsafe_loads(bad)) == 6
    # catching the error torch.load(weights_only=True) raises is not loading a pickle
    assert unsafe_loads("import pickle\ntry:\n    pass\nexcept pickle.UnpicklingError:\n    pass\n") == []
    assert unsafe_loads("import torch\nx = torch.load(f, mmap=True, weights_only=True)\n") == []


def test_no_pickle_is_ever_loaded():
    # tests are not scanned: test_loader pickles a dataset object to check what spawned DataLoader workers get
    files = [p for d in ("hsstore", "extract", "train", "tools") for p in (REPO / d).rglob("*.py")]
    assert len(files) > 30
    found = [f for p in files for f in unsafe_loads(p.read_text(), str(p.relative_to(REPO)))]
    assert not found, found


def secrets_in(text: str) -> list[str]:
    return [s for s in (KEY, SECRET, PASSWORD) if s in text]


def test_credentials_never_stored_logged_or_in_errors(s3_endpoint, tmp_path, caplog):
    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"hs-sec-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(endpoint_url=s3_endpoint).mkdir(bucket)
    url = f"s3://{bucket}/store"
    opts = {"endpoint_url": s3_endpoint, "key": KEY, "secret": SECRET}
    write_samples(url, make_manifest(), make_samples(3), storage_options=opts)
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    objects = fs.find(bucket)
    assert any(o.endswith("manifest.json") for o in objects) and any("/commits/" in o for o in objects)
    for o in objects:  # manifest, commit records, zarr metadata, chunks
        assert not secrets_in(fs.cat_file(o).decode("latin-1")), o

    # the CLI at full debug logging (botocore logs endpoints and signed headers), success and failure
    cli = [sys.executable, "-m", "hsstore", "-vv"]
    ok = subprocess.run(cli + ["info", url, "-S", f"endpoint_url={s3_endpoint}", "-S", f"key={KEY}",
                               "-S", f"secret={SECRET}"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "DEBUG botocore" in ok.stderr  # the third-party debug logs were on
    assert not secrets_in(ok.stdout + ok.stderr)
    bad_endpoint = f"http://user:{PASSWORD}@127.0.0.1:9"
    fail = subprocess.run(cli + ["info", url, "-S", f"endpoint_url={bad_endpoint}", "-S", f"key={KEY}",
                                 "-S", f"secret={SECRET}", "-S", 'config_kwargs={"retries": {"max_attempts": 1}}'],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert fail.returncode == 2 and "hsstore info: error:" in fail.stderr
    assert "Traceback" in fail.stderr and "127.0.0.1:9" in fail.stderr  # -vv: the traceback and debug logs
    assert not secrets_in(fail.stdout + fail.stderr)

    # the library: errors and log records
    caplog.set_level("DEBUG")
    with pytest.raises(hsstore.StoreError) as e:
        hsstore.open(url, endpoint_url=bad_endpoint, key=KEY, secret=SECRET,
                     config_kwargs={"retries": {"max_attempts": 1}})
    assert url in str(e.value) and not secrets_in(str(e.value))
    with pytest.raises(hsstore.StoreError) as e:
        hsstore.StoreWriter(f"s3://{bucket}/other", make_manifest(), storage_options={
            "endpoint_url": bad_endpoint, "key": KEY, "secret": SECRET,
            "config_kwargs": {"retries": {"max_attempts": 1}}})
    assert not secrets_in(str(e.value))
    assert not secrets_in("\n".join(r.getMessage() for r in caplog.records if r.name.startswith("hsstore")))


EVIL_MODULE = '''"""A target folder's own code: it must never run (it marks that it did)."""
from pathlib import Path

Path({marker!r}).write_text("the folder's code ran")

from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402


class EvilConfig(Qwen3_5TextConfig):
    pass


class EvilModel(Qwen3_5ForCausalLM):
    config_class = EvilConfig
'''


@pytest.fixture(scope="module")
def evil_target(tiny_dir, tmp_path_factory):
    """(the tiny target copied into a folder whose config names ``auto_map`` code of its own, the marker file that
    code writes when it runs, a few input rows)."""
    import json
    import shutil

    from hsstore.extract.tiny import demo_conversations_path

    d = tmp_path_factory.mktemp("evil")
    model, marker = d / "evil-target", d / "the-folder-code-ran"
    shutil.copytree(tiny_dir, model)
    (model / "evil.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel",
                          "AutoModelForCausalLM": "evil.EvilModel"}
    (model / "config.json").write_text(json.dumps(config))
    rows = d / "in.jsonl"
    rows.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:4]) + "\n")
    return model, marker, rows


@pytest.fixture(scope="module")
def clean_run(tiny_dir, evil_target, tmp_path_factory):
    """A store extracted from the tiny target's own folder (the same weights) and a drafter trained a step on it:
    what audit and eval are given beside the other folder (a store keeps the config it was extracted with, and
    readers refuse one that names code: tests/test_hostile_files.py)."""
    from hsstore.app.cli import main
    from hsstore.app.schema import build
    from hsstore.train.trainer import TrainSettings, train
    from train_helpers import FAST

    d = tmp_path_factory.mktemp("clean")
    store = str(d / "store")
    assert main(["extract", "--model", str(tiny_dir), "--input", str(evil_target[2]), "--out", store, "--device",
                 "cpu", "--dtype", "float32", "--layers", "1,3,5", "-q", "--force"]) == 0
    train(build(TrainSettings, store=[store], out=str(d / "run"), steps=1, **FAST))
    return store, str(d / "run")


@pytest.mark.slow  # each loads the tiny target (extract: extracts it; audit: recomputes; eval: decodes)
@pytest.mark.parametrize("command", ["extract", "audit", "eval"])
def test_a_target_folders_own_code_never_runs(evil_target, clean_run, tmp_path, capsys, command):
    """A --model folder whose config names ``auto_map`` code (its own config and model classes, in the folder) is
    loaded as the architecture its ``model_type`` names, by transformers' own code, in every command that loads a
    target; the folder's module never runs (it would write a marker file)."""
    import shutil

    from hsstore.app.cli import main

    template, marker, rows = evil_target
    store, run = clean_run
    # a folder of its own name: a module that ran in an earlier command of this process is not run again
    model = shutil.copytree(template, tmp_path / f"evil-target-{command}")
    marker.unlink(missing_ok=True)
    argv = {"extract": ["extract", "--model", str(model), "--input", str(rows), "--out", str(tmp_path / "s"),
                        "--device", "cpu", "--dtype", "float32", "--layers", "1,3,5", "-q", "--force"],
            "audit": ["audit", store, "--model", str(model), "--device", "cpu", "-q"],
            "eval": ["eval", "--store", store, "--drafter", run, "--model", str(model), "--input", str(rows),
                     "--num-samples", "1", "--max-new-tokens", "4", "--device", "cpu", "-q"]}[command]
    rc = main(argv)
    capsys.readouterr()
    assert not marker.exists(), f"{command} ran the model folder's code"
    assert rc == 0
