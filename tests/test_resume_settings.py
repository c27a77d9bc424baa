"""A resume says what changed and keeps each segment's settings; --resume-from, --grad-accum and --weight-decay with
Hugging Face Trainer's meanings (resume_from_checkpoint, gradient_accumulation_steps, weight_decay). Tiny store,
CPU, the real command in process (or the trainer's API where a test feeds its own batches)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import hsstore
from hsstore.app.cli import main
from hsstore.app.schema import build
from hsstore.train import checkpoint as ckpt
from hsstore.train.model import DFlashDrafter
from hsstore.train.optim import DECAY_KEY, decay_parameter_names
from hsstore.train.trainer import TrainSettings, train
from train_helpers import FAST, small_input, store32  # noqa: F401  (fixtures)

FLAGS = ["--token-budget", "1024", "--draft-layers", "1", "--block-size", "8", "--anchors", "32", "--log-every", "1",
         "--device", "cpu", "-q"]


def rows(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.latest_checkpoint(run) / ckpt.MASTER))


def error_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith(("INFO", "WARNING"))]
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


# -- what a resume changes is said, and kept ------------------------------------------------------------------------
def test_a_resume_names_what_changed_and_keeps_each_segments_settings(store32, tmp_path, caplog, capsys):  # noqa: F811
    out = tmp_path / "run"
    base = ["train", "--store", store32, "--out", str(out), "--save-every", "1", "--log-samples", *FLAGS]
    assert main([*base, "--steps", "2"]) == 0
    first = (out / "run.yaml").read_bytes()
    with caplog.at_level("WARNING"):
        assert main([*base, "--steps", "3", "--lr", "0.01", "--clip", "0.5"]) == 0
    said = [r.getMessage() for r in caplog.records if "other than the checkpoint's" in r.getMessage()]
    assert len(said) == 1 and "lr 0.0006 -> 0.01" in said[0] and "clip 1.0 -> 0.5" in said[0], said
    assert (out / "run.yaml").read_bytes() == first  # the first segment's settings, as it trained
    resumes = [json.loads(ln) for ln in (out / "resumes.jsonl").read_text().splitlines()]
    assert len(resumes) == 1 and resumes[0]["step"] == 2
    assert resumes[0]["changed"] == {"lr": [0.0006, 0.01], "clip": [1.0, 0.5]}
    assert resumes[0]["settings"]["training"]["lr"] == 0.01
    assert resumes[0]["checkpoint"] == str(out / "checkpoints" / "step_00000002")
    # the new peak rate trains from the first resumed step: 3 steps, warmup 1, step index 2 at the cosine's end
    assert rows(out)[2]["lr"] == pytest.approx(0.01 * 0.5 * (1 + math.cos(math.pi * (2 - 1) / (3 - 1))))
    logged = [json.loads(ln)["step"] for ln in (out / "samples.rank00000.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3]  # the lines before the resume kept
    # a second resume adds its own line; the first keeps its own
    assert main([*base, "--steps", "4", "--lr", "0.01", "--clip", "0.5"]) == 0
    resumes = [json.loads(ln) for ln in (out / "resumes.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumes] == [2, 3] and resumes[1]["changed"] == {}
    # a change that breaks the run (the drafter's shape) is refused, naming it
    capsys.readouterr()
    assert main([*base, "--steps", "5", "--draft-layers", "2"]) == 2
    assert "draft_layers: 1 -> 2" in error_line(capsys)
    # starting over is a new run: its own run.yaml, no resumes of the run it replaced
    assert main([*base, "--steps", "1", "--no-resume", "--lr", "0.002"]) == 0
    assert yaml.safe_load((out / "run.yaml").read_text())["training"]["lr"] == 0.002
    assert not (out / "resumes.jsonl").exists()


# -- --resume-from ----------------------------------------------------------------------------------------------------
def test_resume_from_an_earlier_checkpoint_branches_without_overwriting(store32, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    assert main(["train", "--store", store32, "--out", str(out), "--steps", "4", "--save-every", "1", "--keep", "0",
                 *FLAGS]) == 0
    before = {p.name: (p / "trainer.json").read_bytes() for p in ckpt.list_checkpoints(out)}
    step2 = out / "checkpoints" / "step_00000002"
    capsys.readouterr()
    # in its own OUT, later checkpoints would be overwritten: refused, nothing changed
    assert main(["train", "--store", store32, "--out", str(out), "--steps", "4", "--resume-from", str(step2),
                 *FLAGS]) == 2
    line = error_line(capsys)
    assert f"--resume-from {step2}" in line and "step_00000003" in line and "a new --out" in line, line
    assert {p.name: (p / "trainer.json").read_bytes() for p in ckpt.list_checkpoints(out)} == before
    # into a new OUT: steps 3 and 4 again, exactly as the run trained them
    branch = tmp_path / "branch"
    assert main(["train", "--store", store32, "--out", str(branch), "--steps", "4", "--save-every", "1",
                 "--resume-from", str(step2), *FLAGS]) == 0
    assert [r["step"] for r in rows(branch)] == [3, 4]
    assert [r["loss"] for r in rows(branch)] == [r["loss"] for r in rows(out)[2:]]
    a, b = weights(out), weights(branch)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((branch / "resumes.jsonl").read_text())["checkpoint"] == str(step2)
    capsys.readouterr()
    assert main(["train", "--store", store32, "--out", str(tmp_path / "x"), "--resume-from", str(step2),
                 "--no-resume", *FLAGS]) == 2
    assert "--resume-from CHECKPOINT or --no-resume" in error_line(capsys)


# -- --grad-accum -----------------------------------------------------------------------------------------------------
class Replay:
    """Batches of the given groups of a store's samples, in order, every epoch (a test's own batches)."""

    def __init__(self, url: str, groups: list[list[int]]):
        self.store, self.groups = hsstore.open(url), groups

    def set_epoch(self, epoch):
        pass

    def state_dict(self):
        return None

    def __iter__(self):
        for group in self.groups:
            yield hsstore.collate_padded([self.store.read(i) for i in group])


def test_grad_accum_steps_as_one_batch_of_the_union(store32, tmp_path):  # noqa: F811
    """2 micro-batches of budget B per step give the parameters one batch of their union (budget 2B) gives, up to
    float rounding: the loss of a step is the weighted mean over every anchor of its micro-batches."""
    small = dict(FAST, token_budget=1024)
    train(build(TrainSettings, store=[store32], out=str(tmp_path / "accum"), steps=2, grad_accum=2, **small),
          source=Replay(store32, [[0, 1], [2, 3], [4, 5], [6, 7]]))
    train(build(TrainSettings, store=[store32], out=str(tmp_path / "union"), steps=2, **{**small, "token_budget": 2048}),
          source=Replay(store32, [[0, 1, 2, 3], [4, 5, 6, 7]]))
    accum, union = rows(tmp_path / "accum"), rows(tmp_path / "union")
    assert [r["step"] for r in accum] == [1, 2] and [r["samples"] for r in accum] == [4, 4]
    assert [r["loss"] for r in accum] == pytest.approx([r["loss"] for r in union], rel=1e-5)
    a, b = weights(tmp_path / "accum"), weights(tmp_path / "union")
    for k in a:  # Adam's first steps are near sign(grad): one element may round apart by 2e-6; a window normalised
        # per micro-batch (the mean of their means) moves them by 1e-3
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5)


def test_grad_accum_through_the_command(store32, tmp_path):  # noqa: F811
    """--grad-accum 2 over epochs of 3 batches: two micro-batches a step, the epoch's last one a step of its own (as
    Hugging Face Trainer ends an epoch); a metrics row per optimizer step, covering its micro-batches."""
    out = tmp_path / "run"
    assert main(["train", "--store", store32, "--out", str(out), "--steps", "3", "--grad-accum", "2",
                 "--log-samples", *FLAGS]) == 0
    logged = [json.loads(ln) for ln in (out / "samples.rank00000.jsonl").read_text().splitlines()]
    assert [(r["step"], r["epoch"]) for r in logged] == [(1, 0), (1, 0), (2, 0), (3, 1), (3, 1)]
    assert [r["interval_steps"] for r in rows(out)] == [1, 1, 1]
    per_step = [sum(len(r["samples"]) for r in logged if r["step"] == s) for s in (1, 2, 3)]
    assert [r["samples"] for r in rows(out)] == per_step


# -- --weight-decay ---------------------------------------------------------------------------------------------------
def test_weight_decay_is_adamws_decoupled_decay_on_what_hugging_face_decays(store32, tmp_path):  # noqa: F811
    def one_step(name, **kw):
        train(build(TrainSettings, store=[store32], out=str(tmp_path / name), steps=1, warmup=0.0, **FAST, **kw))
        return weights(tmp_path / name)

    start = one_step("start", lr=0.0)  # a step of rate 0 leaves the initial weights as they are
    plain = one_step("plain", lr=0.01)
    decayed = one_step("decayed", lr=0.01, weight_decay=0.1)
    cfg, _ = ckpt.read_drafter_config(tmp_path / "plain")
    drafter = DFlashDrafter(cfg, torch.zeros(cfg.vocab_size, cfg.hidden_size), torch.zeros(cfg.vocab_size,
                                                                                             cfg.hidden_size))
    from transformers import Trainer

    names = decay_parameter_names(drafter)
    assert names == set(Trainer.get_decay_parameter_names(None, drafter))  # Hugging Face's own rule, asked
    assert names and any("norm" in k for k in start) and not any("norm" in k for k in names)
    for k in start:  # AdamW: p <- p (1 - lr wd) - lr update, the update the same as without decay
        if k in names:
            torch.testing.assert_close(decayed[k], plain[k] - 0.01 * 0.1 * start[k], rtol=0, atol=1e-7)
            assert not torch.equal(decayed[k], plain[k])
        else:
            assert torch.equal(decayed[k], plain[k]), k


def test_a_checkpoint_of_one_optimizer_group_resumes_exactly(store32, tmp_path):  # noqa: F811
    """Checkpoints written before the optimizer had a group of decayed weights (one group, in the model's order)
    resume as they did: the same losses and weights as the run never stopped."""
    cfg_ = dict(store=[store32], steps=4, save_every=2, keep=0, **FAST)
    train(build(TrainSettings, out=str(tmp_path / "full"), **cfg_))
    cut = tmp_path / "cut"
    train(build(TrainSettings, out=str(cut), **{**cfg_, "steps": 2}))
    ck = ckpt.latest_checkpoint(cut)
    state = json.loads((ck / "trainer.json").read_text())
    groups = state["optimizer"]["param_groups"]
    cfg, _ = ckpt.read_drafter_config(ck)
    drafter = DFlashDrafter(cfg, torch.zeros(cfg.vocab_size, cfg.hidden_size), torch.zeros(cfg.vocab_size,
                                                                                             cfg.hidden_size))
    order = [n for n, p in drafter.named_parameters() if p.requires_grad]
    decayed = decay_parameter_names(drafter)
    saved_order = [n for n in order if n in decayed] + [n for n in order if n not in decayed]
    assert [len(g["params"]) for g in groups] == [len(decayed), len(order) - len(decayed)]
    legacy = {k: v for k, v in groups[0].items() if k != DECAY_KEY}
    state["optimizer"]["param_groups"] = [{**legacy, "params": list(range(len(order)))}]
    state["optimizer"]["scalars"] = {str(order.index(saved_order[int(pid)])): v
                                     for pid, v in state["optimizer"]["scalars"].items()}
    (ck / "trainer.json").write_text(json.dumps(state))
    moments = load_file(str(ck / "optimizer.safetensors"))
    save_file({f"{order.index(saved_order[int(k.split('.', 1)[0])])}.{k.split('.', 1)[1]}": v
               for k, v in moments.items()}, str(ck / "optimizer.safetensors"))
    train(build(TrainSettings, out=str(cut), **cfg_))
    assert [r["loss"] for r in rows(cut)] == [r["loss"] for r in rows(tmp_path / "full")]
    a, b = weights(tmp_path / "full"), weights(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)
