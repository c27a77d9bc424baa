"""z-lab's dflash: the reference DFlash drafter and generator. It reads no store and writes no hidden-state files
(a drafter reaches it through ``hsstore export-drafter``, train/drafter_format.py), so it offers neither export
nor import; what hsstore knows of it is how it numbers the taps.

* **layer ids** -- a drafter's ``dflash_config.target_layer_ids`` are hsstore ids (offset 0): its
  ``extract_context_feature`` reads Hugging Face's ``hidden_states[l + 1]``, the output of decoder layer ``l``,
  for every layer but the last, where transformers hands the final norm's output instead (which tap it cannot
  serve is ``hsstore.format.serving``'s ``dflash`` row).
"""

from __future__ import annotations

from .base import LayerConvention

NAME = "dflash"
LAYERS = LayerConvention(0, "dflash (target_layer_ids = output of decoder layer l, read as HF hidden_states[l+1])")


def ambiguity(layers: list[int], num_layers: int) -> str | None:
    """dflash's ids are hsstore's: a ``--layers`` list cannot be mistaken."""
    return None
