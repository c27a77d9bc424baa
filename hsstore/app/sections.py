"""The settings every command family shares, declared once, for the families' schemas (``hsstore.app.settings``,
``hsstore.extract.settings``, ``hsstore.train.settings``) to compose.

Two kinds: whole sections (``Storage``, ``Progress``), and options that sit inside a family's own sections
(``token_budget`` in train's ``batch`` group, extract's ``forward``, eval's ``store evaluation``, bench's
``loader``), each made by a function here, as ``devices.device_option`` and ``threads.cpu_threads_option`` make
``--device`` and ``--cpu-threads``. The option keeps its group because the group is its ``--help`` heading and
its config-file section; its name, type and spelling come from here. What differs by command (a default, a
help text, an old spelling) is a parameter, and each function says why it differs. Every field made here
carries its shared name (``SHARED_KEY``), and tests/test_settings_layout.py holds every setting of that name,
in every command, to this declaration.

The flags with no setting of their own (``--storage-option``, ``--allow-location``, ``--quiet``, ``--json``,
``--shard-mb``, ``--config``) are the commands' shared flags (``commands.py``); ``commands.shared_overrides``
turns them into the settings declared here (``storage_options``, ``progress``) and extract's ``shard_bytes``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .schema import option

SHARED_KEY = "hsstore.shared"  # in a field's metadata: the shared setting it is (its name)
CACHE_DIR_HELP = "local chunk cache for remote stores"


def _shared(name: str, field: Any) -> Any:
    """``field`` (made by ``schema.option``) marked as the shared setting ``name``."""
    return dataclasses.field(default=field.default, default_factory=field.default_factory,
                             metadata={**field.metadata, SHARED_KEY: name})


def token_budget(default: int | None, help: str, *, metavar: str | None = "N", old: str | None = "--max-tokens",
                 resume: bool = False) -> Any:
    """``--token-budget``: padded tokens per batch, the budget the loader's ``TokenBatches`` and extraction's
    batcher cut by. Its default differs by command because what an unset budget means does: train, and eval's
    teacher-forced pass, which batches as training does, leave it None for the device's default
    (``devices.DEVICE_DEFAULTS``); extract None for its forward's own default by device; bench 0, which times
    single samples rather than batches. ``old``: the flag's earlier spelling in that command (``--max-tokens`` in
    train and eval, ``--batch-tokens`` in bench, none in extract); ``resume``: a resumed training run keeps it."""
    return _shared("token_budget", option(default, help=help, metavar=metavar, old=old or (), resume=resume))


def cache_dir(help: str = CACHE_DIR_HELP) -> Any:
    """``--cache-dir``: the loader's local chunk cache of remote stores (``loader.options.Reading.cache_dir``). A
    path: relative in a ``--config`` file means relative to the file, and ``run.yaml`` records it absolute."""
    return _shared("cache_dir", option(None, path=True, help=help))


def cache_bytes(help: str, *, metavar: str | None = None) -> Any:
    """``--cache-bytes``: the cap of ``--cache-dir`` (``Reading.cache_bytes``; None: the loader's default)."""
    return _shared("cache_bytes", option(None, metavar=metavar, help=help))


def seed(default: int | None, help: str, *, metavar: str | None = None, resume: bool = False) -> Any:
    """``--seed``: what a seeded choice starts from. train's is 0 and kept on resume (data order, anchors, initial
    weights); subset's is None, so that a ``--seed`` without the ``--fraction`` it chooses is refused (0 when
    unset)."""
    return _shared("seed", option(default, metavar=metavar, resume=resume, help=help))


def storage_options() -> Any:
    """The store's fsspec options, parsed from the command's ``--storage-option`` flags (no flag of its own)."""
    return _shared("storage_options", option(default_factory=dict, cli=False,
                                             help="fsspec options of the store (the flag: --storage-option)"))


def progress() -> Any:
    """Progress bars, on unless the command's ``--quiet`` (no flag of its own)."""
    return _shared("progress", option(True, cli=False, help="progress bars (the flag: --quiet)"))


SHARED_NAMES = ("token_budget", "cache_dir", "cache_bytes", "seed", "storage_options", "progress")


@dataclass
class Storage:
    """Where the command's stores are read with (``--storage-option`` joins this group)."""

    storage_options: dict[str, Any] = storage_options()


@dataclass
class Progress:
    """``--quiet`` joins this group."""

    progress: bool = progress()
