"""Progress shown the way its reader reads it: a bar redrawn in place on a terminal, and where stderr is a file or a
pipe (a batch job's log, CI) one plain line every ``env.PROGRESS_S`` seconds and one at the end, never a carriage
return (a bar redrawn into a file is one line of tens of kilobytes). Every command's progress comes through
:func:`progress_bar`, which takes tqdm's arguments.
"""

from __future__ import annotations

import sys
from typing import Any

from . import env

# a log line: what, how far, how long, how fast (a terminal's bar draws the same figures)
LINE_FORMAT = "{desc}: {percentage:.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
LINE_FORMAT_OPEN = "{desc}: {n_fmt} [{elapsed}, {rate_fmt}{postfix}]"  # no total known


class LineFile:
    """A stream that takes tqdm's redraws (``\\r`` + the bar + padding) and writes each as one plain line."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        line = text.replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def is_terminal(stream=None) -> bool:
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def progress_bar(*args: Any, **kwargs: Any):
    """A tqdm progress bar (tqdm's arguments) on a terminal; elsewhere the same counts as a plain line every
    ``env.PROGRESS_S`` seconds (and at the start and the end)."""
    from tqdm import tqdm

    stream = kwargs.pop("file", None) or sys.stderr
    if is_terminal(stream):
        return tqdm(*args, file=stream, **kwargs)
    every = env.PROGRESS_S.get()
    kwargs.pop("dynamic_ncols", None)
    kwargs.pop("ncols", None)
    total = kwargs.get("total")
    if total is None and args and hasattr(args[0], "__len__"):
        total = len(args[0])
    kwargs.setdefault("bar_format", LINE_FORMAT if total else LINE_FORMAT_OPEN)
    return tqdm(*args, file=LineFile(stream), mininterval=every, maxinterval=max(every, 10.0), **kwargs)
