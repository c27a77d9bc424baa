"""Inputs that are not a store pass the same door (issue #52, item 4): ``--config`` files, drafter and checkpoint
folders, run folders being resumed, peers' folders, engine answers. Each case runs the real command in a child
process with a timeout and a 4 GiB address-space limit (a guard that fails is a MemoryError or a hang, not a dead
machine) and asks for one line naming the input and the bound, and nothing outside changed."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

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
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "%|" not in ln and not ln.startswith("WARNING")]
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
