"""What `pip install hsstore` puts on a machine: one top-level name, the commands, no tools or tests.

The built wheel is installed into a fresh virtual environment (its dependencies come from this environment's
site-packages, nothing is downloaded) and used from a directory outside the repository, where a user's own
``train.py`` must not shadow anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                          capture_output=True, text=True)
    if proc.returncode != 0 and "No matching distribution found for setuptools" in proc.stderr:
        pytest.skip("no package index here to fetch the build backend from")
    assert proc.returncode == 0, proc.stderr
    (whl,) = out.glob("hsstore-*.whl")
    return whl


def test_wheel_holds_one_top_level_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"hsstore"}, top
    assert "hsstore/extract/tokenize.py" in names and "hsstore/train/trainer.py" in names
    assert any(n.startswith("hsstore/extract/data/tiny_trained/") for n in names)  # the demo's trained target
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[hsstore.commands]" in text and "hsstore.extract.cli:register" in text


def fresh_venv(path: Path) -> tuple[Path, str]:
    """A new virtualenv that sees this environment's packages (torch and the rest), whatever this environment is:
    a system Python, a virtualenv or a conda-like prefix. ``--system-site-packages`` would show the packages of
    the *base* interpreter only, which inside a virtualenv lack torch; instead the fresh venv gets a ``.pth``
    listing this interpreter's site directories. Paths named in a ``.pth`` file are appended without running their
    own ``.pth`` files, so the repository's editable install (a ``.pth`` hook there) stays out of sight.
    Returns (its python, its purelib)."""
    import site

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    py = path / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    outer = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
    Path(purelib, "outer-environment.pth").write_text("".join(p + "\n" for p in outer))
    return py, purelib


def test_fresh_venv_sees_torch_and_not_the_checkout(tmp_path):
    py, purelib = fresh_venv(tmp_path / "venv")
    code = ("import sys, torch, numpy, zarr\n"
            "import importlib.util\n"
            "spec = importlib.util.find_spec('hsstore')\n"
            "print(spec.origin if spec else None)\n")
    proc = subprocess.run([str(py), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr
    assert not proc.stdout.strip().startswith(str(ROOT))  # the editable install of this checkout is not visible


def test_wheel_in_fresh_venv(wheel, tmp_path):
    py, target = fresh_venv(tmp_path / "venv")
    # this environment's pip installs into the venv; --ignore-installed: hsstore may be installed (not editable)
    # in this environment, and must not count as "already installed"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed",
                    "--target", target, str(wheel)], check=True)
    user = tmp_path / "user"
    user.mkdir()
    (user / "train.py").write_text("raise SystemExit('the user train.py was imported')\n")
    (user / "tools.py").write_text("raise SystemExit('the user tools.py was imported')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import importlib.util, hsstore, hsstore.extract.tokenize, hsstore.train.model\n"
            "import hsstore.app.cli as c\n"
            f"assert hsstore.__file__.startswith({target!r}), hsstore.__file__\n"
            f"assert hsstore.extract.tokenize.__file__.startswith({target!r})\n"
            "assert importlib.util.find_spec('extract') is None\n"
            "from hsstore.extract.tiny import demo_conversations_path, trained_target_dir\n"
            f"assert str(demo_conversations_path()).startswith({target!r}) and demo_conversations_path().is_file()\n"
            "assert (trained_target_dir() / 'config.json').is_file()\n"
            "print(sorted(a for a in c.build_parser()._subparsers._group_actions[0].choices))\n")
    proc = subprocess.run([str(py), "-c", code], cwd=user, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "'extract'" in proc.stdout and "'train'" in proc.stdout and "'info'" in proc.stdout
    proc = subprocess.run([str(py), "-m", "hsstore", "--help"], cwd=user, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for command in ("extract", "train", "eval", "info", "verify"):
        assert command in proc.stdout
    proc = subprocess.run([str(py), "-m", "hsstore", "train", "--help"], cwd=user, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "--store" in proc.stdout, proc.stderr
