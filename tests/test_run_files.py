"""What a run leaves behind and reads back: `--config FILE.yaml` (flag > file > default, unknown keys refused),
OUT/run.yaml (running it again gives the same losses) and OUT/checkpoints/best (follows the best val_tau,
exported like any checkpoint). Tiny store, CPU, in-process CLI."""

import json
from pathlib import Path

import pytest
import yaml

from hsstore.app.cli import build_parser, main
from hsstore.app import config
from hsstore.train import checkpoint as ckpt
from train_helpers import small_input, store32  # noqa: F401  (fixtures)

FAST_FLAGS = ["--token-budget", "1024", "--draft-layers", "1", "--block-size", "8", "--anchors", "32",
              "--log-every", "1", "--device", "cpu", "-q"]


def rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def parse(argv):
    p = build_parser()
    config.apply(p, argv)
    return p.parse_args(argv)


def write_yaml(path, data):
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_config_precedence_flag_over_file_over_default(tmp_path):
    f = write_yaml(tmp_path / "c.yaml", {"run": {"store": ["/s/a"], "out": "/o", "epochs": 3},
                                         "training": {"lr": 0.001, "seed": 7}, "batch": {"anchors": 64}})
    args = parse(["train", "--config", f, "--seed", "3"])
    assert args.store == ["/s/a"] and args.out == "/o"  # required flags may come from the file
    assert args.lr == 0.001 and args.anchors == 64  # file over default
    assert args.seed == 3  # flag over file
    assert args.warmup == 0.04 and args.epochs == 3 and args.steps is None  # default where neither says
    args = parse(["train", "--steps", "5", "--config", f])  # a flag overrides the file's rival in its group
    assert args.steps == 5 and args.epochs is None


def test_config_refuses_unknown_keys_and_bad_values(tmp_path, capsys):
    f = write_yaml(tmp_path / "c.yaml", {"run": {"store": ["/s"], "out": "/o", "stepz": 3},
                                         "trainin": {"lr": 1.0}})
    with pytest.raises(SystemExit) as e:
        parse(["train", "--config", f])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "run.stepz" in err and "trainin" in err and "unknown key" in err
    f = write_yaml(tmp_path / "d.yaml", {"training": {"lr": "fast"}})
    with pytest.raises(SystemExit):
        parse(["train", "--config", f, "--store", "/s", "--out", "/o"])
    assert "training.lr" in capsys.readouterr().err
    f = write_yaml(tmp_path / "e.yaml", {"training": {"attn": "magic"}})
    with pytest.raises(SystemExit):
        parse(["train", "--config", f, "--store", "/s", "--out", "/o"])
    assert "training.attn" in capsys.readouterr().err


def test_every_train_flag_has_a_key():
    """The sections come from the parser itself: each option of `train --help` is a key of one section."""
    p = build_parser()
    sub = p._subparsers._group_actions[0].choices["train"]
    keys = {k for sec in config.sections(sub).values() for k in sec}
    flags = {a.dest for a in sub._actions if a.option_strings and a.help != "==SUPPRESS=="} - {"help", "config"}
    assert flags == keys
    assert {"run", "batch", "drafter", "drafter_shape", "training", "output", "validation"} <= set(
        config.sections(sub))


@pytest.mark.slow
def test_run_yaml_reproduces_the_run_and_best_checkpoint(store32, tmp_path, capsys):  # noqa: F811
    a = tmp_path / "a"
    argv = ["train", "--store", store32, "--out", str(a), "--steps", "4", "--save-every", "2", "--keep", "1",
            "--val-store", store32, "--val-every", "1", "-S", "secret_access_key=hunter2hunter2", *FAST_FLAGS]
    assert main(argv) == 0
    summary = capsys.readouterr().out
    run = yaml.safe_load((a / "run.yaml").read_text())
    assert run["run"]["store"] == [store32] and run["training"]["seed"] == 0 and run["batch"]["anchors"] == 32
    assert run["recorded"]["hsstore_version"] and run["recorded"]["stores"][0]["samples"] == 8
    assert "hunter2" not in (a / "run.yaml").read_text()  # secret storage options are not written down

    b = tmp_path / "b"
    assert main(["train", "--config", str(a / "run.yaml"), "--out", str(b)]) == 0
    ra, rb = rows(a), rows(b)
    assert [r["step"] for r in ra] == [1, 2, 3, 4] and [r["loss"] for r in ra] == [r["loss"] for r in rb]

    # best: the step with the highest val_tau (a tie: the lower val_loss, then the earlier step), kept although --keep 1
    taus = {r["step"]: r["val_tau"] for r in ra}
    losses = {r["step"]: r["val_loss"] for r in ra}
    best_step = max(taus, key=lambda s: (taus[s], -losses[s], -s))
    pointer = json.loads((a / "checkpoints" / "best").read_text())
    assert pointer["step"] == best_step and pointer["val_tau"] == pytest.approx(taus[best_step])
    assert (a / "checkpoints" / pointer["checkpoint"] / "trainer.json").exists()
    assert json.loads((a / "checkpoints" / pointer["checkpoint"] / "trainer.json").read_text())["step"] == best_step
    capsys.readouterr()
    assert f"best checkpoint (val_tau {taus[best_step]:.4f} at step {best_step}): " in summary
    assert f"{a}/checkpoints/{pointer['checkpoint']}; hsstore export-drafter {a} NEW --best" in summary
    assert main(["export-drafter", str(a / "checkpoints" / "best"), str(tmp_path / "exp")]) == 0
    cfg, _ = ckpt.read_drafter_config(tmp_path / "exp")
    assert cfg.num_layers == 1 and cfg.block_size == 8
    # --best on the run: the same checkpoint; without it, the last step (which differs from the best one here)
    assert main(["export-drafter", str(a), str(tmp_path / "exp_best"), "--best"]) == 0
    assert main(["export-drafter", str(a), str(tmp_path / "exp_last")]) == 0
    weights = lambda d: (tmp_path / d / "model.safetensors").read_bytes()  # noqa: E731
    assert weights("exp_best") == weights("exp")
    assert (weights("exp_last") == weights("exp")) == (best_step == 4)
    capsys.readouterr()
    assert main(["export-drafter", str(tmp_path / "exp"), str(tmp_path / "exp2"), "--best"]) != 0
    err = capsys.readouterr().err
    assert "has no checkpoints/best" in err and "--val-store" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "exp2").exists()


def test_best_pointer_is_checked(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    p = tmp_path / "checkpoints" / "best"
    p.write_text(json.dumps({"format": ckpt.BEST_FORMAT, "checkpoint": "../../etc"}))
    with pytest.raises(ValueError, match="not a best-checkpoint pointer"):
        ckpt.resolve_drafter_dir(p)
    p.write_text(json.dumps({"format": ckpt.BEST_FORMAT, "checkpoint": "step_00000009"}))
    with pytest.raises(FileNotFoundError, match="step_00000009"):
        ckpt.resolve_drafter_dir(p)


def test_best_checkpoint_survives_keep(tmp_path):
    """--keep drops old checkpoints but never the one OUT/checkpoints/best names."""
    def fake(step, best=None):
        tmp = ckpt.staging_dir(tmp_path, step)
        tmp.mkdir(parents=True)
        (tmp / "trainer.json").write_text("{}")
        ckpt.publish(tmp, ckpt.checkpoint_dir(tmp_path, step), keep=1, best=best)

    fake(1)
    fake(2, best={"step": 2, "val_tau": 3.0})
    fake(3)
    fake(4)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000004"]
    assert ckpt.read_best(tmp_path)["checkpoint"] == "step_00000002"
    fake(5, best={"step": 5, "val_tau": 3.5})
    fake(6)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000005", "step_00000006"]


def test_extract_config(tmp_path):
    """extract reads the same kind of file, in the sections of its --help groups; a file written when every flag
    but the gate thresholds was under `options` still loads."""
    p = build_parser()
    sub = p._subparsers._group_actions[0].choices["extract"]
    secs = config.sections(sub)
    assert {"input", "store", "tokenize", "gate", "gate_thresholds", "capture", "forward", "run"} <= set(secs)
    assert "model" in secs["input"] and "layers" in secs["capture"] and "shard_mb" in secs["store"]
    name = next(iter(secs["gate_thresholds"]))
    new = {"input": {"model": "/m", "input": ["/in.jsonl"]}, "store": {"out": "/o", "encoding": "fp8"},
           "capture": {"layers": "1,3"}, "tokenize": {"expand": False}}
    old = {"options": {"model": "/m", "input": ["/in.jsonl"], "out": "/o", "layers": "1,3", "encoding": "fp8",
                       "no_expand": True}}
    for data in (new, old):
        f = write_yaml(tmp_path / "x.yaml", data)
        args = parse(["extract", "--config", f, "--out", "/other"])
        assert args.model == "/m" and args.input == ["/in.jsonl"] and args.layers == "1,3" and args.encoding == "fp8"
        assert args.expand is False  # the old key no_expand: true read inverted
        assert args.out == "/other" and getattr(args, name) == sub.get_default(name)
    f = write_yaml(tmp_path / "bad.yaml", {"options": {"no_such_flag": 1}})
    with pytest.raises(SystemExit):
        parse(["extract", "--config", f])


def test_config_abbreviated_flag_is_refused(tmp_path, capsys):
    """Flags are never abbreviated, --config neither: --conf FILE is refused naming --config (it is not read as
    the file, nor is the file read); --config=FILE is the other spelling. A file's keys are matched whole."""
    f = write_yaml(tmp_path / "c.yaml", {"run": {"store": ["/s"], "out": "/o"}, "training": {"lr": 0.5}})
    assert config._config_path(["--conf", f]) is None
    assert main(["train", "--conf", f]) == 2
    assert "unknown flag --conf (did you mean --config?)" in capsys.readouterr().err
    assert parse(["train", f"--config={f}"]).lr == 0.5 and parse(["train", "--config", f]).lr == 0.5
    short = write_yaml(tmp_path / "s.yaml", {"run": {"store": ["/s"], "out": "/o"}, "training": {"l": 0.5}})
    with pytest.raises(SystemExit):
        parse(["train", "--config", short])
    assert "unknown key(s) training.l (did you mean training.lr?)" in capsys.readouterr().err


def test_run_yaml_runs_again_from_another_folder(store32, tmp_path, monkeypatch, caplog):  # noqa: F811
    """#38.3: run.yaml recorded the store as the relative path it was given, so `train --config OUT/run.yaml`
    failed from any other folder. Paths are recorded absolute (URLs as they are); a relative path written in a
    config file is read from the file's folder, and the command says so."""
    import shutil

    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(store32, work / "store")
    monkeypatch.chdir(work)
    assert main(["train", "--store", "store", "--out", "run", "--steps", "2", *FAST_FLAGS]) == 0
    recorded = yaml.safe_load((work / "run" / "run.yaml").read_text())
    assert recorded["run"]["store"] == [str(work / "store")] and recorded["run"]["out"] == str(work / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--config", str(work / "run" / "run.yaml"), "--out", "again"]) == 0
    assert [r["loss"] for r in rows(elsewhere / "again")] == [r["loss"] for r in rows(work / "run")]
    # written by hand next to the store: relative to the file, wherever the command runs
    f = write_yaml(work / "mine.yaml", {"run": {"store": ["store"], "out": "mine", "steps": 1}})
    with caplog.at_level("WARNING", logger="hsstore.app.config"):
        assert main(["train", "--config", f, *FAST_FLAGS]) == 0
    assert (work / "mine" / "metrics.jsonl").exists() and not (elsewhere / "mine").exists()
    assert f"relative paths are read from the file's folder {work}" in caplog.text and "store store" in caplog.text


# (val_tau, val_loss) of each evaluation, at steps 1, 2, ...; the step OUT/checkpoints/best must name
HISTORIES = {
    "rising": ([(1.2, 3.0), (1.5, 2.8), (1.9, 2.5)], 3),
    "falling": ([(1.9, 2.5), (1.5, 2.8), (1.2, 3.0)], 1),
    "up then down": ([(1.2, 3.0), (1.9, 2.5), (1.4, 2.9)], 2),
    "a tie, the later loss lower": ([(1.5, 3.0), (1.5, 2.7), (1.4, 2.0)], 2),
    "a tie, the later loss higher": ([(1.5, 2.7), (1.5, 3.0)], 1),
    "an exact tie": ([(1.5, 2.7), (1.5, 2.7)], 1),
    "a tie without a loss": ([(1.5, 2.7), (1.5, None)], 1),
    "not computed": ([(1.5, 2.7), (float("nan"), 1.0), (None, 1.0), (float("inf"), 1.0)], 1),
}


def follow_history(out, history, saved=None):
    """The trainer's loop over ``history``: each evaluation offered to the best tracker, a checkpoint published at
    every step (pointed at by ``best`` when the tracker has a new one)."""
    from hsstore.train.metrics import BestTracker

    best = BestTracker(saved)
    for step, (tau, loss) in enumerate(history, 1):
        best.offer(step, {"step": step, "val_tau": tau, "val_loss": loss, "val_acc": 0.5, "val_anchors": 64})
        tmp = ckpt.staging_dir(out, step)
        tmp.mkdir(parents=True)
        (tmp / "trainer.json").write_text(json.dumps({"step": step}))
        (tmp / ckpt.CONFIG).write_text("{}")  # what export-drafter looks for in the checkpoint named
        ckpt.publish(tmp, ckpt.checkpoint_dir(out, step), keep=len(history), best=best.take())
    return best


@pytest.mark.parametrize("name", list(HISTORIES))
def test_the_best_checkpoint_follows_validation_up_down_and_through_ties(tmp_path, name):
    history, want = HISTORIES[name]
    follow_history(tmp_path, history)
    pointer = ckpt.read_best(tmp_path)
    assert pointer["step"] == want and pointer["checkpoint"] == ckpt.checkpoint_dir(tmp_path, want).name
    # what `export-drafter OUT NEW --best` exports: the checkpoint the pointer names
    assert ckpt.resolve_drafter_dir(ckpt.best_pointer(tmp_path)) == ckpt.checkpoint_dir(tmp_path, want)


def test_a_resumed_run_keeps_its_best_through_a_tie(tmp_path):
    """A resumed run starts from the pointer's tau and loss: a tie with a higher loss does not move it, a tie with
    a lower loss does."""
    follow_history(tmp_path, [(1.5, 2.7)])
    saved = ckpt.read_best(tmp_path)
    follow_history(tmp_path / "again", [(1.5, 2.9)], saved)
    assert ckpt.read_best(tmp_path / "again") is None  # nothing better than the saved best
    follow_history(tmp_path / "lower", [(1.5, 2.5)], saved)
    assert ckpt.read_best(tmp_path / "lower")["val_loss"] == 2.5


def test_export_drafter_help_says_how_a_tie_is_broken(capsys):
    with pytest.raises(SystemExit):
        main(["export-drafter", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "best validation tau, a tie going to the lower validation loss, then to the earlier step" in text


def test_a_checkpoint_refused_for_another_reason_than_space_does_not_say_free_space(tmp_path):
    """Weights gone non-finite (a store's NaN features read where its records carry no statistics) refuse the
    checkpoint: the line says why and keeps the earlier ones, without the full disk's advice, which would send the
    user to free space and resume into the same step."""
    with pytest.raises(OSError) as e:
        with ckpt.checkpoint_errors(tmp_path, 3):
            raise ValueError("writing drafter: tensor 'fc.weight': non-finite values (4 of 4)")
    assert "non-finite values" in str(e.value) and "are kept" in str(e.value) and "free space" not in str(e.value)
