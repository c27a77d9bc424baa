"""A run folder from elsewhere is data, never authority (docs/RELIABILITY.md, "A received folder grants nothing"): its
run.yaml never chooses where `train` reads or sends the user's credentials, a resume whose record names storage
options or allowed locations needs them on the command line, tracker folders under it pass the door, and every
metrics.jsonl row (and the best-checkpoint pointer's metrics) is typed before use. Each test runs the real
command: in a child process where a failure would be a hang or a request sent, else in process."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from hsstore.app.cli import main
from hsstore.testing.hostile_http import HostileHTTPServer

from test_hostile_inputs import FAST, cli, one_line, run1  # noqa: F401  (run1: a fixture)
from train_helpers import small_input, store32  # noqa: F401  (fixtures)


def received(run1: Path, tmp_path: Path, edit=None) -> Path:  # noqa: F811
    """A copy of a real one-step run, as a folder sent by someone else, its run.yaml changed by ``edit``."""
    run = tmp_path / "received"
    shutil.copytree(run1, run, symlinks=True)
    if edit is not None:
        data = yaml.safe_load((run / "run.yaml").read_text())
        edit(data)
        (run / "run.yaml").write_text(yaml.safe_dump(data))
    return run


def error_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith(("INFO", "WARNING"))]
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


# -- run.yaml read with --config: no endpoint, no location ------------------------------------------------------------
@pytest.mark.parametrize("recorded", ["as written", "recorded section cut out"])
def test_a_received_run_yaml_sends_no_request_to_the_endpoint_it_names(run1, tmp_path, monkeypatch, recorded):  # noqa: F811
    """run.yaml names an S3 store on an endpoint of the sender's: `train --config run.yaml` never asks it, so no
    request signed with the user's access key id reaches it; one line names the flag that would."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUSERSOWNKEYID")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the-users-secret")
    (tmp_path / "served").mkdir()
    with HostileHTTPServer(str(tmp_path / "served"), []) as srv:
        def edit(d):
            d["run"]["store"] = ["s3://users-private-bucket/store"]
            d["storage"]["storage_option"] = [f"endpoint_url={srv.url}"]
            if recorded != "as written":
                d.pop("recorded")

        run = received(run1, tmp_path, edit)
        r = cli("train", "--config", run / "run.yaml", "--out", run, "--steps", "2", timeout=90)
        asked = list(srv.paths)
    one_line(r, f"--config {run / 'run.yaml'} is a run's record", f"-S endpoint_url={srv.url}")
    assert asked == []


@pytest.fixture(scope="module")
def by_reference(store32, tmp_path_factory):  # noqa: F811
    """(a user's private store, a store merged by reference whose shards are the private store's)."""
    d = tmp_path_factory.mktemp("by_reference")
    private = d / "private"
    shutil.copytree(store32, private)
    assert main(["merge", str(d / "ref"), str(private), "--by", "reference", "-q"]) == 0
    return private, d / "ref"


def test_a_received_run_yaml_allows_no_location(run1, by_reference, tmp_path, capsys):  # noqa: F811
    """run.yaml names a store merged by reference and, as an allowed location, the user's private store: `train
    --config` refuses in one line naming --allow-location; the same with the flag given trains."""
    private, ref = by_reference

    def edit(d):
        d["run"]["store"] = [str(ref)]
        d["storage"]["allow_location"] = [str(private)]

    run = received(run1, tmp_path, edit)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:  # refused as the file is read, before the command starts
        main(["train", "--config", str(run / "run.yaml"), "--out", str(tmp_path / "new"), *FAST])
    assert stop.value.code == 2
    line = error_line(capsys)
    assert f"--allow-location {private}" in line and "which this command line does not give" in line
    assert not (tmp_path / "new").exists()
    # the user's own word: the same file, the location on the command line
    assert main(["train", "--config", str(run / "run.yaml"), "--out", str(tmp_path / "mine"), "--steps", "1",
                 "--allow-location", str(private), *FAST]) == 0


def test_resuming_a_run_whose_record_allows_a_location_needs_the_flag_again(by_reference, tmp_path, capsys):
    """A run trained with --allow-location, resumed without it: one line naming the flag and the record, before any
    store is opened; with it, the run goes on."""
    private, ref = by_reference
    out = tmp_path / "run"
    base = ["train", "--store", str(ref), "--out", str(out), "--save-every", "1", *FAST]
    assert main([*base, "--steps", "1", "--allow-location", str(private)]) == 0
    capsys.readouterr()
    assert main([*base, "--steps", "2"]) == 2
    line = error_line(capsys)
    assert f"was trained with --allow-location {private} ({out / 'run.yaml'})" in line, line
    assert not (out / "checkpoints" / "step_00000002").exists()
    assert main([*base, "--steps", "2", "--allow-location", str(private)]) == 0


# -- tracker folders ------------------------------------------------------------------------------------------------
TRACKER_FOLDERS = {  # (--report-to, the name planted under OUT, how, words of the refusal)
    "mlruns meta.yaml a FIFO": ("mlflow", "mlruns/0/meta.yaml", os.mkfifo, "a FIFO"),
    "mlruns meta.yaml -> /dev/zero": ("mlflow", "mlruns/0/meta.yaml", lambda p: os.symlink("/dev/zero", p),
                                      "symbolic link"),
    "tensorboard events a FIFO": ("tensorboard", "tensorboard/events.out.tfevents.1.host", os.mkfifo, "a FIFO"),
    "mlruns meta.yaml of NUL bytes": ("mlflow", "mlruns/0/meta.yaml", lambda p: p.write_bytes(b"\0" * 4096),
                                      "mlflow could not open its logs"),
}


@pytest.mark.parametrize("case", sorted(TRACKER_FOLDERS))
def test_a_tracker_folder_in_a_received_run_is_refused_not_read(run1, store32, tmp_path, monkeypatch, case):  # noqa: F811
    """A received OUT resumed with --report-to: a FIFO or a link in the tracker's folder is one line naming it (its
    library would wait on the FIFO for ever, or read /dev/zero until memory runs out)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    report_to, name, make, words = TRACKER_FOLDERS[case]
    run = received(run1, tmp_path)
    (run / name).parent.mkdir(parents=True)
    make(run / name)
    r = cli("train", "--store", store32, "--out", run, "--steps", "2", "--report-to", report_to, *FAST, timeout=120)
    one_line(r, name, words)


# -- metrics.jsonl and the best pointer: typed before use -----------------------------------------------------------
WRONG_ROWS = {  # a field of a metrics.jsonl row, forged: (the field refused, the row's forged fields)
    "step a string": ("step", {"step": "2"}), "step 1e300": ("step", {"step": 1e300}),
    "step true": ("step", {"step": True}), "epoch a list": ("epoch", {"epoch": [0]}),
    "loss a string": ("loss", {"loss": "low"}), "lr a string": ("lr", {"lr": "x"}),
    "samples a string": ("samples", {"samples": "3", "epoch": 0, "arrived_samples": 3}),
    "arrived_samples a string": ("arrived_samples", {"arrived_samples": "x"}),
    "acc_k a string": ("acc_k", {"acc_k": "abc"}), "acc_k of strings": ("acc_k", {"acc_k": ["a"]}),
    "val_tau a list": ("val_tau", {"val_tau": [3.0, 4.0]}), "val_tau a string": ("val_tau", {"val_tau": "3"}),
    "val_acceptance a number": ("val_acceptance", {"val_tau": 2.0, "val_acceptance": 5}),
}


@pytest.mark.parametrize("case", sorted(WRONG_ROWS))
def test_report_of_a_run_with_a_wrongly_typed_metrics_row_is_one_line(run1, tmp_path, capsys, case):  # noqa: F811
    run = received(run1, tmp_path)
    rows = (run / "metrics.jsonl").read_text().splitlines()
    field, forged = WRONG_ROWS[case]
    row = {**json.loads(rows[0]), "step": 2, **forged}
    (run / "metrics.jsonl").write_text(rows[0] + "\n" + json.dumps(row) + "\n")
    capsys.readouterr()
    assert main(["report", str(run), "--out", str(tmp_path / "r.html")]) == 2
    line = error_line(capsys)
    assert f"metrics.jsonl: line 2: {field}" in line, line
    assert not (tmp_path / "r.html").exists()


def test_a_resume_drops_a_wrongly_typed_row_and_its_report_is_drawn(run1, store32, tmp_path, capsys):  # noqa: F811
    """The trainer reads metrics.jsonl when it resumes (it drops the lines after its checkpoint): a row whose
    fields are not of their kinds is dropped there too, with a warning, so the run's report is drawn."""
    run = received(run1, tmp_path)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**row, "step": 1, "val_tau": [1, 2]}) + "\n")
    assert main(["train", "--store", store32, "--out", str(run), "--steps", "2", *FAST]) == 0
    assert [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    capsys.readouterr()
    assert main(["report", str(run), "--out", str(tmp_path / "r.html")]) == 0


def test_a_resume_drops_forged_samples_log_lines_and_keeps_a_repeated_step(run1, store32, tmp_path, caplog):  # noqa: F811
    """The run's samples log (--log-samples) holding, after its step 1, lines no run stopped at step 1 of epoch 0
    wrote (``FORGED_SAMPLES_LINES``) and its step-1 line again (--grad-accum logs a line per micro-batch): the
    resumed run keeps its own lines, drops the forged ones with one warning that counts them and names the file, and
    logs step 2."""
    from test_train_follow import FORGED_SAMPLES_LINES

    run = received(run1, tmp_path)
    log = run / "samples.rank00000.jsonl"
    first = log.read_text().splitlines()[0]
    log.write_text("".join(ln + "\n" for ln in [first, *map(json.dumps, FORGED_SAMPLES_LINES), first]))
    with caplog.at_level("WARNING"):
        assert main(["train", "--store", store32, "--out", str(run), "--steps", "2", "--log-samples", *FAST]) == 0
    rows = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert rows[:2] == [json.loads(first)] * 2 and [r["step"] for r in rows[2:]] == [2] * (len(rows) - 2), rows
    assert not {s for r in rows for s in r["samples"]} & {"forged-a", "forged-b"}
    warned = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert warned == [f"{log}: {len(FORGED_SAMPLES_LINES)} line(s) that are not a step's log line dropped"], warned


@pytest.mark.parametrize("command", ["train", "export-drafter"])
def test_a_best_pointer_whose_metrics_are_not_numbers_is_one_line(run1, store32, tmp_path, capsys, command):  # noqa: F811
    run = received(run1, tmp_path)
    (run / "checkpoints" / "best").write_text(json.dumps({"format": "hsstore-best-checkpoint", "step": 1,
                                                          "checkpoint": "step_00000001", "val_tau": [9.0]}))
    argv = (["train", "--store", store32, "--out", str(run), "--steps", "2", *FAST] if command == "train"
            else ["export-drafter", str(run), str(tmp_path / "exported"), "--best"])
    capsys.readouterr()
    assert main(argv) == 2
    line = error_line(capsys)
    assert "checkpoints/best: val_tau [9.0] is not a number" in line, line
    assert not (tmp_path / "exported").exists() and not (run / "checkpoints" / "step_00000002").exists()
