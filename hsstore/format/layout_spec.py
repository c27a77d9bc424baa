"""The registry of shard layouts (the manifest's ``layout``): each layout's declaration, what the rest of the
package asks of a layout without reading its code.

A ``LayoutSpec`` says a layout's name (in manifests and on the command line, ``--layout``), the one-line help of
that choice, which chunk codecs and feature encodings its manifests may name (a manifest that names others is
refused when it is made or read), whether the loader's chunk cache serves its reads, and the module that
implements it (``hsstore.layouts.base.Layout``, imported when a shard is first written or read). Declarations
are data, so ``hsstore --help`` and manifest checks need no layout import (the zarr layout imports zarr, which
is slow to load). The two built-in layouts are declared at the end of this module; a layout outside the package
calls ``register`` with its own (and can run ``hsstore.testing.layout_contract`` against itself).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayoutSpec:
    name: str
    help: str
    module: str
    chunk_cache: bool
    codecs: tuple[str, ...] | None = None  # None: every chunk codec (format.codec.CODECS)
    encodings: tuple[str, ...] | None = None  # None: every encoding (format.manifest.ENCODINGS)
    why: str = ""  # why the codecs or encodings are restricted, for the refusal's message


SPECS: dict[str, LayoutSpec] = {}
DEFAULT = "zarr"  # the layout of a manifest that names none


def register(spec: LayoutSpec) -> LayoutSpec:
    """Add ``spec`` to the registry (a second spec of one name is refused: two layouts cannot share a name)."""
    if SPECS.get(spec.name, spec) != spec:
        raise ValueError(f"shard layout {spec.name!r} is registered already")
    SPECS[spec.name] = spec
    return spec


def names() -> tuple[str, ...]:
    return tuple(SPECS)


def get(name: str) -> LayoutSpec:
    try:
        return SPECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown shard layout {name!r}") from None


def refusal(layout: str, codec: str, encoding: str) -> str | None:
    """Why a manifest of ``layout`` may not name ``codec`` or ``encoding`` (None: it may)."""
    if not isinstance(layout, str) or layout not in SPECS:
        return f"layout {layout!r} not supported (one of {names()})"
    spec = SPECS[layout]
    if spec.codecs is not None and codec not in spec.codecs:
        return f"layout {layout!r} {spec.why}: codec must be {' or '.join(map(repr, spec.codecs))}, got {codec!r}"
    if spec.encodings is not None and encoding not in spec.encodings:
        others = [s.name for s in SPECS.values() if s.encodings is None or encoding in s.encodings]
        return (f"layout {layout!r} holds {' or '.join(spec.encodings)} features only: encoding {encoding!r} "
                f"needs layout {' or '.join(map(repr, others))}")
    return None


register(LayoutSpec("zarr", "chunked arrays, codecs", "hsstore.layouts.zarr", chunk_cache=True))
register(LayoutSpec("wds", "WebDataset tars of .npy members", "hsstore.layouts.wds", chunk_cache=False,
                    codecs=("none",), encodings=("raw",), why="stores plain .npy members"))
