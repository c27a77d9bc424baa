"""CPU threads chosen for the work and the machine (``hsstore.app.threads``): one thread for a tiny model, the cores
this process may use (affinity, cgroup quota) for a large one, ``--cpu-threads`` on every command that runs a model,
and OpenMP's passive wait policy set before torch loads. The speed this buys beside busy neighbours is measured by
tools/bench_shared_cores.py (docs/PERFORMANCE.md, "Shared cores"), not asserted here."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hsstore.app import threads
from hsstore.app.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
MODEL_COMMANDS = ("extract", "audit", "train", "eval", "demo")  # every command that runs a model


def _cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


@pytest.mark.parametrize("files,limit", [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "200000 100000\n"}, 2.0),
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),
    ({"cpu,cpuacct/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 3.0),
    ({"cpu.max": "junk\n"}, None),
    ({}, None),
])
def test_the_cgroup_quota_is_read_from_v2_or_v1(tmp_path, files, limit):
    assert threads.cgroup_cpu_limit(_cgroup(tmp_path, files)) == limit


def test_usable_cores_are_the_affinity_capped_by_the_quota_rounded_up(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert threads.usable_cores(_cgroup(tmp_path / "none", {"cpu.max": "max 100000\n"})) == affinity
    assert threads.usable_cores(_cgroup(tmp_path / "half", {"cpu.max": "50000 100000\n"})) == 1
    big = _cgroup(tmp_path / "big", {"cpu.max": f"{(affinity + 8) * 100000} 100000\n"})
    assert threads.usable_cores(big) == affinity  # a quota above the affinity gives no more cores
    if affinity >= 2:
        assert threads.usable_cores(_cgroup(tmp_path / "some", {"cpu.max": "150000 100000\n"})) == 2


def test_a_small_model_gets_one_thread_a_large_one_its_share_of_the_cores():
    assert threads.default_threads(2_000_000, cores=16) == 1
    assert threads.default_threads(threads.SMALL_MODEL_PARAMS - 1, cores=16) == 1
    assert threads.default_threads(threads.SMALL_MODEL_PARAMS, cores=16) == 16
    assert threads.default_threads(8_000_000_000, cores=16, ranks_here=4) == 4
    assert threads.default_threads(8_000_000_000, cores=2, ranks_here=4) == 1


def test_the_flag_wins_and_the_count_is_set(caplog):
    before = torch.get_num_threads()
    try:
        with caplog.at_level("INFO", logger="hsstore.app.threads"):
            assert threads.apply_cpu_threads(None, 1_000_000, "extract") == 1
            assert torch.get_num_threads() == 1
            assert threads.apply_cpu_threads(2, 1_000_000, "extract") == 2
            assert torch.get_num_threads() == 2
            big = threads.apply_cpu_threads(None, 10 * threads.SMALL_MODEL_PARAMS, "extract")
            assert big == threads.usable_cores() == torch.get_num_threads()
        assert "extract: 1 CPU thread(s) (a model of 1.0M parameters" in caplog.text
        with pytest.raises(ValueError, match="--cpu-threads 0"):
            threads.apply_cpu_threads(0, 1, "extract")
    finally:
        torch.set_num_threads(before)


def test_every_command_that_runs_a_model_takes_cpu_threads():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in MODEL_COMMANDS:
        flags = {o for a in sub.choices[name]._actions for o in a.option_strings}
        assert "--cpu-threads" in flags, name


def test_extract_runs_the_tiny_target_on_one_thread(tiny_dir, tmp_path, capsys):
    """Through the command: a tiny target's forward gets one thread whatever torch had, ``--cpu-threads`` another."""
    from hsstore.extract.tiny import demo_conversations_path

    rows = tmp_path / "in.jsonl"
    rows.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:2]) + "\n")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["extract", "--model", str(tiny_dir), "--input", str(rows), "--out", str(tmp_path / "a"),
                     "--device", "cpu", "-q"]) == 0
        assert torch.get_num_threads() == 1
        assert main(["extract", "--model", str(tiny_dir), "--input", str(rows), "--out", str(tmp_path / "b"),
                     "--device", "cpu", "-q", "--cpu-threads", "2"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


PROBE = ("import os, sys\nfrom hsstore.app.cli import main\nmain(['info', sys.argv[1]])\nimport torch\n"
         "print(os.environ.get('OMP_WAIT_POLICY'))\n")


@pytest.mark.parametrize("given,seen", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_openmp_waits_passively_unless_the_user_chose(tmp_path, given, seen):
    """The command line asks for OpenMP's passive wait policy before torch loads (libgomp reads it then), and keeps
    a policy the user set."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    r = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "nothing")], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=120)
    assert r.stdout.strip().splitlines()[-1] == seen, (r.stdout, r.stderr)
