"""Fixtures shared by the trainer tests (tests/test_train*.py): a tiny input and a lossless store."""

from pathlib import Path

import pytest

from hsstore.extract.job import ExtractSettings, run_extract
from hsstore.extract.tiny import demo_conversations_path
from hsstore.app.schema import build

REPO = Path(__file__).resolve().parents[1]
# small and quick: 8 samples of ~270 tokens, ~3 batches per epoch
FAST = dict(token_budget=1024, draft_layers=1, block_size=8, anchors=32, log_every=1, device="cpu", progress=False)


@pytest.fixture(scope="module")
def small_input(tmp_path_factory):
    path = tmp_path_factory.mktemp("input") / "in.jsonl"
    path.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:8]) + "\n")
    return path


@pytest.fixture(scope="module")
def store32(tiny_dir, small_input, tmp_path_factory):
    """A lossless store: float32 features, every sample extracted alone (batch 1), so an online forward of
    the same sample gives bit-identical features."""
    out = tmp_path_factory.mktemp("store") / "s"
    run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(small_input)], out=str(out), dtype="float32",
                      device="cpu", token_budget=1, progress=False))
    return str(out)
