"""The item: the dict one sample becomes, built in one place for ``Store.read``/iteration and the loader.

An item is ``sample_id``, ``input_ids`` (int64), ``loss_mask`` (bool) and ``hidden_states`` ``[T, n_layers, H]``,
a view of the layer-major ``[n_layers, T, H]`` features read (no copy; ``reshape(T, -1)`` gives the drafter's
concatenation); ``final_hidden`` ``[T, H]`` when the store's named feature was read. Encoded stores' items hold
the stored form unless decoded here: fp8's e4m3fn values and ``hidden_scales`` ``[T, n_layers]``, a block
encoding's uint8 rows ``[T, n_layers, W]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

from ..format import codec, encodings


def make_item(sample_id: str, ids: np.ndarray, mask: np.ndarray, feats: torch.Tensor,
              scales: torch.Tensor | None = None, *, dtype: str, final_hidden: bool = False,
              dequantise: bool = True, pin: bool = False, encoding: str = "raw", hidden: int = 0) -> dict[str, Any]:
    """The item of one sample. ``feats``: ``[n_layers, T, H]`` in the manifest ``dtype`` (fp8 stores: e4m3fn,
    with ``scales`` ``[n_layers, T]``; a block ``encoding``'s rows ``[n_layers, T, W]`` uint8 of ``hidden`` values
    each); ``final_hidden``: its last feature is the final norm's output (raw stores only: the manifest refuses it
    encoded). ``dequantise`` (encoded stores): into ``dtype``, on the host.
    ``pin``: ids and mask pinned too (the features are already)."""
    import torch

    item: dict[str, Any] = {"sample_id": sample_id, "input_ids": torch.from_numpy(ids.astype(np.int64)),
                            "loss_mask": torch.from_numpy(mask.astype(bool))}
    if final_hidden:
        item["hidden_states"], item["final_hidden"] = feats[:-1].permute(1, 0, 2), feats[-1]
    else:
        item["hidden_states"] = feats.permute(1, 0, 2)
    if scales is not None:
        item["hidden_scales"] = scales.permute(1, 0)
    if dequantise:
        item = encodings.decode_batch(item, encoding, hidden, codec.TORCH_DTYPE[dtype])
    if pin:
        item["input_ids"], item["loss_mask"] = item["input_ids"].pin_memory(), item["loss_mask"].pin_memory()
    return item
