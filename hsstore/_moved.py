"""The module paths of the flat layout (``hsstore.reader``, ``hsstore.manifest`` ...), kept working for one
release: importing one warns (DeprecationWarning) and gives the module at its new path, the same object, so
names, private ones included, and monkeypatching behave as before."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module (under hsstore.) -> its subpackage path
MOVED = {
    "assets": "format.assets",
    "batching": "loader.batching",
    "bench": "ops.bench",
    "cache": "loader.cache",
    "codec": "format.codec",
    "commit": "format.commit",
    "convert": "ops.convert",
    "estimate": "ops.estimate",
    "fp8": "format.fp8",
    "html_report": "ops.html_report",
    "index": "format.index",
    "info": "ops.info",
    "layout": "layouts.base",
    "manifest": "format.manifest",
    "merge": "ops.merge",
    "names": "format.names",
    "plan": "loader.plan",
    "process_writer": "store.process_writer",
    "reader": "store.reader",
    "records": "format.records",
    "report": "format.report",
    "resume": "loader.resume",
    "stats": "ops.stats",
    "subset": "ops.subset",
    "taps": "format.taps",
    "upgrade": "ops.upgrade",
    "verify": "ops.verify",
    "wds": "layouts.wds",
    "writer": "store.writer",
    "zarr_layout": "layouts.zarr",
}


class _OldPath(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        head, _, old = fullname.partition(".")
        if head == "hsstore" and old in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        new = "hsstore." + MOVED[module.__name__.split(".", 1)[1]]
        warnings.warn(f"{module.__name__} moved to {new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(new)  # the import statement returns this one


def install() -> None:
    if not any(isinstance(f, _OldPath) for f in sys.meta_path):
        sys.meta_path.append(_OldPath())
