"""A command's settings as grouped dataclasses, and its flags generated from them.

One schema per command family is the only list of its settings: each field says its flag, help and default
once, and the ``argparse`` flags (in ``--help`` groups, which are also the sections of ``--config`` files and
``run.yaml``, see ``config.py``), the parsed config object and the keys that must not change on resume all
come from it. A schema is a dataclass whose fields are *sections* (dataclasses themselves, one argument group
each) made with :func:`section`; a section's fields are made with :func:`option`. Field names are unique
across sections, and a setting has one name: its field is ``token_budget``, its flag ``--token-budget``, its key in
config files and ``run.yaml`` ``token_budget`` (the flag's ``dest``), and the code it is passed to calls it so too.
Old spellings (``Option.old``) keep working and say the new name.

    @dataclass
    class Schedule:
        lr: float = option(6e-4, help="peak learning rate", resume=False)

    @dataclass
    class TrainSettings:
        schedule: Schedule = section(Schedule, "training")

    add_arguments(parser, TrainSettings); settings = from_args(TrainSettings, parser.parse_args())

Code reads ``settings.schedule.lr``: the sections are the written types, passed through as they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import types
import typing
import warnings
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)

_KEY = "hsstore.option"
_SECTION = "hsstore.section"
_ABOUT = "hsstore.section.about"


class Deprecated(argparse.Action):
    """An old spelling that keeps working (scripts and saved commands rely on it): it stores into the new
    option's destination and says the new name. Hidden from --help. ``value``: what a bare old flag stores
    (False for one that meant the opposite of the setting: ``--non-causal-sliding`` is ``--no-sliding-causal``)."""

    def __init__(self, option_strings, dest, new: str, value: Any = True, **kwargs) -> None:
        self.new, self.value = new, value
        kwargs.setdefault("default", argparse.SUPPRESS)
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        new = self.new if self.value is True or self.nargs != 0 else "--no-" + self.dest.replace("_", "-")
        log.warning("%s: %s is deprecated, use %s (same meaning)", parser.prog, option_string, new)
        setattr(namespace, self.dest, self.value if self.nargs == 0 else values)


@dataclass(frozen=True)
class Option:
    """How one setting appears on the command line. Its flag is always ``--field-name`` and its key
    ``field_name`` (one name; there is no way to spell them otherwise). A bool defaulting to False is a flag that
    turns it on; one defaulting to True or None is a ``--x/--no-x`` pair (None: unset, decided later).
    ``convert`` maps the parsed value to the setting's (``0`` -> ``None``); ``exclusive`` names a mutually
    exclusive group of the section; ``old`` are hidden deprecated spellings of the same meaning, ``old_negated``
    old flags that meant its opposite (``--non-causal-sliding`` of ``sliding_causal``; their config keys are read
    inverted); ``resume`` marks settings a resumed run must share. ``path``: the value is a local path or a URL
    (``hsstore.app.config``: relative in a file means relative to the file; recorded absolute). ``type``: what the
    flag reads where the setting is another type (``--layers 1,16,31`` is a str, ``convert`` makes the list)."""

    help: str
    short: str | None = None
    metavar: str | None = None
    choices: tuple | None = None
    required: bool = False
    positional: bool = False
    nargs: str | int | None = None  # lists: "+"/"*" on one flag; default: the flag repeated (append)
    const: Any = None  # with nargs="?": the value of the bare flag (a config file's true means the same)
    convert: Callable[[Any], Any] | None = None
    exclusive: str | None = None
    old: tuple[str, ...] = ()
    old_negated: tuple[str, ...] = ()
    was: tuple[str, ...] = ()  # the field's old names: still taken by build/replace and read from recorded configs
    resume: bool = False
    cli: bool = True  # False: a setting of the API only (no flag)
    type: Any = None  # the flag's value type where the setting's differs (then made by ``convert``)
    path: bool = False  # a local path or URL: resolved against a --config file's folder, recorded absolute


PATH_ATTR = "names_a_path"  # on a flag's argparse action: ``Option.path`` (read by ``hsstore.app.config``)
SCHEMA_KEY = "_schema"  # in a command parser's defaults: the schema its flags came from (tests, docs)
OLD_KEYS_ATTR = "old_keys"  # on a flag's argparse action: {old config key: read inverted} (``Option.old``, ``old_negated``)


def option(default: Any = MISSING, *, help: str, default_factory: Any = MISSING, **how: Any) -> Any:
    """A dataclass field that is also a flag (see :class:`Option` for ``how``)."""
    if isinstance(how.get("choices"), list):
        how["choices"] = tuple(how["choices"])
    for key in ("old", "old_negated", "was"):
        if isinstance(how.get(key), str):
            how[key] = (how[key],)
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={_KEY: Option(help=help, **how)})


def section(cls: type, title: str, about: str | None = None) -> Any:
    """A dataclass field holding one argument group (``title`` is its ``--help`` heading and, through
    ``config.section_name``, its section in config files; ``about``, the group's description in ``--help``)."""
    return dataclasses.field(default_factory=cls, metadata={_SECTION: title, _ABOUT: about})


@dataclass(frozen=True)
class Setting:
    """One option of a schema, located: its section's field name and title, and its own field."""

    section: str
    title: str
    field: dataclasses.Field
    type: Any
    how: Option

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def dest(self) -> str:
        """The flag's argparse destination and config key: the field's name."""
        return self.field.name

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def default(self) -> Any:
        f = self.field
        return f.default_factory() if f.default_factory is not MISSING else (None if f.default is MISSING else f.default)


def settings_of(schema: type) -> list[Setting]:
    """Every option of ``schema``, in order; refuses a name used twice."""
    out: list[Setting] = []
    seen: dict[str, str] = {}  # name -> section.field
    for sec in dataclasses.fields(schema):
        if _SECTION not in sec.metadata:
            raise TypeError(f"{schema.__name__}.{sec.name}: a schema's fields are sections (schema.section)")
        cls = typing.get_type_hints(schema)[sec.name]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            how = f.metadata.get(_KEY)
            if how is None:
                raise TypeError(f"{cls.__name__}.{f.name}: a section's fields are options (schema.option)")
            s = Setting(sec.name, sec.metadata[_SECTION], f, hints[f.name], how)
            where = f"{sec.name}.{f.name}"
            if s.name in seen:
                raise TypeError(f"{schema.__name__}: {s.name!r} is used by {seen[s.name]} and {where}")
            seen[s.name] = where
            out.append(s)
    return out


_UnionType = type(int | None)


def _scalar(t: Any) -> tuple[Any, bool]:
    """(element type, is a list) of an annotation such as ``int | None`` or ``list[str] | None``."""
    args = [a for a in typing.get_args(t) if a is not type(None)] if typing.get_origin(t) in (typing.Union,
                                                                                              _UnionType) else [t]
    t = args[0]
    if typing.get_origin(t) in (list, tuple):
        return typing.get_args(t)[0], True
    return t, False



def add_arguments(parser: argparse.ArgumentParser, schema: type) -> dict[str, Any]:
    """The schema's flags on ``parser``, one argument group per section, in the schema's order; returns the
    groups by section field name (for flags shared by many commands, added by their own helpers)."""
    groups = {sec.name: parser.add_argument_group(sec.metadata[_SECTION], sec.metadata.get(_ABOUT))
              for sec in dataclasses.fields(schema)}
    parser.set_defaults(**{SCHEMA_KEY: schema})
    exclusive: dict[tuple[str, str], Any] = {}
    for s in settings_of(schema):
        how = s.how
        if not how.cli:
            continue
        group = groups[s.section]
        target = group
        if how.exclusive:
            target = exclusive.get((s.section, how.exclusive))
            if target is None:
                target = exclusive[(s.section, how.exclusive)] = group.add_mutually_exclusive_group()
        kind, many = _scalar(how.type or s.type)
        kw: dict[str, Any] = {"help": how.help}
        if kind is bool and not many and s.default is not False:  # True or None: --x/--no-x
            kw.update(action=argparse.BooleanOptionalAction, default=s.default)
        elif kind is bool and not many:
            kw["action"] = "store_true"
        else:
            kw["default"] = None if how.type is not None else s.default
            if kind in (int, float):
                kw["type"] = kind
            if many:
                if how.nargs is None:
                    kw["action"] = "append"
                    kw["default"] = None if s.default in (None, []) else list(s.default)
                else:
                    kw["nargs"] = how.nargs
            elif how.nargs is not None:
                kw["nargs"] = how.nargs
            if how.const is not None:
                kw["const"] = how.const
            if how.choices is not None:
                kw["choices"] = list(how.choices)
            if how.metavar:
                kw["metavar"] = how.metavar
        if how.positional:
            if s.field.default is MISSING and s.field.default_factory is MISSING:
                kw.pop("default", None)
            target.add_argument(s.dest, **kw)
            continue
        flags = [s.flag] + ([how.short] if how.short else [])
        if how.required:
            kw["required"] = True
        action = target.add_argument(*flags, dest=s.dest, **kw)
        setattr(action, PATH_ATTR, how.path)
        setattr(action, OLD_KEYS_ATTR, {**{_key(o): False for o in how.old}, **{_key(o): True for o in how.old_negated}})
        is_bool = kind is bool and not many
        for old, value in [*((o, True) for o in how.old), *((o, False) for o in how.old_negated)]:
            if old in action.option_strings:  # --no-resume: once a flag of its own, now the pair's other half
                continue
            extra = {"nargs": 0} if is_bool else {}
            if "type" in kw:
                extra["type"] = kw["type"]
            group.add_argument(old, dest=s.dest, action=Deprecated, new=flags[0], value=value, **extra)
    return groups


def _key(flag: str) -> str:
    """A flag's config key: ``--max-tokens`` -> ``max_tokens``."""
    return flag.lstrip("-").replace("-", "_")


def from_args(schema: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """The schema's object from parsed flags (``convert`` applied); ``overrides`` by field name win, for
    settings that have no flag or come from elsewhere (a section's name: that whole section, e.g.
    ``thresholds=GateThresholds(...)``)."""
    by_section: dict[str, dict[str, Any]] = {}
    missing: list[str] = []
    overrides = by_todays_names(schema, overrides)
    for s in settings_of(schema):
        if s.name in overrides:
            value = overrides.pop(s.name)
        elif s.how.cli and hasattr(args, s.dest):
            value = getattr(args, s.dest)
            if value is None and s.field.default_factory is not MISSING:  # a repeatable flag not given
                value = s.default
            if s.how.convert is not None:
                value = s.how.convert(value)
        elif s.field.default is MISSING and s.field.default_factory is MISSING:
            missing.append(s.name)
            continue
        else:
            value = s.default
        by_section.setdefault(s.section, {})[s.name] = value
    hints = typing.get_type_hints(schema)
    whole = {sec: overrides.pop(sec) for sec in list(overrides) if sec in hints}
    if overrides:
        raise TypeError(f"{schema.__name__}: no settings named {sorted(overrides)}")
    if missing:
        raise TypeError(f"{schema.__name__}: settings without a default need a value: {', '.join(missing)}")
    return schema(**{sec: whole[sec] if sec in whole else hints[sec](**by_section.get(sec, {})) for sec in
                     (f.name for f in dataclasses.fields(schema))})


def flat(config: Any) -> dict[str, Any]:
    """{setting name: value} over all sections (what ``train_config.json`` and the resume check compare)."""
    return {f.name: getattr(getattr(config, sec.name), f.name)
            for sec in dataclasses.fields(config) for f in dataclasses.fields(getattr(config, sec.name))}


def build(schema: type, **by_name: Any) -> Any:
    """The schema's object from settings given by field name (unique across sections), the rest at their
    defaults: how API callers and tests write settings without naming sections (``build(TrainSettings,
    store=[...], out=..., lr=1e-3)``)."""
    return from_args(schema, argparse.Namespace(), **by_name)


def replace(config: Any, **by_name: Any) -> Any:
    """``config`` with the named settings changed, each in its own section (``dataclasses.replace`` on the
    sections that change, so their checks run again)."""
    changes: dict[str, dict[str, Any]] = {}
    by_name = by_todays_names(type(config), by_name)
    for s in settings_of(type(config)):
        if s.name in by_name:
            changes.setdefault(s.section, {})[s.name] = by_name.pop(s.name)
    if by_name:
        raise TypeError(f"{type(config).__name__}: no settings named {sorted(by_name)}")
    return dataclasses.replace(config, **{sec: dataclasses.replace(getattr(config, sec), **kw)
                                          for sec, kw in changes.items()})


def old_names(schema: type) -> dict[str, str]:
    """{old field name: today's} (``Option.was``: ``stores`` is ``store``'s)."""
    return {old: s.name for s in settings_of(schema) for old in s.how.was}


def by_todays_names(schema: type, by_name: dict[str, Any]) -> dict[str, Any]:
    """``by_name`` with settings given by an old field name renamed (a DeprecationWarning says the new one)."""
    old = old_names(schema)
    out = {}
    for k, v in by_name.items():
        if k in old:
            warnings.warn(f"{schema.__name__}: {k} is now {old[k]}", DeprecationWarning, stacklevel=3)
            if old[k] in by_name:
                raise TypeError(f"{schema.__name__}: {k} and {old[k]} are the same setting; give one")
        out[old.get(k, k)] = v
    return out


def resume_keys(schema: type) -> tuple[str, ...]:
    """The settings marked ``resume=True``: a resumed run refuses to change them."""
    return tuple(s.name for s in settings_of(schema) if s.how.resume)


def moved_names(old: str, new: types.ModuleType, names: Iterable[str] | None = None) -> Callable[[str], Any]:
    """The ``__getattr__`` of module ``old`` whose names (all, or ``names``) now live in ``new``: scripts that import
    them from ``old`` keep working, and a DeprecationWarning says where each one is now."""
    only = None if names is None else frozenset(names)

    def __getattr__(name: str) -> Any:
        if not name.startswith("__") and (only is None or name in only) and hasattr(new, name):
            warnings.warn(f"{old}.{name} is now {new.__name__}.{name}", DeprecationWarning, stacklevel=2)
            return getattr(new, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
