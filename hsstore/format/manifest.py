"""The store manifest: what a store holds, and whether two writers or stores may be mixed.

A store is only useful to a team that did not make it if it says which target computed the
features (config hash, layers, hidden size), which tokenizer produced the ids, and which layers
were tapped. Anything that changes the meaning of the numbers is part of the compatibility key.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from . import encodings, layout_spec
from ..io import door, storage
from ..errors import ManifestError, StoreError
from ..io.storage import MANIFEST_FILE

FORMAT_NAME = "hsstore"
FORMAT_VERSION = 2  # 2: commit records list each chunk's payload CRC32C (docs/FORMAT.md, version history)
DTYPES = ("bfloat16", "float16", "float32")
ENCODINGS = encodings.NAMES  # raw: values as computed; the others: format/encodings.py
# stored features that are not a layer's output: ``final_hidden`` is the final norm's output (what the lm_head
# reads, EAGLE-3's training target). Named in the manifest's ``features``; absent from stores without them.
FEATURES = ("final_hidden",)
# keys of ``extra`` whose value is an object keyed by writer tag (``rank00000``), each writer adding its own entry to
# the manifest in force (``StoreWriter``: ``merge_writer_extra``): ``compile_check``, a compiled extraction's check
# of its first batch against the eager forward (extract/compile_check.py; docs/FORMAT.md)
PER_WRITER_EXTRA = ("compile_check",)


def sha256_hex(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()


def canonical_json_hash(obj: Any) -> str:
    """Hash of a JSON-able object that does not depend on key order or whitespace."""
    return sha256_hex(json.dumps(obj, sort_keys=True, separators=(",", ":")))


@dataclass(frozen=True)
class TargetIdentity:
    """The model whose hidden states are stored. ``config_hash`` covers the architecture;
    ``weights_hash`` (optional) tells two random inits of the same config apart."""

    name: str
    num_layers: int
    hidden_size: int
    config_hash: str
    revision: str | None = None
    model_type: str | None = None
    weights_hash: str | None = None


@dataclass(frozen=True)
class TokenizerIdentity:
    """The tokenizer that produced ``input_ids``: a vocab+special-token hash and a chat-template hash."""

    name: str
    vocab_hash: str
    chat_template_hash: str | None = None
    vocab_size: int | None = None


@dataclass(frozen=True)
class Manifest:
    target: TargetIdentity
    tokenizer: TokenizerIdentity
    layers: tuple[int, ...]
    dtype: str = "bfloat16"
    encoding: str = "raw"
    layout: str = layout_spec.DEFAULT
    codec: str = "none"
    chunk_tokens: int | None = None  # None: the writer picks ~16 MiB per layer chunk
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    created_by: str = ""
    created_at: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    features: tuple[str, ...] = ()  # non-layer features (FEATURES), stored after the layers; () in most stores

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", tuple(self.features))
        validate_fields(self)

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def all_features(self) -> list:
        """The features a shard stores per token, in order: the layer ids, then the named features
        (``features``: ``final_hidden``)."""
        return list(self.layers) + list(self.features)

    def compat_key(self) -> dict[str, Any]:
        """What must be equal for two writers to share a store or a loader to mix stores."""
        t, k = self.target, self.tokenizer
        return {
            "target": {"config_hash": t.config_hash, "num_layers": t.num_layers, "hidden_size": t.hidden_size,
                       "weights_hash": t.weights_hash},
            "tokenizer": {"vocab_hash": k.vocab_hash, "chat_template_hash": k.chat_template_hash},
            "layers": list(self.layers),
            "dtype": self.dtype,
            "encoding": self.encoding,
            # only when present: stores without features keep the key (and so every shard's manifest_key) they had
            **({"features": list(self.features)} if self.features else {}),
        }

    def shard_key(self) -> str:
        """Hash of what the bytes of a shard depend on (compatibility key, codec, chunk grid). Every commit
        record carries the key it was written under, so a manifest edited afterwards is detected."""
        return canonical_json_hash({**self.compat_key(), "codec": self.codec, "chunk_tokens": self.chunk_tokens})

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["layers"] = list(self.layers)
        if self.features:
            d["features"] = list(self.features)
        else:  # absent, as before the field existed: older hsstore reads such a store unchanged
            del d["features"]
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "manifest") -> "Manifest":
        return cls.from_dict(door.load_json(text, where, error=ManifestError), where)

    @classmethod
    def from_dict(cls, d: Any, where: str = "manifest") -> "Manifest":
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: expected a JSON object")
        if d.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where}: not an hsstore manifest (format={d.get('format')!r})")
        version = d.get("format_version")
        if not is_int(version):
            raise ManifestError(f"{where}: format_version missing or not an integer")
        if version > FORMAT_VERSION:
            raise NewerFormat(
                f"{where}: store has format version {version}, this hsstore reads up to {FORMAT_VERSION}; "
                "upgrade hsstore")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ManifestError(f"{where}: unknown fields {sorted(unknown)}")
        try:
            if not isinstance(d["layers"], list) or not isinstance(d.get("features", []), list):
                raise ManifestError("layers must be a list of integers, features a list of names")
            for part, kind in (("target", TargetIdentity), ("tokenizer", TokenizerIdentity)):
                odd = _fields_problem(kind, d[part])
                if odd:
                    raise ManifestError(f"field {part}{odd}")
            target = TargetIdentity(**d["target"])
            tokenizer = TokenizerIdentity(**d["tokenizer"])
            rest = {k: v for k, v in d.items() if k not in ("target", "tokenizer", "layers")}
            return cls(target=target, tokenizer=tokenizer, layers=tuple(d["layers"]), **rest)
        except ManifestError as e:
            raise ManifestError(f"{where}: {e}") from None
        except KeyError as e:
            raise ManifestError(f"{where}: field {e.args[0]!r}: missing") from None
        except TypeError as e:
            raise ManifestError(f"{where}: a field of the wrong type ({type(e).__name__})") from None


def _fields_problem(kind, d: Any) -> str | None:
    """What keeps ``d`` from being ``kind``'s fields, from the field's name on (``.x: unknown``), or None."""
    if not isinstance(d, dict):
        return " must be an object"
    fields = {f.name: f for f in dataclasses.fields(kind)}
    unknown = sorted((k for k in d if k not in fields), key=str)
    if unknown:
        return f".{str(unknown[0])[:64]}: not a field of the manifest"
    missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in d]
    return f".{missing[0]}: missing" if missing else None


# what a reader accepts (docs/FORMAT.md, "Limits"): far above any real target, far below what would let a
# forged manifest size a buffer of terabytes
MAX_LAYERS = 100_000
MAX_HIDDEN = 1 << 20
MAX_CHUNK_BYTES = 1 << 31  # one chunk of one feature
MAX_TEXT = 4096  # any identity string (names, hashes, revisions)


def is_int(x: Any) -> bool:
    """An integer that is not a bool (JSON's ``true`` parses as Python's ``True``, an ``int``)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _check_text(what: str, value: Any, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ManifestError(f"{what} must be a string of at most {MAX_TEXT} characters, got {type(value).__name__}")


def validate_fields(m: Manifest) -> None:
    """Schema checks: types and ranges, so a hand-edited (or forged) manifest fails loudly, not later."""
    t, k = m.target, m.tokenizer
    if not is_int(t.num_layers) or not 0 < t.num_layers <= MAX_LAYERS:
        raise ManifestError(f"target.num_layers must be a positive integer of at most {MAX_LAYERS:,}, got "
                            f"{t.num_layers!r}")
    if not is_int(t.hidden_size) or not 0 < t.hidden_size <= MAX_HIDDEN:
        raise ManifestError(f"target.hidden_size must be a positive integer of at most {MAX_HIDDEN:,}, got "
                            f"{t.hidden_size!r}")
    for what, value, optional in (("target.name", t.name, False), ("target.config_hash", t.config_hash, False),
                                  ("target.revision", t.revision, True), ("target.model_type", t.model_type, True),
                                  ("target.weights_hash", t.weights_hash, True), ("tokenizer.name", k.name, False),
                                  ("tokenizer.vocab_hash", k.vocab_hash, False),
                                  ("tokenizer.chat_template_hash", k.chat_template_hash, True),
                                  ("created_by", m.created_by, False), ("created_at", m.created_at, False),
                                  ("codec", m.codec, False)):
        _check_text(what, value, optional)
    if k.vocab_size is not None and (not is_int(k.vocab_size) or not 0 < k.vocab_size <= 1 << 31):
        raise ManifestError(f"tokenizer.vocab_size must be a positive integer, got {k.vocab_size!r}")
    if not isinstance(m.extra, dict):
        raise ManifestError(f"extra must be an object, got {type(m.extra).__name__}")
    if not is_int(m.format_version):
        raise ManifestError(f"format_version must be an integer, got {m.format_version!r}")
    if not m.layers or len(m.layers) > MAX_LAYERS or not all(is_int(x) for x in m.layers):
        raise ManifestError(f"layers must be a non-empty list of integers, got {list(m.layers)[:8]!r}")
    if len(set(m.layers)) != len(m.layers) or list(m.layers) != sorted(m.layers):
        raise ManifestError(f"layers must be strictly increasing, got {list(m.layers)}")
    bad = [x for x in m.layers if not 0 <= x < t.num_layers]
    if bad:
        raise ManifestError(f"layer ids {bad} out of range for a target with {t.num_layers} decoder layers "
                            f"(valid: 0..{t.num_layers - 1})")
    if m.dtype not in DTYPES:
        raise ManifestError(f"dtype {m.dtype!r} not supported (one of {DTYPES})")
    if m.encoding not in ENCODINGS:
        raise ManifestError(f"encoding {m.encoding!r} not supported (one of {ENCODINGS})")
    refused = (layout_spec.refusal(m.layout, m.codec, m.encoding)  # each layout's own rules (its LayoutSpec)
               or encodings.get(m.encoding).refusal(t.hidden_size))
    if refused:
        raise ManifestError(refused)
    bad = [f for f in m.features if f not in FEATURES]
    if bad or len(set(m.features)) != len(m.features):
        raise ManifestError(f"features {list(m.features)!r} not supported (each at most once, of {FEATURES})")
    if m.features and m.encoding != "raw":  # the loader's fp8 path dequantises the layers only
        raise ManifestError(f"features {list(m.features)} are stored with encoding 'raw' only, not {m.encoding!r}")
    if m.chunk_tokens is not None and (not is_int(m.chunk_tokens) or m.chunk_tokens <= 0
                                       or m.chunk_tokens * t.hidden_size * 4 > MAX_CHUNK_BYTES):
        raise ManifestError(f"chunk_tokens must be a positive integer whose chunks are at most {MAX_CHUNK_BYTES:,} "
                            f"bytes, got {m.chunk_tokens!r}")


def check_compatible(a: Manifest, b: Manifest, what_a: str, what_b: str) -> None:
    """Raise naming every field that differs between two manifests' compatibility keys."""
    ka, kb = a.compat_key(), b.compat_key()
    diffs = []
    for key in dict.fromkeys([*ka, *kb]):
        if key not in ka or key not in kb:  # features: one holds final_hidden, the other not
            diffs.append(f"{key}: {ka.get(key, [])!r} vs {kb.get(key, [])!r}")
        elif ka[key] != kb[key]:
            if isinstance(ka[key], dict):
                for sub in ka[key]:
                    va, vb = ka[key][sub], kb[key][sub]
                    if va != vb and not (sub == "weights_hash" and (va is None or vb is None)):
                        diffs.append(f"{key}.{sub}: {va!r} vs {vb!r}")
            else:
                diffs.append(f"{key}: {ka[key]!r} vs {kb[key]!r}")
    if diffs:
        raise ManifestError(f"{what_a} and {what_b} are incompatible (refusing to mix): " + "; ".join(diffs))


class DamagedManifest(ManifestError):
    """A store's ``manifest.json`` is there but is not a manifest (``verify`` reports it as a FAIL line)."""


class NewerFormat(ManifestError):
    """A manifest of a format version this hsstore does not read."""


def read_manifest(fs, root: str, url: str) -> Manifest:
    """The manifest of the store at ``root`` (through ``door``: a regular file of at most ``door.JSON_CAP``
    bytes); a missing one says so, naming the URL, and whether the path exists at all."""
    where = f"{url}/{MANIFEST_FILE}"
    notice = storage.waiting_notice(fs, url)  # an unreachable object store is otherwise silent for a while
    try:
        data = door.read(fs, root, MANIFEST_FILE, bound=door.JSON_CAP, where=f"store {url!r}")
    except FileNotFoundError as e:
        if storage.missing_bucket(fs, root):
            raise StoreError(storage.explain(e, url, "read", fs, root)) from None
        missing = storage.missing_path(fs, root)
        if missing:
            raise ManifestError(f"store {url!r} does not exist: {missing}") from None
        raise ManifestError(f"{url!r} is not an hsstore store: no {MANIFEST_FILE} there") from None
    except StoreError:
        raise
    except Exception as e:
        raise StoreError(storage.explain(e, url, "read", fs, root)) from None
    finally:
        if notice is not None:
            notice.cancel()
    try:
        return Manifest.from_json(data, where=where)
    except NewerFormat:  # not damage: this hsstore is too old for it
        raise
    except ManifestError as e:
        raise DamagedManifest(str(e)) from None


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
