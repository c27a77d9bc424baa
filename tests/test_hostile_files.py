"""Hostile stores, part two (issue #36): the bytes, files and strings behind a store's names.

Small stores forged by hand with valid checksums: files that are links or FIFOs, sizes and shapes that promise
gigabytes, nesting and digits that break parsers, strings that drive a terminal, assets that carry code, two
writers into one destination, a cache that another user could read or plant. Each case runs the real commands;
the ones that could hang or exhaust memory if a guard were missing run in a child process with a timeout and a
4 GiB address-space limit, so a regression fails the test instead of the machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

import hsstore
from hsstore.io import destination, door, storage
from hsstore.format import codec, commit, index, names
from hsstore.format.assets import write_assets

from conftest import make_manifest, make_samples, write_samples

REPO = Path(__file__).resolve().parents[1]
LIMIT = 4 << 30  # address space of a child command: a guard that fails shows as a MemoryError, not a dead machine
SMALL = 64 << 20


def _limit():
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def cli(*args, timeout: float = 120, stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    """``hsstore ARGS`` in a child process (timeout, address-space limit); a hang fails the test."""
    try:
        return subprocess.run([sys.executable, "-m", "hsstore", *map(str, args)], cwd=REPO, capture_output=True,
                              text=True, timeout=timeout, preexec_fn=_limit, stdin=stdin)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hsstore {' '.join(map(str, args))} hung (over {timeout} s)")


def py(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout, preexec_fn=_limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"python -c {code!r} hung (over {timeout} s)")


def one_line(r: subprocess.CompletedProcess, *words: str, rc: int = 2) -> str:
    """The single error line of a refused command, holding ``words``."""
    assert r.returncode == rc, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines()
             if ln.strip() and "%|" not in ln and not ln.startswith(("WARNING", "INFO"))]
    assert len(lines) == 1, r.stderr
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def small(path: Path, n: int = 6, layout: str = "zarr", **kw) -> str:
    m = make_manifest(**kw)
    if layout != "zarr":
        m = dataclasses.replace(m, layout=layout)
    write_samples(str(path), m, make_samples(n, max_len=90), shard_bytes=300 * 3 * 48 * 2)
    return str(path)


def first_record(url: str) -> tuple[Path, dict]:
    p = sorted(Path(url, "commits").glob("*.json"))[0]
    return p, json.loads(p.read_text())


def first_chunk(url: str, array: str = "layer_001") -> Path:
    _, rec = first_record(url)
    key = next(k for k in sorted(rec["files"]) if f"/{array}/c/" in k)
    return Path(url, key)


def replace_listed(url: str, key: str, data: bytes) -> None:
    """Write ``data`` at ``key`` and list it so in its commit record (size and CRC32C, as a forger would)."""
    Path(url, key).write_bytes(data)
    for p in Path(url, "commits").glob("*.json"):
        rec = json.loads(p.read_text())
        if key in rec["files"]:
            crc = codec.crc32c(data[:-4]) if commit.is_chunk_key(key) else codec.crc32c(data)
            rec["files"][key] = {"size": len(data), "crc32c": crc}
            p.write_text(json.dumps(rec))
    shutil.rmtree(Path(url, "index"), ignore_errors=True)  # the index would serve the record as it was


def fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


# -- item 1: fixed names that are links to /dev/zero, or FIFOs -----------------------------------------------------
FIXED = {"manifest": lambda url: Path(url, "manifest.json"),
         "record": lambda url: first_record(url)[0],
         "asset index": lambda url: Path(url, "assets", "index.json")}


@pytest.mark.parametrize("what", sorted(FIXED))
@pytest.mark.parametrize("kind", ["link to /dev/zero", "fifo"])
def test_fixed_names_that_are_not_regular_files_are_refused_at_once(tmp_path, what, kind):
    url = small(tmp_path / "s")
    fs, root = storage.resolve(url)
    write_assets(fs, root, {"config.json": b"{}"})
    path = FIXED[what](url)
    path.unlink()
    os.symlink("/dev/zero", path) if kind.startswith("link") else os.mkfifo(path)
    key = str(path.relative_to(url))
    for command in (["info", url], ["show", url, "0"], ["verify", url]):
        r = cli(*command, timeout=90)
        if what == "asset index" and command[0] == "info":  # info reads no asset: nothing to refuse
            assert r.returncode == 0, r.stderr
            continue
        out = r.stdout + r.stderr
        assert "Traceback" not in out and "MemoryError" not in out, out[-2000:]
        assert key in out and ("symbolic link" in out or "a FIFO" in out), (command, out[-2000:])
        assert r.returncode in (1, 2), out[-2000:]


# -- item 2: a chunk linked to /etc/passwd, or a FIFO ---------------------------------------------------------------
def test_chunk_linked_to_etc_passwd_is_never_opened(tmp_path):
    url = small(tmp_path / "s")
    chunk = first_chunk(url)
    chunk.unlink()
    os.symlink("/etc/passwd", chunk)
    r = cli("verify", url)
    fails = [ln for ln in r.stdout.splitlines() if ln.startswith("FAIL")]
    assert r.returncode == 1 and len(fails) == 1, r.stdout
    assert "symbolic link" in fails[0] and str(chunk.relative_to(url)) in fails[0], fails[0]
    assert str(os.path.getsize("/etc/passwd")) not in r.stdout  # its size was never even looked at
    r = py(f"import hsstore; hsstore.open({url!r}).read(0)")
    assert r.returncode == 1 and "symbolic link" in r.stderr.splitlines()[-1], r.stderr[-1000:]


@pytest.mark.parametrize("layout", ["zarr", "wds"])
def test_chunk_or_tar_that_is_a_fifo_hangs_nothing(tmp_path, layout):
    url = small(tmp_path / "s", layout=layout)
    path = first_chunk(url) if layout == "zarr" else Path(url, next(iter(first_record(url)[1]["files"])))
    fifo(path)
    r = cli("verify", url)
    assert r.returncode == 1 and "a FIFO" in r.stdout, r.stdout + r.stderr
    r = cli("convert", url, tmp_path / "c", "--layout", "wds" if layout == "zarr" else "zarr", "-q")
    one_line(r, "a FIFO")
    r = py(f"import hsstore; s = hsstore.open({url!r}); [s.read(i) for i in range(len(s))]")
    assert r.returncode == 1 and "a FIFO" in r.stderr.splitlines()[-1], r.stderr[-1000:]


# -- item 3: chunks or array folders linked to a copy of the store outside it ----------------------------------------
@pytest.mark.parametrize("what", ["chunk", "array folder"])
def test_links_to_a_copy_outside_are_refused_and_never_copied(tmp_path, what):
    url = small(tmp_path / "s")
    outside = tmp_path / "outside"
    shutil.copytree(url, outside)
    chunk = first_chunk(url)
    target = chunk if what == "chunk" else chunk.parents[2]  # shards/<s>/layer_001/c/0/0 -> shards/<s>/layer_001
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    os.symlink(outside / target.relative_to(url), target)
    r = cli("verify", url)
    assert r.returncode == 1 and "symbolic link" in r.stdout, r.stdout
    for command in (["subset", url, tmp_path / "sub", "-q"], ["convert", url, tmp_path / "conv", "--layout", "wds",
                                                               "-q"]):
        r = cli(*command)
        one_line(r, "symbolic link")
    for dst in ("sub", "conv"):  # nothing of the outside copy reached a destination
        copied = [p for p in (tmp_path / dst).rglob("*") if p.is_file() and "layer" in p.name]
        assert not any(p.read_bytes() == chunk.resolve().read_bytes() for p in copied)


# -- item 5: a wds member that declares 3 GiB -----------------------------------------------------------------------
def test_wds_member_declaring_3_gib_is_refused_before_allocating(tmp_path, capsys):
    from test_hostile_limits import peak_bytes

    url = small(tmp_path / "s", layout="wds")
    p, rec = first_record(url)
    tar_key = next(iter(rec["files"]))
    member = next(n for n in sorted(rec["members"]) if n.endswith(".layer_001.npy"))
    rec["members"][member][1] = 3 << 30  # the record declares 3 GiB, and so would the tar (sparse)
    tar = Path(url, tar_key)
    os.truncate(tar, tar.stat().st_size + (3 << 30))
    rec["files"][tar_key]["size"] = tar.stat().st_size
    p.write_text(json.dumps(rec))
    shutil.rmtree(Path(url, "index"), ignore_errors=True)
    from test_hostile_limits import one_line_error, run

    store = hsstore.open(url)
    err, peak = peak_bytes(lambda: [store.read(i) for i in range(len(store))])
    assert isinstance(err, hsstore.CorruptionError) and "lists 3,221,225,472 bytes" in str(err), err
    assert peak < SMALL, peak
    rc, _, err = run(["convert", url, str(tmp_path / "c"), "--layout", "zarr", "-q"], capsys)
    one_line_error(rc, err, member, "lists 3,221,225,472 bytes")
    rc, out, _ = run(["verify", url, "-q"], capsys)
    assert rc == 1 and "3,221,225,472" in out, out


# -- item 6: a shard's zarr.json forged ------------------------------------------------------------------------------
def _forge_meta(url: str, array: str, edit) -> str:
    p, rec = first_record(url)
    key = f"shards/{rec['shard']}/{array}/zarr.json"
    meta = json.loads(Path(url, key).read_text())
    edit(meta)
    replace_listed(url, key, json.dumps(meta).encode())
    return key


def test_zarr_json_with_1e12_tokens_is_one_fail_not_a_loop(tmp_path):
    url = small(tmp_path / "s")

    def huge(meta):
        meta["shape"][0] = 10 ** 12
        meta["chunk_grid"]["configuration"]["chunk_shape"][0] = 1

    key = _forge_meta(url, "layer_001", huge)
    r = cli("verify", url, timeout=60)
    fails = [ln for ln in r.stdout.splitlines() if ln.startswith("FAIL")]
    assert r.returncode == 1 and any(key in f and "1000000000000" in f for f in fails), r.stdout


def test_gzip_bomb_in_input_ids_is_refused_unread(tmp_path):
    url = small(tmp_path / "s")

    def gzip(meta):
        meta["codecs"].insert(1, {"name": "gzip", "configuration": {"level": 1}})

    meta_key = _forge_meta(url, "input_ids", gzip)
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(64 << 20)
    bomb = b"".join(c.compress(zeros) for _ in range(16)) + c.flush()  # 1 GiB of zeros
    assert len(bomb) < 4 << 20
    chunk = first_chunk(url, "input_ids")
    replace_listed(url, str(chunk.relative_to(url)), bomb + struct.pack("<I", codec.crc32c(bomb)))
    r = cli("verify", url, timeout=120)
    out = r.stdout
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert meta_key in out and "codecs" in out, out
    assert str(chunk.relative_to(url)) in out and "larger than its bound" in out, out


# -- item 7: JSON that breaks parsers -------------------------------------------------------------------------------
@pytest.mark.parametrize("edit, words", [
    (lambda m: m.__setitem__("extra", json.loads("[" * 500 + "]" * 500)), ["nested too deep"]),
    ("deep", ["nested too deep"]),
    ("digits", ["not valid JSON", "digits"]),
    (lambda m: m.__setitem__("layers", [True, 3, 5]), ["layers must be"]),
    (lambda m: m["target"].__setitem__("num_layers", True), ["num_layers must be"]),
])
def test_manifest_json_that_breaks_parsers_is_one_line_naming_it(tmp_path, edit, words):
    url = small(tmp_path / "s")
    path = Path(url, "manifest.json")
    if edit == "deep":  # 200,000 levels: json's own recursion limit, not a traceback
        m = json.loads(path.read_text())
        text = json.dumps(m)[:-1] + ', "extra": ' + "[" * 200_000 + "]" * 200_000 + "}"
        text = text.replace('"extra": {}, ', "")
        path.write_text(text)
    elif edit == "digits":
        path.write_text(path.read_text().replace('"hidden_size": 48', '"hidden_size": ' + "9" * 5000))
    else:
        m = json.loads(path.read_text())
        edit(m)
        path.write_text(json.dumps(m))
    for command in (["info", url], ["verify", url, "-q"]):
        one_line(cli(*command), "manifest.json", *words)


# -- item 8: strings that drive a terminal ---------------------------------------------------------------------------
HOSTILE_ID = "s0\nverify /x: OK (0 problems)\x1b]0;pwned\x07\x1b[2J\r"


def test_hostile_ids_and_flags_are_escaped_in_verify_and_info(tmp_path):
    url = str(tmp_path / "s")
    samples = make_samples(4, max_len=60)
    with hsstore.StoreWriter(url, make_manifest()) as w:
        for i, s in enumerate(samples):
            w.add(HOSTILE_ID if i == 0 else s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"],
                  source="src\x1b[31m", flags=["bad\nflag\x1b[2J"])
    chunk = first_chunk(url)
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1  # one corrupt chunk: verify names its samples
    chunk.write_bytes(bytes(data))
    for command in (["verify", url], ["info", url], ["show", url, "0"]):
        r = cli(*command)
        out = r.stdout + r.stderr
        assert "\x1b" not in out and "\x07" not in out and "\r" not in out, repr(out[-1500:])
        assert not any(ln.startswith("verify /x") for ln in out.splitlines()), out
    r = cli("verify", url)
    assert "s0\\nverify /x: OK (0 problems)\\x1b]0;pwned\\x07\\x1b[2J\\r" in r.stdout, r.stdout


# -- item 9: code in a store's assets --------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["auto_map", "py file", "pickle"])
def test_assets_carrying_code_are_refused_in_one_line_never_a_prompt(tmp_path, tiny_dir, how):
    url = small(tmp_path / "s")
    fs, root = storage.resolve(url)
    marker = tmp_path / "ran"
    tok = {f"tokenizer/{p.name}": p.read_bytes() for p in Path(tiny_dir).iterdir()
           if p.name.startswith(("tokenizer", "special_tokens", "chat_template"))}
    evil = f"open({str(marker)!r}, 'w').write('the store ran code')\n".encode()
    cfg = json.loads(tok["tokenizer/tokenizer_config.json"])
    if how == "auto_map":
        cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
        tok["tokenizer/tokenizer_config.json"] = json.dumps(cfg).encode()
        tok["tokenizer/tokenization_evil.py"] = evil
        files = dict(tok)
        del files["tokenizer/tokenization_evil.py"]  # the auto_map alone is refused, listed .py or not
        write_assets(fs, root, files)
        Path(url, "assets", "tokenizer", "tokenization_evil.py").write_bytes(evil)
        named = "tokenizer/tokenizer_config.json"
    elif how == "py file":
        write_assets(fs, root, {**tok, "tokenizer/tokenization_evil.py": evil})
        named = "tokenizer/tokenization_evil.py"
    else:
        write_assets(fs, root, {**tok, "tokenizer/weights.pkl": b"\x80\x04K\x01."})
        named = "tokenizer/weights.pkl"
    r = cli("show", url, "0", stdin=subprocess.PIPE, timeout=60)  # a prompt would wait on stdin: none comes
    one_line(r, named, "refused")
    assert not marker.exists()
    r = cli("verify", url)
    assert r.returncode == 1 and named in r.stdout and "refused" in r.stdout, r.stdout


# -- item 10: two writers into one new destination --------------------------------------------------------------------
@pytest.mark.parametrize("by", ["copy", "reference"])
def test_two_merges_into_one_new_store_at_once_never_duplicate(tmp_path, by):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_samples(a, make_manifest(), make_samples(60, max_len=40), shard_bytes=20_000)
    write_samples(b, make_manifest(), make_samples(60, max_len=40, prefix="t"), shard_bytes=20_000)
    dst = str(tmp_path / "dst")
    env = {**os.environ, "HSSTORE_ALLOW_LOCATIONS": str(tmp_path)}
    cmd = [sys.executable, "-m", "hsstore", "merge", dst, a, b, "--by", by, "-q"]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for rc, err in results:  # each merged, found everything merged, or was refused while the other ran
        assert rc == 0 or (rc == 2 and "is writing into" in err), err
    if by == "reference":
        os.environ["HSSTORE_ALLOW_LOCATIONS"] = str(tmp_path)
    try:
        ids = hsstore.open(dst).sample_ids()
    finally:
        os.environ.pop("HSSTORE_ALLOW_LOCATIONS", None)
    assert len(ids) == 120 and len(set(ids)) == 120


def test_taking_over_a_dead_lock_is_atomic(tmp_path):
    """Eight takers of one dead holder's lock at once: exactly one holds it at any time."""
    fs, root = storage.resolve(str(tmp_path / "dst"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = {"host": os.uname().nodename, "pid": dead.pid, "token": "deadbeef", "command": "subset"}
    assert destination.create_exclusive(fs, f"{root}/locks/write.lock", json.dumps(lock).encode())
    holding, most, refused = [0], [0], []
    guard = threading.Lock()
    start = threading.Barrier(8)

    def taker():
        start.wait()
        try:
            with destination.hold_lock(fs, root, str(tmp_path / "dst"), "merge"):
                with guard:
                    holding[0] += 1
                    most[0] = max(most[0], holding[0])
                threading.Event().wait(0.3)
                with guard:
                    holding[0] -= 1
        except destination.LockHeld as e:
            refused.append(str(e))

    threads = [threading.Thread(target=taker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1 and len(refused) == 7, (most, refused)


# -- item 11: the chunk cache -----------------------------------------------------------------------------------------
def _cached_store(s3_store, tmp_path, codec="none"):
    from hsstore.loader.cache import ChunkCache

    url, opts = s3_store
    write_samples(url, make_manifest(chunk_tokens=50, codec=codec), make_samples(6), storage_options=opts)
    store = hsstore.open(url, **opts)
    cache = ChunkCache(str(tmp_path / "cache"), 1 << 30)
    store.use_chunk_cache(cache)
    return store, cache


def test_chunk_cache_is_private(s3_store, tmp_path):
    store, cache = _cached_store(s3_store, tmp_path)
    store.read(0)
    entries = [(p, p.stat().st_mode & 0o777) for p in Path(cache.root).rglob("*")]
    assert entries and Path(cache.root).stat().st_mode & 0o777 == 0o700
    assert all(mode == (0o700 if p.is_dir() else 0o600) for p, mode in entries), entries


def test_a_planted_cache_copy_with_a_matching_crc_is_never_served(s3_store, tmp_path):
    store, cache = _cached_store(s3_store, tmp_path)
    first = store.read(0)["hidden_states"].clone()
    copies = [p for p in Path(cache.root).rglob("*") if p.is_file() and "/layer_001/" in str(p)]
    assert copies
    for p in copies:  # other values, four bytes adjusted so that the chunk's CRC32C still holds (linear CRC)
        body = p.read_bytes()[:-32]
        payload, tail = bytearray(body[:-4]), body[-4:]
        payload[:16] = bytes(range(16))
        payload[16:20] = _fix_crc(bytes(payload), 16, int.from_bytes(tail, "little"))
        assert codec.crc32c(bytes(payload)) == int.from_bytes(tail, "little")
        p.write_bytes(bytes(payload) + tail + p.read_bytes()[-32:])
    misses = cache.misses
    again = store.read(0)["hidden_states"]
    assert bool((again == first).all()) and cache.misses > misses  # fetched again from the store, not served
    assert all(p.read_bytes()[:16] != bytes(range(16)) for p in copies if p.exists())


def _fix_crc(data: bytes, at: int, want: int) -> bytes:
    """The 4 bytes to put at ``at`` so that ``crc32c(data)`` is ``want`` (CRC is linear: solve for them)."""
    base = bytearray(data)
    base[at:at + 4] = bytes(4)

    def crc(b):
        return codec.crc32c(bytes(b))

    zero = crc(base)
    cols = []
    for bit in range(32):
        b = bytearray(base)
        b[at + bit // 8] ^= 1 << (bit % 8)
        cols.append(crc(b) ^ zero)
    target = want ^ zero
    # solve cols * x = target over GF(2) (32 x 32)
    rows = [(cols[i], 1 << i) for i in range(32)]
    basis: dict[int, tuple[int, int]] = {}
    for v, m in rows:
        for bitpos in range(31, -1, -1):
            if not v >> bitpos & 1:
                continue
            if bitpos in basis:
                bv, bm = basis[bitpos]
                v, m = v ^ bv, m ^ bm
            else:
                basis[bitpos] = (v, m)
                break
    x, t = 0, target
    for bitpos in range(31, -1, -1):
        if t >> bitpos & 1:
            bv, bm = basis[bitpos]
            t, x = t ^ bv, x ^ bm
    assert t == 0
    return x.to_bytes(4, "little")


@pytest.mark.parametrize("how", ["another user's", "a link"])
def test_a_cache_folder_not_ours_is_refused(tmp_path, how):
    from hsstore.loader.cache import ChunkCache

    root = tmp_path / "cache"
    if how == "a link":
        (tmp_path / "elsewhere").mkdir()
        os.symlink(tmp_path / "elsewhere", root)
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to make a folder owned by another user")
        root.mkdir()
        os.chown(root, 12345, 12345)
    with pytest.raises(hsstore.StoreError, match="refused"):
        ChunkCache(str(root), 1 << 20)


# -- the two guards that had barely a test ---------------------------------------------------------------------------
def test_a_name_resolving_through_a_link_without_dotdot_is_refused(tmp_path):
    """``names.path``: a key with no ``..`` whose folder is a link out of the root (lexically fine)."""
    root = tmp_path / "store"
    (root / "assets").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_bytes(b"x")
    os.symlink(tmp_path / "outside", root / "assets" / "tok")
    fs, r = storage.resolve(str(root))
    with pytest.raises(hsstore.StoreError, match="outside"):
        names.path(fs, r, "assets/tok/secret", "asset name", "test")
    with pytest.raises(door.Refused, match="symbolic link"):
        door.read(fs, r, "assets/tok/secret", bound=10)


def test_v2_segment_whose_header_agrees_with_a_512_mb_frame_is_refused_in_small_memory(tmp_path):
    """The 128x expansion bound alone: the header's arrays declare exactly what the 16 kB frame decodes to."""
    from test_hostile_limits import peak_bytes

    import numcodecs

    url = small(tmp_path / "s", n=4)
    seg = next(Path(url, "index").iterdir())
    data = seg.read_bytes()
    (hl,) = struct.unpack("<I", data[len(index.MAGIC):len(index.MAGIC) + 4])
    header = json.loads(data[len(index.MAGIC) + 4:len(index.MAGIC) + 4 + hl])
    bomb = bytes(numcodecs.Zstd(level=19).encode(np.zeros(512 << 20, np.uint8)))
    blocks = data[len(index.MAGIC) + 4 + hl + header["columns_bytes"]:-4]
    declared = sum(int(np.prod(s)) * np.dtype(d).itemsize for _, d, s in header["table"]["arrays"])
    header["table"]["arrays"].append(["pad", "|u1", [(512 << 20) - declared]])
    header["columns_bytes"] = len(bomb)
    hb = json.dumps(header).encode()
    body = index.MAGIC + struct.pack("<I", len(hb)) + hb + bomb + blocks
    seg.write_bytes(body + struct.pack("<I", codec.crc32c(body)))
    store, peak = peak_bytes(lambda: hsstore.open(url))
    assert isinstance(store, hsstore.Store) and len(store) == 4 and peak < SMALL, (store, peak)
    assert store.index_use.damaged == [seg.name]
    assert "at most" in store.index_use.why[seg.name], store.index_use.why


@pytest.mark.parametrize("size", [3 << 30, 700 << 20])
def test_a_huge_index_segment_costs_no_memory(tmp_path, size):
    """Found by the 3,000-case fuzz run (seed 2): a segment made sparse-huge (3 GiB) was read whole (+6 GB in
    info, verify, show, subset...). A segment over ``door.INDEX_SEGMENT_CAP`` (700 MB: refused alone), or
    segments over ``INDEX_TOTAL_CAP`` together (3 GiB: not read at all), leave the index aside: records are read."""
    from test_hostile_limits import peak_bytes

    url = small(tmp_path / "s", n=4)
    seg = next(Path(url, "index").iterdir())
    os.truncate(seg, size)
    store, peak = peak_bytes(lambda: hsstore.open(url))
    assert isinstance(store, hsstore.Store) and len(store) == 4 and peak < SMALL, (store, peak)
    assert store.index_use.damaged == [seg.name]
    r = cli("info", url)
    assert r.returncode == 0 and "samples" in r.stdout, r.stderr[-500:]


def test_an_index_segment_whose_value_lists_are_not_text_is_ignored(tmp_path):
    """Found by the same run: a segment's writer values forged into an object (checksum fixed) ended `info` in a
    TypeError traceback; now the segment is damaged, ignored, and the records are read."""
    url = small(tmp_path / "s", n=4)
    seg = next(Path(url, "index").iterdir())
    data = seg.read_bytes()
    (hl,) = struct.unpack("<I", data[len(index.MAGIC):len(index.MAGIC) + 4])
    header = json.loads(data[len(index.MAGIC) + 4:len(index.MAGIC) + 4 + hl])
    header["table"]["writer"][0] = {"a": 1}
    hb = json.dumps(header).encode()
    body = index.MAGIC + struct.pack("<I", len(hb)) + hb + data[len(index.MAGIC) + 4 + hl:-4]
    seg.write_bytes(body + struct.pack("<I", codec.crc32c(body)))
    store = hsstore.open(url)
    assert len(store) == 4 and store.index_use.damaged == [seg.name], store.index_use
    assert "text" in store.index_use.why[seg.name]
    r = cli("info", url)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-800:]


def test_a_record_layer_entry_without_its_byte_counts_is_one_line(tmp_path):
    """Found by the 1,000-case fuzz run of seed 3: a record whose layer entry held other keys than its byte
    counts passed the type check and ended every command in a KeyError traceback; now one line naming it."""
    url = small(tmp_path / "s", n=4)
    rec_path, rec = first_record(url)
    rec["layers"][next(iter(rec["layers"]))] = {"a": 1}
    rec_path.write_text(json.dumps(rec))
    shutil.rmtree(Path(url, "index"), ignore_errors=True)  # else the index serves the record as it was
    for cmd in ("info", "verify"):
        r = cli(cmd, url)
        assert r.returncode in (1, 2) and "Traceback" not in r.stderr, r.stderr[-800:]
        assert "byte counts" in r.stdout + r.stderr
