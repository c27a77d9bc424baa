"""Guards that no test held before issue #52 (item 7): each test here fails when its guard is switched off (how each
was checked is in docs/RELIABILITY.md, "Boundaries"), through the real commands where the guard sits behind one.

- the index's total cap (``door.INDEX_TOTAL_CAP``): segments each under their own cap, over it together;
- the tokenizer loader's ``trust_remote_code=False``: a model folder whose tokenizer names code beside it;
- the chunk cache's HMAC on the path that fetches chunks as bytes (compressed chunks);
- the re-read of a dead holder's lock before it is taken over;
- ``convert``'s and ``import``'s destination locks;
- fp8 statistics at extraction's call site (of the quantised values, not the features before);
- ``audit``'s relative-error bound;
- the door's size bound, on its own (not one fuzz case among thousands).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore.io import destination
from hsstore import StoreWriter
from hsstore.app.cli import main
from hsstore.extract.tiny import tiny_target_dir
from hsstore.format import codec

from conftest import make_manifest, make_samples, write_samples
from test_hostile_files import _cached_store, _fix_crc, cli, one_line, small
from test_hostile_limits import peak_bytes

SMALL = 64 << 20


# -- the index's total cap ----------------------------------------------------------------------------------------------
def test_index_segments_over_the_total_cap_together_are_never_read(tmp_path):
    """Three segments of 400 MiB (sparse), each within its own cap of 512 MiB, 1.2 GiB together: over the total
    cap the index is left aside before a byte of it is read, and the records are read instead."""
    url = small(tmp_path / "s", n=4)
    seg = next(Path(url, "index").iterdir())
    for i in range(3):
        name = Path(url, "index", f"{seg.name[:-12]}{i:08x}.idx")
        shutil.copy(seg, name)
        os.truncate(name, 400 << 20)
    seg.unlink()
    store, peak = peak_bytes(lambda: hsstore.open(url))
    assert isinstance(store, hsstore.Store) and len(store) == 4, store
    assert peak < SMALL, peak
    assert len(store.index_use.damaged) == 3
    assert all("exceed 1,073,741,824" in why for why in store.index_use.why.values()), store.index_use.why


# -- the tokenizer loader's trust_remote_code=False -----------------------------------------------------------------
EVIL = '''
import os
open(os.environ["HSSTORE_TEST_MARKER"], "w").write("the tokenizer's code ran")
from transformers import PreTrainedTokenizerFast


class EvilTokenizer(PreTrainedTokenizerFast):
    pass
'''


def test_a_tokenizer_naming_code_beside_it_never_runs_it(tmp_path):
    """A model folder whose tokenizer_config.json maps AutoTokenizer to a class in a .py file beside it: ``check``
    refuses the tokenizer in one line, and the file is never imported (with trust_remote_code=True it runs)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_target_dir(), model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "evil_tok.EvilTokenizer"]})
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    (model / "evil_tok.py").write_text(EVIL)
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Hi"},
                                                       {"role": "assistant", "content": "Hello."}]}) + "\n")
    marker = tmp_path / "ran"
    r = subprocess.run([sys.executable, "-m", "hsstore", "check", "--model", str(model), "--input", str(inp)],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                       env={**os.environ, "HSSTORE_TEST_MARKER": str(marker)})
    assert not marker.exists(), r.stderr[-2000:]
    assert r.returncode in (0, 1, 2) and "Traceback" not in r.stderr, r.stderr[-2000:]  # read as data, or refused


# -- the chunk cache's HMAC where chunks are fetched as bytes -------------------------------------------------------
def test_a_planted_cache_copy_is_never_served_where_chunks_are_fetched_whole(s3_store, tmp_path, monkeypatch):
    """As ``test_a_planted_cache_copy_with_a_matching_crc_is_never_served``, on the path that fetches a chunk as bytes
    and takes a cached copy through ``ChunkCache.get`` (compressed chunks): only the copy's HMAC tells it from the
    cache's own, its CRC32C being the record's."""
    store, cache = _cached_store(s3_store, tmp_path, codec="zstd")
    first = store.read(0)["hidden_states"].clone()
    copies = [p for p in Path(cache.root).rglob("*") if p.is_file() and "/layer_001/" in str(p)]
    assert copies
    for p in copies:
        body, mac = p.read_bytes()[:-32], p.read_bytes()[-32:]
        payload, tail = bytearray(body[:-4]), body[-4:]
        payload[:16] = bytes(range(16))
        payload[16:20] = _fix_crc(bytes(payload), 16, int.from_bytes(tail, "little"))
        assert codec.crc32c(bytes(payload)) == int.from_bytes(tail, "little")
        p.write_bytes(bytes(payload) + tail + mac)
    hits, misses = cache.hits, cache.misses
    again = store.read(0)["hidden_states"]
    assert bool((again == first).all()) and cache.misses > misses, (cache.hits - hits, cache.misses - misses)
    assert all(p.read_bytes()[:16] != bytes(range(16)) for p in copies if p.exists())


# -- the re-read before a lock take-over ----------------------------------------------------------------------------
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_lock_taken_over_meanwhile_is_not_taken_again(tmp_path, monkeypatch, capsys):
    """``subset`` finds DST's lock held, reads it as a dead process's (as it was when it looked), but by the time it
    may take it over another job has done so and holds it (alive): the re-read sees the new holder, and ``subset``
    is refused in one line; the live job's lock is left as it was."""
    src = small(tmp_path / "s", n=4)
    dst = tmp_path / "dst"
    fs, root = hsstore.io.storage.resolve(str(dst))
    host = os.uname().nodename
    dead = {"host": host, "pid": _dead_pid(), "token": "deadbeef", "command": "subset"}
    live = {"host": host, "pid": os.getpid(), "token": "cafef00d", "command": "merge"}
    assert destination.create_exclusive(fs, f"{root}/locks/write.lock", json.dumps(live).encode(), root)
    real, reads = destination._read_lock, []

    def stale_first(*a):  # its first look: the lock as the dead holder left it, before the live job took it over
        reads.append(1)
        return dict(dead) if len(reads) == 1 else real(*a)

    monkeypatch.setattr(destination, "_read_lock", stale_first)
    rc = main(["subset", src, str(dst), "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and "another `hsstore merge` is writing into" in err, err
    assert json.loads((dst / "locks" / "write.lock").read_text()) == live
    assert not (dst / "manifest.json").exists()


# -- convert's and import's destination locks ---------------------------------------------------------------------
@pytest.fixture
def held_destination(tmp_path):
    """DST whose lock a live job of this machine holds (a sleeping process)."""
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    dst = tmp_path / "dst"
    fs, root = hsstore.io.storage.resolve(str(dst))
    lock = {"host": os.uname().nodename, "pid": job.pid, "token": "0123abcd", "command": "subset"}
    assert destination.create_exclusive(fs, f"{root}/locks/write.lock", json.dumps(lock).encode(), root)
    yield dst
    job.kill()
    job.wait()


def test_convert_waits_for_no_one_into_a_destination_another_job_writes(tmp_path, held_destination):
    src = small(tmp_path / "s", n=4)
    one_line(cli("convert", src, held_destination, "--layout", "wds", "-q"), "is writing into", "locks/write.lock")
    assert sorted(os.listdir(held_destination)) == ["locks"]


def test_import_waits_for_no_one_into_a_destination_another_job_writes(tmp_path, held_destination):
    from test_hostile_inputs import IDENTITY, specforge_folder

    folder = specforge_folder(tmp_path / "sf")
    one_line(cli("import", "specforge", folder, "--out", held_destination, *IDENTITY), "is writing into",
             "locks/write.lock")
    assert sorted(os.listdir(held_destination)) == ["locks"]


# -- fp8 statistics at extraction's call site -----------------------------------------------------------------------
def test_an_fp8_extraction_records_the_statistics_of_what_it_stores(tmp_path, small_input):
    """A target whose residual stream carries one large channel (the tiny target, its embedding's channel 0 set to
    3,000): every token's scale is large, and its small entries store as e4m3 zeros. The records' statistics must
    count those zeros (taken after quantising), or ``verify`` fails the store it wrote."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "loud"
    shutil.copytree(tiny_target_dir(), model)
    weights = load_file(str(model / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"].clone()
    embed[:, 0] = 3000.0
    weights["model.embed_tokens.weight"] = embed
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "fp8"
    assert main(["extract", "--model", str(model), "--input", str(small_input), "--out", str(out), "--device", "cpu",
                 "--layers", "1,4", "--encoding", "fp8", "-q"]) == 0
    store = hsstore.open(str(out))
    zeros = sum(int(z) for rec in store.commits for e in rec.stats["features"].values() for z in e["sample_zeros"])
    assert zeros > 0  # what the store holds has zeros: statistics of the features before quantising count none
    assert main(["verify", str(out), "-q"]) == 0


@pytest.fixture
def small_input(tmp_path):
    from hsstore.extract.tiny import demo_conversations_path

    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:4]) + "\n")
    return path


# -- audit's relative-error bound -----------------------------------------------------------------------------------
def test_audit_fails_features_of_the_right_direction_and_the_wrong_size(tmp_path, small_input, capsys):
    """Every feature of layer 4 stored at (1 + 2 x the bound's relative error) times its value: cosine 1 with the
    recomputed one, relative error twice the bound. Only the relative-error bound tells it from the target's."""
    from hsstore.extract.compare import bound_of
    from hsstore.extract.job import ExtractSettings, run_extract
    from hsstore.app.schema import build

    base = str(tmp_path / "base")
    run_extract(build(ExtractSettings, model=str(tiny_target_dir()), input=[str(small_input)], out=base,
                      device="cpu", dtype="float32", layers=[1, 4], progress=False))
    src = hsstore.open(base)
    factor = 1 + 2 * bound_of(src.manifest.dtype, src.manifest.encoding).rel_err
    url = str(tmp_path / "scaled")
    with StoreWriter(url, src.manifest) as w:
        for i in range(len(src)):
            item = src.read(i)
            hs = item["hidden_states"].clone()
            hs[:, 1] *= factor
            w.add(item["sample_id"], item["input_ids"], item["loss_mask"], hs)
    capsys.readouterr()
    rc = main(["audit", url, "--model", str(tiny_target_dir()), "--device", "cpu", "--samples", str(len(src)),
               "--json", "-q"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and not report["ok"], report
    assert report["features"]["layer 1"]["ok"]
    bad = report["features"]["layer 4"]
    assert not bad["ok"] and bad["min_cosine"] > 0.9999, bad
    assert bad["max_rel_err"] == pytest.approx(factor - 1, rel=0.05), bad


# -- the door's size bound -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("what,bound", [("manifest.json", "1,048,576"), ("commit record", "268,435,456")])
def test_an_object_over_its_bound_is_refused_unread(tmp_path, what, bound):
    """A store file larger than the door allows its kind (a sparse 2 GiB manifest.json, a 300 MiB commit record
    with the index set aside): one line naming it and the bound, nothing of it read (small memory)."""
    url = small(tmp_path / "s", n=4)
    shutil.rmtree(Path(url, "index"))
    target = (Path(url, "manifest.json") if what == "manifest.json"
              else next(Path(url, "commits").iterdir()))
    os.truncate(target, (2 << 30) if what == "manifest.json" else (300 << 20))
    for command in (["info", url], ["verify", url, "-q"]):
        r = subprocess.run([sys.executable, "-c", PEAK, *command], capture_output=True, text=True, timeout=120)
        line = one_line(r, target.name, f"larger than its bound of {bound}")
        assert "refused" in line
        peak = int(r.stdout.rsplit("PEAK_MB", 1)[1].split()[0])
        assert peak < 400, peak  # a plain `info` takes ~150 MB; reading the object would add its size


PEAK = ("import sys\nfrom hsstore.app.cli import main\nrc = main(sys.argv[1:])\n"
        "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0].split()[1]\n"
        "print('PEAK_MB', int(hwm) // 1024)\nsys.exit(rc)\n")
