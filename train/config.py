"""The old home of the training commands' schemas, now ``hsstore.train.settings`` (every command family keeps its
schemas in a module named ``settings``). Names read from here still work, with a DeprecationWarning."""

from __future__ import annotations

from hsstore.app.schema import moved_names

from . import settings

__getattr__ = moved_names(__name__, settings)
