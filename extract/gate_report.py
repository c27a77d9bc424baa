"""The quality gate's verdict as a file, so the gate over the whole input runs once per job.

``hsstore check --report FILE`` writes it; ``hsstore extract --gate-report FILE`` (every torchrun rank) reuses
it and then tokenizes only its own rows. A report is bound to what decided it: the input files (name, size,
mtime and a content hash), the tokenizer (vocabulary and chat-template hashes) and every setting that changes
the samples or the verdict (template arguments, max length, truncation, expansion, thresholds). A report that
differs in any of them is refused, naming what differs: data the gate never saw cannot reach a GPU under
its verdict.

Inputs are compared by size and mtime first (one ``stat`` per file, whatever the row count); a file whose
mtime moved but not its size (copied to another machine) is hashed and accepted when its content hash is
the same. ``check`` stats every file before it reads and again after, and refuses to write a report for
input that changed under it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hsstore.io import storage, transfer

from .gate import GateReport, GateThresholds, check, is_stub
from .readers import _hf_dataset_dir, input_files
from .sample import TokenizedSample
from .tokenize import load_samples
from .tokenize_stats import TokenizeStats

log = logging.getLogger(__name__)

FORMAT = "hsstore-gate-report"
VERSION = 1


class GateReportMismatch(ValueError):
    """The gate report does not describe this run's input, tokenizer or settings."""


@dataclass
class GateVerdict:
    """What extraction needs of a gate run over the whole input, whether computed here or read from a report."""

    ok: bool
    failures: list[str]
    thresholds: GateThresholds
    #: samples the gate flagged ``duplicate`` (a later copy of an earlier sample's tokens): all of them
    duplicate_ids: set[str] = field(default_factory=set)
    #: sample ids met more than once (listed up to the report's limit; any is an error)
    repeated_ids: list[str] = field(default_factory=list)
    source: str = ""  # the report file, when read from one
    report: GateReport | None = None  # when computed in this process

    @classmethod
    def from_report(cls, report: GateReport) -> GateVerdict:
        dup = {r.sample_id for r in report.samples if "duplicate" in r.flags}
        return cls(report.ok, list(report.failures), report.thresholds, dup, list(report.repeated_ids),
                   report=report)

    def flags(self, s: TokenizedSample) -> list[str]:
        """The sample's flags as the gate recorded them (``stub_answer`` and ``duplicate`` added), for the store."""
        flags = list(s.flags)
        if is_stub(s, self.thresholds):
            flags.append("stub_answer")
        if s.sample_id in self.duplicate_ids:
            flags.append("duplicate")
        return flags

    def format_text(self, tokenizer=None) -> str:
        """The full report (with decoded examples) when computed here; the verdict and reasons from a file."""
        if self.report is not None:
            return self.report.format_text(tokenizer, n_examples=3)
        lines = [f"hsstore quality gate: {'PASS' if self.ok else 'FAIL'} (from the gate report {self.source})"]
        lines += [f"    FAIL  {f}" for f in self.failures]
        return "\n".join(lines) + "\n"


def file_digest(path: Path, block: int = 8 << 20) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def _data_files(p: Path) -> list[Path]:
    """The files whose bytes the readers consume for input ``p`` (a ``save_to_disk`` dir: its .arrow files)."""
    if p.is_dir() and _hf_dataset_dir(p):
        return sorted(f for f in p.rglob("*.arrow") if f.is_file())
    return input_files(p)


def input_identity(inputs: list[str], hash_content: bool = True) -> list[dict]:
    """Per input argument: its files (names relative to it), sizes, mtimes and optionally content hashes."""
    out = []
    for arg in inputs:
        p = Path(arg)
        files = []
        for f in _data_files(p):
            st = f.stat()
            entry = {"name": f.name if p.is_file() else str(f.relative_to(p)), "bytes": st.st_size,
                     "mtime_ns": st.st_mtime_ns}
            if hash_content:
                entry["blake2b"] = file_digest(f)
            files.append(entry)
        out.append({"path": str(arg), "files": files})
    return out


def run_identity(inputs: list[str], tokenizer, *, chat_template_kwargs: dict | None, max_length: int | None,
                 truncate: bool, expand: bool, thresholds: GateThresholds, hash_content: bool = True,
                 trust_engine_ids: bool = False, learn_not_generated: bool = False) -> dict:
    """Everything a gate verdict depends on besides the gate's code."""
    from .target import tokenizer_identity

    tid = tokenizer_identity(tokenizer, "")
    return {
        "inputs": input_identity(inputs, hash_content),
        "tokenizer": {"vocab_hash": tid.vocab_hash, "chat_template_hash": tid.chat_template_hash},
        "settings": {"chat_template_kwargs": dict(chat_template_kwargs or {}), "max_length": max_length,
                     "truncate": bool(truncate), "expand": bool(expand),
                     **({"trust_engine_ids": True} if trust_engine_ids else {}),
                     **({"learn_not_generated": True} if learn_not_generated else {})},
        "thresholds": asdict(thresholds),
    }


def write_gate_report(url: str, report: GateReport, identity: dict) -> None:
    """The report as JSON (the ``check --json`` summary, the identity, every ``duplicate`` id), written atomically."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "identity": identity,
        "report": report.to_dict(),
        "duplicate_ids": [r.sample_id for r in report.samples if "duplicate" in r.flags],
        "repeated_ids": report.repeated_ids,
    }
    fs, path = storage.resolve(url)
    transfer.put_atomic(fs, path, json.dumps(doc, ensure_ascii=False).encode("utf-8"))


def read_gate_report(url: str) -> dict:
    fs, path = storage.resolve(url)
    try:
        doc = json.loads(fs.cat_file(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"gate report not found: {url} (write it with hsstore check --report)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"gate report {url}: not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"gate report {url}: not an hsstore gate report (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise ValueError(f"gate report {url}: version {doc.get('version')!r}, this hsstore reads version {VERSION}")
    return doc


def _short(v) -> str:
    text = json.dumps(v, sort_keys=True) if not isinstance(v, str) else v
    return text[:16] + "..." if isinstance(v, str) and len(v) > 40 else text


def identity_difference(want: dict, have: dict) -> str | None:
    """What differs between a report's identity (``want``) and this run's (``have``, content hashes optional),
    as one phrase; None when they match. Files whose mtime moved are hashed here."""
    for key in ("vocab_hash", "chat_template_hash"):
        a, b = want["tokenizer"].get(key), have["tokenizer"].get(key)
        if a != b:
            return f"tokenizer {key} differs (report {_short(a)}, here {_short(b)})"
    for group in ("settings", "thresholds"):
        for key in sorted(set(want[group]) | set(have[group])):
            a, b = want[group].get(key), have[group].get(key)
            if a != b:
                flag = "--" + key.replace("_", "-")
                return f"{flag} differs (report {_short(a)}, here {_short(b)})"
    if len(want["inputs"]) != len(have["inputs"]):
        return f"the number of --input paths differs (report {len(want['inputs'])}, here {len(have['inputs'])})"
    for w, h in zip(want["inputs"], have["inputs"], strict=True):
        wn, hn = [f["name"] for f in w["files"]], [f["name"] for f in h["files"]]
        if wn != hn:
            extra = sorted(set(hn) - set(wn)) or sorted(set(wn) - set(hn)) or ["order"]
            return f"the files of input {h['path']} differ (report {len(wn)}, here {len(hn)}; e.g. {extra[0]})"
        for wf, hf in zip(w["files"], h["files"], strict=True):
            root = Path(h["path"])
            name = str(root / hf["name"]) if root.is_dir() else h["path"]
            if wf["bytes"] != hf["bytes"]:
                return f"input file {name} changed (size: report {wf['bytes']:,} bytes, here {hf['bytes']:,})"
            if wf["mtime_ns"] != hf["mtime_ns"]:
                digest = hf.get("blake2b") or file_digest(Path(name))
                if digest != wf.get("blake2b"):
                    return f"input file {name} changed (content hash differs)"
                log.info("%s: mtime differs from the gate report's, content hash matches", name)
    return None


def reuse_gate_report(url: str, identity: dict) -> GateVerdict:
    """The verdict of the report at ``url`` if it describes this run (``identity`` from :func:`run_identity`,
    content hashes not needed); else :class:`GateReportMismatch` naming what differs."""
    doc = read_gate_report(url)
    diff = identity_difference(doc["identity"], identity)
    if diff:
        raise GateReportMismatch(f"gate report {url} does not match this run: {diff}; run hsstore check --report "
                                 "again with this run's input and settings")
    rep = doc["report"]
    return GateVerdict(ok=bool(rep["ok"]), failures=list(rep["failures"]),
                       thresholds=GateThresholds(**doc["identity"]["thresholds"]),
                       duplicate_ids=set(doc.get("duplicate_ids", [])), repeated_ids=list(doc.get("repeated_ids", [])),
                       source=url)


def gate_inputs(inputs: list[str], tokenizer, *, thresholds: GateThresholds, chat_template_kwargs: dict | None = None,
                max_length: int | None = None, truncate: bool = False, expand: bool = True,
                report_url: str | None = None, trust_engine_ids: bool = False,
                learn_not_generated: bool = False) -> GateReport:
    """The gate over the whole input, streamed (``hsstore check``); with ``report_url`` also its report file.

    Memory: the gate's per-sample records (id, counts, flags, a 16-byte hash), not the samples' tokens.
    """
    settings = dict(chat_template_kwargs=chat_template_kwargs, max_length=max_length, truncate=truncate,
                    expand=expand, thresholds=thresholds, trust_engine_ids=trust_engine_ids,
                    learn_not_generated=learn_not_generated)
    before = run_identity(inputs, tokenizer, hash_content=False, **settings) if report_url else None
    stats = TokenizeStats()
    samples = load_samples(inputs, tokenizer, max_length=max_length, truncate=truncate, keep_over_length=True,
                           expand=expand, stats=stats, chat_template_kwargs=chat_template_kwargs,
                           trust_engine_ids=trust_engine_ids, learn_not_generated=learn_not_generated)
    report = check(samples, thresholds, stats=stats)
    if report_url:
        identity = run_identity(inputs, tokenizer, **settings)
        if _stats_of(identity) != _stats_of(before):
            raise ValueError(f"the input changed while it was being checked ({', '.join(inputs)}): no gate report "
                             f"written to {report_url}")
        write_gate_report(report_url, report, identity)
    return report


def _stats_of(identity: dict) -> list:
    return [(f["name"], f["bytes"], f["mtime_ns"]) for i in identity["inputs"] for f in i["files"]]
