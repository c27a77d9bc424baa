"""Stopping a run cleanly on Ctrl-C or SIGTERM: at a step boundary, after a checkpoint."""

from __future__ import annotations

import logging
import signal
import threading
import time

log = logging.getLogger(__name__)


class StopOnInterrupt:
    """Ctrl-C (SIGINT) or SIGTERM stops training at a step boundary, after a checkpoint, instead of losing every
    step since the last save; a second Ctrl-C, a few seconds after the first, stops at once.

    Under torchrun every rank gets the signal (from the terminal, and again from the launcher, which forwards it
    and kills the ranks 30 s later), but not at the same step: ``requested`` is this rank's wish, and ``agreed`` is
    set by the step's lockstep all-reduce when any rank asked, so all of them stop after the same step and write
    the checkpoint together."""

    REPEAT_S = 3.0  # a repeat within this time is the same request (torchrun forwards the terminal's signal)

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self.agreed = False
        self._first = 0.0
        self._previous: dict = {}

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.requested:
            if signum == signal.SIGINT and now - self._first > self.REPEAT_S:
                raise KeyboardInterrupt
            return
        self.requested, self._first = True, now
        log.warning("%s: stopping after this step, with a checkpoint (Ctrl-C again to stop at once)",
                    signal.Signals(signum).name)

    def __enter__(self) -> "StopOnInterrupt":
        if self.enabled:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def stopping(self, world: int) -> bool:
        """Stop after this step? One process: when asked; DDP: when the ranks agreed at this step's all-reduce."""
        return self.requested if world == 1 else self.agreed
