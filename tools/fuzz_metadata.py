"""The boundaries fuzzer's metadata families: ``python -m tools.fuzz_store --families
records,columns,writers,journal,assets,weights,received`` (``METADATA`` below; the families are driven by
``tools/fuzz_boundaries.py``, which hands them to this module).

A case copies a valid input made once (``make_base``: an extracted store of 4 shards in both layouts, with its
assets and writer records; a one-step run on it; a ``train --follow`` run with its journal) and changes its
metadata, one to three mutations picked at random; then it runs the commands that read it, each under the
fuzzer's alarm with its output captured:

- ``records``: commit records (ids repeated, lookalike or forging a line; lengths, counts, offsets, tokens shifted,
  zeroed or huge; zero-length samples; names, locations, file keys, wds members; chunk_tokens, layers,
  manifest_key, writer; a record copied under another name; format version 1), the index left stale, dropped or
  rebuilt from the mutated records; ``info``, ``verify``, ``show``, a loader epoch, ``subset``, ``convert``,
  ``copy``, ``merge``, ``export``, ``report``, at times ``train --steps 2`` and ``eval``;
- ``columns``: an index segment whose columns say what a mutation of a record would, the record's bytes kept (or
  a column array edited in place); the same commands;
- ``writers``: writer sessions and end records (an end planted beside a live writer, ends whose counts lie, an
  end of a session never recorded, a writer expected that never starts, hostile heartbeats, a host, tag or error
  holding a newline, links and FIFOs); ``info``, ``verify``, ``train --follow``;
- ``journal``: the follow journal of a ``train --follow`` run folder (entries' fields, a join's segment rebuilt
  from other records, entries removed or planted, links); ``train --follow`` resuming it, a following loader epoch;
- ``assets``: ``assets/config.json`` numbers that lie, ``embed_tokens``/``lm_head`` NaN, zero, of another shape or
  dtype (re-listed with valid checksums, or not); ``info``, ``verify``, ``show``, ``train --steps 2``, ``eval``;
- ``weights``: a drafter whose weights' dtype, values or shapes lie, or whose config names another dtype;
  ``eval``, ``export-drafter``, ``train --init``;
- ``received``: a run folder from elsewhere (run.yaml naming an allowed location or an endpoint, tracker folders
  with links and FIFOs, metrics.jsonl rows of wrong types); ``train --config OUT/run.yaml``, ``train`` resuming,
  ``report``.

Besides the fuzzer's oracles (no traceback, no hang past 30 s, memory, one line for a refusal, no escape, nothing
read outside) a case fails when:

- a sample is served from a shard ``verify`` refuses: ``verify`` runs on the mutated store first (``verdict``),
  then every sample a command served is traced to the shards whose records hold its id (a loader epoch's items,
  ``show``'s sample, the samples a ``train`` logged, what ``subset``, ``convert``, ``copy`` and ``merge`` wrote;
  ``export`` and ``eval`` serve every sample when they succeed): it must be held, and by no refused shard, and a
  store ``verify`` refuses as a whole (a store-wide rule, its manifest) serves nothing;
- a line printed starts with ``MARK``, which the mutations plant after a newline in store strings;
- a ``train --follow`` ends with exit 0 having trained in epoch 0 other samples than the store holds;
- a command ends with exit 0 having written a drafter whose weights are not all finite, or printed a loss or
  acceptance that is not finite.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

METADATA = ("records", "columns", "writers", "journal", "assets", "weights", "received")
MARK = "FORGED"  # what a planted newline is followed by: no printed line may start with it
INVISIBLE = ["\u200b", "\u2060", "\ufeff", "\u00ad", "\U000e0041", "\u200e"]
SHARD_BYTES = 500_000  # about two samples a shard
FOLLOW_DEADLINE_S = "6"  # train --follow's deadline, where the command has one


# -- base --------------------------------------------------------------------------------------------------------
def make_base(work: Path, fast: list[str]) -> dict[str, Any]:
    """What the metadata families start from, made once: a store of 8 conversations in 4 shards (``zarr``, and its
    ``wds`` conversion), the digest of each sample's bits, a one-step run on it (``run``, its drafter and
    checkpoint), and a ``train --follow`` run of one epoch with every checkpoint kept (``follow_run``)."""
    import hsstore
    from hsstore.app.cli import main
    from hsstore.app.schema import build
    from hsstore.extract.job import ExtractSettings, run_extract
    from hsstore.extract.tiny import demo_conversations_path, tiny_target_dir
    from tools.fuzz_oracles import item_digest

    b = work / "metadata"
    b.mkdir(parents=True, exist_ok=True)
    inp = b / "in.jsonl"
    inp.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:8]) + "\n")
    store = b / "store-zarr"
    run_extract(build(ExtractSettings, model=str(tiny_target_dir()), input=[str(inp)], out=str(store), device="cpu",
                      progress=False, shard_bytes=SHARD_BYTES, codec="zstd"))
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["convert", str(store), str(b / "store-wds"), "--layout", "wds", "-q"]) == 0
    s = hsstore.open(str(store))
    digests = {s.ref(i).sample_id: item_digest(s.read(i)) for i in range(len(s))}
    for name, extra in (("run", ["--steps", "1"]), ("follow_run", ["--follow", "--epochs", "1", "--keep", "10"])):
        subprocess.run([sys.executable, "-m", "hsstore", "train", "--store", str(store), "--out", str(b / name),
                        "--save-every", "1", "--log-samples", *extra, *fast], check=True, capture_output=True)
    return {"dir": str(b), "zarr": str(store), "wds": str(b / "store-wds"), "digests": digests,
            "run": str(b / "run"), "follow_run": str(b / "follow_run")}


# -- helpers ------------------------------------------------------------------------------------------------------
def _records(store: Path) -> list[Path]:
    return sorted(p for p in (store / "commits").glob("*.json") if p.is_file() and not p.is_symlink())


def load_plain(p: Path) -> Any:
    """``p``'s JSON; a link, FIFO or device an earlier mutation of the case planted there is never followed (a
    ``/dev/zero`` read to its end filled the fuzzer's memory)."""
    from tools.fuzz_oracles import plain_file

    if not plain_file(p):
        raise ValueError(f"{p.name}: not a plain JSON file (an earlier mutation)")
    return json.loads(p.read_text())


def _save(p: Path, doc: Any) -> None:
    p.write_text(json.dumps(doc))


def _parsed(p: Path | None) -> Any:
    """``p``'s JSON, or None where an earlier mutation left no plain JSON file there."""
    if p is None:
        return None
    try:
        return load_plain(p)
    except ValueError:
        return None


def _ids(store: Path) -> list[str]:
    out = []
    for p in _records(store):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            out += [str(x) for x in load_plain(p)["samples"]["sample_id"]]
    return out or ["s0"]


def _forged(rng: random.Random) -> str:
    """A store string that, printed raw, starts a line of its own (and drives a terminal)."""
    return rng.choice([f"x\n{MARK} every writer finished", f"x\r\n{MARK} verify OK", f"x\u2028{MARK}",
                       f"x\n{MARK}\x1b]0;pwned\x07\x1b[2J"])


# -- commit records -------------------------------------------------------------------------------------------------
def _k(rng, s: dict) -> int:
    return rng.randrange(max(1, len(s["length"])))


def e_id_repeat(rng, d: dict, ids: list[str]) -> str:
    s = d["samples"]
    k = _k(rng, s)
    s["sample_id"][k] = rng.choice(ids)
    return f"id {k} repeated as {s['sample_id'][k]!r}"


def e_id_lookalike(rng, d: dict, ids: list[str]) -> str:
    s = d["samples"]
    k = _k(rng, s)
    base = rng.choice(ids)
    ch = rng.choice(INVISIBLE)
    at = rng.randrange(len(base) + 1)
    s["sample_id"][k] = base[:at] + ch + base[at:]
    return f"id {k} a lookalike of {base!r} (U+{ord(ch):04X})"


def e_id_odd(rng, d: dict, ids: list[str]) -> str:
    s = d["samples"]
    k = _k(rng, s)
    col = rng.choice(["sample_id", "sample_id", "source", "flags"])
    v = rng.choice([_forged(rng), "", "x" * 5000, "../../etc/passwd", "a\x00b", f"new-{rng.randrange(10**6)}"])
    s[col][k] = [v] if col == "flags" else v
    return f"{col} {k} set to {v[:24]!r}"


def e_length(rng, d: dict, ids: list[str]) -> str:
    s = d["samples"]
    k = _k(rng, s)
    v = rng.choice([-5, -1, 1, 7, 1000, -s["length"][k], 2 ** 31])
    s["length"][k] = s["length"][k] + v
    if rng.random() < 0.6:
        d["n_tokens"] = sum(s["length"])
    return f"length {k} {v:+d}"


def e_shift(rng, d: dict, ids: list[str]) -> str:
    s = d["samples"]
    if len(s["length"]) < 2:
        return e_length(rng, d, ids)
    k = rng.randrange(len(s["length"]) - 1)
    v = rng.choice([1, 3, -2, s["length"][k + 1] - 1, -(s["length"][k] - 1)])
    s["length"][k] += v
    s["length"][k + 1] -= v
    return f"boundary {k}/{k + 1} shifted {v:+d}"


def e_zero_samples(rng, d: dict, ids: list[str]) -> str:
    s = d["samples"]
    n = rng.choice([1, 10, 2000])
    for col, v in (("sample_id", None), ("source", ""), ("length", 0), ("loss_tokens", 0), ("thinking_tokens", 0),
                   ("flags", [])):
        s[col] += [f"z{i}" for i in range(n)] if v is None else [v] * n
    d["n_samples"] += n
    return f"{n} zero-length samples added"


def e_drop_row(rng, d: dict, ids: list[str]) -> str:
    s = d["samples"]
    k = _k(rng, s)
    for col in s.values():
        if k < len(col):
            del col[k]
    if rng.random() < 0.5:
        d["n_samples"] -= 1
        d["n_tokens"] = sum(s["length"])
    return f"row {k} dropped"


def e_count(rng, d: dict, ids: list[str]) -> str:
    key = rng.choice(["n_samples", "n_tokens"])
    v = rng.choice([0, d[key] - 1, d[key] + 1, 2 ** 31, 10 ** 12, 2 ** 40, -1])
    d[key] = v
    return f"{key} = {v}"


def e_loss(rng, d: dict, ids: list[str]) -> str:
    s = d["samples"]
    k = _k(rng, s)
    col = rng.choice(["loss_tokens", "thinking_tokens"])
    v = rng.choice([s["length"][k] + 5, -1, 0, 2 ** 40, s["length"][k]])
    s[col][k] = v
    return f"{col} {k} = {v}"


def e_offsets(rng, d: dict, ids: list[str]) -> str:
    keys = [f for f in d["files"] if f.endswith("/offsets/c/0")]
    if not keys:  # a wds record: a member moved instead
        return e_member(rng, d, ids)
    e = d["files"][keys[0]]
    e["crc32c"] = (e["crc32c"] + rng.randrange(1, 1 << 16)) % (1 << 32)
    return "offsets checksum changed"


def e_member(rng, d: dict, ids: list[str]) -> str:
    members = d.get("members")
    if not isinstance(members, dict) or len(members) < 2:
        return e_shift(rng, d, ids)
    a, b = rng.sample(sorted(members), 2)
    how = rng.choice(["swap", "offset", "size"])
    if how == "swap":
        members[a], members[b] = members[b], members[a]
    elif how == "offset":
        members[a][0] = members[a][0] + rng.choice([512, -512, 1, 10 ** 12])
    else:
        members[a][1] = members[a][1] + rng.choice([8, -8, 10 ** 15])
    return f"member {a} {how}"


def e_grid(rng, d: dict, ids: list[str]) -> str:
    v = rng.choice([0, 1, d["chunk_tokens"] * 2, d["chunk_tokens"] - 1, 2 ** 40, -1])
    d["chunk_tokens"] = v
    return f"chunk_tokens = {v}"


def e_layers(rng, d: dict, ids: list[str]) -> str:
    layers = d["layers"]
    how = rng.choice(["pop", "add", "rename"])
    k = rng.choice(sorted(layers))
    if how == "pop":
        layers.pop(k)
    elif how == "add":
        layers["7"] = dict(layers[k])
    else:
        layers[str(int(k) + 10)] = layers.pop(k)
    return f"layers: {how} {k}"


def e_manifest_key(rng, d: dict, ids: list[str]) -> str:
    v = rng.choice(["0" * 64, "", None, 5, "x" * 64])
    d["manifest_key"] = v
    return f"manifest_key = {v!r}"


def e_writer(rng, d: dict, ids: list[str]) -> str:
    v = rng.choice(["someone-else", "", "rank00001", _forged(rng)])
    d["writer"] = v
    return f"writer = {v[:24]!r}"


def e_shard(rng, d: dict, ids: list[str]) -> str:
    v = rng.choice([d["shard"] + "x", "../victim", d["writer"] + "-" + "0" * 8 + "-00009", "", _forged(rng)])
    d["shard"] = v
    return f"shard = {v[:24]!r}"


def e_location(rng, d: dict, ids: list[str]) -> str:
    v = rng.choice(["../other", "/etc", "s3://elsewhere/store", "%2e%2e/x", "../sentinel/victim"])
    d["location"] = v
    return f"location = {v!r}"


def e_version1(rng, d: dict, ids: list[str]) -> str:
    from hsstore.format import codec, commit

    d["format_version"] = 1
    for key, e in d["files"].items():
        if commit.is_chunk_key(key):
            e["crc32c"] = codec.CHUNK_RESIDUE
    return "format version 1" + ("" if rng.random() < 0.5 else " and " + e_shift(rng, d, ids))


def e_field(rng, d: dict, ids: list[str]) -> str:
    """A field outside the file listing set to a hostile value (the listing's checksums are the store family's)."""
    from tools.fuzz_oracles import HOSTILE, set_random

    part = rng.choice([k for k in d if k not in ("files", "members")])
    if isinstance(d[part], (dict, list)) and d[part]:
        where = set_random(rng, d[part], rng.choice(HOSTILE))
        return f"field {part}/{where}"
    d[part] = rng.choice(HOSTILE)
    return f"field {part}"


RECORD_EDITS: dict[str, Callable[[random.Random, dict, list[str]], str]] = {
    "id_repeat": e_id_repeat, "id_lookalike": e_id_lookalike, "id_odd": e_id_odd, "length": e_length,
    "shift": e_shift, "zero_samples": e_zero_samples, "drop_row": e_drop_row, "count": e_count, "loss": e_loss,
    "offsets": e_offsets, "member": e_member, "grid": e_grid, "layers": e_layers, "manifest_key": e_manifest_key,
    "writer": e_writer, "shard": e_shard, "location": e_location, "version1": e_version1, "field": e_field}
# what an index entry's columns can say (the rest of a record is not in its columns, or not parsed from them)
COLUMN_EDITS = ("id_repeat", "id_lookalike", "id_odd", "length", "shift", "zero_samples", "drop_row", "count",
                "loss", "grid", "layers", "manifest_key", "writer")


def apply_edit(rng, d: dict, ids: list[str], names=tuple(RECORD_EDITS)) -> str:
    """One of the edits ``names`` applied to the record ``d``; one that finds no sample to edit (a record whose
    rows an earlier edit dropped) gives way to another (each reads what it indexes before it writes)."""
    for _ in range(8):
        with contextlib.suppress(IndexError):
            return RECORD_EDITS[rng.choice(names)](rng, d, ids)
    return e_zero_samples(rng, d, ids)


def edit_record(rng, store: Path) -> str:
    """One mutation of one commit record (or of the set of records: a record copied or removed)."""
    paths = _records(store)
    p = rng.choice(paths)
    what = rng.choice([*RECORD_EDITS, "copy", "remove"])
    if what == "copy":  # the same shard committed twice, under its own name or another
        d = load_plain(p)
        other = store / "commits" / f"{d['writer']}-{'f' * 8}-{rng.randrange(10 ** 5):05d}.json"
        if rng.random() < 0.5:
            d["shard"] = other.stem
        _save(other, d)
        return f"record {p.name} copied as {other.name}"
    if what == "remove":
        p.unlink()
        return f"record {p.name} removed"
    d = load_plain(p)
    said = apply_edit(rng, d, _ids(store), (what,))
    _save(p, d)
    return f"{p.name}: {said}"


def index_after(rng, store: Path) -> str:
    """The index after the records changed: left as it was (stale entries: readers read those records), dropped,
    or rebuilt from the mutated records (``hsstore index``: the index then says what they say)."""
    how = rng.choice(["stale", "stale", "dropped", "rebuilt"])
    if how == "dropped":
        shutil.rmtree(store / "index", ignore_errors=True)
    elif how == "rebuilt":
        from hsstore.format.index import compact
        from hsstore.io import storage

        fs, root = storage.resolve(str(store))
        try:
            compact(fs, root, grace_s=0)
        except Exception as e:  # noqa: BLE001 (a record the compaction refuses: the index as it was)
            return f"index rebuilt: refused ({type(e).__name__})"
    return f"index {how}"


def forge_records(rng, d: Path, base: dict) -> tuple[str, list[str]]:
    layout = rng.choice(["zarr", "wds"])
    store = d / "store"
    shutil.copytree(base[layout], store)
    done = [edit_record(rng, store) for _ in range(rng.randint(1, 3))]
    return layout, done + [index_after(rng, store)]


def forge_columns(rng, d: Path, base: dict) -> tuple[str, list[str]]:
    """The columns of one shard in the index segment say what an edit of its record would; the segment keeps the
    record's own bytes, size and stamp (what a reader takes from the index). At times a column array edited in
    place instead (a table no record parses into)."""
    from hsstore.errors import StoreError
    from hsstore.format import commit, index, records

    layout = rng.choice(["zarr", "wds"])
    store = d / "store"
    shutil.copytree(base[layout], store)
    (name,) = os.listdir(store / index.INDEX_DIR)
    path = store / index.INDEX_DIR / name
    seg = index.decode_segment(name, path.read_bytes())
    t = seg.table
    row = rng.randrange(len(t))
    if rng.random() < 0.25:
        col = rng.choice(["n_tokens", "n_samples", "chunk_tokens"])
        t.ints[col] = t.ints[col].copy()
        t.ints[col][row] += rng.choice([-1, 1, 7, 2 ** 31])
        path.write_bytes(index.encode_segment(seg.kind, seg.writer, t, seg.supersedes))
        return layout, [f"index column {col} of row {row} changed"]
    done, items = [], []
    ids = _ids(store)
    for i in range(len(t)):
        raw = t.raw(i)
        rec = commit.CommitRecord.from_json(raw, "kept")
        for _ in range(5 if i == row else 0):  # an edit no record parses into is tried again with another
            doc = json.loads(raw)
            said = [apply_edit(rng, doc, ids, COLUMN_EDITS) for _ in range(rng.randint(1, 2))]
            with contextlib.suppress(StoreError):
                rec = commit.CommitRecord.from_dict(doc, "forged")
                done.append(f"columns of {doc['shard']}: {'; '.join(said)}")
                break
        items.append((rec, raw, t.stamp[i], int(t.crc32c[i]), int(t.size[i])))
    path.write_bytes(index.encode_segment(seg.kind, seg.writer, records.from_records(items), seg.supersedes))
    return layout, done


# -- writer sessions ------------------------------------------------------------------------------------------------
def _writer_files(store: Path) -> tuple[Path, Path | None]:
    w = store / "writers"
    session = next(p for p in sorted(w.glob("*.json")) if not p.name.endswith(".end.json"))
    end = session.with_name(session.name[:-len(".json")] + ".end.json")
    return session, end if end.exists() else None


def forge_writers(rng, d: Path, base: dict, sentinel: Path) -> list[str]:
    from tools.fuzz_oracles import json_edit, link_or_odd

    store = d / "store"
    shutil.copytree(base["zarr"], store)
    done = []
    for _ in range(rng.randint(1, 2)):
        if (store / "writers").is_symlink() or not (store / "writers").is_dir():
            break  # an earlier mutation made the folder a link: nothing of it is the store's to change
        session, end = _writer_files(store)
        what = rng.choice(["live_end", "live_end", "end_lies", "foreign_end", "expects", "strings", "heartbeat",
                           "json", "odd", "many", "no_end"])
        s, e = _parsed(session), _parsed(end)
        if s is None or (what in ("end_lies",) and e is None):
            what = "json"
        if what == "live_end":  # a writer still beating, and an end record planted beside it (its counts agree or lie)
            s["heartbeat_unix"] = time.time() + rng.choice([0, 3600])
            _save(session, s)
            planted = e or {"format": "hsstore-writer", "version": 1, "kind": "end", "writer": s["writer"],
                            "session": s["session"], "ended": "2026-01-01T00:00:00+00:00", "ended_unix": time.time(),
                            "shards": 4, "samples": 8, "tokens": 1000}
            if rng.random() < 0.6:
                planted["samples"] = planted["samples"] + rng.choice([-3, 5, 10 ** 6])
            _save(session.with_name(f"{s['writer']}-{s['session']}.end.json"), planted)
            done.append("end planted beside a live writer")
        elif what == "end_lies":
            key = rng.choice(["shards", "samples", "tokens"])
            e[key] = rng.choice([0, e[key] - 1, e[key] + 5, 2 ** 61])
            _save(end, e)
            done.append(f"end record's {key} = {e[key]}")
        elif what == "foreign_end":  # an end of a session no record names, for a writer the job expects or not
            tag = rng.choice(["rank00001", s["writer"]])
            planted = {"format": "hsstore-writer", "version": 1, "kind": "end", "writer": tag, "session": "deadbeef",
                       "ended": "2026-01-01T00:00:00+00:00", "ended_unix": time.time(), "shards": 2, "samples": 4,
                       "tokens": 900}
            _save(store / "writers" / f"{tag}-deadbeef.end.json", planted)
            if rng.random() < 0.5:
                s["expects"] = sorted({*s["expects"], tag})
                _save(session, s)
            done.append(f"end of an unrecorded session of {tag}")
        elif what == "expects":
            s["expects"] = rng.choice([[*s["expects"], "rank00001"], [f"rank{i:05d}" for i in range(20000)],
                                       [_forged(rng)], []])
            _save(session, s)
            done.append(f"expects {len(s['expects'])} writers")
        elif what == "strings":  # a line forged where a writer is named
            key = rng.choice(["host", "writer", "failed", "session"])
            s[key] = _forged(rng)
            _save(session, s)
            if rng.random() < 0.7 and end is not None:
                end.unlink()  # an unfinished writer is named in the follower's log
            done.append(f"session {key} forges a line")
        elif what == "heartbeat":
            key = rng.choice(["heartbeat_unix", "heartbeat_s", "started_unix"])
            s[key] = rng.choice([0, -1, 1e308, 1e-9, time.time() + 10 ** 9, 2 ** 62])
            _save(session, s)
            if rng.random() < 0.5 and end is not None:
                end.unlink()
            done.append(f"session {key} = {s[key]}")
        elif what == "json":
            done.append(json_edit(rng, rng.choice([p for p in (session, end) if p is not None])))
        elif what == "odd":
            done.append(link_or_odd(rng, rng.choice([p for p in (session, end, store / "writers") if p is not None]),
                                     sentinel))
        elif what == "many":
            for i in range(rng.choice([100, 3000])):
                (store / "writers" / f"rank{i + 2:05d}-cafe{i:04x}.json").write_text(session.read_text())
            done.append("thousands of session records")
        else:
            if end is not None:
                end.unlink()
            s["heartbeat_unix"] = time.time() - rng.choice([0, 10 ** 6])
            _save(session, s)
            done.append("end record removed")
    return done


# -- follow journals ------------------------------------------------------------------------------------------------
def forge_journal(rng, d: Path, base: dict, sentinel: Path) -> list[str]:
    """A copy of the follow run, cut back to its first checkpoint (a resume replays epoch 0 from the journal),
    its journal changed."""
    from tools.fuzz_oracles import json_edit, link_or_odd

    run = d / "run"
    shutil.copytree(base["follow_run"], run)
    ck = sorted((run / "checkpoints").glob("step_*"))
    for p in ck[1:]:
        shutil.rmtree(p)
    shutil.rmtree(run / "drafter", ignore_errors=True)
    j = run / "follow"
    done = []
    for _ in range(rng.randint(1, 2)):
        what = rng.choice(["entry", "entry", "head", "segment", "segment", "remove", "plant", "odd"])
        if what == "entry":
            done.append(json_edit(rng, rng.choice(sorted(j.glob("0*.json")))))
        elif what == "head":
            doc = load_plain(j / "journal.json")
            doc[rng.choice(["stores", "id", "version"])] = rng.choice([["elsewhere"], [], 5, "x", None, 2])
            _save(j / "journal.json", doc)
            done.append("journal head changed")
        elif what == "segment":
            done.append(_reencode_join(rng, j, base))
        elif what == "remove":
            victim = rng.choice(sorted(p for p in j.iterdir() if p.name != "journal.json"))
            victim.unlink()
            done.append(f"{victim.name} removed")
        elif what == "plant":  # a join naming a shard the store does not hold, or the same shards again
            k = len(list(j.glob("0*.json")))
            entry = {"format": "hsstore-follow", "index": k, "kind": "join", "t": time.time(), "stores": [0],
                     "shards": 1, "samples": 2, "tokens": 500, "expected_tokens": None, "why": None, "shard": None}
            shutil.copy(j / "000000.s0.idx", j / f"{k:06d}.s0.idx")
            _save(j / f"{k:06d}.json", entry)
            done.append(f"join {k} planted (the first join's shards again)")
        else:
            done.append(link_or_odd(rng, rng.choice(sorted(j.iterdir())), sentinel))
    _clone(j, d / "journal")  # the loader's epoch follows its own copy (the trainer's leader appends to the run's)
    return done


def _clone(src: Path, dst: Path) -> None:
    """``src``'s entries in ``dst`` as they are: files copied, links and FIFOs made again (never opened)."""
    dst.mkdir()
    for p in sorted(src.iterdir()):
        if p.is_symlink():
            os.symlink(os.readlink(p), dst / p.name)
        elif p.is_fifo():
            os.mkfifo(dst / p.name)
        elif p.is_file() and p.stat().st_size > 16 << 20:  # a sparse giant a mutation made: sparse again
            with open(dst / p.name, "wb") as f:
                f.truncate(p.stat().st_size)
        elif p.is_file():
            shutil.copy2(p, dst / p.name)


def _reencode_join(rng, j: Path, base: dict) -> str:
    """The first join's segment rebuilt from records changed as a forger would (ids renamed or swapped, lengths
    moved, a record of the other layout's store): a valid segment whose records the store's do not match."""
    from hsstore.errors import StoreError
    from hsstore.format import codec, commit, index, records

    name = "000000.s0.idx"
    seg = index.decode_segment(name, (j / name).read_bytes())
    t = seg.table
    items, said = [], ""
    row = rng.randrange(len(t))
    ids = [x for i in range(len(t)) for x in json.loads(t.raw(i))["samples"]["sample_id"]]
    for i in range(len(t)):
        doc = json.loads(t.raw(i))
        if i == row:
            what = rng.choice(["id_repeat", "id_odd", "shift", "length", "drop_row", "swap"])
            if what == "swap" and len(doc["samples"]["sample_id"]) > 1:
                ids_ = doc["samples"]["sample_id"]
                ids_[0], ids_[1] = ids_[1], ids_[0]
                said = "ids swapped"
            else:
                said = apply_edit(rng, doc, ids, (what if what != "swap" else "id_repeat",))
        raw = json.dumps(doc).encode()
        try:
            rec = commit.CommitRecord.from_json(raw, "forged")
        except StoreError:  # a forgery the parser refuses: the row kept as it was
            raw = t.raw(i)
            rec = commit.CommitRecord.from_json(raw, "kept")
        items.append((rec, raw, t.stamp[i], codec.crc32c(raw)))
    (j / name).write_bytes(index.encode_segment("follow", "join 0", records.from_records(items)))
    return f"join 0's segment re-encoded: {t.shard[row]} {said}"


# -- assets ---------------------------------------------------------------------------------------------------------
CONFIG_LIES = {
    "rms_norm_eps": [0, -1, 1e308, float("nan")], "eos_token_id": [10 ** 6, -1, 1033, [1, 10 ** 9]],
    "pad_token_id": [10 ** 6, -5], "bos_token_id": [2 ** 40], "vocab_size": [0, 1, -1, 2 ** 40, 10],
    "hidden_size": [0, -64, 2 ** 40, 65, 1], "intermediate_size": [2 ** 40, 0, -1],
    "num_attention_heads": [0, 3, 2 ** 31], "num_key_value_heads": [0, 3, 64], "head_dim": [0, 7, 2 ** 30],
    "num_hidden_layers": [0, 1, 10 ** 6, -1], "max_position_embeddings": [0, 2 ** 62],
    "rope_parameters": [{"rope_theta": -1.0, "rope_type": "default"}, {"rope_type": "yarn", "factor": 1e308}],
    "tie_word_embeddings": [True, "yes"], "model_type": ["llama", "", "x" * 5000], "dtype": ["int8", "bool", 7],
    "layer_types": [[], ["mystery"] * 8, "full_attention"],
}


def _tensor_lie(rng, t):
    import torch

    how = rng.choice(["nan", "zero", "inf", "one_nan", "shape", "transpose", "int", "bool", "f64", "huge"])
    if how == "nan":
        t = torch.full_like(t, float("nan"))
    elif how == "zero":
        t = torch.zeros_like(t)
    elif how == "inf":
        t = torch.full_like(t, float("inf"))
    elif how == "one_nan":
        t = t.clone()
        t.view(-1)[rng.randrange(t.numel())] = float("nan")
    elif how == "shape":
        dim = rng.randrange(t.dim())
        t = torch.cat([t, t.narrow(dim, 0, 1)], dim=dim)
    elif how == "transpose":
        t = t.t().contiguous() if t.dim() == 2 else t
    elif how == "int":
        t = t.contiguous().view(torch.int16) if t.element_size() == 2 else t.to(torch.int32)
    elif how == "bool":
        t = t != 0
    elif how == "f64":
        t = t.to(torch.float64)
    else:
        t = torch.full_like(t, 3e38 if t.dtype == torch.float32 else 6e4)
    return t, how


def _relist(store: Path, key: str) -> None:
    """``assets/index.json`` lists ``key`` with its new size and CRC32C (a forger's valid checksums)."""
    from hsstore.format import codec

    idx = store / "assets" / "index.json"
    doc = load_plain(idx)
    p = store / "assets" / key
    doc["files"][key] = {"size": p.stat().st_size, "crc32c": codec.crc32c(p.read_bytes())}
    _save(idx, doc)


def forge_assets(rng, d: Path, base: dict) -> list[str]:
    from safetensors.torch import load_file, save_file

    store = d / "store"
    shutil.copytree(base["zarr"], store)
    done = []
    for _ in range(rng.randint(1, 2)):
        what = rng.choice(["config", "config", "config", "tensor", "tensor", "names"])
        if what == "config":
            p = store / "assets" / "config.json"
            doc = load_plain(p)
            key = rng.choice(sorted(CONFIG_LIES))
            doc[key] = rng.choice(CONFIG_LIES[key])
            p.write_text(json.dumps(doc))  # (NaN written as JSON's NaN, as Python writes it)
            key_done, listed = f"config.json {key} = {str(doc[key])[:24]}", "config.json"
        else:
            name = rng.choice(["embed_tokens.safetensors", "lm_head.safetensors"])
            p = store / "assets" / name
            tensors = load_file(str(p))
            (k, t), = tensors.items()
            if what == "names":
                tensors = {rng.choice(["weight.x", "other", k + ".bias"]): t.clone()}
                how = "renamed"
                if rng.random() < 0.5:
                    tensors[k] = t
                    tensors["extra"] = t[:2].clone()
                    how = "an extra tensor"
            else:
                t, how = _tensor_lie(rng, t)
                tensors = {k: t}
            save_file(tensors, str(p))
            key_done, listed = f"{name}: {how}", name
        if rng.random() < 0.85:
            _relist(store, listed)
        else:
            key_done += " (checksum not re-listed)"
        done.append(key_done)
    return done


# -- drafter weights --------------------------------------------------------------------------------------------------
def forge_weights(rng, d: Path, base: dict) -> list[str]:
    from safetensors.torch import load_file, save_file

    folder = d / "drafter"
    shutil.copytree(Path(base["run"]) / "drafter", folder)
    done = []
    for _ in range(rng.randint(1, 2)):
        what = rng.choice(["tensor", "tensor", "all", "config_dtype", "meta_dtype", "drop", "extra"])
        p = folder / "model.safetensors"
        tensors = load_file(str(p))
        if what in ("tensor", "all"):
            keys = sorted(tensors) if what == "all" else [rng.choice(sorted(tensors))]
            hows = set()
            for k in keys:
                tensors[k], how = _tensor_lie(rng, tensors[k])
                hows.add(how)
            save_file(tensors, str(p))
            done.append(f"{len(keys)} weight(s): {', '.join(sorted(hows))}")
        elif what == "drop":
            k = rng.choice(sorted(tensors))
            del tensors[k]
            save_file(tensors, str(p))
            done.append(f"weight {k} missing")
        elif what == "extra":
            k = rng.choice(sorted(tensors))
            tensors[k + ".extra"] = tensors[k].clone()
            save_file(tensors, str(p))
            done.append(f"an extra weight beside {k}")
        else:
            f = folder / ("config.json" if what == "config_dtype" else "hsstore_drafter.json")
            doc = load_plain(f)
            key = "dtype" if what == "config_dtype" else rng.choice(["dtype", "torch_dtype"])
            doc[key] = rng.choice(["int8", "bool", "float64", "int64", 5, "float8_e4m3fn", ""])
            _save(f, doc)
            done.append(f"{f.name} {key} = {doc[key]!r}")
    return done


# -- received run folders -------------------------------------------------------------------------------------------
def forge_received(rng, d: Path, base: dict, sentinel: Path) -> dict[str, Any]:
    """A run folder from elsewhere: its run.yaml naming a store merged by reference from the user's private store
    (``sentinel/private``: a read of it moves a sentinel's access time) with that store as an allowed location, or
    an S3 store on an endpoint (a recording server: a request to it is a failure), tracker folders planted, rows
    of metrics.jsonl of wrong types."""
    import yaml

    from hsstore.app.cli import main
    from tools.fuzz_oracles import link_or_odd

    run = d / "run"
    shutil.copytree(base["run"], run)
    out: dict[str, Any] = {"mutations": []}
    for _ in range(rng.randint(1, 2)):
        what = rng.choice(["allow", "allow", "endpoint", "endpoint", "tracker", "tracker", "metrics", "metrics"])
        if what in ("allow", "endpoint"):
            doc = yaml.safe_load((run / "run.yaml").read_text())
            if what == "allow":
                private = sentinel / "private"
                if not private.exists():
                    shutil.copytree(base["zarr"], private)
                    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                        main(["merge", str(d / "ref"), str(private), "--by", "reference", "-q"])
                doc["run"]["store"] = [str(d / "ref")]
                doc["storage"]["allow_location"] = [str(private)]
                out["mutations"].append("run.yaml allows the user's private store")
            else:
                doc["run"]["store"] = ["s3://users-private-bucket/store"]
                doc["storage"]["storage_option"] = ["endpoint_url=ENDPOINT"]
                out["endpoint"] = True
                out["mutations"].append("run.yaml names an S3 store on a received endpoint")
            (run / "run.yaml").write_text(yaml.safe_dump(doc))
        elif what == "tracker":
            kind = rng.choice(["mlflow", "tensorboard"])
            name = {"mlflow": "mlruns/0/meta.yaml", "tensorboard": "tensorboard/events.out.tfevents.1.host"}[kind]
            (run / name).parent.mkdir(parents=True, exist_ok=True)
            (run / name).write_text("x\n")
            out["report_to"] = kind
            out["mutations"].append(f"{kind}: " + link_or_odd(rng, run / name, sentinel))
        else:
            rows = [{"step": "x"}, {"step": 1, "loss": [1]}, {"step": 1, "val_tau": [1, 2]}, {"step": 1e308},
                    {"step": None, "loss": {"a": 1}}, [1, 2], "text", {"step": 1, "tau": "NaN", "lr": True},
                    {"step": -1, "tokens": 10 ** 30}, {"step": 2, "epoch": "0", "loss": float("inf")}]
            with open(run / "metrics.jsonl", "a") as f:
                for r in rng.sample(rows, rng.randint(1, 4)):
                    f.write(json.dumps(r) + "\n")
            out["mutations"].append("metrics.jsonl rows of wrong types")
    return out


# -- forging, by family ---------------------------------------------------------------------------------------------
def forge(family: str, rng: random.Random, base: dict, d: Path, sentinel: Path, case: dict) -> None:
    """Fill ``case`` (its mutations, and what its commands need) for one case of ``family`` in ``d``; a forger
    that fails part way says so in the mutations (the case is what it forged so far: a long run goes on)."""
    try:
        _forge(family, rng, base, d, sentinel, case)
    except Exception as e:  # noqa: BLE001 (named in the case: tests/test_fuzz_store.py asks for none)
        case.setdefault("mutations", []).append(f"forging stopped: {type(e).__name__}: {str(e)[:120]}")


def _forge(family: str, rng: random.Random, base: dict, d: Path, sentinel: Path, case: dict) -> None:
    case["show"] = rng.choice(sorted(base["digests"]))
    case["train"] = rng.random() < 0.25
    case["eval"] = rng.random() < 0.2
    if family == "records":
        case["layout"], case["mutations"] = forge_records(rng, d, base)
    elif family == "columns":
        case["layout"], case["mutations"] = forge_columns(rng, d, base)
    elif family == "writers":
        case["mutations"] = forge_writers(rng, d, base, sentinel)
    elif family == "journal":
        case["mutations"] = forge_journal(rng, d, base, sentinel)
    elif family == "assets":
        case["mutations"] = forge_assets(rng, d, base)
    elif family == "weights":
        case["mutations"] = forge_weights(rng, d, base)
    elif family == "received":
        case.update(forge_received(rng, d, base, sentinel))
    else:
        raise KeyError(f"unknown family {family!r}")


# -- the oracle's verdict: what verify refuses --------------------------------------------------------------------------
WHOLE = ("(samples)", "(shards)")  # a store-wide rule's breach: every reader refuses the store


def verdict(url: str) -> dict[str, Any]:
    """What ``verify`` refuses of the store at ``url`` and which shards hold each id (from the commit records, the
    authority, not the index): ``whole`` (why nothing of it may be served, or ""), ``refused`` shards, ``assets``
    (verify refuses an asset), ``holders`` (id -> shards), ``listed`` (the ids a reader's table lists, the index's
    columns where it has them: what a command that serves every sample serves). A store that does not open is
    refused whole."""
    import hsstore
    from hsstore.errors import StoreError
    from hsstore.ops.verify import verify
    from hsstore.store.reader import Store

    try:
        records = Store(url, use_index=False)
        store = hsstore.open(url)
        report = verify(store)
    except (StoreError, ValueError, OSError) as e:
        return {"whole": f"does not open ({type(e).__name__})", "refused": [], "assets": False, "holders": {},
                "listed": []}
    holders: dict[str, list[str]] = {}
    for i, sid in enumerate(records.sample_ids()):
        holders.setdefault(sid, []).append(records.ref(i).shard)
    whole = [str(p) for p in report.problems if p.shard in WHOLE] + [str(b.problem()) for b in records.breaches()]
    return {"whole": whole[0][:200] if whole else "", "assets": any(p.shard == "(assets)" for p in report.problems),
            "refused": sorted({p.shard for p in report.problems if not p.shard.startswith("(")}),
            "holders": holders, "listed": store.sample_ids()}


def served_problems(name: str, served: list[tuple[str, str | None]], v: dict, digests: dict[str, str]) -> list[str]:
    """What ``name`` served that it may not: a sample of a store ``verify`` refuses as a whole, an id no record
    holds, an id a refused shard holds; or bits that are not that id's (``digests``: the original store's)."""
    out, refused, known = [], set(v["refused"]), set(digests.values())
    for sid, digest in served:
        if v["whole"]:
            out.append(f"{name}: served from a store verify refuses ({v['whole'][:120]}): {sid[:40]!r}")
        elif sid not in v["holders"]:
            out.append(f"{name}: served from no shard of the store: {sid[:40]!r}")
        elif refused & set(v["holders"][sid]):
            out.append(f"{name}: served from a shard verify refuses: {sid[:40]!r} of {sorted(refused)[:2]}")
        elif digest is not None and (digest != digests.get(sid, digest) or digest not in known):
            out.append(f"{name}: other bits for {sid[:40]!r}")
        else:
            continue
        break  # one line a command
    return out


# -- what each command served ---------------------------------------------------------------------------------------
def _epoch(url: str, follow: str | None = None) -> list[tuple[str, str]]:
    """A loader epoch (a following one's epoch 0 from the journal at ``follow``): each item's id and bits."""
    import hsstore
    from hsstore.loader.follow import Follow
    from tools.fuzz_oracles import item_digest

    ds = hsstore.HiddenStateDataset(url, planning=hsstore.Planning(shuffle=False), reading=hsstore.Reading(prefetch=1),
                                    follow=Follow(journal=follow, poll_s=(0.05, 0.5)) if follow else None)
    return [(item["sample_id"], item_digest(item)) for item in ds]


def _store_ids(url: Path) -> list[tuple[str, None]]:
    """The ids a destination store's commit records hold (what a copying command wrote)."""
    from hsstore.store.reader import Store

    if not (url / "manifest.json").is_file():
        return []
    try:
        return [(sid, None) for sid in Store(str(url), use_index=False).sample_ids()]
    except Exception:  # noqa: BLE001 (a destination left unreadable holds nothing a reader serves)
        return []


def _logged(out: Path, epoch: int | None = None) -> list[tuple[str, None]]:
    """The ids a ``train`` logged (``--log-samples``), of ``epoch`` or all."""
    p = out / "samples.rank00000.jsonl"
    if not p.is_file():
        return []
    ids = []
    for line in p.read_text().splitlines():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            row = json.loads(line)
            if epoch is None or row.get("epoch") == epoch:
                ids += [(str(s), None) for s in row["samples"]]
    return ids


def _not_finite_weights(folder: Path) -> str | None:
    """Why a drafter folder's weights are not all finite numbers (None: they are, or there are none)."""
    import torch
    from safetensors.torch import load_file

    for p in sorted(folder.glob("*.safetensors")):
        for k, t in load_file(str(p)).items():
            if not t.is_floating_point():
                return f"{p.name}:{k} is {t.dtype}"
            if not torch.isfinite(t).all():
                return f"{p.name}:{k} holds non-finite values"
    return None


def _not_finite_numbers(out: str) -> str | None:
    try:
        doc = json.loads(out)
    except ValueError:
        return None
    bad = [k for k in ("loss", "acc", "tau") if isinstance(doc, dict) and isinstance(doc.get(k), float)
           and not math.isfinite(doc[k])]
    return f"{bad[0]} = {doc[bad[0]]}" if bad else None


def _supports(command: str, flag: str) -> bool:
    """Whether ``hsstore COMMAND`` has ``flag`` (a flag other work adds: used where it is there)."""
    from hsstore.app.cli import build_parser

    with contextlib.suppress(Exception):
        sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
        return flag in sub.choices[command]._option_string_actions
    return False


# -- the commands of a case ---------------------------------------------------------------------------------------------
def commands(case: dict, m: dict, d: Path, fast: list[str]) -> dict[str, Any]:
    """Each command of a case: name -> argv of ``hsstore`` or a callable (a loader epoch)."""
    fam = case["family"]
    url = str(d / "store") if (d / "store").is_dir() else m["zarr"]
    drafter = str(Path(m["run"]) / "drafter")
    train = ["train", "--store", url, "--out", str(d / "train"), "--steps", "2", "--log-samples", *fast]
    ev = ["eval", "--store", url, "--drafter", drafter, "--device", "cpu", "-q", "--json"]
    follow = ["--follow-deadline", FOLLOW_DEADLINE_S] if _supports("train", "--follow-deadline") else []
    if fam in ("records", "columns"):
        other = "wds" if case.get("layout") == "zarr" else "zarr"
        cmds: dict[str, Any] = {
            "info": ["info", url], "verify": ["verify", url, "-q"], "show": ["show", url, case["show"]],
            "epoch": lambda: _epoch(url), "subset": ["subset", url, str(d / "subset"), "-q"],
            "convert": ["convert", url, str(d / "convert"), "--layout", other, "-q"],
            "copy": ["copy", url, str(d / "copy"), "-q"], "merge": ["merge", str(d / "merge"), url, "-q"],
            "export": ["export", "specforge", url, str(d / "export"), "-q"],
            "report": ["report", url, "--out", str(d / "report.html")]}
        if case.get("train"):
            cmds["train"] = train
        if case.get("eval"):
            cmds["eval"] = ev
        return cmds
    if fam == "writers":
        return {"info": ["info", url], "verify": ["verify", url, "-q"],
                "train_follow": ["train", "--store", url, "--out", str(d / "train"), "--follow", "--epochs", "1",
                                 "--log-samples", *follow, *fast]}
    if fam == "journal":
        return {"epoch_follow": lambda: _epoch(m["zarr"], str(d / "journal")),
                "train_follow": ["train", "--store", m["zarr"], "--out", str(d / "run"), "--follow", "--epochs", "1",
                                 "--save-every", "1", "--log-samples", *follow, *fast]}
    if fam == "assets":
        cmds = {"info": ["info", url], "verify": ["verify", url, "-q"], "show": ["show", url, case["show"]],
                "train": train}
        if case.get("eval"):
            cmds["eval"] = ev
        return cmds
    if fam == "weights":
        cmds = {"eval": [*ev[:4], str(d / "drafter"), *ev[5:]],
                "export_drafter": ["export-drafter", str(d / "drafter"), str(d / "exported")]}
        if case.get("train"):
            cmds["train_init"] = [*train, "--init", str(d / "drafter")]
        return cmds
    if fam == "received":
        report_to = ["--report-to", case["report_to"]] if case.get("report_to") else []
        return {"train_config": ["train", "--config", str(d / "run" / "run.yaml"), "--out", str(d / "new"), "--steps",
                                 "2", *report_to, *fast],
                "report": ["report", str(d / "run"), "--out", str(d / "report.html")],
                "train_resume": ["train", "--store", m["zarr"], "--out", str(d / "run"), "--steps", "3", *report_to,
                                 *fast]}
    raise ValueError(fam)


def served_by(name: str, case: dict, d: Path, rc: Any, got: Any, v: dict) -> list[tuple[str, str | None]]:
    """The samples command ``name`` served (ids, with their bits' digest where the command hands them over)."""
    if name in ("epoch", "epoch_follow"):
        return list(got) if isinstance(got, list) else []
    if name in ("subset", "convert", "copy", "merge"):  # what they wrote, whatever their exit status
        return _store_ids(d / name)
    if name == "show":
        return [(case["show"], None)] if rc == 0 else []
    if name in ("train", "train_follow"):
        return _logged(d / ("run" if case["family"] == "journal" else "train"))
    if name in ("export", "eval") and rc == 0:  # every sample a reader's table lists
        return [(sid, None) for sid in v["listed"]] or [("(the store)", None)]
    return []


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, x in saved.items():
            os.environ.pop(k) if x is None else os.environ.__setitem__(k, x)


def drive(case: dict, base: dict) -> dict:
    """Run a case's commands (``fuzz_store.run_command``), then the oracles: ``verify``'s verdict first (on a
    mutated store), what each command served against it, lines forged, a follower's trained vs held, values."""
    from hsstore.app.cli import main
    from tools.fuzz_oracles import DEADLINES, FAST, sentinel_failures
    from tools.fuzz_oracles import run_command

    m = base["metadata"]
    d = Path(case["dir"])
    fam = case["family"]
    results: dict[str, Any] = {}
    failures: list[str] = []
    env = {**DEADLINES, "HSSTORE_FOLLOW_POLL_S": "0.5", "AWS_ACCESS_KEY_ID": "AKIAUSERSOWNKEYID",
           "AWS_SECRET_ACCESS_KEY": "the-users-secret"}
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_environ(env))
            v = {"whole": "", "refused": [], "assets": False, "holders": {sid: ["?"] for sid in m["digests"]},
                 "listed": sorted(m["digests"])}
            if (d / "store").is_dir():
                results["verdict"], problems, got = run_command("verdict", lambda: verdict(str(d / "store")),
                                                                refusals_raise=True, log_dir=d)
                failures += problems
                if not isinstance(got, dict):
                    return {"case": case["case"], "results": results, "failures": failures}
                v = got
            asked = _endpoint(case, d, stack)
            for name, cmd in commands(case, m, d, FAST).items():
                fn = cmd if callable(cmd) else (lambda argv=cmd: main(argv))
                out: list[str] = []
                results[name], problems, got = run_command(name, fn, refusals_raise=callable(cmd), log_dir=d,
                                                           keep=out)
                failures += problems + checks(name, case, d, results[name].get("rc"), got, v, m, out)
            if asked is not None and asked():
                failures.append(f"asked the received endpoint: {asked()[:2]}")
    except Exception as e:  # noqa: BLE001 (a case the driver could not set up is a failure to see)
        failures.append(f"driver: {type(e).__name__}: {str(e)[:200]}")
    failures += sentinel_failures(case, d)
    return {"case": case["case"], "results": results, "failures": failures}


def _endpoint(case: dict, d: Path, stack: contextlib.ExitStack) -> Callable[[], list[str]] | None:
    """For a received run.yaml naming an endpoint: a recording server put in its place; what was asked of it."""
    if not case.get("endpoint"):
        return None
    from hsstore.testing.hostile_http import HostileHTTPServer

    (d / "endpoint").mkdir(exist_ok=True)
    srv = stack.enter_context(HostileHTTPServer(str(d / "endpoint")))
    p = d / "run" / "run.yaml"
    p.write_text(p.read_text().replace("ENDPOINT", srv.url))
    return lambda: list(srv.paths)


def checks(name: str, case: dict, d: Path, rc: Any, got: Any, v: dict, m: dict, out: list[str]) -> list[str]:
    """The metadata oracles of one command's run."""
    fam = case["family"]
    failures = []
    printed = "\n".join(out)
    if any(ln.lstrip().startswith(MARK) for ln in printed.splitlines()):
        failures.append(f"{name}: a store string forged a line (its newline printed raw; escape missing)")
    served = served_by(name, case, d, rc, got, v)
    if fam in ("records", "columns", "assets", "journal") and served:
        failures += served_problems(name, served, v, m["digests"])
    if fam == "assets" and v["assets"] and name in ("train", "eval") and rc == 0:
        failures.append(f"{name}: served from a store verify refuses (its assets): exit 0")
    if name == "train_follow" and rc == 0:
        trained = sorted(sid for sid, _ in _logged(d / ("run" if fam == "journal" else "train"), epoch=0))
        held = sorted(v["holders"])
        if trained != held:
            failures.append(f"{name}: follow trained {len(trained)} samples ({len(set(trained))} distinct) in epoch 0, "
                            f"the store holds {len(held)}; exit 0")
    if rc == 0:
        folder = {"train": d / "train" / "drafter", "train_init": d / "train" / "drafter",
                  "train_follow": d / ("run" if fam == "journal" else "train") / "drafter",
                  "export_drafter": d / "exported", "train_config": d / "new" / "drafter",
                  "train_resume": d / "run" / "drafter"}.get(name)
        why = _not_finite_weights(folder) if folder is not None and folder.is_dir() else None
        if name == "eval" and out:
            why = _not_finite_numbers(out[0])
        if why:
            failures.append(f"{name}: non-finite values written or printed with exit 0 ({why})")
    return failures
