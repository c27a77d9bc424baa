"""The old home of the store commands' schemas, now ``hsstore.app.settings`` (every command family keeps its
schemas in a module named ``settings``). Names read from here still work, with a DeprecationWarning."""

from __future__ import annotations

from . import settings
from .schema import moved_names

__getattr__ = moved_names(__name__, settings)
