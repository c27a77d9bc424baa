"""ProcessWriter: a :class:`StoreWriter` that runs in a child process, fed through shared memory.

Why: during extraction the Python thread that launches the GPU's kernels shares one interpreter (and its GIL, its
cores' caches) with everything the writer does: copying samples into shard buffers, checksums, file writes, fsync:
in-process, that work slows the forward (docs/PERFORMANCE.md). Here the writer lives in its own process. The
producer copies features from the GPU straight into a *staging* buffer of shared memory (pinned for the GPU by the
producer), then sends only the sample's place in it plus its ids and mask; the child copies from there into its
shard buffers and uploads. ``sync()`` returns once the child has taken everything sent so far, so the producer knows
when a staging region may be reused.

The child is this package's own code, started with ``spawn`` (safe after CUDA has been initialised);
the pipe between the two carries plain tuples of str/int/numpy arrays, never data from outside.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import tempfile
from typing import Any

import numpy as np
import torch

from ..format import fp8
from ..format.sessions import SlotHeld
from ..io import storage
from ..errors import CorruptionError, ManifestError, SampleError, StoreError
from ..locks import ProcessLock
from ..format.manifest import Manifest
from .writer import StoreWriter

log = logging.getLogger(__name__)

_ERRORS = {c.__name__: c for c in (StoreError, SampleError, ManifestError, CorruptionError, SlotHeld, ValueError,
                                   OSError)}


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class ProcessWriter:
    """Like :class:`StoreWriter` (same ``add``/``note_skipped``/``close``), but the writing happens in a
    child process. Features passed to ``add`` must lie in a buffer from :meth:`staging` and must stay
    untouched until the next :meth:`sync` returns."""

    def __init__(self, url: str, manifest: Manifest, *, storage_options: dict[str, Any] | None = None,
                 **writer_kwargs: Any) -> None:
        self.url = url
        self.storage_options = storage_options or {}
        self.fs, self.root = storage.resolve(url, self.storage_options)
        self.bytes_written = 0
        self.committed_shards = 0
        self.wait_s = 0.0  # the child writer's back-pressure time (see StoreWriter.wait_s)
        self._buffers: list[tuple[int, int]] = []  # staging buffers: (data_ptr, nbytes)
        self._tensors: list[torch.Tensor] = []
        self._closed = False
        # one conversation on the pipe at a time: extraction's main thread asks for staging buffers while its
        # consumer thread adds and syncs, and a reply taken by the other thread is a reply lost
        self._talk = ProcessLock()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, name="hsstore-writer",
                                 args=(child, url, manifest.to_json(), self.storage_options, writer_kwargs),
                                 daemon=True)
        self._proc.start()
        child.close()
        reply = self._recv()  # the child has opened the store (manifest checked) or failed doing so
        self.manifest = Manifest.from_json(reply[1], url)
        self.layers = list(self.manifest.layers)
        self.fp8 = self.manifest.encoding == fp8.ENCODING

    # -- staging -------------------------------------------------------------------------------
    def staging(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` tensor of ``nbytes`` in memory shared with the child (pin it for GPU copies)."""
        fd, path = tempfile.mkstemp(prefix="hsstore-staging-", dir=_shm_dir())
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        try:
            t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            with self._talk:
                self._send(("map", path, nbytes))
                self._recv()
        finally:
            os.unlink(path)  # both processes hold a mapping; nothing is left behind if either dies
        self._buffers.append((t.data_ptr(), nbytes))
        self._tensors.append(t)
        return t

    def _locate(self, x: torch.Tensor, where: str) -> tuple[int, int]:
        if not x.is_contiguous():
            raise SampleError(f"{where}: features must be contiguous in a staging buffer")
        start, n = x.data_ptr(), x.numel() * x.element_size()
        for k, (ptr, size) in enumerate(self._buffers):
            if ptr <= start and start + n <= ptr + size:
                return k, start - ptr
        raise SampleError(f"{where}: features are not in a staging buffer of this ProcessWriter")

    # -- the StoreWriter surface ----------------------------------------------------------------
    def add(self, sample_id: str, input_ids, loss_mask, hidden_states: torch.Tensor | fp8.Quantised, *,
            source: str = "", thinking_tokens: int = 0, flags: list[str] | None = None,
            feature_stats: np.ndarray | None = None) -> None:
        """Queue one sample whose ``hidden_states`` ``[T, n_layers, H]`` (or fp8 values and scales) lie in
        staging buffers (``feature_stats``: as ``StoreWriter.add`` takes them, a small numpy array)."""
        self._check_open()
        where = f"sample {sample_id!r}"
        tensors = list(hidden_states) if isinstance(hidden_states, fp8.Quantised) else [hidden_states]
        parts = [(*self._locate(t, where), tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]
        ids = np.asarray(torch.as_tensor(input_ids).cpu()).reshape(-1)
        mask = np.asarray(torch.as_tensor(loss_mask).cpu()).reshape(-1)
        with self._talk:
            self._raise_reported()
            self._send(("add", parts, str(sample_id), ids, mask,
                        {"source": source, "thinking_tokens": thinking_tokens, "flags": flags,
                         "feature_stats": None if feature_stats is None else np.asarray(feature_stats, np.float64)}))

    def note_skipped(self, reason: str, sample_ids: list[str]) -> None:
        self._check_open()
        with self._talk:
            self._send(("skip", reason, [str(s) for s in sample_ids]))

    def sync(self) -> None:
        """Return once the child has copied every sample sent so far out of the staging buffers."""
        self._check_open()
        with self._talk:
            self._send(("sync",))
            self._progress(self._recv()[1])

    def close(self, commit: bool = True) -> None:
        """Commit what is buffered (``commit=True``) or drop it; wait for the child to finish."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._proc.is_alive():
                with self._talk:
                    self._send(("close", commit))
                    self._progress(self._recv()[1])
        finally:
            self._proc.join(timeout=60)
            if self._proc.is_alive():
                self._proc.kill()
            self._conn.close()
            self._tensors.clear()

    def __enter__(self) -> "ProcessWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(commit=exc_type is None)

    # -- plumbing ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("writer is closed")

    def _send(self, msg: tuple) -> None:
        try:
            self._conn.send(msg)
        except (BrokenPipeError, ConnectionResetError):
            self._proc.join(timeout=5)
            raise StoreError(f"the writer process of store {self.url!r} died "
                             f"(exit code {self._proc.exitcode})") from None

    def _progress(self, p: dict) -> None:
        self.bytes_written, self.committed_shards, self.wait_s = p["bytes_written"], p["committed"], p["wait_s"]

    def _raise_reported(self) -> None:
        """Raise an error the child already reported, without waiting (it sends nothing else unasked)."""
        if self._conn.poll():
            self._recv()

    def _recv(self) -> tuple:
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise StoreError(f"the writer process of store {self.url!r} died "
                                 f"(exit code {self._proc.exitcode}); nothing it had not committed is visible")
        try:
            msg = self._conn.recv()
        except EOFError:
            raise StoreError(f"the writer process of store {self.url!r} died "
                             f"(exit code {self._proc.exitcode})") from None
        if msg[0] == "error":
            self._closed = True
            self._proc.join(timeout=60)
            raise _ERRORS.get(msg[1], StoreError)(msg[2])
        return msg


def _progress(writer: StoreWriter) -> dict:
    return {"bytes_written": writer.bytes_written, "committed": len(writer.committed), "wait_s": writer.wait_s}


def _serve(conn, url: str, manifest_json: bytes, storage_options: dict, writer_kwargs: dict) -> None:
    """The child: a plain StoreWriter fed from the pipe. The first error is reported, then it exits
    after dropping (never committing) what it had buffered."""
    views: list[np.ndarray] = []
    writer = None
    try:
        writer = StoreWriter(url, Manifest.from_json(manifest_json, url), storage_options=storage_options,
                             **writer_kwargs)
        conn.send(("ready", writer.manifest.to_json()))
        while True:
            msg = conn.recv()
            op = msg[0]
            if op == "add":
                _, parts, sample_id, ids, mask, meta = msg
                tensors = [torch.frombuffer(views[k], dtype=getattr(torch, dtype), count=int(np.prod(shape)),
                                            offset=off).view(shape) for k, off, shape, dtype in parts]
                writer.add(sample_id, ids, mask, fp8.Quantised(*tensors) if len(tensors) == 2 else tensors[0], **meta)
            elif op == "map":
                _, path, nbytes = msg
                views.append(np.memmap(path, dtype=np.uint8, mode="r+", shape=(nbytes,)))
                conn.send(("mapped",))
            elif op == "skip":
                writer.note_skipped(msg[1], msg[2])
            elif op == "sync":
                writer.raise_background_error()
                conn.send(("synced", _progress(writer)))
            elif op == "close":
                writer.close(commit=msg[1])
                conn.send(("closed", _progress(writer)))
                return
    except BaseException as e:  # reported to the parent, which raises it there
        if writer is not None:
            why = ("its producer process ended without closing it" if isinstance(e, EOFError)
                   else f"{type(e).__name__}: {e}")
            try:
                writer.close(commit=False, why=why)
            except BaseException:
                pass
        try:
            conn.send(("error", type(e).__name__, str(e)))
        except (BrokenPipeError, OSError):
            pass
    finally:
        conn.close()
