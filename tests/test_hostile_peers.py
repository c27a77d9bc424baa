"""Peer folders and drafter configs from other teams, forged past what ``test_hostile_inputs`` covers: token ids
a cast would wrap, Arrow files that lie about their rows, links in a speculators folder, torch.save files holding
sparse, meta or compressed tensors, drafter configs whose numbers are not integers. Each runs the real command in a
child process (``test_hostile_inputs.cli``: a timeout and a memory limit) and asks for one line naming the input,
with nothing committed or exported."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from test_hostile_inputs import _config, _sample, cli, import_is_one_line, one_line, run1, speculators_folder
from train_helpers import small_input, store32  # noqa: F401  (fixtures)

ARROW = "data-00000-of-00001.arrow"


# -- speculators folders ---------------------------------------------------------------------------------------------
def _arrow(d: Path, columns: dict) -> None:
    import pyarrow as pa

    table = pa.table(columns)
    with pa.OSFile(str(d / ARROW), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)


def _wrapping_ids(d: Path) -> None:
    """Row 0's tokens 2**32 + t: cast to int32 they wrap to t, the tokens its hidden states were made from."""
    rows = [_sample(seed=i) for i in range(2)]
    _arrow(d, {"input_ids": [[(1 << 32) + t for t in rows[0]["input_ids"].tolist()], rows[1]["input_ids"].tolist()],
               "loss_mask": [s["loss_mask"].tolist() for s in rows]})


def _patch(path: Path, old: bytes, new: bytes) -> None:
    raw = path.read_bytes()
    assert raw.count(old) >= 1
    path.write_bytes(raw.replace(old, new, 1))


def _offsets_past_values(d: Path) -> None:
    """input_ids' list offsets [0, 12, 24] made [0, 12, 10**9]: row 1 runs past the column's values."""
    _patch(d / ARROW, struct.pack("<iii", 0, 12, 24), struct.pack("<iii", 0, 12, 10**9))


def _rows_lie(d: Path) -> None:
    """The record batch says 1000 rows; its buffers hold 2."""
    raw = bytearray((d / ARROW).read_bytes())
    i = raw.find(struct.pack("<q", 2), 200)
    raw[i:i + 8] = struct.pack("<q", 1000)
    (d / ARROW).write_bytes(bytes(raw))


def _hidden_states_link_out(d: Path) -> None:
    other = speculators_folder(d.parent / "other")
    shutil.rmtree(d / "hidden_states")
    os.symlink(other / "hidden_states", d / "hidden_states")


def _arrow_link_out(d: Path) -> None:
    """No state.json (a plain Arrow folder), its Arrow file a link to another dataset's."""
    other = speculators_folder(d.parent / "other")
    (d / "state.json").unlink()
    (d / ARROW).unlink()
    os.symlink(other / ARROW, d / ARROW)


SPECULATORS = {
    "token ids past int32": (_wrapping_ids, [ARROW + " row 0", "4294967", "outside int32"]),
    "list offsets past the values": (_offsets_past_values, [ARROW, "offsets outside its 24 values"]),
    "a batch whose row count lies": (_rows_lie, [ARROW, "not a readable Arrow file"]),
    "hidden_states/ a link out": (_hidden_states_link_out, ["hidden_states", "symbolic link"]),
    "no state.json, its .arrow a link out": (_arrow_link_out, [ARROW, "symbolic link"]),
}


# -- SpecForge files -------------------------------------------------------------------------------------------------
def _deflated(path: Path, hidden: torch.Tensor) -> None:
    """``path`` a torch.save archive of one sample whose hidden-state entry is deflated (a re-zipped file)."""
    s = {"input_ids": torch.arange(1, 13), "loss_mask": torch.ones(12, dtype=torch.int64), "hidden_states": hidden}
    buf = io.BytesIO()
    torch.save(s, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data/2"):  # the hidden states' storage, padded: torch.load maps it whole
                z.writestr(info.filename, data + bytes(4096), compress_type=zipfile.ZIP_DEFLATED)
            else:
                z.writestr(info, data)


def _finite_garbage(d: Path) -> None:
    """data_1.ckpt: a deflated hidden-state entry that torch.load's mapping reads as finite values of the right
    shape (the compressed bytes, not the features): nothing after the load could tell."""
    path = d / "rows_0-4" / "data_1.ckpt"
    for seed in range(1000):
        hidden = torch.randn(12, 3, 48, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        _deflated(path, hidden)
        got = torch.load(path, weights_only=True, mmap=True)["hidden_states"]
        if torch.isfinite(got.float()).all() and not torch.equal(got, hidden):
            return
    pytest.skip("no deflated archive read as finite values on this zlib")


def _set(key: str, value) -> callable:
    def forge(d: Path) -> None:
        s = _sample(seed=1)
        s[key] = value() if callable(value) else value
        torch.save(s, d / "rows_0-4" / "data_1.ckpt")
    return forge


def _sparse() -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([[0, 99], [0, 0], [0, 0]]), torch.ones(2, dtype=torch.bfloat16),
                                   (12, 3, 48), check_invariants=False)


SPECFORGE = {
    "input_ids a list of strings": (_set("input_ids", ["a"] * 12), ["data_1.ckpt", "'input_ids'", "no list of"]),
    "hidden_states sparse, an index out of bounds": (_set("hidden_states", _sparse),
                                                    ["data_1.ckpt", "sparse_coo", "dense tensor"]),
    "hidden_states on the meta device": (_set("hidden_states", lambda: torch.empty(12, 3, 48, device="meta")),
                                         ["data_1.ckpt", "meta", "dense tensor"]),
    "a deflated hidden-state entry": (_finite_garbage, ["data_1.ckpt", "compressed zip entries"]),
}


FOLDERS = {**{("speculators", k): v for k, v in SPECULATORS.items()}, **{("specforge", k): v for k, v in SPECFORGE.items()}}


@pytest.mark.parametrize("fmt,case", sorted(FOLDERS))
def test_a_forged_peer_folder_is_one_line(tmp_path, fmt, case):
    import_is_one_line(tmp_path, fmt, *FOLDERS[fmt, case])


# -- drafter configs: numbers as written -----------------------------------------------------------------------------
def _set_config(**changes):
    def forge(d: Path) -> None:
        def edit(c: dict) -> None:
            for k, v in changes.items():
                (c["dflash_config"] if k in ("target_layer_ids", "mask_token_id") else c)[k] = v
            if changes.get("layer_types"):
                c["sliding_window"] = True
        _config(d / "config.json", edit)
    return forge


CONFIG_NUMBERS = {  # each was rounded or replaced by a default, and the drafter served and exported as that
    "hidden_size 64.7": (_set_config(hidden_size=64.7), ["hidden_size 64.7", "not a positive integer"]),
    "block_size 0": (_set_config(block_size=0), ["block_size 0", "not a positive integer"]),
    "mask_token_id true": (_set_config(mask_token_id=True), ["mask_token_id True", "not a token id"]),
    "target_layer_ids [1.5, ...]": (_set_config(target_layer_ids=[1.5, 2, 3, 4, 5]),
                                    ["target layer ids [1.5, 2, 3, 4, 5]", "not a list of integers"]),
    "sliding_window true": (_set_config(layer_types=["sliding_attention"]), ["sliding_window True"]),
}


@pytest.mark.parametrize("case", sorted(CONFIG_NUMBERS))
def test_a_drafter_config_number_is_read_as_written(run1, tmp_path, case):
    """export-drafter, eval and train --init read a drafter's config the same way (``drafter_format.read_config``):
    export-drafter stands for all three."""
    forge, words = CONFIG_NUMBERS[case]
    d = tmp_path / "drafter"
    shutil.copytree(run1 / "drafter", d)
    forge(d)
    one_line(cli("export-drafter", d, tmp_path / "exported", timeout=90), "config.json", *words)
    assert not (tmp_path / "exported").exists()
