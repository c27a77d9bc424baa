"""A writer's session in its store (``format/sessions.py``): its tag's slot claimed and the record written when it
opens, a heartbeat while it writes, the end record after a clean close, the error after a failed one. Followers (``--follow``) end epoch 0
by these records, so a writer that was killed is never taken for one that finished."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time

from ..format import sessions
from ..locks import ProcessLock
from ..format.manifest import now_iso

log = logging.getLogger(__name__)


class WriterSession:
    """``start`` writes the session record and starts the heartbeat thread; ``committed`` counts shards (the next
    heartbeat says so); ``end`` or ``fail`` stop the thread and write the last word. Heartbeats that cannot be
    written are logged, never raised: the shards are what matters, and a follower only waits longer."""

    def __init__(self, fs, root: str, tag: str, session: str, *, expects: list[str] | None = None,
                 planned_samples: int | None = None, planned_tokens: int | None = None) -> None:
        self.fs, self.root = fs, root
        self.record = sessions.new_session(tag, session, host=socket.gethostname(), pid=os.getpid(), expects=expects,
                                           planned_samples=planned_samples, planned_tokens=planned_tokens)
        self._lock = ProcessLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def start(self, url: str) -> None:
        """Claim the writer tag's slot (``SlotHeld`` when a session that still writes holds it: nothing written),
        then write the session record and start beating."""
        sessions.claim_slot(self.fs, self.root, url, self.record)
        sessions.write_session(self.fs, self.root, self.record)  # raises: a store it cannot write is no store
        self._thread = threading.Thread(target=self._beat, name="hsstore-writer-heartbeat", daemon=True)
        self._thread.start()

    def committed(self, shards: int) -> None:
        with self._lock:
            self.record.committed = int(shards)

    def _write(self) -> None:
        with self._lock:
            self.record.heartbeat_unix = time.time()
            rec = dataclasses.replace(self.record, expects=list(self.record.expects))
        try:
            sessions.write_session(self.fs, self.root, rec)
        except Exception as e:
            if not self._warned:
                log.warning("writer session %s: heartbeat not written (%s: %s); followers may report it dead",
                            rec.key, type(e).__name__, e)
                self._warned = True

    def _beat(self) -> None:
        while not self._stop.wait(self.record.heartbeat_s):
            self._write()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def end(self, shards: int, samples: int, tokens: int) -> None:
        """After every shard was committed: the end record (a follower's epoch 0 may now end)."""
        self._halt()
        r = self.record
        try:
            sessions.write_end(self.fs, self.root, sessions.EndRecord(r.writer, r.session, now_iso(), time.time(),
                                                                      int(shards), int(samples), int(tokens)))
        except Exception as e:
            log.warning("writer session %s: end record not written (%s: %s); followers of the store wait for it "
                        "until a later session of %s ends", r.key, type(e).__name__, e, r.writer)

    def fail(self, why: str) -> None:
        """The session stops without finishing: its record says why (a follower waits for a re-run)."""
        self._halt()
        with self._lock:
            self.record.failed = why[:1000] or "stopped"
        self._write()
