"""Inputs that are not a store pass the same door (issue #52, item 4): ``--config`` files, drafter and checkpoint
folders, run folders being resumed, peers' folders, engine answers. Each case runs the real command in a child
process with a timeout and a 4 GiB address-space limit (a guard that fails is a MemoryError or a hang, not a dead
machine) and asks for one line naming the input and the bound, and nothing outside changed."""

from __future__ import annotations

import base64
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from hsstore.testing.hostile_http import HostileHTTPServer

from train_helpers import small_input, store32  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[1]
LIMIT = 4 << 30


def _limit():
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def cli(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "hsstore", *map(str, args)], cwd=REPO, capture_output=True,
                              text=True, timeout=timeout, preexec_fn=_limit, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hsstore {' '.join(map(str, args))} hung (over {timeout} s)")


def one_line(r: subprocess.CompletedProcess, *words: str, rc: int = 2) -> str:
    assert r.returncode == rc, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "%|" not in ln
             and not ln.startswith(("WARNING", "INFO"))]
    assert len(lines) == 1, r.stderr[-3000:]
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


# -- --config files ------------------------------------------------------------------------------------------------
def alias_bomb(levels: int = 9) -> str:
    """The "billion laughs" in YAML: each alias level repeats the one before 9 times (9**9 strings), ~350 bytes."""
    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in range(1, levels):
        prev, cur = chr(96 + i), chr(97 + i)
        text += f"{cur}: &{cur} [{','.join('*' + prev for _ in range(9))}]\n"
    return text


CONFIGS = {
    "alias bomb": (lambda p: p.write_text(alias_bomb()), "more than 100,000 nodes"),
    "deep nesting": (lambda p: p.write_text("train: " + "[" * 5000 + "]" * 5000 + "\n"), "nested too deep"),
    "fifo": (lambda p: os.mkfifo(p), "a FIFO, not a regular file"),
    "/dev/zero": (lambda p: os.symlink("/dev/zero", p), "a device, not a regular file"),
    "huge": (lambda p: (p.write_bytes(b"train: {}\n"), os.truncate(p, 3 << 30)), "larger than its bound"),
    "python tag": (lambda p: p.write_text("run: !!python/object/apply:os.system ['echo pwned']\n"), "not valid YAML"),
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
@pytest.mark.parametrize("command", ["train", "extract"])
def test_a_hostile_config_file_is_one_line(tmp_path, case, command):
    make, words = CONFIGS[case]
    path = tmp_path / "run.yaml"
    make(path)
    r = cli(command, "--config", path, timeout=60)
    one_line(r, f"--config {path}", words)


# -- drafter folders: eval --drafter, export-drafter ------------------------------------------------------------------
FAST = ["--token-budget", "1024", "--draft-layers", "1", "--block-size", "8", "--anchors", "32", "--log-every", "1",
        "--device", "cpu", "-q"]


@pytest.fixture(scope="module")
def run1(store32, tmp_path_factory):  # noqa: F811
    """A real run of one step on ``store32``: OUT/drafter, OUT/checkpoints/step_00000001, metrics, run.yaml."""
    from hsstore.app.cli import main

    out = tmp_path_factory.mktemp("run") / "run"
    assert main(["train", "--store", store32, "--out", str(out), "--steps", "1", "--save-every", "1",
                 "--log-samples", *FAST]) == 0
    return out


def _config(path: Path, edit) -> None:
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def _replace(path: Path, make) -> None:
    path.unlink()
    make(path)


DRAFTERS = {  # (how the drafter folder D is forged, words its refusal must hold)
    "config.json a FIFO": (lambda d: _replace(d / "config.json", os.mkfifo), ["config.json", "a FIFO"]),
    "config.json -> /dev/zero": (lambda d: _replace(d / "config.json", lambda p: os.symlink("/dev/zero", p)),
                                 ["config.json", "symbolic link"]),
    "weights a FIFO": (lambda d: _replace(d / "model.safetensors", os.mkfifo), ["model.safetensors", "a FIFO"]),
    "weights -> /dev/zero": (lambda d: _replace(d / "model.safetensors", lambda p: os.symlink("/dev/zero", p)),
                             ["model.safetensors", "symbolic link"]),
    "weights sparse 6 GiB": (lambda d: os.truncate(d / "model.safetensors", 6 << 30),
                             ["model.safetensors", "larger than its bound"]),
    "2e6 layers": (lambda d: _config(d / "config.json", lambda c: (c.update(num_hidden_layers=2_000_000),
                                                                   c.pop("layer_types"))),
                   ["config.json", "num_hidden_layers 2000000", "1 to 256 layers"]),
    "config nested 100,000 deep": (lambda d: (d / "config.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000),
                                   ["config.json", "nested too deep"]),
    "config without its keys": (lambda d: _config(d / "config.json", lambda c: c.pop("num_attention_heads")),
                                ["config.json", "not a drafter config"]),
}


@pytest.mark.parametrize("case", sorted(DRAFTERS))
@pytest.mark.parametrize("command", ["export-drafter", "eval"])
def test_a_hostile_drafter_folder_is_one_line(run1, store32, tmp_path, case, command):  # noqa: F811
    forge, words = DRAFTERS[case]
    d = tmp_path / "drafter"
    shutil.copytree(run1 / "drafter", d)
    forge(d)
    argv = (["export-drafter", d, tmp_path / "exported"] if command == "export-drafter"
            else ["eval", "--store", store32, "--drafter", d, "--device", "cpu", "-q"])
    one_line(cli(*argv, timeout=90), *words)
    assert not (tmp_path / "exported").exists()


def test_a_run_whose_drafter_folder_is_a_link_out_is_refused(run1, tmp_path):
    """OUT/drafter a link to a drafter elsewhere: never read as the run's."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(run1 / "drafter", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", run / "drafter")
    one_line(cli("export-drafter", run, tmp_path / "exported", timeout=60), "drafter", "symbolic link")
    assert not (tmp_path / "exported").exists()


# -- run folders being resumed -----------------------------------------------------------------------------------------
def _loader_bomb(ck: Path) -> None:
    """loader.rank00000.json's bitmap of consumed entries: 4 GiB of zeros, zlib'd (~4 MB)."""
    p = ck / "loader.rank00000.json"
    d = json.loads(p.read_text())
    z = zlib.compressobj(9)
    d["done"] = base64.b64encode(b"".join(z.compress(bytes(64 << 20)) for _ in range(64)) + z.flush()).decode()
    p.write_text(json.dumps(d))


def _trainer(**fields):
    return lambda ck: _config(ck / "trainer.json", lambda d: d.update(fields))


def _moment(ck: Path) -> None:
    """optimizer.safetensors with one moment of another shape than its parameter's."""
    from safetensors.torch import load_file, save_file

    t = load_file(str(ck / "optimizer.safetensors"))
    key = next(k for k in sorted(t) if k.endswith("exp_avg") and t[k].ndim == 2)
    t[key] = torch.zeros(3, 5)
    save_file(t, str(ck / "optimizer.safetensors"))


RUNS = {
    "loader state zlib bomb": (_loader_bomb, ["loader.rank", "larger than the 134,217,728 bytes"]),
    "trainer.json step a string": (_trainer(step="x"), ["trainer.json", "step 'x'"]),
    "trainer.json world 5": (_trainer(world=5), ["trainer.json", "world 5"]),
    # the step its folder does not name: resumed, steps 1.. trained again (their checkpoints overwritten) or skipped
    "trainer.json step 0 in step_1": (_trainer(step=0), ["trainer.json", "step 0 in the folder of step 1"]),
    "trainer.json step 5 in step_1": (_trainer(step=5), ["trainer.json", "step 5 in the folder of step 1"]),
    "trainer.json optimizer empty": (_trainer(optimizer={}), ["trainer.json", "param_groups"]),
    "trainer.json scheduler keys": (_trainer(scheduler={"x": 1}), ["trainer.json", "scheduler keys"]),
    "trainer.json python_rng short": (_trainer(python_rng=[3, [1, 2], None]), ["step_00000001", "RNG state"]),
    "trainer.json config forged": (_trainer(config={"stores": 5}), ["trainer.json", "config"]),
    "trainer.json nested": (lambda ck: (ck / "trainer.json").write_text("[" * 100_000 + "]" * 100_000),
                            ["trainer.json", "nested too deep"]),
    "trainer.json a FIFO": (lambda ck: _replace(ck / "trainer.json", os.mkfifo), ["trainer.json", "a FIFO"]),
    "optimizer moment misshapen": (_moment, ["optimizer.safetensors", "exp_avg of shape (3, 5)"]),
    "optimizer -> /dev/zero": (lambda ck: _replace(ck / "optimizer.safetensors", lambda p: os.symlink("/dev/zero", p)),
                               ["optimizer.safetensors", "symbolic link"]),
}


@pytest.mark.parametrize("case", sorted(RUNS))
def test_a_hostile_run_folder_is_one_line_on_resume(run1, store32, tmp_path, case):  # noqa: F811
    forge, words = RUNS[case]
    run = tmp_path / "run"
    shutil.copytree(run1, run, symlinks=True)
    forge(run / "checkpoints" / "step_00000001")
    r = cli("train", "--store", store32, "--out", run, "--steps", "2", "--save-every", "1", *FAST, timeout=120)
    one_line(r, *words)
    assert not (run / "checkpoints" / "step_00000002").exists()


def victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim"
    (v / "dir").mkdir(parents=True)
    for name in ("notes.txt", "dir/a.bin"):
        (v / name).write_bytes(b"the user's own file " + name.encode())
    return v


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (os.readlink(p).encode() if p.is_symlink() else p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_symlink() or p.is_file()}


# every name a resumed run writes in OUT, each planted as a link to a file or folder of the user's outside it
PLANTED = ["metrics.jsonl", "samples.rank00000.jsonl", "run.yaml", "train_config.json", "checkpoints/best",
           "checkpoints/.tmp-step_00000002/", "checkpoints/step_00000002/", "checkpoints/step_00000001/",
           "checkpoints/", "drafter/", "drafter/model.safetensors", "drafter/config.json", ".tmp-drafter/",
           "tensorboard/", "resumes.jsonl"]


@pytest.mark.parametrize("name", PLANTED)
def test_a_link_planted_in_a_run_folder_is_never_written_through(run1, store32, tmp_path, name):  # noqa: F811
    """A run folder resumed (``train`` again on its OUT) with a link planted at a name it writes: the run goes on
    (the link replaced, never written through) or stops in one line naming it; nothing outside OUT changes."""
    run, v = tmp_path / "run", victim(tmp_path)
    shutil.copytree(run1, run, symlinks=True)
    p = run / name.rstrip("/")
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()
    p.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(v / "dir" if name.endswith("/") else v / "notes.txt", p)
    before = tree(v)
    report = ["--report-to", "tensorboard"] if name == "tensorboard/" else []
    r = cli("train", "--store", store32, "--out", run, "--steps", "3", "--save-every", "1", "--log-samples",
            *report, *FAST, timeout=180)
    assert tree(v) == before
    if r.returncode:
        one_line(r, name.rstrip("/").split("/")[-1], "link")
    else:
        assert "Traceback" not in r.stderr and (run / "checkpoints" / "step_00000003" / "trainer.json").is_file()


# -- peer folders: import ----------------------------------------------------------------------------------------------
IDENTITY = ["--layers", "1,3,5", "--model-name", "peer-target", "--num-layers", "8", "--hidden-size", "48",
            "--config-hash", "cfg-peer", "--tokenizer-hash", "vocab-peer", "-q"]


def _sample(T: int = 12, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(1, 500, (T,), generator=g), "loss_mask": torch.ones(T, dtype=torch.int64),
            "hidden_states": torch.randn(T, 3, 48, generator=g).to(torch.bfloat16)}


def specforge_folder(d: Path, n: int = 3) -> Path:
    (d / "rows_0-4").mkdir(parents=True)
    for i in range(n):
        torch.save(_sample(seed=i), d / "rows_0-4" / f"data_{i}.ckpt")
    return d


def _gzip_bomb(d: Path) -> None:
    """data_1.ckpt: gzip of 4 GiB of zeros (~4 MB)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    (d / "rows_0-4" / "data_1.ckpt").write_bytes(b"".join(z.compress(bytes(64 << 20)) for _ in range(64)) + z.flush())


def _link_out(d: Path) -> None:
    """data_1.ckpt a link to a sample file outside the folder imported."""
    outside = d.parent / "outside.ckpt"
    torch.save(_sample(seed=99), outside)
    _replace(d / "rows_0-4" / "data_1.ckpt", lambda p: os.symlink(outside, p))


def _folder_link_out(d: Path) -> None:
    outside = d.parent / "outside"
    specforge_folder(outside)
    os.symlink(outside / "rows_0-4", d / "rows_4-8")


def _int_features(path: Path) -> None:
    """A sample file whose hidden states are integers (a safetensors header that says so, or a torch.save)."""
    s = _sample(seed=1)
    s["hidden_states"] = (s["hidden_states"] * 100).to(torch.int64)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({"hidden_states": s["hidden_states"]}, str(path))
    else:
        torch.save(s, path)


def _header_dtype(path: Path, dtype: str) -> None:
    """A safetensors file whose header names ``dtype`` for its bf16 hidden states (the same byte count)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["hidden_states"]["dtype"] = dtype
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


PEERS = {
    "gzip bomb": (_gzip_bomb, ["data_1.ckpt", "gzip expanding past"]),
    "int64 hidden states": (lambda d: _int_features(d / "rows_0-4" / "data_1.ckpt"), ["data_1.ckpt", "int64"]),
    "a .ckpt link out": (_link_out, ["data_1.ckpt", "symbolic link"]),
    "a folder link out": (_folder_link_out, ["rows_4-8", "symbolic link"]),
    "a .ckpt FIFO": (lambda d: _replace(d / "rows_0-4" / "data_1.ckpt", os.mkfifo), ["data_1.ckpt", "a FIFO"]),
}


def speculators_folder(d: Path, n: int = 2) -> Path:
    import pyarrow as pa
    from safetensors.torch import save_file

    samples = [_sample(seed=i) for i in range(n)]
    d.mkdir(parents=True)
    table = pa.table({"input_ids": [s["input_ids"].tolist() for s in samples],
                      "loss_mask": [s["loss_mask"].tolist() for s in samples]})
    with pa.OSFile(str(d / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (d / "hidden_states").mkdir()
    for i, s in enumerate(samples):
        save_file({"hidden_states": s["hidden_states"].contiguous()}, str(d / "hidden_states" / f"hs_{i}.safetensors"))
    return d


def _absolute_data_file(d: Path) -> None:
    """state.json naming an Arrow file by its absolute path outside the folder (another dataset's rows)."""
    other = speculators_folder(d.parent / "other")
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": str(other / "data-00000-of-00001.arrow")}]}))


SPECULATORS = {
    "state.json absolute path": (_absolute_data_file, ["state.json", "an absolute name"]),
    "state.json ../ path": (lambda d: (d / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": "../other.arrow"}]})), ["state.json", "'..' part"]),
    "hs_0 -> /dev/zero": (lambda d: _replace(d / "hidden_states" / "hs_0.safetensors",
                                             lambda p: os.symlink("/dev/zero", p)), ["hs_0.safetensors", "symbolic link"]),
    "hs_0 of int64": (lambda d: _int_features(d / "hidden_states" / "hs_0.safetensors"), ["hs_0.safetensors", "int64"]),
    "hs_0 header says I16": (lambda d: _header_dtype(d / "hidden_states" / "hs_0.safetensors", "I16"),
                             ["hs_0.safetensors", "holds int16 values"]),
}
FOLDERS = {**{("specforge", k): v for k, v in PEERS.items()}, **{("speculators", k): v for k, v in SPECULATORS.items()}}


@pytest.mark.parametrize("fmt,case", sorted(FOLDERS))
def test_a_hostile_peer_folder_is_one_line(tmp_path, fmt, case):
    import_is_one_line(tmp_path, fmt, *FOLDERS[fmt, case])


def import_is_one_line(tmp_path: Path, fmt: str, forge, words: list[str]) -> None:
    """A real peer folder of ``fmt`` forged by ``forge``: its import refused in one line holding ``words``."""
    folder = (specforge_folder if fmt == "specforge" else speculators_folder)(tmp_path / "peer")
    forge(folder)
    one_line(cli("import", fmt, folder, "--out", tmp_path / "dst", *IDENTITY, timeout=120), *words)
    assert not list((tmp_path / "dst").glob("commits/*"))  # nothing committed of an import refused


# -- engine answers: regenerate ----------------------------------------------------------------------------------------
ANSWER = {"id": "x", "object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi.", "reasoning_content": "ok"}}]}


@pytest.mark.parametrize("kind,words", [
    ("ignore_range", ["ran past 67,108,864 bytes"]),  # an answer that never ends
    ("trickle", ["--timeout"]),  # a byte a second: never idle for --timeout, past it in all
    ("trickle_head", ["--timeout"]),
    ("gzip", ["encoded ('gzip')"]),
    ("huge_length", ["declares 1,000,000,000,000 bytes"]),
])
def test_an_engine_answer_is_bounded_in_bytes_and_time(tmp_path, kind, words):
    served = tmp_path / "engine"
    (served / "v1" / "chat").mkdir(parents=True)
    (served / "v1" / "chat" / "completions").write_text(json.dumps(ANSWER))
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Hello?"}]}) + "\n")
    with HostileHTTPServer(str(served), [(kind, lambda p: p.endswith("/chat/completions"))]) as srv:
        if kind == "gzip":
            srv.bomb()  # made before the request (seconds of compression, not the engine's answer time)
        t0 = time.monotonic()
        r = cli("regenerate", "--server", srv.url, "--model", "m", "--input", inp, "--out", tmp_path / "out.jsonl",
                "--timeout", "4", "--retries", "0", "-q", timeout=60)
        took = time.monotonic() - t0
        assert srv.injected[kind] >= 1
    one_line(r, "prompt", *words)
    assert took < 30, took
