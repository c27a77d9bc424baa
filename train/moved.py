"""Names that moved to another train/ module keep working from their old module for a release, with a warning."""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable


def moved_getattr(module: str, moved: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module``: a name in ``moved`` (name -> its train/ module now) warns and
    gives the object from its new home; any other missing name is an AttributeError as usual."""

    def __getattr__(name: str) -> Any:
        if name in moved:
            where = f"hsstore.train.{moved[name]}"
            warnings.warn(f"{module}.{name} moved to {where}.{name}", DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(where), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
