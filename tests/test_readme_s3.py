"""The README's paragraph on trying the S3 paths without a bucket runs as written: moto's server on loopback, a
bucket, ``hsstore copy`` of a store to it and ``hsstore info`` of the copy (its port moved to a free one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from hsstore.testing.ports import free_port

from conftest import make_manifest, make_samples, write_samples

REPO = Path(__file__).resolve().parents[1]


def readme_block(after: str) -> str:
    text = (REPO / "README.md").read_text()
    rest = text[text.index(after):]
    return re.search(r"```bash\n(.*?)```", rest, re.S).group(1)


def test_the_readmes_s3_paragraph_runs_as_written(tmp_path):
    block = readme_block("**Trying the S3 paths without a bucket.**").replace("5000", str(free_port()))
    write_samples(str(tmp_path / "hsstore-demo" / "store"), make_manifest(), make_samples(5))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # this checkout's hsstore
    script = "set -e\ntrap 'kill $(jobs -p) 2>/dev/null' EXIT\n" + block
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "5 samples" in r.stdout and "verify of the copy: OK" in r.stdout, r.stdout  # the copy
    assert re.search(r"^store\s+s3://demo-bucket/store", r.stdout, re.M), r.stdout  # info of it
