"""A store from another team is untrusted input (issue 26): no URL secret is written down or printed, no sample is
stored twice, no allocation or decompression is sized by its metadata beyond what the manifest and records allow,
and a flipped byte is a ``CorruptionError`` on every read path. Hand-made hostile stores carry valid checksums:
only the forged field is wrong. (Names escaping the store: tests/test_security.py; destinations:
tests/test_destinations.py.)"""

from __future__ import annotations

import base64
import functools
import gzip
import http.server
import json
import os
import re
import struct
import subprocess
import sys
import threading
import tracemalloc
import uuid
import zlib
from pathlib import Path

import numcodecs
import numpy as np
import pytest
import s3fs

import hsstore
from hsstore.format import codec, commit, index
from hsstore.io import destination, storage
from hsstore.app.cli import main
from hsstore.errors import CorruptionError, StoreError
from hsstore.app.schema import build

from conftest import make_manifest, make_samples, write_samples
from train_helpers import FAST, small_input, store32  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[1]
USER, PASSWORD = "alice", "pw-Zq81-secret"
SMALL = 64 << 20  # what each hostile file may cost in Python allocations (tracemalloc peak), at most


def run(argv, capsys):
    """(exit status, stdout, stderr) of an ``hsstore`` command run in this process."""
    rc = main(argv)
    got = capsys.readouterr()
    return rc, got.out, got.err


def one_line_error(rc, err, *words):
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip() and "%|" not in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), lines[0]


def _status_bytes(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) << 10


def peak_bytes(fn):
    """(result or exception, the most memory ``fn`` held at once): the larger of the Python allocations' peak
    (tracemalloc: numpy, zlib and numcodecs buffers count, touched or not) and the growth of the process's peak
    resident memory, reset first (Linux ``clear_refs``; torch's allocator is invisible to tracemalloc)."""
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_bytes("VmRSS")
    tracemalloc.start()
    try:
        try:
            out = fn()
        except Exception as e:
            out = e
        return out, max(tracemalloc.get_traced_memory()[1], _status_bytes("VmHWM") - base)
    finally:
        tracemalloc.stop()


def tree_bytes(root) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file())


# -- item 5: URL secrets ------------------------------------------------------------------------------------------
def serve_with_basic_auth(directory: str):
    """A loopback HTTP server of ``directory`` that answers only requests carrying USER:PASSWORD (basic auth)."""
    want = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _allowed(self) -> bool:
            if self.headers.get("Authorization") == want:
                return True
            self.send_response(401)
            self.send_header("WWW-Authenticate", "Basic")
            self.end_headers()
            return False

        def do_GET(self):
            if self._allowed():
                super().do_GET()

        def do_HEAD(self):
            if self._allowed():
                super().do_HEAD()

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=directory))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture
def http_store(tmp_path):
    """(URL with user:password, the same URL without) of a store served over HTTP with basic auth."""
    served = tmp_path / "served"
    write_samples(str(served / "store"), make_manifest(), make_samples(6, max_len=60))
    srv = serve_with_basic_auth(str(served))
    base = f"127.0.0.1:{srv.server_address[1]}/store"
    yield f"http://{USER}:{PASSWORD}@{base}", f"http://{base}"
    srv.shutdown()


def test_recordable_url():
    from hsstore.redaction import recordable_url

    assert recordable_url(f"https://{USER}:{PASSWORD}@host/a/b") == "https://host/a/b"
    assert recordable_url("s3://tok3n@bucket/x") == "s3://bucket/x"  # a bare token before @ too
    assert recordable_url("https://h/x?X-Amz-Signature=abc&part=1") == "https://h/x?X-Amz-Signature=***&part=1"
    assert recordable_url("/local/path@2") == "/local/path@2" and recordable_url("s3://b/k") == "s3://b/k"


@pytest.mark.slow
def test_url_user_info_never_recorded_or_printed(http_store, tmp_path, capsys):
    url, bare = http_store
    assert len(hsstore.open(url)) == 6  # the password works: the server refuses requests without it
    with pytest.raises(Exception):
        hsstore.open(bare)

    rc, out, err = run(["info", url, "--json"], capsys)
    assert rc == 0 and json.loads(out)["url"] == bare and PASSWORD not in out + err

    sub = tmp_path / "sub"
    rc, out, err = run(["subset", url, str(sub), "-q"], capsys)
    assert rc == 0 and PASSWORD not in out + err and bare in out
    assert hsstore.open(str(sub)).manifest.extra["subset_of"] == bare

    exp = tmp_path / "exp"
    rc, out, err = run(["export", "specforge", url, str(exp), "-q"], capsys)
    assert rc == 0 and PASSWORD not in out + err
    assert json.loads((exp / "hsstore_export.json").read_text())["store"] == bare

    ref = tmp_path / "ref"
    rc, out, err = run(["merge", str(ref), url, "--by", "reference", "-q"], capsys)
    assert rc == 0 and PASSWORD not in out + err
    records = [json.loads(p.read_text()) for p in (ref / "commits").glob("*.json")]
    assert records and {r["location"] for r in records} == {bare}
    assert list((ref / "index").iterdir())  # merge's index segment: records in zstd blocks, scanned decoded
    for seg in (ref / "index").iterdir():
        table = index.decode_segment(seg.name, seg.read_bytes()).table
        assert table.location.values and all(PASSWORD not in (v or "") for v in table.location.values)
    for d in (sub, exp, ref):
        for p in Path(d).rglob("*"):
            assert not p.is_file() or PASSWORD.encode() not in p.read_bytes(), p


def test_train_config_and_checkpoints_record_no_url_secret(tmp_path):
    from hsstore.train.settings import TrainSettings, recordable_config

    cfg = build(TrainSettings, store=[f"https://{USER}:{PASSWORD}@h/s"], val_store=[f"s3://{USER}:{PASSWORD}@b/v"],
                out=str(tmp_path), storage_options={"secret": "x"})
    saved = json.dumps(recordable_config(cfg))
    assert PASSWORD not in saved and '"https://h/s"' in saved and '"s3://b/v"' in saved
    assert json.loads(saved)["storage_options"] is None


def test_train_from_a_store_url_with_password(store32_http, tmp_path):
    """train_config.json and every checkpoint's trainer.json, from a real run over HTTP with basic auth."""
    from hsstore.train.trainer import TrainSettings, train


    url, bare = store32_http
    out = tmp_path / "run"
    train(build(TrainSettings, store=[url], out=str(out), steps=2, save_every=1, keep=0, cache_dir=str(tmp_path / "c"),
                **FAST))
    files = [out / "train_config.json", *out.glob("checkpoints/*/trainer.json")]
    assert len(files) >= 3
    for f in files:
        text = f.read_text()
        assert PASSWORD not in text and bare in text, f


@pytest.fixture(scope="module")
def store32_http(tiny_dir, tmp_path_factory):
    from hsstore.extract.job import ExtractSettings, run_extract
    from hsstore.extract.tiny import demo_conversations_path

    served = tmp_path_factory.mktemp("served")
    inp = served / "in.jsonl"
    inp.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:4]) + "\n")
    run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(inp)], out=str(served / "store"),
                      dtype="float32", device="cpu", progress=False))
    srv = serve_with_basic_auth(str(served))
    base = f"127.0.0.1:{srv.server_address[1]}/store"
    yield f"http://{USER}:{PASSWORD}@{base}", f"http://{base}"
    srv.shutdown()


# -- item 6: duplicates ----------------------------------------------------------------------------------------------
def test_writer_refuses_a_repeated_sample_id(tmp_path):
    s = make_samples(3)
    with pytest.raises(hsstore.SampleError, match="'s0': added twice"):
        with hsstore.StoreWriter(str(tmp_path / "s"), make_manifest()) as w:
            for x in s + s[:1]:
                w.add(x["sample_id"], x["input_ids"], x["loss_mask"], x["hidden_states"])


def test_verify_fails_on_a_repeated_id_naming_it(tmp_path, capsys):
    url = str(tmp_path / "s")
    write_samples(url, make_manifest(), make_samples(3))
    write_samples(url, make_manifest(), make_samples(1))  # another session adds 's0' again
    rc, out, _ = run(["verify", url], capsys)
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert rc == 1 and len(fails) == 1 and "sample id 's0' is held 2 times" in fails[0], out


def test_two_subsets_at_once_never_duplicate(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_samples(src, make_manifest(), make_samples(240, max_len=40), shard_bytes=20_000)
    cmd = [sys.executable, "-m", "hsstore", "subset", src, dst, "-q"]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for rc, err in results:  # each copied, resumed (nothing left) or was refused while the other ran
        assert rc == 0 or (rc == 2 and "another `hsstore subset` is writing into" in err), err
    ids = hsstore.open(dst).sample_ids()
    assert len(ids) == 240 and len(set(ids)) == 240


def test_subset_refuses_while_another_holds_the_lock_and_takes_over_a_dead_ones(tmp_path, capsys):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_samples(src, make_manifest(), make_samples(5))
    fs, root = storage.resolve(dst)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"host": os.uname().nodename, "pid": sleeper.pid, "token": "x", "started": "then"}
        destination.create_exclusive(fs, f"{root}/locks/write.lock", json.dumps(lock).encode())
        rc, _, err = run(["subset", src, dst, "-q"], capsys)
        one_line_error(rc, err, "another `hsstore subset` is writing into", str(sleeper.pid))
        assert not os.path.exists(f"{root}/manifest.json")
    finally:
        sleeper.kill()
        sleeper.wait()
    rc, _, err = run(["subset", src, dst, "-q"], capsys)  # its process is gone: the lock is taken over
    assert rc == 0, err
    assert len(hsstore.open(dst)) == 5 and not os.path.exists(f"{root}/locks/write.lock")


def test_exclusive_create_on_s3_lets_one_of_many_win(s3_store):
    """Six racing creates send conditional PUTs (``If-None-Match: *``): the losers' 412 is understood as "taken",
    and once the lock exists every later create loses. That two racing PUTs cannot both win is S3's own
    guarantee; moto's server does not serialise them (one run here saw 2 winners of 6), so the race itself asserts
    only that someone wins and the rest are told no."""
    url, opts = s3_store
    fs, root = storage.resolve(url, opts)
    path = f"{root}/locks/write.lock"
    wins = {}
    threads = [threading.Thread(target=lambda i=i: wins.update({i: destination.create_exclusive(fs, path, b"%d" % i)}))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 6 and any(wins.values()) and not all(wins.values())
    assert fs.cat_file(path) in {b"%d" % i for i, won in wins.items() if won}  # a winner's bytes, whole
    assert [destination.create_exclusive(fs, path, b"late") for _ in range(3)] == [False] * 3
    assert fs.cat_file(path) != b"late"


# -- items 7 and 10: resources -----------------------------------------------------------------------------------------
@pytest.fixture
def small_store(tmp_path):
    url = str(tmp_path / "store")
    write_samples(url, make_manifest(), make_samples(4, max_len=50))
    return url


def test_gzip_bomb_index_segment_is_refused_in_small_memory(small_store, capsys):
    """A version-1 segment: 0.5 MB of gzip that expands to 512 MB (gzip reaches ~1000x)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    head = b'{"format": "hsstore-index", "version": 1, "kind": "c", "created_unix": 0, "writer": "x", ' \
           b'"supersedes": {}, "entries": [], "pad": "'
    parts = [z.compress(head)] + [z.compress(b"a" * (64 << 20)) for _ in range(8)] + [z.compress(b'"}'), z.flush()]
    bomb = b"".join(parts)
    assert len(bomb) < (1 << 20)
    Path(small_store, "index", "c-bomb.json.gz").write_bytes(bomb)
    store, peak = peak_bytes(lambda: hsstore.open(small_store))
    assert isinstance(store, hsstore.Store) and len(store) == 4 and peak < SMALL, (store, peak)
    assert store.index_use.damaged == ["c-bomb.json.gz"]
    rc, out, _ = run(["verify", small_store], capsys)
    assert rc == 1 and "index/c-bomb.json.gz" in out and "damaged" in out


def test_zstd_bomb_in_index_columns_is_refused_in_small_memory(small_store, capsys):
    """A version-2 segment with a valid CRC whose 16 kB columns block decodes to 512 MB."""
    seg_dir = Path(small_store, "index")
    name = next(p.name for p in seg_dir.iterdir())
    data = (seg_dir / name).read_bytes()
    (hl,) = struct.unpack("<I", data[len(index.MAGIC):len(index.MAGIC) + 4])
    header = json.loads(data[len(index.MAGIC) + 4:len(index.MAGIC) + 4 + hl])
    bomb = bytes(numcodecs.Zstd(level=19).encode(np.zeros(512 << 20, np.uint8)))
    assert len(bomb) < 100_000
    blocks = data[len(index.MAGIC) + 4 + hl + header["columns_bytes"]:-4]
    header["columns_bytes"] = len(bomb)
    hb = json.dumps(header).encode()
    body = index.MAGIC + struct.pack("<I", len(hb)) + hb + bomb + blocks
    (seg_dir / name).write_bytes(body + struct.pack("<I", codec.crc32c(body)))
    store, peak = peak_bytes(lambda: hsstore.open(small_store))
    assert isinstance(store, hsstore.Store) and len(store) == 4 and peak < SMALL, (store, peak)
    assert store.index_use.damaged == [name]
    rc, out, _ = run(["verify", small_store], capsys)
    assert rc == 1 and f"index/{name}" in out and "damaged" in out


def forge_chunk(url: str, payload: bytes) -> str:
    """Replace the first layer chunk of the first shard with a valid chunk object holding ``payload`` (its own
    CRC32C as the tail) and list it so in the commit record: every checksum holds. Returns the shard."""
    store = hsstore.open(url)
    rec = store.commits[0]
    key = next(k for k in rec.files if "/layer_" in k and commit.is_chunk_key(k))
    blob = payload + struct.pack("<I", codec.crc32c(payload))
    Path(url, key).write_bytes(blob)
    d = json.loads(Path(url, commit.commit_path(rec.shard)).read_text())
    d["files"][key] = {"size": len(blob), "crc32c": codec.crc32c(payload)}
    Path(url, commit.commit_path(rec.shard)).write_text(json.dumps(d))
    return rec.shard


def _bomb(spec: str, nbytes: int) -> bytes:
    zeros = np.zeros(nbytes, np.uint8)
    return bytes(numcodecs.Zstd(level=19).encode(zeros) if spec == "zstd" else
                 numcodecs.Blosc(cname="lz4", clevel=9, shuffle=numcodecs.Blosc.SHUFFLE).encode(zeros))


@pytest.mark.parametrize("spec", ["zstd", "lz4"])
def test_chunk_bomb_is_refused_before_decoding(tmp_path, spec, capsys):
    """A chunk object small enough to pass the chunk's size bound (the raw chunk is 6 KiB here) that declares
    1 MiB of decoded bytes: refused by the decoder's bound, before anything is allocated."""
    url = str(tmp_path / "s")
    write_samples(url, make_manifest(codec=spec), make_samples(4, max_len=50))
    payload = _bomb(spec, 1 << 20)
    assert len(payload) < 6144
    shard = forge_chunk(url, payload)
    store = hsstore.open(url)
    err, peak = peak_bytes(lambda: store.read(0))
    assert isinstance(err, CorruptionError) and "declare 1,048,576 decoded bytes" in str(err), err
    assert peak < SMALL, peak
    rc, out, _ = run(["verify", url], capsys)
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert rc == 1 and len(fails) == 1 and f"shard {shard}" in fails[0], out
    assert "declare 1,048,576 decoded bytes" in fails[0]  # what readers say of it
    rc, _, err = run(["convert", url, str(tmp_path / "c"), "--layout", "wds", "-q"], capsys)
    one_line_error(rc, err, "declare 1,048,576 decoded bytes")
    rc, _, err = run(["export", "specforge", url, str(tmp_path / "e"), "-q"], capsys)
    one_line_error(rc, err, "declare 1,048,576 decoded bytes")


@pytest.mark.parametrize("spec", ["zstd", "lz4"])
def test_chunk_bomb_larger_than_a_chunk_is_refused_unread(tmp_path, spec, capsys):
    """A 512 MiB bomb is itself larger than any chunk of this store may be: refused from
    the size its record lists, before a byte of it is read."""
    url = str(tmp_path / "s")
    write_samples(url, make_manifest(codec=spec), make_samples(4, max_len=50))
    payload = _bomb(spec, 512 << 20)
    assert len(payload) < 3 << 20
    shard = forge_chunk(url, payload)
    err, peak = peak_bytes(lambda: hsstore.open(url).read(0))
    assert isinstance(err, CorruptionError) and "larger than its bound of 7,556" in str(err), err
    assert peak < SMALL, peak
    rc, out, _ = run(["verify", url], capsys)
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert rc == 1 and len(fails) == 1 and f"shard {shard}" in fails[0] and "larger than its bound" in fails[0], out


def forge_record(url: str, edit) -> str:
    store = hsstore.open(url)
    rec = store.commits[0]
    path = Path(url, commit.commit_path(rec.shard))
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))
    return rec.shard


@pytest.mark.parametrize("command", ["convert", "subset", "export"])
def test_record_claiming_1e12_tokens_is_one_line(small_store, tmp_path, command, capsys):
    def edit(d):
        extra = 10 ** 12
        d["samples"]["length"][0] += extra
        d["n_tokens"] += extra

    shard = forge_record(small_store, edit)
    argv = {"convert": ["convert", small_store, str(tmp_path / "o"), "--layout", "wds"],
            "subset": ["subset", small_store, str(tmp_path / "o")],
            "export": ["export", "specforge", small_store, str(tmp_path / "o")]}[command]
    rc, _, err = run(argv + ["-q"], capsys)
    one_line_error(rc, err, shard, "1,000,000,000,")


@pytest.mark.parametrize("command", ["convert", "subset", "export", "info", "verify"])
def test_manifest_hidden_size_2_pow_40_is_one_line(small_store, tmp_path, command, capsys):
    """A hidden size no target has (2^40) is refused by the manifest's own check, naming the file, before any
    record is read or buffer sized (docs/FORMAT.md, "Limits": at most 2^20)."""
    path = Path(small_store, "manifest.json")
    m = json.loads(path.read_text())
    m["target"]["hidden_size"] = 1 << 40
    path.write_text(json.dumps(m))
    argv = {"convert": ["convert", small_store, str(tmp_path / "o"), "--layout", "wds", "-q"],
            "subset": ["subset", small_store, str(tmp_path / "o"), "-q"],
            "export": ["export", "specforge", small_store, str(tmp_path / "o"), "-q"],
            "info": ["info", small_store], "verify": ["verify", small_store, "-q"]}[command]
    rc, out, err = run(argv, capsys)
    if command == "verify":  # a finding of verify's: a FAIL line naming the file and the field (exit 1)
        fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
        assert rc == 1 and len(fails) == 1 and "manifest.json" in fails[0] and "at most 1,048,576" in fails[0], out
    else:
        one_line_error(rc, err, "manifest.json", "hidden_size must be a positive integer of at most 1,048,576")
    assert not (tmp_path / "o").exists()


@pytest.fixture
def huge_config_drafter(tmp_path):
    """A drafter directory whose config.json says intermediate_size 4M while its weights are a tiny model's."""
    import torch

    from hsstore.train import drafter_format
    from hsstore.train.model import DrafterConfig, DFlashDrafter

    cfg = DrafterConfig(hidden_size=48, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=24,
                        intermediate_size=64, vocab_size=5000, target_layers=[1, 3, 5], block_size=8,
                        mask_token_id=4999, num_target_layers=8)
    head = torch.zeros(5000, 48)
    path = drafter_format.save_drafter(tmp_path / "drafter", DFlashDrafter(cfg, head, head))
    d = json.loads((path / "config.json").read_text())
    d["intermediate_size"] = 4 << 20
    (path / "config.json").write_text(json.dumps(d))
    return path, head


def test_drafter_config_checked_before_any_weight_is_built(huge_config_drafter):
    from hsstore.train import checkpoint as ckpt

    path, head = huge_config_drafter
    err, peak = peak_bytes(lambda: ckpt.load_drafter(path, head, head))
    assert isinstance(err, ValueError) and "does not match its config" in str(err) and "4194304" in str(err), err
    assert peak < SMALL, peak


def test_train_init_with_a_huge_config_is_one_line(huge_config_drafter, tmp_path):
    from hsstore.train import checkpoint as ckpt
    from hsstore.train.build import init_config
    from hsstore.train.settings import TrainSettings

    path, _ = huge_config_drafter
    manifest = make_manifest()
    cfg = build(TrainSettings, store=["unused"], out=str(tmp_path / "o"), block_size=8, init=str(path))
    err, peak = peak_bytes(lambda: init_config(str(path), manifest, 5000, cfg, "sdpa"))
    assert isinstance(err, ValueError) and "does not match its config" in str(err), err
    assert peak < SMALL
    assert ckpt.read_drafter_config(path)[0].intermediate_size == 4 << 20


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs: a real ENOSPC when it fills (needs mount rights; skipped without them)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_train_on_a_full_disk_while_checkpointing_is_one_line(store32, small_disk, capsys):
    ballast = small_disk / "ballast"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    ballast.write_bytes(b"\0" * max(0, free - (200 << 10)))  # ~200 kB left: the config fits, a checkpoint not
    argv = ["train", "--store", store32, "--out", str(small_disk / "run"), "--steps", "2", "--save-every", "1",
            "--token-budget", "1024", "--draft-layers", "1", "--block-size", "8", "--anchors", "32", "--device",
            "cpu", "-q"]
    rc, _, err = run(argv, capsys)
    one_line_error(rc, err, "checkpoint of step 1 could not be written", "the disk is full")
    assert "SafetensorError" not in err


# -- corruption: a flipped payload byte, the tail intact ---------------------------------------------------------------
def flip_payload_byte(fs, path: str) -> None:
    blob = bytearray(fs.cat_file(path))
    blob[len(blob) // 3] ^= 0x10  # inside the payload; the CRC32C tail stays as written
    fs.pipe_file(path, bytes(blob))


def corrupt_first_layer_chunk(url: str, opts: dict | None = None) -> str:
    store = hsstore.open(url, **(opts or {}))
    rec = store.commits[0]
    key = next(k for k in rec.files if "/layer_" in k and commit.is_chunk_key(k))
    flip_payload_byte(store.fs, f"{store.root}/{key}")
    return rec.samples["sample_id"][0]


@pytest.mark.parametrize("where,path", [("local", "read"), ("local", "loader"), ("s3", "read"), ("s3", "loader"),
                                        ("s3", "loader+cache")])
@pytest.mark.parametrize("spec", ["zstd", "lz4"])
def test_flipped_payload_byte_is_a_checksum_error(where, spec, path, tmp_path, request):
    """Through ``Store.read`` and the loader (on S3 also through its chunk cache), each read names the checksum."""
    from hsstore.loader.dataset import HiddenStateDataset
    from hsstore.loader.options import Reading

    opts = {}
    if where == "s3":
        url, opts = request.getfixturevalue("s3_store")
    else:
        url = str(tmp_path / "s")
    write_samples(url, make_manifest(codec=spec), make_samples(3, max_len=50), storage_options=opts)
    sid = corrupt_first_layer_chunk(url, opts)
    if path == "read":
        with pytest.raises(CorruptionError, match="checksum mismatch") as e:
            hsstore.open(url, **opts).read(0)
        assert sid in str(e.value)
    else:
        cache = str(tmp_path / "cache") if path == "loader+cache" else None
        with pytest.raises(CorruptionError, match="checksum mismatch"):
            list(HiddenStateDataset(url, storage_options=opts, reading=Reading(cache_dir=cache)))
