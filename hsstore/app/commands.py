"""How a command joins the ``hsstore`` command line: one registration for the three families (the store commands
in ``cli.py``, ``hsstore.extract.cli``, ``hsstore.train.cli``).

A family lists its commands as :class:`Command` values: the name, the schema its flags come from (its family's
``settings.py``), the handler, the help, and the shared flags that have no setting of their own (``-S``,
``--allow-location``, ``-q``, ``--json``, ``--shard-mb``, ``--config``), each placed in the ``--help`` group of
one of the schema's sections (which is also its section in a ``--config`` file). :func:`add_commands` makes the
parsers; ``cli.main`` parses, applies ``--config`` and dispatches to the handler. :func:`command_settings` is a
handler's settings object: the schema's flags, and the shared flags read into the settings the schema declares for
them (``sections.py``: ``storage_options``, ``progress``; extract's ``shard_bytes``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable

from ..io.storage import parse_storage_options
from .config import add_config_option
from .schema import Deprecated, add_arguments, from_args, settings_of


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each option's default (where it has one worth showing)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("%(default)" in text or action.default in (None, False, [], argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def add_storage_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", "-S", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec/s3fs option, repeatable (e.g. anon=true, endpoint_url=http://..., "
                        "client_kwargs.region_name=us-east-1); AWS env vars and profiles apply as usual")
    p.add_argument("--allow-location", action="append", default=[], metavar="PREFIX",
                   help="read shards merged by reference from stores under PREFIX (a URL or local path; "
                        "repeatable; for every store this command opens). Without it a "
                        "commit record's location outside the store is refused; local system paths always are")


def add_quiet_option(p: argparse.ArgumentParser) -> None:
    """``-q/--quiet`` on every command that shows progress (``--no-progress``, its old spelling, still works)."""
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    p.add_argument("--no-progress", dest="quiet", nargs=0, action=Deprecated, new="--quiet")


def add_json_option(p: argparse.ArgumentParser, what: str = "the summary") -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON on stdout")


def add_shard_mb_flag(group) -> None:
    group.add_argument("--shard-mb", type=float, default=1024, help="feature bytes per shard (MiB; default 1024)")


def mib_bytes(mib: float) -> int:
    """``--shard-mb`` in bytes, at least one."""
    return max(1, int(mib * (1 << 20)))


@dataclass(frozen=True)
class Shared:
    """One of the shared flags on a command, in the ``--help`` group of the schema's section ``group`` (``--config``:
    on the parser itself). ``what``: ``--json``'s words for what it prints; ``record_markers``: ``--config``'s, the
    files that make a folder one of this command's runs."""

    flag: str  # "quiet", "json", "storage", "shard_mb" or "config"
    group: str | None = None
    what: str = "the summary"
    record_markers: tuple[str, ...] = ()

    def add(self, parser: argparse.ArgumentParser, groups: dict[str, Any]) -> None:
        if self.flag == "config":
            add_config_option(parser, record_markers=self.record_markers)
        elif self.flag == "json":
            add_json_option(groups[self.group], self.what)
        else:
            {"quiet": add_quiet_option, "storage": add_storage_option, "shard_mb": add_shard_mb_flag}[self.flag](
                groups[self.group])


def quiet(group: str) -> Shared:
    return Shared("quiet", group)


def json_flag(group: str, what: str = "the summary") -> Shared:
    return Shared("json", group, what)


def storage_flags(group: str) -> Shared:
    """``-S/--storage-option`` and ``--allow-location``."""
    return Shared("storage", group)


def shard_mb(group: str) -> Shared:
    return Shared("shard_mb", group)


def config(record_markers: tuple[str, ...] = ()) -> Shared:
    return Shared("config", record_markers=tuple(record_markers))


@dataclass(frozen=True)
class Command:
    """One ``hsstore`` command: its parser from ``schema`` and ``shared`` (in that order, which is ``--help``'s),
    ``run(args) -> exit status``. ``before``: what ``cli.main`` calls ahead of ``run`` (``preflight``: refusals
    that need nothing loaded; ``announce``: the first line); ``defaults_in_help``: ``--help`` shows defaults."""

    name: str
    schema: type
    run: Callable[[argparse.Namespace], int]
    help: str
    description: str | None = None
    shared: tuple[Shared, ...] = ()
    before: dict[str, Callable[[argparse.Namespace], None]] = field(default_factory=dict)
    defaults_in_help: bool = False


def add_command(subparsers, command: Command) -> argparse.ArgumentParser:
    """``command``'s parser under ``subparsers``: the schema's flags in its sections' groups, then the shared ones."""
    extra = {"formatter_class": DefaultsHelpFormatter} if command.defaults_in_help else {}
    if command.description is not None:
        extra["description"] = command.description
    parser = subparsers.add_parser(command.name, help=command.help, **extra)
    groups = add_arguments(parser, command.schema)
    for flag in command.shared:
        flag.add(parser, groups)
    parser.set_defaults(func=command.run, **command.before)
    return parser


def add_commands(subparsers, commands: tuple[Command, ...]) -> None:
    for command in commands:
        add_command(subparsers, command)


def shared_overrides(args: argparse.Namespace, schema: type | None = None) -> dict[str, Any]:
    """The settings of the shared flags the command has: ``storage_options`` from ``-S``, ``progress`` from
    ``-q``, ``shard_bytes`` from ``--shard-mb``, for ``from_args`` (``schema``: only those it declares; ``show``
    takes -q but has no progress)."""
    names = None if schema is None else {s.name for s in settings_of(schema)}
    out: dict[str, Any] = {}
    for flag, name, value in (("storage_option", "storage_options", parse_storage_options),
                              ("quiet", "progress", lambda q: not q), ("shard_mb", "shard_bytes", mib_bytes)):
        if hasattr(args, flag) and (names is None or name in names):
            out[name] = value(getattr(args, flag))
    return out


def command_settings(schema: type, args: argparse.Namespace) -> Any:
    """A handler's settings: ``schema``'s object from the parsed flags, the shared flags' settings included."""
    return from_args(schema, args, **shared_overrides(args, schema))
