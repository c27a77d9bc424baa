"""OUT, a training run's directory, besides its checkpoints: what makes a folder a run, and its settings files.

``train_config.json`` (the config as ``config.recordable_config`` records it) marks a folder as a run that a
re-run of the same command resumes; a folder without it that holds anything else is the user's, and refused.
``run.yaml`` holds the command's settings by section (``hsstore train --config OUT/run.yaml`` runs it again).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from hsstore.io import destination, sinks
from hsstore.version import __version__

RUN_MARKER = "train_config.json"  # what makes a folder a run (``--out`` of an earlier train, resumed)
RUN_FILE = "run.yaml"


def prepare(out: str | os.PathLike, rank: int) -> Path:
    """OUT, created; refused (rank 0) when it is a user's folder rather than a run to resume (other ranks
    would see rank 0's first files)."""
    out = Path(out)
    if rank == 0:
        destination.check_output_folder(out, (RUN_MARKER,), "train --out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def record(out: Path, config_json: dict[str, Any], settings: dict[str, Any] | None, stores, device) -> None:
    """Rank 0, at the start: OUT/train_config.json, and OUT/run.yaml when the command's settings are known."""
    sinks.write_atomic(out, RUN_MARKER, json.dumps(config_json, indent=2).encode(), what=f"writing {out / RUN_MARKER}")
    if settings is not None:
        write_run_file(out / RUN_FILE, settings, stores, {**config_json, "device": str(device)})


def write_run_file(path: Path, settings: dict[str, Any], stores, resolved: dict[str, Any]) -> None:
    """OUT/run.yaml: the command's settings (``hsstore train --config OUT/run.yaml`` runs it again), and for
    people the version, each store's identity and the values the device chose."""
    from hsstore.app.config import dump
    from hsstore.redaction import scrub

    recorded = {"hsstore_version": __version__,
                "stores": [{"url": scrub(s.url), "samples": len(s), "layers": list(s.manifest.layers),
                            "dtype": s.manifest.dtype, "encoding": s.manifest.encoding,
                            "target": dataclasses.asdict(s.manifest.target),
                            "tokenizer": dataclasses.asdict(s.manifest.tokenizer)} for s in stores],
                "resolved": {k: v for k, v in resolved.items() if k in ("device", "token_budget", "anchors",
                                                                         "epochs", "steps")}}
    header = ("hsstore train settings of this run. `hsstore train --config run.yaml --out NEW` runs it again\n"
              "(flags given with --config win); secret storage options are not recorded: pass them with -S.")
    # under a fresh temporary name, renamed over it: a link planted at either name is never written through
    sinks.write_atomic(path.parent, path.name, dump(settings, recorded, header).encode(), what=f"writing {path}")
