"""Render a tokenized sample as text with its loss-masked spans visible, for people to read."""

from __future__ import annotations

import numpy as np

from .response import masked_spans

MASK_OPEN, MASK_CLOSE = "⟦", "⟧"
_ANSI_MASKED = "\x1b[1;32m"  # bold green: what the drafter learns
_ANSI_CONTEXT = "\x1b[2m"  # dim: prompt / context
_ANSI_RESET = "\x1b[0m"


def segments(tokenizer, input_ids, loss_mask) -> list[tuple[str, bool]]:
    """Decoded (text, masked) runs, in order. Special tokens are kept so turn structure stays visible."""
    ids = np.asarray(input_ids)
    mask = np.asarray(loss_mask)
    if ids.shape != mask.shape:
        raise ValueError(f"input_ids has {ids.size} tokens but loss_mask has {mask.size}")
    bounds = []
    pos = 0
    for start, end in masked_spans(mask):
        if start > pos:
            bounds.append((pos, start, False))
        bounds.append((start, end, True))
        pos = end
    if pos < ids.size:
        bounds.append((pos, ids.size, False))
    return [
        (tokenizer.decode(ids[a:b].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False), masked)
        for a, b, masked in bounds
    ]


def format_sample(tokenizer, input_ids, loss_mask, color: bool = False, max_chars: int | None = None) -> str:
    """Decoded sample with masked spans in bold green (``color=True``) or wrapped in ⟦ ⟧ (plain text).

    ``max_chars`` keeps the end of long samples (the response is what one wants to read) and marks the cut.
    """
    parts = segments(tokenizer, input_ids, loss_mask)
    if max_chars is not None and sum(len(t) for t, _ in parts) > max_chars:
        kept: list[tuple[str, bool]] = []
        budget = max_chars
        for text, masked in reversed(parts):
            if budget <= 0:
                break
            kept.append((text[-budget:], masked))
            budget -= len(text)
        parts = [("[...] ", False)] + kept[::-1]
    out = []
    for text, masked in parts:
        if color:
            out.append((_ANSI_MASKED if masked else _ANSI_CONTEXT) + text + _ANSI_RESET)
        else:
            out.append(MASK_OPEN + text + MASK_CLOSE if masked else text)
    return "".join(out)
