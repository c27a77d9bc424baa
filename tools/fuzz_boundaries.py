"""The fuzzer's boundaries beyond a store's files (issue #52, item 6): ``python -m tools.fuzz_store --families
http,s3,engine,drafter,run,peer,config``.

Each case of a family forges one input and runs the commands that read it (in the fuzzer's driver, each under its
alarm, output captured):

- ``http``: a hostile HTTP server on loopback serving a store (``hsstore.testing.hostile_http``: a body that never
  ends, a Content-Length of 10^12, a gzip bomb, an index page that never ends, a byte a second in the body or the
  headers, a redirect to another host), on a path picked at random, and at times a record whose file key or
  location leaves the store once percent-decoded; ``info``, ``verify`` and ``merge`` into a local destination;
- ``s3``: a hostile S3 endpoint (``hsstore.testing.faultproxy`` in front of moto's server: a trickled body, a body
  past its size, a Content-Length of 10^12, a listing that never ends, short and cut bodies); ``info``, ``verify``;
- ``engine``: an engine's answer to ``regenerate`` misbehaving as above, or a canned answer forged (not JSON, nested,
  wrong types, a million ids);
- ``drafter``: a drafter folder forged (its config's fields, odd JSON, links, FIFOs, sparse huge weights, bytes of
  its safetensors header); ``export-drafter`` and ``eval --drafter``;
- ``run``: a run folder being resumed, forged (trainer.json and loader state fields, a zlib bomb, links planted at
  the names a run writes, FIFOs, odd safetensors); ``train`` resuming it;
- ``peer``: a SpecForge or speculators folder forged (gzip bombs, links out, FIFOs, sparse huge files, a pickle
  that runs code, state.json naming files outside); ``import``;
- ``config``: a ``--config`` YAML made at random (alias bombs, deep nesting, tags, huge values, wrong types);
  ``train`` and ``extract`` with it;
- the metadata families (``records``, ``columns``, ``writers``, ``journal``, ``assets``, ``weights``, ``received``:
  a store's and a run's metadata changed, with the oracle that no sample is served from a shard ``verify``
  refuses): ``tools/fuzz_metadata.py``, forged and driven from here.

Besides the fuzzer's own oracles (no traceback, no hang, bounded memory, one line for a refusal), a case fails when a
byte outside what the command was given is read (a sentinel's access time moved, a request outside the served
store's prefix) or a file outside its destination changes (the sentinel tree). Deadlines are scaled down for the
run (``DEADLINES``: 2 s to a first byte instead of 10, 5 s to an S3 answer's headers instead of 60) so a trickled
answer costs seconds, not a minute; the bound they set is the same.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any, Callable

from tools import fuzz_metadata
from tools.fuzz_oracles import (DEADLINES, FAST, HOSTILE_JSON, PASSWD, json_edit, link_or_odd, plain_file,
                                replace_path)

FAMILIES = ("http", "s3", "engine", "drafter", "run", "peer", "config")
ENGINE_TIMEOUT_S = "3"
GIB_ZEROS_Z = "zeros.z"  # 1 GiB of zeros, zlib'd (~1 MB), made once
GIB_ZEROS_GZ = "zeros.gz"


# -- base -----------------------------------------------------------------------------------------------------------
def make_base(work: Path, store: str, families: tuple[str, ...] = FAMILIES) -> dict[str, Any]:
    """What the families' cases start from, made once: the served store (``store``, a copy of the fuzzer's zarr
    base), an extracted store with a one-step run on it (its drafter, checkpoint, run.yaml), a SpecForge and a
    speculators folder, an engine's canned answer and prompts, and the compressed bombs; the metadata families'
    own (``fuzz_metadata.make_base``) under ``metadata``, each only where ``families`` need it."""
    own = {"store": store}
    if set(families) & set(fuzz_metadata.METADATA):
        own["metadata"] = fuzz_metadata.make_base(work, FAST)
    if not set(families) & set(FAMILIES):
        return own
    from hsstore.extract.job import ExtractSettings, run_extract
    from hsstore.extract.tiny import demo_conversations_path, tiny_target_dir
    from hsstore.app.schema import build

    b = work / "boundaries"
    b.mkdir(parents=True, exist_ok=True)
    inp = b / "in.jsonl"
    inp.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:4]) + "\n")
    run_store = b / "run-store"
    run_extract(build(ExtractSettings, model=str(tiny_target_dir()), input=[str(inp)], out=str(run_store),
                      device="cpu", progress=False))
    run = b / "run"
    subprocess.run([sys.executable, "-m", "hsstore", "train", "--store", str(run_store), "--out", str(run), "--steps",
                    "1", "--save-every", "1", "--log-samples", *FAST], check=True, capture_output=True)
    _peer_folders(b)
    engine = b / "engine" / "v1" / "chat"
    engine.mkdir(parents=True)
    (engine / "completions").write_text(json.dumps(ANSWER))
    (b / "prompts.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": f"Question {i}?"}]}) + "\n" for i in range(2)))
    z = zlib.compressobj(9)
    (b / GIB_ZEROS_Z).write_bytes(b"".join(z.compress(bytes(64 << 20)) for _ in range(16)) + z.flush())
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    (b / GIB_ZEROS_GZ).write_bytes(b"".join(z.compress(bytes(64 << 20)) for _ in range(16)) + z.flush())
    return {**own, "dir": str(b), "run_store": str(run_store), "run": str(run), "inputs": str(inp),
            "model": str(tiny_target_dir())}


ANSWER = {"id": "x", "object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "finish_reason": "stop",
     "message": {"role": "assistant", "content": "Fine.", "reasoning_content": "Think."}}]}


def _peer_folders(b: Path) -> None:
    import pyarrow as pa
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(3):
        T = int(torch.randint(5, 40, (1,), generator=g))
        samples.append({"input_ids": torch.randint(1, 500, (T,), generator=g),
                        "loss_mask": torch.ones(T, dtype=torch.int64),
                        "hidden_states": torch.randn(T, 3, 48, generator=g).to(torch.bfloat16)})
    sf = b / "specforge" / "rows_0-4"
    sf.mkdir(parents=True)
    for i, s in enumerate(samples):
        torch.save(s, sf / f"data_{i}.ckpt")
    sp = b / "speculators"
    (sp / "hidden_states").mkdir(parents=True)
    table = pa.table({"input_ids": [s["input_ids"].tolist() for s in samples],
                      "loss_mask": [s["loss_mask"].tolist() for s in samples]})
    with pa.OSFile(str(sp / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (sp / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    for i, s in enumerate(samples):
        save_file({"hidden_states": s["hidden_states"].contiguous(), "token_ids": s["input_ids"]},
                  str(sp / "hidden_states" / f"hs_{i}.safetensors"))


# -- sentinels: what must be neither read nor changed -----------------------------------------------------------------
def plant_sentinel(d: Path) -> Path:
    """``d/sentinel``: a secret file and a victim folder, their access times set before their modification times,
    so that a read of one moves it (``relatime``)."""
    s = d / "sentinel"
    (s / "victim").mkdir(parents=True)
    (s / "secret").write_bytes(b"sentinel: never read, never written\n" * 100)
    (s / "passwd").write_bytes(PASSWD)  # what a link "to /etc/passwd" points at
    for name in ("a.txt", "b.bin"):
        (s / "victim" / name).write_bytes(b"the user's own file\n")
    return s


def age_atimes(s: Path) -> dict[str, int]:
    out = {}
    for p in sorted(s.rglob("*")):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            os.utime(p, ns=(st.st_mtime_ns - 100 * 10 ** 9, st.st_mtime_ns))  # (the modification time kept exact)
            out[str(p)] = p.stat().st_atime_ns
    return out


# -- forging ----------------------------------------------------------------------------------------------------------
def _files(root: Path, pred: Callable[[Path], bool] = lambda p: True) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and pred(p))


def _flip(rng: random.Random, p: Path, head: int | None = None) -> str:
    if not plain_file(p):
        return f"flip {p.name}: not a plain file now"
    data = bytearray(p.read_bytes())
    if not data:
        return f"flip {p.name}: empty"
    span = min(len(data), head or len(data))
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(span)] ^= 1 << rng.randrange(8)
    p.write_bytes(bytes(data))
    return f"flip {p.name}"


def forge_drafter(rng, d: Path, base: dict, sentinel: Path) -> list[str]:
    folder = d / "drafter"
    shutil.copytree(Path(base["run"]) / "drafter", folder)
    done = []
    for _ in range(rng.randint(1, 2)):
        what = rng.choice(["config", "config", "meta", "link", "header", "weights"])
        if what == "config":
            done.append(json_edit(rng, folder / "config.json"))
        elif what == "meta":
            done.append(json_edit(rng, folder / "hsstore_drafter.json"))
        elif what == "link":
            done.append(link_or_odd(rng, folder / rng.choice(["config.json", "model.safetensors",
                                                                "hsstore_drafter.json"]), sentinel))
        elif what == "header":
            done.append(_flip(rng, folder / "model.safetensors", head=256))
        else:
            done.append(_flip(rng, folder / "model.safetensors"))
    return done


# the names a resumed run reads or writes, for links and odd files planted there
RUN_NAMES = ["metrics.jsonl", "samples.rank00000.jsonl", "run.yaml", "train_config.json", "checkpoints/best",
             "checkpoints/.tmp-step_00000002", "checkpoints/step_00000002", "checkpoints/step_00000001",
             "checkpoints", "drafter", "drafter/model.safetensors", ".tmp-drafter",
             "checkpoints/step_00000001/trainer.json", "checkpoints/step_00000001/loader.rank00000.json",
             "checkpoints/step_00000001/optimizer.safetensors", "checkpoints/step_00000001/master_weights.safetensors",
             "checkpoints/step_00000001/rank00000.safetensors", "checkpoints/step_00000001/config.json"]


def forge_run(rng, d: Path, base: dict, sentinel: Path) -> list[str]:
    run = d / "run"
    shutil.copytree(base["run"], run, symlinks=True)
    ck = run / "checkpoints" / "step_00000001"
    done = []
    for _ in range(rng.randint(1, 2)):
        what = rng.choice(["trainer", "trainer", "loader", "bomb", "plant", "plant", "tensors", "metrics", "best"])
        if what == "trainer":
            done.append(json_edit(rng, ck / "trainer.json"))
        elif what == "loader":
            done.append(json_edit(rng, ck / "loader.rank00000.json"))
        elif what == "bomb":
            p = ck / "loader.rank00000.json"
            try:
                doc = json.loads(p.read_text()) if plain_file(p) else None
            except ValueError:
                doc = None
            if isinstance(doc, dict):
                doc["done"] = base64.b64encode((Path(base["dir"]) / GIB_ZEROS_Z).read_bytes()).decode()
                p.write_text(json.dumps(doc))
            done.append("zlib bomb in loader state")
        elif what == "plant":
            done.append(link_or_odd(rng, run / rng.choice(RUN_NAMES), sentinel))
        elif what == "tensors":
            p = ck / rng.choice(["optimizer.safetensors", "master_weights.safetensors", "rank00000.safetensors"])
            done.append(_flip(rng, p, head=rng.choice([256, None])))
        elif what == "metrics":
            if plain_file(run / "metrics.jsonl"):
                with open(run / "metrics.jsonl", "ab") as f:
                    f.write(rng.choice([b"{not json\n", b'{"step": "x"}\n', b"[" * 100_000 + b"\n",
                                        os.urandom(200)]))
            done.append("junk line in metrics.jsonl")
        else:
            pointer = json.dumps({"format": "hsstore-best-checkpoint",
                                  "checkpoint": rng.choice(["../../sentinel", "step_9", 5])})
            if (run / "checkpoints").is_dir() and not (run / "checkpoints").is_symlink():
                replace_path(run / "checkpoints" / "best", lambda q: q.write_text(pointer))
            done.append("best pointer forged")
    return done


class _RunsCode:
    """What a hostile peer pickles: unpickled, it runs ``touch MARKER`` (``torch.load(weights_only=True)`` refuses)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def forge_peer(rng, d: Path, base: dict, sentinel: Path) -> tuple[str, list[str]]:
    fmt = rng.choice(["specforge", "speculators"])
    folder = d / "peer"
    shutil.copytree(Path(base["dir"]) / fmt, folder)
    done = []
    for _ in range(rng.randint(1, 2)):
        files = _files(folder, plain_file)
        what = rng.choice(["odd", "odd", "flip", "gzip bomb", "pickle", "state", "outside"])
        if what == "odd" and files:
            done.append(link_or_odd(rng, rng.choice(files), sentinel))
        elif what == "flip" and files:
            done.append(_flip(rng, rng.choice(files)))
        elif what == "gzip bomb" and fmt == "specforge":
            bomb = (Path(base["dir"]) / GIB_ZEROS_GZ).read_bytes()
            replace_path(folder / "rows_0-4" / "data_1.ckpt", lambda q: q.write_bytes(bomb))
            done.append("gzip bomb data_1.ckpt")
        elif what == "pickle" and fmt == "specforge":
            import pickle

            code = pickle.dumps({"input_ids": _RunsCode(d / "pickle-ran")})
            replace_path(folder / "rows_0-4" / "data_2.ckpt", lambda q: q.write_bytes(code))
            done.append("pickle that runs code")
        elif what == "state" and fmt == "speculators":
            name = rng.choice([str(sentinel / "secret"), "../sentinel/secret", "%2e%2e/x.arrow", "a//b.arrow", 5,
                               "hidden_states/hs_0.safetensors"])
            replace_path(folder / "state.json", lambda q: q.write_text(json.dumps({"_data_files": [{"filename": name}]})))
            done.append(f"state.json names {name!r}")
        elif what == "outside":
            link = folder / ("rows_9-9" if fmt == "specforge" else "hidden_states/x")
            if (folder / "hidden_states").is_dir() or fmt == "specforge":
                with contextlib.suppress(FileExistsError):
                    os.symlink(sentinel / "victim", link)
            done.append("a folder link out")
        else:
            done.append(_flip(rng, rng.choice(files)) if files else "nothing")
    return fmt, done


def random_yaml(rng: random.Random) -> bytes:
    """A --config file: sections of the real flags' keys with hostile values, or a hostile shape."""
    kind = rng.choice(["values", "values", "values", "aliases", "deep", "tag", "junk", "huge"])
    if kind == "aliases":
        levels, width = rng.randint(3, 12), rng.randint(2, 12)
        text = f"a: &a [{','.join(['x'] * width)}]\n"
        for i in range(1, levels):
            text += f"{chr(97 + i)}: &{chr(97 + i)} [{','.join('*' + chr(96 + i) for _ in range(width))}]\n"
        return text.encode()
    if kind == "deep":
        n = rng.choice([65, 200, 5000, 100_000])
        return ("run: " + "[" * n + "]" * n + "\n").encode() if rng.random() < 0.5 else \
            ("".join("  " * i + f"k{i}:\n" for i in range(min(n, 3000))) + "  " * min(n, 3000) + "v: 1\n").encode()
    if kind == "tag":
        return rng.choice([b"run: !!python/object/apply:os.system ['echo pwned']\n",
                           b"run: !!python/name:os.system\n", b"options: !!binary aGVsbG8=\n",
                           b"x: !custom {a: 1}\n"])
    if kind == "junk":
        return os.urandom(rng.randint(1, 400))
    if kind == "huge":
        return b"run:\n  out: " + b"x" * rng.choice([1 << 20, 3 << 20]) + b"\n"
    keys = {"run": ["store", "out", "steps", "epochs", "device"], "batch": ["token_budget", "anchors"],
            "training": ["seed", "lr"], "options": ["config", "verbose", "quiet"], "nonsense": ["x"]}
    doc = {}
    for sec in rng.sample(sorted(keys), rng.randint(1, 3)):
        doc[sec] = {k: rng.choice(HOSTILE_JSON) for k in rng.sample(keys[sec], rng.randint(1, len(keys[sec])))}
    return json.dumps(doc).encode()  # JSON is YAML


def forge_engine(rng, d: Path, base: dict, sentinel: Path) -> tuple[str | None, list[str]]:
    served = d / "engine"
    shutil.copytree(Path(base["dir"]) / "engine", served)
    answer = served / "v1" / "chat" / "completions"
    kind = rng.choice([None, "ignore_range", "huge_length", "overrun", "gzip", "trickle", "trickle_head", "redirect",
                       "endless_index"])
    done = [f"engine {kind or 'answers'}"]
    if kind is None or rng.random() < 0.3:
        what = rng.choice(["json", "ids", "junk", "nested"])
        if what == "json":
            done.append(json_edit(rng, answer))
        elif what == "ids":
            doc = dict(ANSWER, prompt_token_ids=list(range(rng.choice([10, 1_000_000]))))
            doc["choices"] = [dict(ANSWER["choices"][0], token_ids=[rng.choice(HOSTILE_JSON)] * 3)]
            replace_path(answer, lambda q: q.write_text(json.dumps(doc)))
            done.append("engine ids forged")
        elif what == "junk":
            junk = os.urandom(rng.randint(0, 300))
            replace_path(answer, lambda q: q.write_bytes(junk))
            done.append("engine answer junk")
        else:
            replace_path(answer, lambda q: q.write_bytes(b"[" * 100_000 + b"]" * 100_000))
            done.append("engine answer nested")
    return kind, done


def http_forge(rng, d: Path, base: dict) -> tuple[str | None, str, list[str]]:
    """A copy of the served store in ``d/served/store`` beside ``d/served/secret`` (outside its prefix); the fault
    and the kind of path it hits."""
    served = d / "served"
    shutil.copytree(base["store"], served / "store")
    (served / "secret").mkdir()
    (served / "secret" / "chunk").write_bytes(b"outside the store's prefix\n" * 50)
    done = []
    if rng.random() < 0.3:  # a record whose file key or location leaves the store once percent-decoded
        shutil.rmtree(served / "store" / "index", ignore_errors=True)
        rec_path = rng.choice(sorted((served / "store" / "commits").glob("*.json")))
        rec = json.loads(rec_path.read_text())
        if rng.random() < 0.5:
            key = rng.choice(sorted(rec["files"]))
            forged = key.rsplit("/", 1)[0] + "/" + "%2e%2e/" * 8 + "secret/chunk"
            rec["files"][forged] = rec["files"].pop(key)
            done.append(f"percent-encoded file key {forged}")
        else:
            rec["location"] = rng.choice(["%2e%2e/secret", "%252e%252e/secret", "..%2fsecret"])
            done.append(f"percent-encoded location {rec['location']}")
        rec_path.write_text(json.dumps(rec))
    kind = rng.choice([None, "ignore_range", "huge_length", "overrun", "gzip", "endless_index", "trickle",
                       "trickle_head", "redirect"])
    where = rng.choice(["manifest.json", "commits", "record", "chunk", "assets", "index", "any"])
    done.append(f"http {kind} on {where}")
    return kind, where, done


HTTP_PATHS: dict[str, Callable[[str], bool]] = {
    "manifest.json": lambda p: p.endswith("/manifest.json"),
    "commits": lambda p: p.rstrip("/").endswith("/commits"),
    "record": lambda p: "/commits/" in p and p.endswith(".json"),
    "chunk": lambda p: "/c/" in p or p.endswith(".tar"),
    "assets": lambda p: "/assets/" in p,
    "index": lambda p: "/index" in p,
    "any": lambda p: True,
}


def forge(family: str, rng: random.Random, base: dict, d: Path) -> dict[str, Any]:
    """One case of ``family`` in folder ``d``: what the driver needs to run it."""
    sentinel = plant_sentinel(d)
    case: dict[str, Any] = {"family": family, "mutations": []}
    try:
        _forge_family(family, rng, base, d, sentinel, case)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError, OSError, MemoryError) as e:
        case["mutations"].append(f"forging stopped: {type(e).__name__}")  # what it forged so far is the case
    from tools.fuzz_oracles import tree_digest

    case["sentinel"] = tree_digest(sentinel)
    case["atimes"] = age_atimes(sentinel)
    return case


def _forge_family(family: str, rng: random.Random, base: dict, d: Path, sentinel: Path, case: dict) -> None:
    if family == "drafter":
        case["mutations"] = forge_drafter(rng, d, base, sentinel)
        case["eval"] = rng.random() < 0.4
    elif family == "run":
        case["mutations"] = forge_run(rng, d, base, sentinel)
    elif family == "peer":
        case["format"], case["mutations"] = forge_peer(rng, d, base, sentinel)
    elif family == "config":
        (d / "run.yaml").write_bytes(random_yaml(rng))
        if rng.random() < 0.1:  # (the file named may be a link: the user's own, so never one to the sentinel)
            kind = rng.choice(["fifo", "zero", "huge"])
            replace_path(d / "run.yaml", os.mkfifo if kind == "fifo" else (lambda q: os.symlink("/dev/zero", q))
                     if kind == "zero" else (lambda q: (q.write_bytes(b"run: {}\n"), os.truncate(q, 3 << 30))))
        case["mutations"] = ["config"]
    elif family == "engine":
        case["fault"], case["mutations"] = forge_engine(rng, d, base, sentinel)
    elif family == "http":
        case["fault"], case["where"], case["mutations"] = http_forge(rng, d, base)
    elif family == "s3":
        case["fault"] = rng.choice(["trickle", "overrun", "huge_length", "endless_list", "short", "truncate"])
        case["where"] = rng.choice(["manifest", "record", "chunk", "list", "any"])
        case["mutations"] = [f"s3 {case['fault']} on {case['where']}"]
    elif family in fuzz_metadata.METADATA:
        fuzz_metadata.forge(family, rng, base["metadata"], d, sentinel, case)
    else:
        raise KeyError(f"unknown family {family!r}")


# -- driving ------------------------------------------------------------------------------------------------------
S3_PATHS: dict[str, Callable[[str, str], bool]] = {
    "manifest": lambda m, p: m == "GET" and p.split("?")[0].endswith("/manifest.json"),
    "record": lambda m, p: m == "GET" and "/commits/" in p.split("?")[0],
    "chunk": lambda m, p: m == "GET" and "/c/" in p,
    "list": lambda m, p: m == "GET" and "list-type=2" in p,
    "any": lambda m, p: m == "GET",
}


class S3:
    """moto's server in the driver, the fuzzer's served store uploaded once under ``bucket/store``, and
    ``bucket/secret`` beside it (outside the store's prefix)."""

    _one: "S3 | None" = None

    def __init__(self, store: str) -> None:
        import s3fs
        from moto.server import ThreadedMotoServer

        from hsstore.testing.ports import free_port

        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                     "AWS_DEFAULT_REGION": "us-east-1"}.items():
            os.environ[k] = v
        import logging

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server's request lines: not a command's
        port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        s3fs.S3FileSystem.connect_timeout = 60
        fs = s3fs.S3FileSystem(endpoint_url=self.endpoint)
        fs.mkdir("fuzz")
        fs.put(store.rstrip("/") + "/", "fuzz/store", recursive=True)
        fs.pipe("fuzz/secret", b"outside the store's prefix\n")

    @classmethod
    def get(cls, store: str) -> "S3":
        if cls._one is None:
            cls._one = S3(store)
        return cls._one


def commands(case: dict, base: dict, d: Path, stack: contextlib.ExitStack) -> tuple[dict[str, list[str]], Callable]:
    """The commands of a case (argv of ``hsstore``) and a check run after them: what it read outside its input."""
    from hsstore.testing.faultproxy import FaultProxy
    from hsstore.testing.hostile_http import HostileHTTPServer

    fam = case["family"]
    none = (lambda: [])
    if fam == "drafter":
        cmds = {"export_drafter": ["export-drafter", str(d / "drafter"), str(d / "exported")]}
        if case.get("eval"):
            cmds["eval"] = ["eval", "--store", base["run_store"], "--drafter", str(d / "drafter"), "--device", "cpu",
                            "-q"]
        return cmds, none
    if fam == "run":
        return {"train_resume": ["train", "--store", base["run_store"], "--out", str(d / "run"), "--steps", "2",
                                 "--save-every", "1", "--log-samples", *FAST]}, none
    if fam == "peer":
        return {"import": ["import", case.get("format", "specforge"), str(d / "peer"), "--out", str(d / "imported"), "--layers",
                           "1,3,5", "--model-name", "peer", "--num-layers", "8", "--hidden-size", "48",
                           "--config-hash", "c", "--tokenizer-hash", "t", "-q"]}, \
            (lambda: ["a pickle's code ran"] if (d / "pickle-ran").exists() else [])
    if fam == "config":
        return {"train_config": ["train", "--config", str(d / "run.yaml"), "--store", str(d / "no-store"), "--out",
                                 str(d / "out"), "-q"],
                "extract_config": ["extract", "--config", str(d / "run.yaml"), "--model", str(d / "no-model"),
                                   "--input", str(d / "no-input"), "--out", str(d / "out2"), "-q"]}, none
    if fam == "engine":
        other = stack.enter_context(HostileHTTPServer(str(d / "sentinel")))
        faults = [(case["fault"], lambda p: "/v1/" in p)] if case.get("fault") else []
        srv = stack.enter_context(HostileHTTPServer(str(d / "engine"), faults, redirect_to=other.url))
        if case.get("fault") == "gzip":
            srv.bomb()  # made before the command (seconds of compression: not the answer's time)
        return {"regenerate": ["regenerate", "--server", srv.url, "--model", "m", "--input",
                               str(Path(base["dir"]) / "prompts.jsonl"), "--out", str(d / "answers.jsonl"),
                               "--timeout", ENGINE_TIMEOUT_S, "--retries", "1", "-q"]}, \
            (lambda: [f"asked the redirect's host {other.paths[:2]}"] if other.paths else [])
    if fam == "http":
        other = stack.enter_context(HostileHTTPServer(str(d / "sentinel")))
        faults = [(case["fault"], HTTP_PATHS[case.get("where", "any")])] if case.get("fault") else []
        srv = stack.enter_context(HostileHTTPServer(str(d / "served"), faults, redirect_to=other.url))
        if case.get("fault") == "gzip":
            srv.bomb()
        url = f"{srv.url}/store"

        def outside() -> list[str]:
            bad = [p for p in srv.paths if not p.startswith("/store")]
            return ([f"asked {bad[:2]} outside the store's prefix"] if bad else []) + \
                ([f"asked the redirect's host {other.paths[:2]}"] if other.paths else [])
        return {"info": ["info", url], "verify": ["verify", url, "-q"],
                "merge": ["merge", str(d / "merged"), url, "-q"]}, outside
    if fam == "s3":
        s3 = S3.get(base["store"])
        proxy = stack.enter_context(FaultProxy(s3.endpoint, faults=[case["fault"]], persistent=True,
                                               match=S3_PATHS[case["where"]]))
        url, opt = "s3://fuzz/store", ["-S", f"endpoint_url={proxy.url}"]

        def outside() -> list[str]:
            bad = [p for p in proxy.sent if p.startswith("/fuzz/") and not p.startswith("/fuzz/store")]
            return [f"fetched {bad[:2]} outside the store's prefix"] if bad else []
        return {"info": ["info", url, *opt], "verify": ["verify", url, "-q", *opt]}, outside
    raise ValueError(fam)


def drive(case: dict, base: dict) -> dict:
    """Run a case's commands (``fuzz_oracles.run_command``: alarm, captured output, memory), then the checks of what
    they read outside their input."""
    from hsstore.app.cli import main
    from tools.fuzz_oracles import run_command, sentinel_failures

    if case["family"] in fuzz_metadata.METADATA:
        return fuzz_metadata.drive(case, base)
    d = Path(case["dir"])
    results, failures = {}, []
    saved = {k: os.environ.get(k) for k in DEADLINES}
    os.environ.update(DEADLINES)
    try:
        with contextlib.ExitStack() as stack:
            cmds, outside = commands(case, base, d, stack)
            for name, argv in cmds.items():
                results[name], problems, _ = run_command(name, lambda argv=argv: main(argv), log_dir=d)
                failures += problems
            failures += outside()
    except Exception as e:  # noqa: BLE001 (a case the driver could not set up is a failure to see)
        failures.append(f"driver: {type(e).__name__}: {str(e)[:200]}")
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    failures += sentinel_failures(case, d)
    return {"case": case["case"], "results": results, "failures": failures}
