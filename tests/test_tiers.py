"""The test tiers (tests/conftest.py): the README's command runs every test, `-m fast` the rest of the tiers, and
the rules put a test in its tier by what it does, read from a real collection of this suite."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIERS = {"fast", "slow", "s3", "browser", "gpu"}
# a plugin for the collecting process: each test's tiers, as pytest holds them after collection
RECORDER = """
import json, os
def pytest_collection_finish(session):
    tiers = {i.nodeid: sorted({m.name for m in i.iter_markers()} & set(%r)) for i in session.items}
    with open(os.environ["TIERS_OUT"], "w") as f:
        json.dump(tiers, f)
"""


def pytest_run(*args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def tiers_of_every_test(tmp_path: Path, *args: str) -> tuple[dict[str, set[str]], str]:
    """{test id: its tiers} of the tests a run with ``args`` selects, and what the run said."""
    (tmp_path / "tier_recorder.py").write_text(RECORDER % sorted(TIERS))
    out = tmp_path / f"tiers{len(list(tmp_path.iterdir()))}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "TIERS_OUT": str(out)}
    r = pytest_run("--collect-only", "-q", "-p", "tier_recorder", *args, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return {k: set(v) for k, v in json.loads(out.read_text()).items()}, r.stdout


def test_the_default_run_holds_every_tier_and_fast_is_the_rest(tmp_path):
    every, said = tiers_of_every_test(tmp_path)
    assert "deselected" not in said.splitlines()[-1], said.splitlines()[-1]
    assert all(t == {"fast"} or "fast" not in t for t in every.values())
    assert {t for ts in every.values() for t in ts} == TIERS
    fast, said = tiers_of_every_test(tmp_path, "-m", "fast")
    assert set(fast) == {k for k, t in every.items() if "fast" in t} and "deselected" in said.splitlines()[-1]

    def tiers(name: str) -> set[str]:
        return every[f"tests/{name}"]

    assert tiers("test_loader_s3.py::test_s3_cache_capped") == {"s3"}  # the s3_store fixture
    assert tiers("test_fp8.py::test_store_roundtrip_fp8_bits_and_scales[s3]") == {"s3"}  # its "s3" case
    assert tiers("test_fp8.py::test_store_roundtrip_fp8_bits_and_scales[local]") == {"fast"}
    assert tiers("test_hostile_inputs.py::test_a_hostile_config_file_is_one_line[train-fifo]") == {"slow"}  # cli()
    assert tiers("test_train_ddp.py::test_two_ranks_take_the_step_of_one_process_on_the_union") == {"slow"}  # spawn
    assert tiers("test_loader.py::test_exactly_once_spawn_workers") == {"slow"}  # the "spawn" start method
    assert tiers("test_process_writer.py::test_a_dead_writer_process_is_a_clear_error") == {"slow"}
    assert tiers("test_html_report.py::test_store_report_renders") >= {"browser"}
    assert tiers("test_devices.py::test_local_rank_past_last_gpu_refused") == {"gpu"}
    assert tiers("test_tiers.py::test_the_default_run_holds_every_tier_and_fast_is_the_rest") == {"slow"}


def test_a_mistyped_marker_fails_the_run(tmp_path):
    test = tmp_path / "test_typo.py"
    test.write_text("import pytest\n\n\n@pytest.mark.slwo\ndef test_x():\n    pass\n")
    # the project's settings found as pytest finds them; pytest 9.0 ignored --strict-markers given in addopts
    # (hence pytest>=9.1 in the test extra)
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    r = pytest_run("-q", str(test), cwd=tmp_path)
    assert r.returncode != 0 and "'slwo' not found in `markers`" in r.stdout + r.stderr, r.stdout[-2000:]
