"""Every registered shard layout runs the layout contract (hsstore.testing.layout_contract): one subclass per layout,
each saying only where a feature byte lies in its files; a layout registered without one fails here."""

from __future__ import annotations

import os

import pytest

from hsstore.layouts import base as layout, wds, zarr as zarr_layout
from hsstore.format.commit import layer_array

from hsstore.testing.layout_contract import LayoutContract

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


class TestZarrLayout(LayoutContract):
    layout = "zarr"
    variants = [{"codec": "none"}, {"codec": "zstd"}, {"codec": "blosc-zstd"}]

    def feature_byte(self, store, shard_index, local, layer):
        rec = store.commits[shard_index]
        ct, off = store.manifest.chunk_tokens, rec.offsets
        k = int(off[local]) // ct  # the chunk holding the sample's first token: its first payload byte
        key = zarr_layout.chunk_key(f"{zarr_layout.shard_path(rec.shard)}/{layer_array(layer)}", k, 2)
        hit = [rec.samples["sample_id"][i] for i in range(rec.n_samples)
               if off[i] < (k + 1) * ct and off[i + 1] > k * ct]
        return os.path.join(store.root, key), 0, key, hit


class TestWdsLayout(LayoutContract):
    layout = "wds"

    def feature_byte(self, store, shard_index, local, layer):
        rec = store.commits[shard_index]
        member = wds.member_name(local, wds.layer_part(layer))
        start, size, _ = rec.members[member]
        return os.path.join(store.root, wds.tar_path(rec.shard)), start + size - 1, member, \
            [rec.samples["sample_id"][local]]


def test_every_registered_layout_runs_the_contract():
    covered = {cls.layout for cls in LayoutContract.__subclasses__()}
    assert covered == set(layout.names()), f"layouts without a contract test class: {set(layout.names()) - covered}"
