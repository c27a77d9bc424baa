"""Throughput of `hsstore import`, `merge --by copy` and `subset` against the raw cost of the same bytes, in one run.

    python -m tools.bench_share --size-mb 256 [--dir /tmp] [--rounds 2]

* import: SpecForge-layout files (one ``torch.save`` per sample) -> store, vs ``torch.load(weights_only=True)``
  of every file, and vs load + write of the features with an fsync per file (the least a durable importer does);
* merge by copy: the store's committed files copied and CRC-checked into a new store, vs ``shutil.copytree``
  of the same store and vs a copy with an fsync per file (the store's durability rule);
* subset (everything kept): samples decoded and re-written through the writer, vs the import.
Ratios, not absolute numbers: the machines are shared and noisy. Best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from hsstore.extract.peers import get
from hsstore.extract.peers.importing import import_files, peer_files
from hsstore.ops.bench import bench_manifest, pipe_fsync, synthetic_samples
from hsstore.ops.merge import merge
from hsstore.ops.subset import SampleFilter, subset
from tools.measure import timed


def load_and_write(files, out: Path) -> None:
    """The least a durable importer does: load each file, write its features to a file, fsync it."""
    out.mkdir()
    for i, f in enumerate(files):
        hs = torch.load(f.path, weights_only=True, mmap=True)["hidden_states"]
        pipe_fsync({str(out / f"{i}"): hs.contiguous().view(torch.int16).numpy().tobytes()})


def copy_fsync(src: Path, dst: Path) -> None:
    """A store's files copied one by one, each fsync'ed (the store's own durability rule)."""
    for p in src.rglob("*"):
        if p.is_file():
            (dst / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            pipe_fsync({str(dst / p.relative_to(src)): p.read_bytes()})


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default=None, help="scratch folder (default: the system's temp folder)")
    args = p.parse_args()
    manifest = bench_manifest(args.layers, args.hidden, "none")
    best = {k: float("inf") for k in ("load", "load_write", "import", "copytree", "copy_fsync", "merge", "subset")}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        samples = synthetic_samples(args.size_mb << 20, args.layers, args.hidden, mean_len=1024)
        nbytes = sum(s[3].numel() * 2 for s in samples)
        (root / "sf").mkdir()
        for i, (_, ids, mask, hs) in enumerate(samples):
            torch.save({"input_ids": ids, "loss_mask": mask.long(), "hidden_states": hs}, root / "sf" / f"data_{i}.ckpt")
        del samples
        files = peer_files(get("specforge"), str(root / "sf"), n_layers=args.layers, hidden=args.hidden)
        for r in range(args.rounds):
            for d in ("store", "copy", "copy2", "raw", "merged", "sub"):
                shutil.rmtree(root / d, ignore_errors=True)
            best["load"] = min(best["load"], timed(lambda: [torch.load(f.path, weights_only=True) for f in files]))
            best["load_write"] = min(best["load_write"], timed(lambda: load_and_write(files, root / "raw")))
            best["import"] = min(best["import"], timed(
                lambda: import_files(files, str(root / "store"), manifest, progress=False, shard_bytes=256 << 20)))
            best["copytree"] = min(best["copytree"], timed(lambda: shutil.copytree(root / "store", root / "copy")))
            best["copy_fsync"] = min(best["copy_fsync"], timed(lambda: copy_fsync(root / "store", root / "copy2")))
            best["merge"] = min(best["merge"], timed(
                lambda: merge(str(root / "merged"), [str(root / "store")], progress=False)))
            best["subset"] = min(best["subset"], timed(
                lambda: subset(str(root / "store"), str(root / "sub"), SampleFilter(), progress=False,
                               shard_bytes=256 << 20)))
    gb = nbytes / 1e9
    out = {k: round(gb / v, 3) for k, v in best.items()}
    out.update({"bytes": nbytes, "import_vs_load": round(best["load"] / best["import"], 3),
                "import_vs_load_write_fsync": round(best["load_write"] / best["import"], 3),
                "merge_vs_copytree": round(best["copytree"] / best["merge"], 3),
                "merge_vs_copy_fsync": round(best["copy_fsync"] / best["merge"], 3),
                "subset_vs_import": round(best["import"] / best["subset"], 3)})
    print(json.dumps({"gbps": {k: out[k] for k in best}, **{k: v for k, v in out.items() if k not in best}},
                     indent=2))


if __name__ == "__main__":
    main()
