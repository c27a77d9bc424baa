"""OUT, a training run's directory, besides its checkpoints: what makes a folder a run, and its settings files.

``train_config.json`` (the config as ``config.recordable_config`` records it) marks a folder as a run that a
re-run of the same command resumes; a folder without it that holds anything else is the user's, and refused.
``run.yaml`` holds the settings of the run's first segment by section (``hsstore train --config OUT/run.yaml``
runs it again); each resume appends its own settings, and what changed, as one line of ``resumes.jsonl``, so the
run keeps what every segment trained with.

A run folder may come from elsewhere: what it records is data, never authority. Its storage options and allowed
locations are never taken from it, and a resume whose record names some that the command line does not give
stops in one line naming the flags to pass (``check_authority``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from hsstore.io import destination, door, sinks
from hsstore.version import __version__

RUN_MARKER = "train_config.json"  # what makes a folder a run (``--out`` of an earlier train, resumed)
RUN_FILE = "run.yaml"
RESUMES_FILE = "resumes.jsonl"  # one line per resume: its step, checkpoint, changes and settings
RESUMES_CAP = 64 << 20  # resumes.jsonl (a few kB a resume)


@dataclasses.dataclass(frozen=True)
class ResumeRecord:
    """A resume, as ``resumes.jsonl`` records it: the step and checkpoint it continues from and the settings that
    differ from those the checkpoint was saved with (``{key: [before, now]}``)."""

    step: int
    checkpoint: str
    changed: dict[str, list[Any]]


def prepare(out: str | os.PathLike, rank: int) -> Path:
    """OUT, created; refused (rank 0) when it is a user's folder rather than a run to resume (other ranks
    would see rank 0's first files)."""
    out = Path(out)
    if rank == 0:
        destination.check_output_folder(out, (RUN_MARKER,), "train --out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def record(out: Path, config_json: dict[str, Any], settings: dict[str, Any] | None, stores, device,
           resumed: ResumeRecord | None = None) -> None:
    """Rank 0, at the start: OUT/train_config.json; a run from step 0 (or into an OUT without one) writes
    OUT/run.yaml when the command's settings are known and drops an earlier run's resumes; a resume appends a line
    to OUT/resumes.jsonl instead, leaving run.yaml as the first segment wrote it."""
    sinks.write_atomic(out, RUN_MARKER, json.dumps(config_json, indent=2).encode(), what=f"writing {out / RUN_MARKER}")
    first = resumed is None or not door.is_file_beneath(out, RUN_FILE)
    if resumed is None:
        sinks.remove_tree(out, RESUMES_FILE)  # starting over: the resumes of the run it replaces are not this one's
    else:
        line = {"step": resumed.step, "checkpoint": resumed.checkpoint, "hsstore_version": __version__,
                "changed": resumed.changed, "settings": settings}
        with sinks.open_append(out, RESUMES_FILE, what="appending to") as f:  # a planted link refused
            f.write(json.dumps(line) + "\n")
    if settings is not None and first:
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
    header = ("hsstore train settings of this run's first segment (resumes: resumes.jsonl). `hsstore train --config\n"
              "run.yaml --out NEW` runs it again (flags given with --config win); storage options and allowed\n"
              "locations are recorded for people, never taken from this file: pass them with -S / --allow-location.")
    # under a fresh temporary name, renamed over it: a link planted at either name is never written through
    sinks.write_atomic(path.parent, path.name, dump(settings, recorded, header).encode(), what=f"writing {path}")


def last_settings(out: Path) -> tuple[dict[str, Any], str] | None:
    """(settings by section, the file they come from) of the run's latest segment: its last resume's line, else
    run.yaml; None when it has neither. Read through the door (a run folder may come from elsewhere)."""
    from hsstore.app.config import RECORDED

    try:
        if door.is_file_beneath(out, RESUMES_FILE):
            lines = door.read_beneath(out, RESUMES_FILE, bound=RESUMES_CAP, where=str(out)).splitlines()
            last = next((ln for ln in reversed(lines) if ln.strip()), None)
            if last is not None:
                where = str(out / RESUMES_FILE)
                line = door.load_json(last, where, error=ValueError)
                settings = line.get("settings") if isinstance(line, dict) else None
                if not isinstance(settings, dict):
                    raise ValueError(f"{where}: its last line is not a resume's record (no settings object)")
                return settings, where
        if door.is_file_beneath(out, RUN_FILE):
            where = str(out / RUN_FILE)
            data = door.load_yaml(door.read_beneath(out, RUN_FILE, bound=door.YAML_CAP, where=str(out)), where)
            if not isinstance(data, dict):
                raise ValueError(f"{where}: not a run's settings (a YAML {type(data).__name__})")
            return {k: v for k, v in data.items() if k != RECORDED}, where
    except door.Refused as e:
        raise ValueError(str(e)) from None
    return None


def check_authority(out: Path, storage_options: dict[str, Any], allows: list[str]) -> None:
    """A resume of OUT: refused in one line when the run's record names storage options or allowed locations that
    this command (``storage_options`` parsed; ``allows`` from the command line and the environment) does not give.
    Nothing is taken from the record: it only says what the user must repeat to read where the run read."""
    from hsstore.app.config import record_authority, unrepeated

    found = last_settings(out)
    if found is None:
        return
    settings, where = found
    missing = unrepeated(*record_authority(settings, where), storage_options, allows)
    if missing:
        raise ValueError(f"{out} was trained with {' '.join(missing)} ({where}), which this command line does not "
                         "give; a run's record never chooses where this command reads or sends your credentials: "
                         "pass them again to resume (or --no-resume to start over)")
