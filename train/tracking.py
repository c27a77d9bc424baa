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
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BACKENDS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # name -> module to import
EXTRA = "pip install 'hsstore[track]'"
PERF = ("tokens_per_s", "wait_frac", "gpu_mem_gib", "tokens", "samples", "val_seconds")
SKIP = ("step",)


def parse_report_to(text: str | list[str] | None) -> list[str]:
    """``"tensorboard,wandb"`` -> ["tensorboard", "wandb"]; "none" or empty -> []; unknown names refused."""
    items = text if isinstance(text, list) else (text or "").split(",")
    names = [t.strip().lower() for t in items if t.strip() and t.strip().lower() != "none"]
    bad = [n for n in names if n not in BACKENDS]
    if bad:
        raise ValueError(f"--report-to {','.join(bad)}: unknown (one or more of {', '.join(BACKENDS)}, or none)")
    return list(dict.fromkeys(names))


def check_available(names: list[str]) -> None:
    """One line naming the pip extra when a chosen backend's package is not installed."""
    missing = [n for n in names if importlib.util.find_spec(BACKENDS[n]) is None]
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


class Trackers:
    """The chosen backends, opened at the start of a run (rank 0 only), fed each logged row, closed at the end."""

    def __init__(self, names: list[str], out: Path, params: dict[str, Any], run_name: str | None = None):
        check_available(names)
        self.out, self.params, self.run_name = Path(out), flatten_params(params), run_name or Path(out).name
        self._sinks: list[tuple[str, Any]] = []
        for n in names:
            self._sinks.append((n, getattr(self, f"_open_{n}")()))

    def _open_tensorboard(self):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        w = SummaryWriter(log_dir=str(self.out / "tensorboard"))
        exp, ssi, sei = hparams(self.params, {})
        for s in (exp, ssi, sei):
            w.file_writer.add_summary(s)
        w.add_text("settings", "\n".join(f"    {k}: {v}" for k, v in self.params.items()))
        return w

    def _open_wandb(self):
        import wandb

        return wandb.init(project=os.environ.get("WANDB_PROJECT", "hsstore"), dir=str(self.out),
                          name=self.run_name, config=self.params, reinit="finish_previous")

    def _open_mlflow(self):
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (self.out / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        client = mlflow.MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "hsstore")
        exp = client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(name)
        run = client.create_run(exp_id, run_name=self.run_name)
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in self.params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(run.info.run_id, params=items[i:i + 100])
        return client, run.info.run_id

    def log(self, row: dict[str, Any], step: int) -> None:
        values = flatten_row(row)
        if not values:
            return
        for name, sink in self._sinks:
            if name == "tensorboard":
                for k, v in values.items():
                    sink.add_scalar(k, v, global_step=step)
                sink.flush()
            elif name == "wandb":
                sink.log(values, step=step)
            else:
                from mlflow.entities import Metric
                import time

                client, run_id = sink
                ms = int(time.time() * 1000)
                client.log_batch(run_id, metrics=[Metric(k, v, ms, step) for k, v in values.items()])

    def close(self, failed: bool = False) -> None:
        for name, sink in self._sinks:
            try:
                if name == "tensorboard":
                    sink.close()
                elif name == "wandb":
                    sink.finish(exit_code=1 if failed else 0)
                else:
                    client, run_id = sink
                    client.set_terminated(run_id, status="FAILED" if failed else "FINISHED")
            except Exception as e:  # a tracker failing at the end must not hide the run's own outcome
                log.warning("closing %s failed: %s", name, e)
        self._sinks = []
