"""``hsstore train --report-to tensorboard,wandb,mlflow``: the metrics.jsonl rows sent to experiment trackers too.

Each backend is an optional package (``pip install 'hsstore[track]'``); a missing one is refused before
training starts, in one line naming the extra. Rank 0 reports; names are grouped ``train/`` (loss, acc, tau,
acc_k/K per draft position, lr, grad_norm), ``val/`` (loss, tau, acceptance/K, ...) and ``perf/`` (tokens/s,
loader wait share, peak GPU memory). The run's settings go in as hyper-parameters, flattened ``section.key``.
Where each one writes, by default inside OUT:

* tensorboard: ``OUT/tensorboard/`` event files (torch's ``SummaryWriter``), settings as text and hparams;
* wandb: ``OUT/wandb/`` (``wandb.init(dir=OUT)``; project ``$WANDB_PROJECT`` or ``hsstore``);
  ``WANDB_MODE=offline`` writes the run there without a network, ``wandb sync`` uploads it later;
* mlflow: ``$MLFLOW_TRACKING_URI`` when set, else the local file store ``OUT/mlruns`` (MLflow 3 keeps its
  file store behind ``MLFLOW_ALLOW_FILE_STORE``, which is set for that case only); experiment
  ``$MLFLOW_EXPERIMENT_NAME`` or ``hsstore``.

A resumed run (the same command again) opens a new tracker run whose steps go on from the checkpoint's. Every
row is flushed as it is logged, so a run that crashes keeps what it reported (its MLflow status stays RUNNING).
A tracker's folder under OUT may come with a run from elsewhere, and its library reads it by name: a link or
anything but folders and regular files in it is refused in one line before the library opens it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from hsstore.errors import StoreError
from hsstore.io import door, sinks

log = logging.getLogger(__name__)

EXTRA = "pip install 'hsstore[track]'"
PERF = ("tokens_per_s", "wait_frac", "gpu_mem_gib", "tokens", "samples", "val_seconds", "interval_steps",
        "interval_seconds")
SKIP = ("step",)


def parse_report_to(text: str | list[str] | None) -> list[str]:
    """``"tensorboard,wandb"`` -> ["tensorboard", "wandb"]; "none" or empty -> []; unknown names refused."""
    items = text if isinstance(text, list) else (text or "").split(",")
    names = [t.strip().lower() for t in items if t.strip() and t.strip().lower() != "none"]
    bad = [n for n in names if n not in TRACKERS]
    if bad:
        raise ValueError(f"--report-to {','.join(bad)}: unknown (one or more of {', '.join(TRACKERS)}, or none)")
    return list(dict.fromkeys(names))


def check_available(names: list[str]) -> None:
    """One line naming the pip extra when a chosen backend's package is not installed."""
    missing = [n for n in names if importlib.util.find_spec(TRACKERS[n].package) is None]
    if missing:
        raise ValueError(f"--report-to {','.join(missing)}: the {' and '.join(missing)} package(s) are not "
                         f"installed; {EXTRA}")


def metric_name(key: str) -> str:
    if key.startswith("val_"):
        return "val/" + key[4:]
    return ("perf/" if key in PERF else "train/") + key


def flatten_row(row: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl row as {tracker name: number}; lists become one series per position (1-based)."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if k in SKIP:
            continue
        if isinstance(v, (list, tuple)):
            for i, x in enumerate(v, 1):
                if isinstance(x, (int, float)) and x is not None and math.isfinite(x):
                    out[f"{metric_name(k)}/{i}"] = float(x)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[metric_name(k)] = float(v)
    return out


def flatten_params(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as {"section.key": scalar}; lists and None as text (what every tracker accepts)."""
    out: dict[str, Any] = {}
    for k, v in settings.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_params(v, name + "."))
        elif isinstance(v, (bool, int, float, str)):
            out[name] = v
        else:
            out[name] = str(v)
    return out


class Tracker:
    """One backend: ``open`` at the start of a run, ``log`` each row's numbers, ``close`` at the end."""

    name = ""
    package = ""  # the module whose absence is refused up front
    folder = ""  # what it writes under OUT (a link planted there is refused: its library would write through it)

    def __init__(self, out: Path, params: dict[str, Any], run_name: str) -> None:
        raise NotImplementedError

    def log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self, failed: bool) -> None:
        raise NotImplementedError


class TensorBoard(Tracker):
    name = package = folder = "tensorboard"

    def __init__(self, out: Path, params: dict[str, Any], run_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        for summary in hparams(params, {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("settings", "\n".join(f"    {k}: {v}" for k, v in params.items()))

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandB(Tracker):
    name = package = folder = "wandb"

    def __init__(self, out: Path, params: dict[str, Any], run_name: str) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "hsstore"), dir=str(out), name=run_name,
                              config=params, reinit="finish_previous")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MLflow(Tracker):
    name = package = "mlflow"
    folder = "mlruns"

    def __init__(self, out: Path, params: dict[str, Any], run_name: str) -> None:
        import mlflow
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (out / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "hsstore")
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step) for k, v in values.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


TRACKERS: dict[str, type[Tracker]] = {t.name: t for t in (TensorBoard, WandB, MLflow)}  # --report-to's names


def _opened(name: str, out: Path, params: dict[str, Any], run_name: str) -> Tracker:
    """Backend ``name`` opened on ``out``: its library parses what a received OUT holds in its folder, so a file
    there it cannot read is one line naming it (the library's own words, on one line), not its traceback."""
    try:
        return TRACKERS[name](out, params, run_name)
    except Exception as e:
        words = " ".join(str(e).split())[:400]
        raise StoreError(f"{out / TRACKERS[name].folder}: {name} could not open its logs ({type(e).__name__}: "
                         f"{words}); move the folder away or give another --out") from None


class Trackers:
    """The chosen backends, opened at the start of a run (rank 0 only), fed each logged row, closed at the end."""

    def __init__(self, names: list[str], out: Path, params: dict[str, Any], run_name: str | None = None):
        check_available(names)
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                os.close(sinks.open_folder(out, TRACKERS[n].folder, create=False, what=f"{n} logs"))
                # a run folder from elsewhere: its library reads what is there by name, so nothing in it may be a
                # link or a FIFO
                door.check_tree(out, TRACKERS[n].folder, where=f"{n} logs")
        flat_params, name = flatten_params(params), run_name or Path(out).name
        self._open = [_opened(n, Path(out), flat_params, name) for n in names]

    def log(self, row: dict[str, Any], step: int) -> None:
        values = flatten_row(row)
        if values:
            for tracker in self._open:
                tracker.log(values, step)

    def close(self, failed: bool = False) -> None:
        for tracker in self._open:
            try:
                tracker.close(failed)
            except Exception as e:  # a tracker failing at the end must not hide the run's own outcome
                log.warning("closing %s failed: %s", tracker.name, e)
        self._open = []
