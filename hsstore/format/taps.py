"""A target's tapped layers as hsstore names them, shared by extraction and training.

Layer id ``l`` is the output of decoder layer ``l`` (0-based) before the final norm, for the last layer too: Hugging
Face ``hidden_states[l + 1]`` (index 0 is the embeddings) for every layer but the last, whose entry transformers
replaces by the norm's output (DFlash's and SpecForge's convention; which engines serve which taps:
``serving.py``). Extraction picks the taps and training
builds a drafter for them, and neither may import the other, so the default spacing lives here, once: two
copies had drifted apart (64 layers, 1 tap: one said [61], the other [1]; DFlash says [32]).
"""

from __future__ import annotations

DEFAULT_NUM_TAPS = 5  # the published DFlash drafters tap five target layers


def default_taps(num_layers: int, num_taps: int = DEFAULT_NUM_TAPS) -> list[int]:
    """DFlash's default taps (``build_target_layer_ids`` of z-lab's dflash, SpecForge and SGLang).

    One tap: the middle layer, ``num_layers // 2``. Several: ``num_taps`` ids evenly spaced from 1 to
    ``num_layers - 3``, rounded as Python rounds: 64 layers -> [1, 16, 31, 46, 61], 36 -> [1, 9, 17, 25, 33].
    A target too shallow for that many distinct ids is refused rather than given fewer taps than asked
    (the drafter's ``fc`` width depends on the count): name the layers instead.
    """
    if num_layers < 1 or num_taps < 1:
        raise ValueError(f"default taps need at least one layer and one tap (got {num_layers} layers, "
                         f"{num_taps} taps)")
    if num_taps == 1:
        return [num_layers // 2]
    first, last = 1, num_layers - 3
    taps = [int(round(first + i * (last - first) / (num_taps - 1))) for i in range(num_taps)]
    if last < first or len(set(taps)) != num_taps:
        raise ValueError(f"a {num_layers}-layer target has too few layers for {num_taps} DFlash taps (evenly "
                         f"spaced over 1..{num_layers - 3}); give the layer ids explicitly")
    return taps


def check_taps(layers: list[int], num_layers: int) -> list[int]:
    """``layers`` as a list, refused unless they are valid, strictly increasing ids of a ``num_layers`` target."""
    bad = [l for l in layers if not 0 <= l < num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} out of range: the target has {num_layers} decoder layers "
                         f"(valid ids 0..{num_layers - 1}; id l = output of decoder layer l, before the final norm)")
    if sorted(set(layers)) != list(layers):
        raise ValueError(f"layer ids must be strictly increasing, got {layers}")
    return list(layers)
