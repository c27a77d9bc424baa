"""Forge stores at random and run every reading command on each (issue #36): ``python -m tools.fuzz_store
--cases N [--seed S] [--work DIR] [--json] [--families store,http,s3,engine,drafter,run,peer,config] [--jobs J]``
(the families beyond a store's files, issue #52: ``tools/fuzz_boundaries.py``; those of a store's and a run's
metadata, ``records,columns,writers,journal,assets,weights,received``: ``tools/fuzz_metadata.py``).

Each case starts from a copy of a small valid store (zarr or wds, with assets) and applies one to three
mutators from ``MUTATORS``: fields of the manifest, commit records, zarr.json, asset and index files set to hostile
values (bools for integers, huge or negative numbers, deep nesting, thousands of digits, control characters);
files replaced by links (to a sentinel tree outside, to ``/dev/zero``, to an outside copy) or FIFOs; sparse huge
files; flipped bytes; forged tar headers and index segments. Then ``info``, ``info --json``, ``verify``,
``show``, ``subset``, ``convert``, ``export``, ``report`` and one loader epoch run on it, in a driver process
(``--driver``), each under an alarm, with its stdout/stderr captured at the descriptor.

What a case must give, else it is counted as a failure of its kind:
- no traceback: a command returns (0 or a one-line error, exit 1 for verify's FAIL) and never raises;
- no hang: each command ends within ``COMMAND_S`` seconds;
- bounded memory: the driver's peak resident set grows by at most ``MEMORY_MB`` over its baseline;
- no escape: no byte of the sentinel tree outside the store changes, and nothing a command prints holds an
  escape or bell character from the store;
- the original bits or a refusal: every sample a loader epoch yields, and every sample ``subset`` and
  ``convert`` write, is bit for bit a sample of the original store, whatever id a forged record gives it (a
  mutation that re-binds checksums to other data is never made, so other bits are always a failure).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from tools.fuzz_metadata import METADATA
from tools.fuzz_oracles import (COMMAND_S, HOSTILE, PASSWD, guard_forging, item_digest, run_command, set_random,
                                 tree_digest)





# -- base stores ------------------------------------------------------------------------------------------------
def make_base(work: Path) -> dict[str, Any]:
    """Two small valid stores (zarr, wds) with the tiny target's tokenizer and config as assets, and the digest of
    every sample's bits."""
    import torch

    import hsstore
    from hsstore.io import storage
    from hsstore.extract.tiny import tiny_target_dir
    from hsstore.format.assets import write_assets
    from hsstore.format.manifest import Manifest, TargetIdentity, TokenizerIdentity

    tiny = Path(tiny_target_dir())
    assets = {f"tokenizer/{p.name}": p.read_bytes() for p in tiny.iterdir()
              if p.name.startswith(("tokenizer", "special_tokens", "chat_template"))}
    assets["config.json"] = (tiny / "config.json").read_bytes()
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(8):
        T = int(torch.randint(5, 90, (1,), generator=g))
        samples.append((f"s{i}", torch.randint(0, 500, (T,), generator=g), torch.rand(T, generator=g) > 0.4,
                        (torch.randn(T, 3, 48, generator=g) * 3).to(torch.bfloat16)))
    digests = {}
    for layout in ("zarr", "wds"):
        m = Manifest(target=TargetIdentity(name="tiny-target", num_layers=8, hidden_size=48, config_hash="cfg",
                                           model_type="qwen3_5_text"),
                     tokenizer=TokenizerIdentity(name="tiny-tok", vocab_hash="vocab", chat_template_hash="tmpl"),
                     layers=(1, 3, 5), dtype="bfloat16", layout=layout, chunk_tokens=64)
        url = str(work / f"base-{layout}")
        with hsstore.StoreWriter(url, m, shard_bytes=250 * 3 * 48 * 2) as w:
            for sid, ids, mask, feats in samples:
                w.add(sid, ids, mask, feats, source="fuzz", flags=["ok"])
        fs, root = storage.resolve(url)
        write_assets(fs, root, assets)
        store = hsstore.open(url)
        digests = {store.ref(i).sample_id: item_digest(store.read(i)) for i in range(len(store))}
    return {"zarr": str(work / "base-zarr"), "wds": str(work / "base-wds"), "digests": digests}




# -- mutators: each changes one thing of a store and says what ---------------------------------------------------
def _json_files(store: Path, pattern: str) -> list[Path]:
    return sorted(p for p in store.glob(pattern) if p.is_file() and not p.is_symlink() and p.stat().st_size < 16 << 20)


def _drop_index(store: Path) -> None:
    shutil.rmtree(store / "index", ignore_errors=True)  # so records are read from commits/, as forged


def m_json_field(rng, store: Path, sentinel: Path) -> str:
    """A field of the manifest, a commit record, a zarr.json or the asset index set to a hostile value (the
    record's listing of a zarr.json updated, so its checksum holds)."""
    files = (_json_files(store, "manifest.json") + _json_files(store, "commits/*.json")
             + _json_files(store, "shards/*/*/zarr.json") + _json_files(store, "assets/index.json"))
    p = rng.choice(files)
    doc = json.loads(p.read_text())
    where = set_random(rng, doc, rng.choice(HOSTILE))
    data = json.dumps(doc).encode()
    p.write_bytes(data)
    _relist(store, p)
    _drop_index(store)
    return f"json field {p.relative_to(store)}:{where}"


def _relist(store: Path, p: Path) -> None:
    """List ``p`` in its commit record with its new size and CRC32C (a forger's valid checksums)."""
    from hsstore.format import codec

    key = str(p.relative_to(store))
    for rp in _json_files(store, "commits/*.json"):
        try:
            rec = json.loads(rp.read_text())
            if isinstance(rec.get("files"), dict) and key in rec["files"]:
                rec["files"][key] = {"size": p.stat().st_size, "crc32c": codec.crc32c(p.read_bytes())}
                rp.write_text(json.dumps(rec))
        except (ValueError, AttributeError, TypeError, RecursionError):
            pass


def m_odd_json(rng, store: Path, sentinel: Path) -> str:
    """A JSON file replaced by deep nesting, thousands of digits, invalid UTF-8, NaN, or not JSON at all."""
    p = rng.choice(_json_files(store, "manifest.json") + _json_files(store, "commits/*.json")
                   + _json_files(store, "assets/index.json") + _json_files(store, "shards/*/*/zarr.json"))
    kind = rng.choice(["deep", "digits", "utf8", "nan", "junk", "empty", "big"])
    body = {"deep": b"[" * 300_000 + b"]" * 300_000, "digits": b'{"a": ' + b"7" * 20000 + b"}",
            "utf8": b'{"a": "\xff\xfe"}', "nan": b'{"a": NaN, "b": Infinity}', "junk": os.urandom(64),
            "empty": b"", "big": b'{"a": "' + b"x" * (3 << 20) + b'"}'}[kind]
    p.write_bytes(body)
    _relist(store, p)
    _drop_index(store)
    return f"odd json ({kind}) {p.relative_to(store)}"


def _any_file(rng, store: Path) -> Path:
    files = [p for p in store.rglob("*") if p.is_file() and not p.is_symlink() and ".tmp-" not in p.name
             and p.stat().st_size < 16 << 20]
    return rng.choice(files)


def m_link(rng, store: Path, sentinel: Path) -> str:
    """A file or folder replaced by a link: to a sentinel file, to /dev/zero, to an outside copy of itself."""
    p = _any_file(rng, store)
    if rng.random() < 0.3 and p.parent != store and all(
            f.is_symlink() or not f.is_file() or f.stat().st_size < 16 << 20 for f in p.parent.rglob("*")):
        p = p.parent  # a folder (never one holding a huge sparse file: its copy would fill the disk)
    outside = sentinel / "copy" / p.relative_to(store)
    outside.parent.mkdir(parents=True, exist_ok=True)
    if not outside.exists():
        shutil.copytree(p, outside) if p.is_dir() else shutil.copy2(p, outside)
    target = rng.choice([outside, sentinel / "secret", Path("/dev/zero"), sentinel / "passwd"])
    shutil.rmtree(p) if p.is_dir() else p.unlink()
    os.symlink(target, p)
    return f"link {p.relative_to(store)} -> {target}"


def m_fifo(rng, store: Path, sentinel: Path) -> str:
    p = _any_file(rng, store)
    p.unlink()
    os.mkfifo(p)
    return f"fifo {p.relative_to(store)}"


def m_huge(rng, store: Path, sentinel: Path) -> str:
    """A file made huge and sparse (its listing in the record updated, or not)."""
    p = _any_file(rng, store)
    os.truncate(p, rng.choice([3 << 30, 48 << 30, 1 << 40]))
    if rng.random() < 0.5:
        for rp in _json_files(store, "commits/*.json"):
            try:
                rec = json.loads(rp.read_text())
                key = str(p.relative_to(store))
                if key in rec.get("files", {}):
                    rec["files"][key]["size"] = p.stat().st_size
                    rp.write_text(json.dumps(rec))
            except (ValueError, AttributeError, TypeError, RecursionError):
                pass
        _drop_index(store)
    return f"huge {p.relative_to(store)}"


def m_flip(rng, store: Path, sentinel: Path) -> str:
    """Bytes of a data file flipped (its checksums left as they were: reads must refuse it)."""
    files = [p for p in store.rglob("*") if p.is_file() and not p.is_symlink() and 0 < p.stat().st_size < 16 << 20
             and ("/c/" in str(p) or p.suffix == ".tar")]
    p = rng.choice(files)
    data = bytearray(p.read_bytes())
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    p.write_bytes(bytes(data))
    return f"flip {p.relative_to(store)}"


def m_strings(rng, store: Path, sentinel: Path) -> str:
    """Sample ids, sources and flags of a record set to strings that drive a terminal."""
    rp = rng.choice(_json_files(store, "commits/*.json"))
    rec = json.loads(rp.read_text())
    col = rng.choice(["sample_id", "source", "flags"])
    evil = "x\nverify fake: OK (0 problems)\x1b]0;pwned\x07\x1b[2J"
    rec["samples"][col] = [[evil] if col == "flags" else f"{evil}{i}" for i in range(rec["n_samples"])]
    rp.write_text(json.dumps(rec))
    _drop_index(store)
    return f"strings {col} in {rp.relative_to(store)}"


def m_tar_header(rng, store: Path, sentinel: Path) -> str:
    """A wds member's tar header size field (and the record's member entry) forged to gigabytes."""
    tars = [p for p in store.glob("shards/*.tar") if p.is_file() and not p.is_symlink() and p.stat().st_size < 16 << 20]
    if not tars:
        return m_json_field(rng, store, sentinel)
    tar = rng.choice(tars)
    data = bytearray(tar.read_bytes())
    at = rng.randrange(0, max(1, len(data) // 512)) * 512
    size = rng.choice([3 << 30, 48 << 30])
    data[at + 124:at + 136] = f"{size:011o}\0".encode()
    tar.write_bytes(bytes(data))
    return f"tar header at {at} of {tar.relative_to(store)}"


def m_segment(rng, store: Path, sentinel: Path) -> str:
    """An index segment's header field set to a hostile value, its CRC fixed."""
    import struct

    from hsstore.format import codec, index

    segs = [p for p in store.glob("index/*") if p.is_file() and not p.is_symlink()]
    if not segs:
        return m_flip(rng, store, sentinel)
    p = rng.choice(segs)
    data = p.read_bytes()
    if not data.startswith(index.MAGIC):
        return m_flip(rng, store, sentinel)
    (hl,) = struct.unpack("<I", data[len(index.MAGIC):len(index.MAGIC) + 4])
    header = json.loads(data[len(index.MAGIC) + 4:len(index.MAGIC) + 4 + hl])
    where = set_random(rng, header, rng.choice(HOSTILE))
    hb = json.dumps(header).encode()
    body = index.MAGIC + struct.pack("<I", len(hb)) + hb + data[len(index.MAGIC) + 4 + hl:-4]
    p.write_bytes(body + struct.pack("<I", codec.crc32c(body)))
    return f"segment {p.relative_to(store)}:{where}"


MUTATORS: dict[str, Callable] = {"json_field": m_json_field, "odd_json": m_odd_json, "link": m_link, "fifo": m_fifo,
                                 "huge": m_huge, "flip": m_flip, "strings": m_strings, "tar_header": m_tar_header,
                                 "segment": m_segment}


def _apply(name: str, rng, store: Path, sentinel: Path) -> str:
    """One mutator; one that finds nothing it can parse to change (an earlier one broke it) says so."""
    try:
        return MUTATORS[name](rng, store, sentinel)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError, OSError) as e:
        return f"{name}: nothing to change ({type(e).__name__})"


FAMILIES = ("store", "http", "s3", "engine", "drafter", "run", "peer", "config", *METADATA)  # store: this module's;
# the rest: tools/fuzz_boundaries.py (the metadata families: tools/fuzz_metadata.py)


def forge(base: dict, work: Path, case: int, seed: int, families: tuple[str, ...] = ("store",)) -> dict:
    rng = random.Random(seed * 1_000_003 + case)
    d = work / f"case{case:05d}"
    family = families[0] if len(families) == 1 else random.Random(f"{seed}-{case}").choice(families)
    if family != "store":
        from tools import fuzz_boundaries

        d.mkdir(parents=True)
        return {"case": case, "dir": str(d), **fuzz_boundaries.forge(family, rng, base["boundaries"], d)}
    layout = rng.choice(["zarr", "wds"])
    store, sentinel = d / "store", d / "sentinel"
    shutil.copytree(base[layout], store, symlinks=True)
    sentinel.mkdir(parents=True)
    (sentinel / "secret").write_bytes(b"sentinel: never read into a store, never written\n" * 100)
    (sentinel / "passwd").write_bytes(PASSWD)  # what a link "to /etc/passwd" points at
    done = [_apply(name, rng, store, sentinel) for name in rng.sample(sorted(MUTATORS), rng.randint(1, 3))]
    return {"case": case, "dir": str(d), "layout": layout, "mutations": done, "sentinel": tree_digest(sentinel)}


# -- the driver: every command on each case, in one process ---------------------------------------------------------
def _epoch(url: str) -> dict[str, str]:
    import hsstore

    ds = hsstore.HiddenStateDataset(url, planning=hsstore.Planning(shuffle=False),
                                    reading=hsstore.Reading(prefetch=1))
    return {item["sample_id"]: item_digest(item) for item in ds}


def _written(url: str) -> dict[str, str]:
    import hsstore

    if not Path(url, "manifest.json").exists():
        return {}
    store = hsstore.open(url)
    return {store.ref(i).sample_id: item_digest(store.read(i)) for i in range(len(store))}


def drive(case: dict, digests: dict[str, str]) -> dict:
    """Run every command on one forged store; what each gave and which oracles it broke."""
    from hsstore.app.cli import main

    d = Path(case["dir"])
    url = str(d / "store")
    other = "wds" if case["layout"] == "zarr" else "zarr"
    commands = {"info": ["info", url], "info_json": ["info", url, "--json"], "verify": ["verify", url, "-q"],
                "show": ["show", url, "0"], "subset": ["subset", url, str(d / "subset"), "-q"],
                "convert": ["convert", url, str(d / "convert"), "--layout", other, "-q"],
                "export": ["export", "specforge", url, str(d / "export"), "-q"],
                "report": ["report", url, "--out", str(d / "report.html")]}
    results, failures = {}, []
    known = set(digests.values())  # a sample's bits, whatever id a forged record gives it
    for name, argv in commands.items():
        results[name], problems, _ = run_command(name, lambda argv=argv: main(argv), log_dir=d)
        failures += problems
    results["epoch"], problems, got = run_command("epoch", lambda: _epoch(url), refusals_raise=True, log_dir=d)
    failures += problems
    if results["epoch"].get("rc") == 0:
        wrong = [sid for sid, dg in got.items() if dg not in known]
        if wrong:
            failures.append(f"epoch: other bits for {wrong[:3]}")
    for name in ("subset", "convert"):  # what they wrote: the original bits, never other ones
        try:
            wrong = [sid for sid, dg in _written(str(d / name)).items() if dg not in known]
        except Exception as e:  # noqa: BLE001 (a destination that cannot be read back is a failure too)
            wrong = [f"unreadable ({type(e).__name__}: {e})"]
        if wrong:
            failures.append(f"{name}: wrote other bits for {wrong[:3]}")
    return {"case": case["case"], "results": results, "failures": failures}


def driver_main(cases_file: str) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(cases_file).read_text())
    out = []
    for c in spec["cases"]:
        if c.get("family", "store") == "store":
            out.append(drive(c, spec["digests"]))
        else:
            from tools import fuzz_boundaries

            out.append(fuzz_boundaries.drive(c, spec["boundaries"]))
    Path(cases_file).with_suffix(".out.json").write_text(json.dumps(out))


# -- the run ------------------------------------------------------------------------------------------------------
DRIVER_AS = 8 << 30  # the driver's address space (torch and the commands need ~1 GB)


def _cap_forging_memory() -> None:
    """The command's own process forges every case: a forger that reads what a mutation planted (a link to
    /dev/zero) must fail as a MemoryError the forge names, not take the machine's memory. Only the command's
    process: ``run`` called in a test process must leave that process's limits alone."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    cap = DRIVER_AS if hard == resource.RLIM_INFINITY else min(DRIVER_AS, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def _cap_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (DRIVER_AS, DRIVER_AS))
def _kind(failure: str) -> str:
    """The count a failure adds to (a read outside first: its paths name the sentinel it read)."""
    return ("outside" if failure.startswith(("read outside", "asked", "fetched")) or "outside the store" in failure
            else "escapes" if "escape" in failure or "sentinel" in failure or "code ran" in failure else
            "hangs" if ": hang (" in failure else "memory" if ": memory +" in failure else
            "other_bits" if "bits" in failure else "served_refused" if ": served from " in failure else
            "follow" if ": follow trained " in failure else "values" if ": non-finite values" in failure
            else "tracebacks")


def run(cases: int, seed: int = 0, work: str | None = None, per_driver: int = 25,
        families: tuple[str, ...] = ("store",), jobs: int = 1, only: list[int] | None = None) -> dict:
    """Forge ``cases`` inputs of ``families``, drive the commands on each (``per_driver`` cases per driver process,
    ``jobs`` drivers at a time), check the sentinel trees; the counts and every failure. ``only``: just these case
    numbers of the run ``cases`` and ``seed`` name (a case is forged from the seed and its number alone, so a case
    a run reported is forged again bit for bit: how a failure is looked at alone)."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    own = work is None
    w = Path(work or tempfile.mkdtemp(prefix="hsstore-fuzz-"))
    w.mkdir(parents=True, exist_ok=True)
    guard_forging(w)
    t0 = time.perf_counter()
    base = make_base(w)
    if set(families) - {"store"}:
        from tools import fuzz_boundaries

        base["boundaries"] = fuzz_boundaries.make_base(w, base["zarr"], families)
    base_digest = {k: tree_digest(Path(base[k])) for k in ("zarr", "wds")}
    totals = {"cases": 0, "commands": 0, "refused": 0, "tracebacks": 0, "hangs": 0, "memory": 0, "escapes": 0,
              "other_bits": 0, "outside": 0, "served_refused": 0, "follow": 0, "values": 0, "over_1gib": 0,
              "max_mb": 0.0, "max_peak_mb": 0.0, "max_s": 0.0, "max_cpu_s": 0.0, "by_family": {}}
    failures = []

    def drive_batch(batch: list[dict], spec: Path) -> list[dict]:
        spec.write_text(json.dumps({"cases": batch, "digests": base["digests"],
                                    "boundaries": base.get("boundaries")}))
        budget = (COMMAND_S * 10 + 30) * len(batch)
        try:  # the driver's address space capped: a guard that fails is a MemoryError, not a machine out of memory
            subprocess.run([sys.executable, "-m", "tools.fuzz_store", "--driver", str(spec)], timeout=budget,
                           cwd=Path(__file__).resolve().parents[1], check=False, preexec_fn=_cap_memory)
            return json.loads(spec.with_suffix(".out.json").read_text())
        except (subprocess.TimeoutExpired, FileNotFoundError, ValueError) as e:
            return [{"case": c["case"], "results": {}, "failures": [f"driver: {type(e).__name__}"]} for c in batch]

    def tally(batch: list[dict], outs: list[dict]) -> None:
        for c, o in zip(batch, outs):
            totals["cases"] += 1
            fam = totals["by_family"].setdefault(c.get("family", "store"), {"cases": 0, "commands": 0, "refused": 0})
            fam["cases"] += 1
            if tree_digest(Path(c["dir"]) / "sentinel") != c["sentinel"] and "sentinel tree changed" not in o["failures"]:
                o["failures"].append("sentinel tree changed")
            for r in o["results"].values():
                totals["commands"] += 1
                fam["commands"] += 1
                refused = r.get("rc") not in (0, None)
                totals["refused"] += refused
                fam["refused"] += refused
                totals["over_1gib"] += r.get("peak_mb", 0) > 1024
                totals["max_mb"] = max(totals["max_mb"], r["mb"])
                totals["max_peak_mb"] = max(totals["max_peak_mb"], r.get("peak_mb", 0))
                totals["max_s"] = max(totals["max_s"], r["s"])
                totals["max_cpu_s"] = max(totals["max_cpu_s"], r.get("cpu_s", 0.0))
            for f in o["failures"]:
                totals[_kind(f)] += 1
                failures.append({"case": c["case"], "family": c.get("family", "store"), "mutations": c["mutations"],
                                 "failure": f})
            if not o["failures"]:
                shutil.rmtree(c["dir"], ignore_errors=True)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        pending = {}
        numbers = sorted(set(only)) if only else list(range(cases))
        for start in range(0, len(numbers), per_driver):
            batch = [forge(base, w, c, seed, families) for c in numbers[start:start + per_driver]]
            pending[pool.submit(drive_batch, batch, w / f"batch{start:05d}.json")] = batch
            while len(pending) >= max(1, jobs):
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    tally(pending.pop(fut), fut.result())
        for fut in list(pending):
            tally(pending.pop(fut), fut.result())
    for k in ("zarr", "wds"):
        if tree_digest(Path(base[k])) != base_digest[k]:
            failures.append({"case": -1, "mutations": [], "failure": f"base {k} store changed"})
            totals["escapes"] += 1
    totals["seconds"] = round(time.perf_counter() - t0, 1)
    if own and not failures:
        shutil.rmtree(w, ignore_errors=True)
    return {"totals": totals, "failures": failures, "work": str(w)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.fuzz_store", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--cases", type=int, default=200, help="stores to forge")
    p.add_argument("--seed", type=int, default=0, help="the run's seed (a case is seed and number)")
    p.add_argument("--work", default=None, help="folder for the cases (kept when a case fails)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--families", default="store", help=f"comma-separated, of {','.join(FAMILIES)} (default store)")
    p.add_argument("--jobs", type=int, default=1, help="driver processes at a time")
    p.add_argument("--only", default=None, help="comma-separated case numbers: forge and drive just these")
    p.add_argument("--driver", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.driver:
        driver_main(args.driver)
        return 0
    families = tuple(f.strip() for f in args.families.split(",") if f.strip())
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown or not families:
        p.error(f"unknown families {unknown} (known: {', '.join(FAMILIES)})")
    only = [int(x) for x in args.only.split(",") if x.strip()] if args.only else None
    _cap_forging_memory()
    result = run(args.cases, args.seed, args.work, families=families, jobs=args.jobs, only=only)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        t = result["totals"]
        print(f"fuzz_store: {t['cases']} cases, {t['commands']} commands ({t['refused']} refused) in {t['seconds']} s; "
              f"tracebacks {t['tracebacks']}, hangs {t['hangs']}, memory {t['memory']}, escapes {t['escapes']}, "
              f"other bits {t['other_bits']}, read outside {t['outside']}, samples served from shards verify refuses "
              f"{t['served_refused']}, follow trained other than held {t['follow']}, non-finite values "
              f"{t['values']}; slowest command {t['max_s']} s (most CPU {t['max_cpu_s']} s), most "
              f"memory +{t['max_mb']} MB (peak {t['max_peak_mb']} MB; {t['over_1gib']} commands over 1 GiB)")
        for fam, f in sorted(t["by_family"].items()):
            print(f"  {fam}: {f['cases']} cases, {f['commands']} commands, {f['refused']} refused")
        for f in result["failures"][:50]:
            print(f"  case {f['case']} {f['mutations']}: {f['failure']}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
