"""A short fixed-seed run of the store fuzzer (``tools/fuzz_store.py``; issue #36): forged stores of every kind of
mutation, every reading command on each, no traceback, hang, memory blow-up, escape or other bits; and of the
boundaries beyond a store's files (``tools/fuzz_boundaries.py``; issue #52): hostile HTTP and S3 endpoints, engine
answers, drafter, run and peer folders, config files, nothing read outside what a command was given; and of a store's
and a run's metadata (``tools/fuzz_metadata.py``): no sample served from a shard ``verify`` refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import fuzz_oracles, fuzz_store


def test_every_mutator_forges_something(tmp_path):
    """Each mutator changes the store it is given (a mutator that silently did nothing would fuzz nothing)."""
    import random

    base = fuzz_store.make_base(tmp_path)
    for name, mutate in sorted(fuzz_store.MUTATORS.items()):
        for layout in ("zarr", "wds"):
            store, sentinel = tmp_path / f"{name}-{layout}", tmp_path / f"sentinel-{name}-{layout}"
            import shutil

            shutil.copytree(base[layout], store, symlinks=True)
            sentinel.mkdir()
            (sentinel / "secret").write_bytes(b"s")
            before = fuzz_store.tree_digest(store)
            said = mutate(random.Random(7), store, sentinel)
            assert fuzz_store.tree_digest(store) != before, (name, layout, said)


@pytest.mark.slow
def test_a_short_fuzz_run_finds_nothing(tmp_path):
    import resource

    before = resource.getrlimit(resource.RLIMIT_AS)
    result = fuzz_store.run(cases=40, seed=36, work=str(tmp_path / "fuzz"))
    assert resource.getrlimit(resource.RLIMIT_AS) == before  # the command caps its own process, not a caller's
    t = result["totals"]
    assert t["cases"] == 40 and t["commands"] == 40 * 9
    assert t["refused"] > 0  # the forgeries were refused, not silently read
    assert not result["failures"], result["failures"][:10]


def test_a_short_fuzz_run_of_every_boundary_finds_nothing(tmp_path):
    from tools import fuzz_boundaries

    result = fuzz_store.run(cases=28, seed=52, work=str(tmp_path / "fuzz"), families=fuzz_boundaries.FAMILIES, jobs=2)
    t = result["totals"]
    assert t["cases"] == 28 and set(t["by_family"]) == set(fuzz_boundaries.FAMILIES), t["by_family"]
    assert t["refused"] > 0
    assert not result["failures"], result["failures"][:10]


# -- the metadata families (tools/fuzz_metadata.py): their oracles, their forgers, a short run ---------------------------
def _store_with_a_refused_shard(tmp_path):
    """A small store whose first record's sample boundaries are shifted (``verify`` refuses that shard alone), the
    original bits of every sample, and (the refused shard's ids, an accepted shard's ids)."""
    import json

    import hsstore
    from hsstore.testing.stores import make_manifest, make_samples, write_samples

    url = str(tmp_path / "s")
    write_samples(url, make_manifest(), make_samples(12, min_len=20, max_len=60), shard_bytes=3 * 48 * 2 * 150)
    store = hsstore.open(url)
    digests = {store.ref(i).sample_id: fuzz_oracles.item_digest(store.read(i)) for i in range(len(store))}
    first, second = sorted((tmp_path / "s" / "commits").glob("*.json"))[:2]
    d = json.loads(first.read_text())
    d["samples"]["length"][0] += 3
    d["samples"]["length"][1] -= 3
    first.write_text(json.dumps(d))
    return url, digests, d["samples"]["sample_id"], json.loads(second.read_text())["samples"]["sample_id"]


def test_the_served_oracle_names_what_a_refused_shard_served(tmp_path):
    """The oracle can fail: ``verify``'s verdict refuses exactly the shard whose boundaries moved; a sample of it
    served is named, as is an id no record holds, other bits under an id, and anything of a store refused whole;
    a sample of an accepted shard with its own bits is not."""
    import json

    from tools import fuzz_metadata

    url, digests, refused_ids, accepted_ids = _store_with_a_refused_shard(tmp_path)
    v = fuzz_metadata.verdict(url)
    assert not v["whole"] and len(v["refused"]) == 1 and v["refused"][0] in v["holders"][refused_ids[0]], v["refused"]
    ok = accepted_ids[0]
    assert fuzz_metadata.served_problems("epoch", [(ok, digests[ok])], v, digests) == []
    for served, words in (([(refused_ids[1], None)], "served from a shard verify refuses"),
                          ([("not-an-id", None)], "served from no shard"),
                          ([(ok, digests[refused_ids[0]])], "other bits")):
        (line,) = fuzz_metadata.served_problems("epoch", served, v, digests)
        assert words in line, line
        assert fuzz_store._kind(line) == ("other_bits" if words == "other bits" else "served_refused")
    rec = sorted(Path(url, "commits").glob("*.json"))[-1]  # an id held twice: a store-wide rule, the store refused whole
    d = json.loads(rec.read_text())
    d["samples"]["sample_id"][0] = ok
    rec.write_text(json.dumps(d))
    v = fuzz_metadata.verdict(url)
    assert "unique-ids" in v["whole"]
    (line,) = fuzz_metadata.served_problems("subset", [(accepted_ids[-1], None)], v, digests)
    assert "served from a store verify refuses" in line and fuzz_store._kind(line) == "served_refused"


def test_the_metadata_oracles_name_forged_lines_non_finite_drafters_and_a_short_follow(tmp_path):
    """A printed line that starts with the planted mark, a drafter written with NaN weights, and a ``train
    --follow`` that ends with exit 0 having trained other samples than the store holds are each a failure of its
    kind; the same runs without them are none."""
    import json

    import torch
    from safetensors.torch import save_file

    from tools import fuzz_metadata

    v = {"whole": "", "refused": [], "assets": False, "holders": {"a": ["s"], "b": ["s"]}}
    m = {"digests": {}}
    clean = fuzz_metadata.checks("info", {"family": "writers"}, tmp_path, 0, None, v, m, ["x\\nFORGED y\n", ""])
    assert clean == []
    (line,) = fuzz_metadata.checks("info", {"family": "writers"}, tmp_path, 0, None, v, m, ["x\nFORGED y\n", ""])
    assert fuzz_store._kind(line) == "escapes", line
    (tmp_path / "exported").mkdir()
    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "exported" / "model.safetensors"))
    assert fuzz_metadata.checks("export_drafter", {"family": "weights"}, tmp_path, 0, None, v, m, ["", ""]) == []
    save_file({"w": torch.full((2, 2), float("nan"))}, str(tmp_path / "exported" / "model.safetensors"))
    (line,) = fuzz_metadata.checks("export_drafter", {"family": "weights"}, tmp_path, 0, None, v, m, ["", ""])
    assert fuzz_store._kind(line) == "values", line
    assert fuzz_metadata.checks("export_drafter", {"family": "weights"}, tmp_path, 2, None, v, m, ["", ""]) == []
    (tmp_path / "train").mkdir()
    log = tmp_path / "train" / "samples.rank00000.jsonl"
    log.write_text(json.dumps({"step": 1, "epoch": 0, "samples": ["b", "a"]}) + "\n")
    assert fuzz_metadata.checks("train_follow", {"family": "writers"}, tmp_path, 0, None, v, m, ["", ""]) == []
    log.write_text(json.dumps({"step": 1, "epoch": 0, "samples": ["a"]}) + "\n")
    (line,) = fuzz_metadata.checks("train_follow", {"family": "writers"}, tmp_path, 0, None, v, m, ["", ""])
    assert fuzz_store._kind(line) == "follow", line
    assert fuzz_store._kind("read outside: ['/w/case00001/sentinel/private/shards/x/c/0']") == "outside"


@pytest.fixture(scope="module")
def metadata_base(tmp_path_factory):
    from tools import fuzz_boundaries, fuzz_metadata

    return fuzz_metadata.make_base(tmp_path_factory.mktemp("metadata"), fuzz_boundaries.FAST)


@pytest.mark.slow
def test_every_metadata_family_forges_something(metadata_base, tmp_path):
    """Each family changes the input it copies, case after case (a forger that did nothing would fuzz nothing)."""
    import random

    from tools import fuzz_boundaries, fuzz_metadata

    b = metadata_base
    inputs = {"journal": ("run/follow", Path(b["follow_run"]) / "follow"),
              "weights": ("drafter", Path(b["run"]) / "drafter"), "received": ("run", Path(b["run"]))}
    for family in fuzz_metadata.METADATA:
        for seed in range(4):
            d = tmp_path / f"{family}{seed}"
            d.mkdir()
            case = fuzz_boundaries.forge(family, random.Random(seed), {"metadata": b}, d)
            assert case["mutations"] and not any("forging stopped" in m for m in case["mutations"]), case["mutations"]
            mine, theirs = inputs.get(family, ("store", Path(b[case.get("layout", "zarr")])))
            assert fuzz_store.tree_digest(d / mine) != fuzz_store.tree_digest(theirs), (family, seed, case["mutations"])


@pytest.mark.slow
def test_a_short_fuzz_run_of_the_metadata_families_finds_nothing(tmp_path):
    from tools import fuzz_metadata

    result = fuzz_store.run(cases=21, seed=61, work=str(tmp_path / "fuzz"), families=fuzz_metadata.METADATA)
    t = result["totals"]
    assert t["cases"] == 21 and set(t["by_family"]) == set(fuzz_metadata.METADATA), t["by_family"]
    assert t["refused"] > 0
    assert not result["failures"], result["failures"][:10]


@pytest.mark.parametrize("caught", [Exception, BaseException])
def test_a_command_that_swallows_its_alarm_is_still_a_hang(monkeypatch, caught):
    """A command past its time is a hang even where its own handler catches the alarm and returns (a CLI turns an
    exception into exit 2 and one line; a swallowed alarm must not read as a refusal)."""
    import time

    monkeypatch.setattr(fuzz_oracles, "COMMAND_S", 1)

    def swallowing():
        try:
            time.sleep(5)
        except caught:  # noqa: BLE001 (what a command's handler might do)
            return 2
        return 0

    r, failures, _ = fuzz_oracles.run_command("slow", swallowing)
    assert any(": hang (" in f for f in failures), (r, failures)
    assert r["s"] < 4  # the alarm ended it


def test_a_forger_never_reads_a_link_an_earlier_mutation_planted(tmp_path):
    """A case's later mutation reads a file an earlier one turned into a link to /dev/zero: refused at once (read to
    its end, it filled the forging process's memory and the machine's)."""
    from tools import fuzz_metadata

    (tmp_path / "journal.json").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="not a plain JSON file"):
        fuzz_metadata.load_plain(tmp_path / "journal.json")


def test_the_forging_process_never_writes_through_a_link_it_planted(tmp_path):
    """Once ``guard_forging`` runs (the fuzzer's forging process), a file under the work folder is not opened for
    writing, appended to or truncated through a link (an earlier mutation's), while plain files there and reads
    through links still work: a forger's later mutation wrote an end record through a link to /etc/passwd. In a
    child process: the audit hook it installs is for the life of the process."""
    import subprocess
    import sys

    outside = tmp_path / "outside.txt"
    outside.write_text("the user's\n")
    work = tmp_path / "work"
    (work / "d").mkdir(parents=True)
    (work / "end.json").symlink_to(outside)
    (work / "linked").symlink_to(tmp_path)
    code = f"""
import os
from pathlib import Path
from tools.fuzz_oracles import guard_forging
w = Path({str(work)!r})
guard_forging(w)
(w / "d" / "plain.json").write_text("{{}}")
assert (w / "end.json").read_text() == "the user's\\n"
for attempt in (lambda: (w / "end.json").write_text("{{}}"), lambda: open(w / "end.json", "a").write("x"),
                lambda: os.truncate(w / "end.json", 0), lambda: (w / "linked" / "new.txt").write_text("x"),
                lambda: os.open(w / "end.json", os.O_WRONLY)):
    try:
        attempt()
    except PermissionError:
        continue
    raise SystemExit("written through a link")
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    assert outside.read_text() == "the user's\n" and not (tmp_path / "new.txt").exists()
