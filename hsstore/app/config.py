"""``--config FILE.yaml``: a command's settings from a file, and ``run.yaml``, the file a run leaves behind.

The keys are the command's own flags (their argparse ``dest``: ``--token-budget`` is ``token_budget``), in
sections named after the command's argument groups (``--help`` shows the same groups; flags outside a group
are in ``options``), so there is no second list of settings to keep in step with the flags. Precedence is
flag > file > default: the file's values become the parser's defaults before parsing, except for flags
given on the command line (and the other members of their mutually exclusive group: ``--steps`` given
overrides a file's ``epochs``). Unknown sections or keys are refused, naming them; values are checked
against the flag's type and choices; a key whose flag has since moved into another group (under ``options``, or
``data.checkpoint_layers``, now ``memory.checkpoint_layers``) is read as that flag, and the key of an old flag
spelling (``max_tokens``: ``--max-tokens``) as today's flag (inverted for one that meant the opposite:
``no_resume: true`` is ``resume: false``). A top-level
``recorded`` section (what ``run.yaml`` notes for people: version, store identities, resolved values) is read
past. Paths (flags marked ``Option.path``) that are
relative in a file are relative to the file's folder, and are recorded absolute (URLs as they are), so a
``run.yaml`` runs again from any folder.

A run's record (a file with a ``recorded`` section, or one beside the command's run marker, e.g. a received
``OUT/run.yaml``) is data, not the user's word: its storage options and allowed locations (``AUTHORITY``) are never
taken from it, since they choose where the command reads and where it sends the user's credentials. Where it names
some that the command line does not give, the command stops in one line naming the flags to pass (``unrepeated``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from .. import env
from ..errors import StoreError
from ..io import door
from ..io.storage import parse_storage_options
from ..redaction import is_secret_key, scrub
from .schema import OLD_KEYS_ATTR, PATH_ATTR, Deprecated

log = logging.getLogger(__name__)

CONFIG_DEST = "config"
PARSER_KEY = "_config_parser"  # the namespace holds the parser that has --config (for sections / dump)
APPLIED_KEY = "_config_applied"  # the file apply() read, to check against what argparse parsed
RECORDED = "recorded"
DEFAULT_SECTION = "options"
RECORD_MARKERS_KEY = "_config_record_markers"  # files whose presence beside a --config file makes it a run's record
# the flags a run's record never sets: where the command may read (locations) and where it sends credentials
AUTHORITY = ("storage_option", "allow_location")
_DEFAULT_TITLES = ("options", "optional arguments", "positional arguments")


def add_config_option(p: argparse.ArgumentParser, record_markers: tuple[str, ...] = ()) -> None:
    """``--config``; ``record_markers``: the files that make a folder one of this command's runs (a --config file
    beside one is that run's record)."""
    p.add_argument("--config", metavar="FILE.yaml", default=None,
                   help="settings from a YAML file (keys: the flags' names with _ for -, in sections as in "
                        "--help); flags given here win over the file, the file over the defaults; a run's "
                        "record (OUT/run.yaml) never sets --storage-option or --allow-location: give those here")
    p.set_defaults(**{PARSER_KEY: p, RECORD_MARKERS_KEY: tuple(record_markers)})


def section_name(title: str | None) -> str:
    if not title or title in _DEFAULT_TITLES:
        return DEFAULT_SECTION
    return title.split("(")[0].strip().replace(" ", "_").replace("-", "_")


def _settable(a: argparse.Action) -> bool:
    """A flag with a key: not help/version, not --config, not hidden (the old spellings, ``schema.Deprecated``,
    are hidden and share their new flag's key)."""
    return not (isinstance(a, (argparse._HelpAction, argparse._VersionAction))
                or a.dest in (CONFIG_DEST, argparse.SUPPRESS) or a.help == argparse.SUPPRESS)


def sections(parser: argparse.ArgumentParser) -> dict[str, dict[str, argparse.Action]]:
    """section -> {key: action}, in the order of ``--help``."""
    out: dict[str, dict[str, argparse.Action]] = {}
    for group in parser._action_groups:
        for a in group._group_actions:
            if _settable(a):
                out.setdefault(section_name(group.title), {})[a.dest] = a
    return out


def _check_value(a: argparse.Action, value: Any, where: str) -> Any:
    """``value`` as the flag would have produced it; ValueError naming ``where`` otherwise."""
    def bad(why: str):
        raise ValueError(f"{where}: {why} (got {value!r})")

    def one(v: Any) -> Any:
        if v is None:
            return None
        t = a.type
        if t in (int, float):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (t is int and not isinstance(v, int)):
                if isinstance(v, str):
                    try:
                        v = t(v)
                    except ValueError:
                        bad(f"expected {'an integer' if t is int else 'a number'}")
                else:
                    bad(f"expected {'an integer' if t is int else 'a number'}")
            v = t(v)
        elif t is None or t is str:
            if not isinstance(v, str):
                bad("expected a string")
        elif isinstance(v, str):
            v = t(v)
        if a.choices is not None and v not in a.choices:
            bad(f"expected one of {list(a.choices)}")
        return v

    if a.nargs == "?" and a.const is not None and isinstance(value, bool):  # a flag with an optional value
        return a.const if value else a.default  # true: the bare flag; false: as if not given
    if a.nargs == 0 or isinstance(a, argparse.BooleanOptionalAction):  # store_true / --x/--no-x
        if not (isinstance(value, bool) or (value is None and isinstance(a, argparse.BooleanOptionalAction))):
            bad("expected true or false")
        return value
    if isinstance(a, argparse._AppendAction) or a.nargs in ("+", "*") or isinstance(a.nargs, int):
        if value is None:
            return None
        if not isinstance(value, list):
            bad("expected a list")
        return [one(v) for v in value]
    return one(value)


def _moved(known: dict[str, dict[str, argparse.Action]], sec: str, key: str) -> str | None:
    """The one section a key found elsewhere belongs in, for files written before its flag had a group (under
    ``options``) or moved to another (``data.checkpoint_layers`` before ``memory`` had it)."""
    homes = [other for other, actions in known.items() if key in actions]
    return homes[0] if len(homes) == 1 else None


def read_sections(path: str | Path) -> dict[str, Any]:
    """A config file's mapping of sections, read as a file from elsewhere: a regular file of settings size, YAML of
    bounded depth and aliases."""
    where = f"--config {path}"
    try:
        text = door.read_file(path, bound=door.YAML_CAP, where=where)
    except door.Refused as e:
        raise ValueError(str(e)) from None
    data = door.load_yaml(text, where)
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def load(path: str | Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """{dest: value} from a config file, checked against ``parser``'s flags."""
    return values_of(read_sections(path), parser, path)


def values_of(data: dict[str, Any], parser: argparse.ArgumentParser, path: str | Path) -> dict[str, Any]:
    """{dest: value} of a config file's sections, checked against ``parser``'s flags."""
    known = sections(parser)
    renamed = old_keys(parser)
    unknown, values = [], {}
    for sec, body in data.items():
        if sec == RECORDED:
            continue
        if sec not in known and sec != DEFAULT_SECTION:
            unknown.append(_with_near(str(sec), list(known)))
            continue
        if not isinstance(body, dict):
            raise ValueError(f"--config {path}: section {sec!r} must be a mapping of keys")
        for key, value in body.items():
            if key in renamed and key not in known.get(sec, {}):
                new, inverted = renamed[key]
                log.warning("--config %s: %s.%s is the old name of %s (%s)", path, sec, key, new,
                            "read inverted: %s" % key if inverted else "same meaning")
                key, value = new, (not value if inverted and isinstance(value, bool) else value)
            where = sec if key in known.get(sec, {}) else _moved(known, sec, key)
            if where is None:
                unknown.append(_with_near(f"{sec}.{key}", [f"{s_}.{k}" for s_, keys in known.items() for k in keys]))
                continue
            if where != sec and sec != DEFAULT_SECTION:
                log.warning("--config %s: %s.%s is now %s.%s (read there)", path, sec, key, where, key)
            values[key] = _check_value(known[where][key], value, f"--config {path}: {sec}.{key}")
    if unknown:
        raise ValueError(f"--config {path}: unknown key(s) {', '.join(unknown)} (known sections: "
                         f"{', '.join(known)}; `hsstore {parser.prog.split()[-1]} --help` lists the flags)")
    return _against_file(values, {k: a for actions in known.values() for k, a in actions.items()}, Path(path))


def old_keys(parser: argparse.ArgumentParser) -> dict[str, tuple[str, bool]]:
    """{old key: (today's key, read inverted)} from the flags' old spellings (``Option.old``: ``--max-tokens`` is
    ``token_budget``'s; ``Option.old_negated``: ``--no-resume``'s key ``no_resume`` is ``resume`` inverted; hand-made
    ``schema.Deprecated`` flags), so a file written with an old flag's key still loads, with a warning."""
    out = {opt.lstrip("-").replace("-", "_"): (a.dest, False) for a in parser._actions if isinstance(a, Deprecated)
           for opt in a.option_strings if opt.startswith("--")}
    for a in parser._actions:
        out.update({old: (a.dest, inverted) for old, inverted in getattr(a, OLD_KEYS_ATTR, {}).items()})
    return out


def near(word: str, names: list[str]) -> str | None:
    """The name ``word`` most likely meant (a typo, a plural, a key in another section), or None."""
    import difflib

    tail = word.rsplit(".", 1)[-1]
    same_key = [n for n in names if n.rsplit(".", 1)[-1] == tail]  # the right key in another section
    if same_key:
        return same_key[0]
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return close[0] if close else None


def _with_near(word: str, names: list[str]) -> str:
    guess = near(word, names)
    return f"{word} (did you mean {guess}?)" if guess else word


def is_relative_path(value: Any) -> bool:
    """A local path that is not absolute (URLs, ``~`` paths and absolute paths are taken as they are)."""
    return isinstance(value, str) and bool(value) and "://" not in value and not value.startswith(("/", "~"))


def _against_file(values: dict[str, Any], actions: dict[str, argparse.Action], path: Path) -> dict[str, Any]:
    """The file's relative paths (flags marked ``Option.path``) made relative to the file's folder, where a
    person reading the file expects them, not to wherever the command runs; said when that is another folder."""
    base = path.resolve().parent
    moved = []

    def fix(key: str, v: Any) -> Any:
        if not is_relative_path(v):
            return v
        moved.append(f"{key} {v}")
        return str(base / v)

    out = {}
    for key, v in values.items():
        if getattr(actions.get(key), PATH_ATTR, False):
            v = [fix(key, x) for x in v] if isinstance(v, list) else fix(key, v)
        out[key] = v
    if moved and base != Path.cwd().resolve():
        log.warning("--config %s: relative paths are read from the file's folder %s (%s)", path, base,
                    ", ".join(moved))
    return out


def _explicit(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, Any]:
    """{dest: value} of the flags given on the command line: a parse with every default suppressed."""
    saved = [(a, a.default, a.required) for a in parser._actions]
    saved_defaults = dict(parser._defaults)
    try:
        for a in parser._actions:
            a.default, a.required = argparse.SUPPRESS, False
        parser._defaults.clear()
        ns, _ = parser.parse_known_args(argv)
    finally:
        for a, default, required in saved:
            a.default, a.required = default, required
        parser._defaults.update(saved_defaults)
    return dict(vars(ns))


def is_run_record(path: str | Path, data: dict[str, Any], markers: tuple[str, ...]) -> bool:
    """Whether a --config file is a run's record rather than a config of the user's: it has the ``recorded``
    section a run writes, or it lies beside a run's marker (a record whose ``recorded`` section was cut out)."""
    if RECORDED in data:
        return True
    folders = {Path(path).parent, Path(os.path.realpath(path)).parent}
    return any(door.is_file_beneath(folder, m) for folder in folders for m in markers)


def leaf_keys(options: dict[str, Any], prefix: str = "") -> set[str]:
    """The dotted keys of parsed storage options' leaves (``client_kwargs.endpoint_url``)."""
    out: set[str] = set()
    for k, v in options.items():
        out |= leaf_keys(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}"}
    return out


def unrepeated(options: list[str], allows: list[str], given_options: dict[str, Any],
               given_allows: list[str]) -> list[str]:
    """The flags (``-S KEY=VALUE``, ``--allow-location PREFIX``) a run's record names whose keys or prefixes the
    user does not give (``given_options`` parsed, ``given_allows`` the command line's and the environment's)."""
    have = leaf_keys(given_options)
    out = []
    for pair in options:
        try:
            keys = leaf_keys(parse_storage_options([pair]))
        except StoreError:
            keys = {pair}
        if not keys <= have:
            out.append(f"-S {pair}")
    allowed = {absolute_path(a) for a in given_allows}
    return out + [f"--allow-location {a}" for a in allows if absolute_path(a) not in allowed]


def record_authority(data: dict[str, Any], where: str) -> tuple[list[str], list[str]]:
    """(storage options, allowed locations) a run's record names, wherever its sections hold them; ValueError
    naming ``where`` when they are not lists of strings."""
    found: dict[str, list[str]] = {}
    for sec, body in data.items():
        if sec == RECORDED or not isinstance(body, dict):
            continue
        for key in AUTHORITY:
            value = body.get(key)
            if value is None:
                continue
            if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise ValueError(f"{where}: {sec}.{key} is not a list of strings (got {value!r:.80})")
            found.setdefault(key, []).extend(value)
    return found.get("storage_option", []), found.get("allow_location", [])


def not_granted(path: str | Path, values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """A run's record read as a --config file: ``values`` without its storage options and allowed locations, or
    ValueError (one line) when it names some that the command line (or the environment) does not give."""
    missing = unrepeated(values.get("storage_option") or [], values.get("allow_location") or [],
                         parse_storage_options(given.get("storage_option") or []),
                         [*(given.get("allow_location") or []), *env.ALLOW_LOCATIONS.get()])
    if missing:
        raise ValueError(f"--config {path} is a run's record, which never chooses where this command reads or sends "
                         f"your credentials: it names {' '.join(missing)}, which this command line does not give; "
                         "pass them (or your own) on the command line to go on")
    return {k: v for k, v in values.items() if k not in AUTHORITY}


def _config_path(argv: list[str]) -> str | None:
    for i, tok in enumerate(argv):
        if tok == "--":
            break
        name, eq, value = tok.partition("=")
        if name == "--config":  # flags are never abbreviated: --conf is refused as an unknown flag
            if eq:
                return value
            return argv[i + 1] if i + 1 < len(argv) else None
    return None


def apply(parser: argparse.ArgumentParser, argv: list[str] | None) -> None:
    """Before ``parser.parse_args(argv)``: a sub-command's ``--config`` file becomes its defaults."""
    argv = list(sys.argv[1:] if argv is None else argv)
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return
    choices = subs[0].choices
    at = next((i for i, tok in enumerate(argv) if tok in choices), None)
    if at is None:
        return
    sub, rest = choices[argv[at]], argv[at + 1:]
    path = _config_path(rest)
    if path is None or PARSER_KEY not in sub._defaults:
        return
    explicit = _explicit(sub, rest)
    try:
        data = read_sections(path)
        values = values_of(data, sub, path)
        if is_run_record(path, data, sub._defaults.get(RECORD_MARKERS_KEY, ())):
            values = not_granted(path, values, explicit)
    except (OSError, ValueError) as e:  # one line, as every other error (not the command's usage first)
        print(f"{sub.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    given = set(explicit)
    for group in sub._mutually_exclusive_groups:  # a flag given overrides the file's value of its rivals
        dests = {a.dest for a in group._group_actions}
        if dests & given:
            given |= dests
    defaults = {k: v for k, v in values.items() if k not in given}
    for a in sub._actions:
        if a.dest in defaults and defaults[a.dest] is not None:
            a.required = False
    sub.set_defaults(**defaults, **{APPLIED_KEY: path})


def check_applied(args: argparse.Namespace) -> None:
    """After parsing: a --config that ``apply`` did not read (an odd spelling) is an error, not ignored."""
    path = getattr(args, CONFIG_DEST, None)
    if path is not None and PARSER_KEY in vars(args) and getattr(args, APPLIED_KEY, None) != path:
        raise ValueError(f"--config {path} was not read (spell it --config FILE or --config=FILE)")


def flag_values(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The command's effective settings by section (secret storage options left out, URL passwords masked):
    what ``run.yaml`` records and ``--config`` reads back."""
    parser = getattr(args, PARSER_KEY)
    out: dict[str, dict[str, Any]] = {}
    for sec, actions in sections(parser).items():
        for dest, action in actions.items():
            value = getattr(args, dest, None)
            if getattr(action, PATH_ATTR, False):  # recorded absolute: the file works from any folder
                value = [absolute_path(v) for v in value] if isinstance(value, list) else absolute_path(value)
            out.setdefault(sec, {})[dest] = _public(dest, value)
    return out


def absolute_path(value: Any) -> Any:
    """A relative local path made absolute (against the current folder); URLs and the rest as they are."""
    return os.path.abspath(value) if is_relative_path(value) else value


def _public(dest: str, v: Any) -> Any:
    if dest == "storage_option" and isinstance(v, list):  # KEY=VALUE strings
        return [scrub(s) for s in v if not is_secret_key(str(s).split("=", 1)[0])]
    if isinstance(v, str):
        return scrub(v)
    if isinstance(v, list):
        return [scrub(x) if isinstance(x, str) else x for x in v]
    return v


def dump(flags: dict[str, dict[str, Any]], recorded: dict[str, Any] | None = None, header: str = "") -> str:
    import yaml

    body = yaml.safe_dump(flags, sort_keys=False, default_flow_style=False)
    if recorded:
        body += yaml.safe_dump({RECORDED: recorded}, sort_keys=False, default_flow_style=False)
    return "".join(f"# {ln}\n" for ln in header.splitlines()) + body
