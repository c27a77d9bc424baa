"""Every feature tensor that enters training is value-checked where the trainer reads it, whatever the store's records
say: a received store whose records carry no value statistics (as older writers wrote them), or a run told to train
on an unhealthy store anyway (``--allow-unhealthy``, meant for all-zero features), still never trains on a NaN or an
infinity. Tiny Qwen3.5 target, CPU, the lossless store of the trainer's tests."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import hsstore
from hsstore.app.cli import main
from hsstore.train import checkpoint as ckpt
from hsstore.train.data import read_ahead
from train_helpers import small_input, store32  # noqa: F401  (fixtures)


def with_a_poisoned_sample(store: str, dst: Path, *, record_stats: bool) -> str:
    """A copy of ``store`` plus one shard, written by hsstore's own writer, holding a copy of its first sample as
    ``poisoned`` with one feature value a NaN (``check_finite`` off: a writer of another team need not check)."""
    shutil.copytree(store, dst)
    src = hsstore.open(str(dst))
    x = src.read(0, layers=src.layers)
    feats = x["hidden_states"].clone()
    feats[len(feats) // 2, -1, 7] = float("nan")
    with hsstore.StoreWriter(str(dst), src.manifest, writer_tag="other", check_finite=False,
                             record_stats=record_stats) as w:
        w.add("poisoned", x["input_ids"].numpy(), x["loss_mask"].numpy(), feats)
    return str(dst)


def train_args(url: str, out: Path, *extra: str) -> list[str]:
    return ["train", "--store", url, "--out", str(out), "--epochs", "1", "--device", "cpu", "--token-budget", "1024",
            "--draft-layers", "1", "--block-size", "8", "--anchors", "32", "--save-every", "1000", "-q", *extra]


@pytest.mark.parametrize("case", ["records without statistics", "--allow-unhealthy"])
def test_train_refuses_a_sample_with_a_nan_feature_naming_it_and_saves_nothing(store32, tmp_path, capsys, case):
    stats = case != "records without statistics"
    url = with_a_poisoned_sample(store32, tmp_path / "s", record_stats=stats)
    (rec,) = [r for r in hsstore.open(url).commits if "poisoned" in list(r.samples["sample_id"])]
    assert stats == ("features" in rec.stats)  # the fixture is the case it names
    out = tmp_path / "run"
    rc = main(train_args(url, out, *(["--allow-unhealthy"] if stats else [])))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("WARNING", "INFO")) and "%|" not in ln]
    assert rc == 2 and "Traceback" not in err, err
    assert "'poisoned'" in lines[-1] and "NaN or an infinity" in lines[-1], err
    assert ckpt.list_checkpoints(out) == [] and not (out / "drafter").exists()  # no weights saved from it


class Batches(list):
    """A source of ready batches, as ``read_ahead`` reads one (its state: none)."""

    def state_dict(self):
        return None


def test_a_packed_batch_names_the_sample_of_the_non_finite_token():
    """Packed batches are [tokens, taps, H]: the refusal maps the token back to its sample by ``cu_seqlens``."""
    hidden = torch.zeros(10, 2, 4)
    hidden[7, 1, 2] = float("inf")  # token 7: the second sample (tokens 3..9)
    batch = {"sample_id": ["a", "b"], "hidden_states": hidden, "cu_seqlens": torch.tensor([0, 3, 10])}
    with pytest.raises(hsstore.CorruptionError, match="sample 'b'"):
        list(read_ahead(Batches([batch]), lambda b: b, torch.device("cpu")))
    batch["hidden_states"] = torch.zeros(10, 2, 4)
    assert len(list(read_ahead(Batches([batch]), lambda b: b, torch.device("cpu")))) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_check_on_cuda_refuses_what_it_refuses_on_the_cpu():
    hidden = torch.randn(2, 5, 3, 8, dtype=torch.bfloat16)
    hidden[1, 4, 2, 3] = float("nan")
    batch = {"sample_id": ["a", "b"], "hidden_states": hidden}
    with pytest.raises(hsstore.CorruptionError, match="sample 'b'"):
        list(read_ahead(Batches([batch]), lambda b: b, torch.device("cuda")))
    batch["hidden_states"] = torch.randn(2, 5, 3, 8, dtype=torch.bfloat16)
    got = list(read_ahead(Batches([batch]), lambda b: b, torch.device("cuda")))
    assert len(got) == 1 and got[0][0]["hidden_states"].is_cuda and np.isfinite(
        got[0][0]["hidden_states"].float().cpu().numpy()).all()
