"""Shard layouts: how one shard's features, tokens and masks are arranged in files (Zarr v3 chunks or
WebDataset tar members), written and read back by byte ranges.

``base`` is the protocol every layout implements and the registry (``layout_for``); ``zarr`` and ``wds`` are
the two layouts. A layout sees only what it is handed for one shard, never a whole store; every registered
layout passes the one contract test suite (``hsstore.testing.layout_contract``); what the rest of the
package knows of a layout is its declaration in ``format.layout_spec``.

Imports: hsstore core, io, format.
"""
