"""Render a tokenized sample as text with its loss-masked spans visible, for people to read."""

from __future__ import annotations

import numpy as np

from hsstore.terminal import escape

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
        text = escape(text, keep="\n\t")  # the tokenizer may be a store's: its text never drives the terminal
        if color:
            out.append((_ANSI_MASKED if masked else _ANSI_CONTEXT) + text + _ANSI_RESET)
        else:
            out.append(MASK_OPEN + text + MASK_CLOSE if masked else text)
    return "".join(out)


def input_sample(inputs, n: str, tokenizer, *, expand: bool = True, chat_template_kwargs: dict | None = None,
                 trust_engine_ids: bool = False, learn_not_generated: bool = False):
    """Sample ``n`` of input files (0-based position after multi-turn expansion, or a sample id), tokenized as
    extract would; a row that was skipped, or a position past the end, is refused saying which and why."""
    from .tokenize import TokenizeStats, load_samples

    index = int(n) if n.isdigit() else None
    count = 0
    stats = TokenizeStats()
    for sample in load_samples(inputs, tokenizer, keep_over_length=True, expand=expand, stats=stats,
                               chat_template_kwargs=chat_template_kwargs or {}, trust_engine_ids=trust_engine_ids,
                               learn_not_generated=learn_not_generated):
        if count == index or sample.sample_id == n:
            return sample
        count += 1
    why = next((r for r, ids in stats.skipped.items() if n in ids), None)
    if why:
        raise ValueError(f"{inputs}: row {n!r} was skipped ({why}): it cannot be tokenized faithfully "
                         "(the warning above says why)")
    skipped = "".join(f"; {len(ids)} rows skipped ({r}), first: {stats.first_skipped[r][:240]}"
                      for r, ids in stats.skipped.items())
    raise ValueError(f"{inputs}: no sample {n!r} (it has {count} samples{skipped})")


def format_input_sample(sample, tokenizer, color: bool = False, max_chars: int | None = None) -> str:
    """A header line (id, source, token counts, gate flags), then the decoded sample with its mask marked."""
    s = sample
    flags = ", ".join(s.flags) or "-"
    return (f"# {escape(s.sample_id)} [{escape(s.source)}] {s.num_tokens} tokens, loss {s.loss_tokens}, thinking "
            f"{s.thinking_tokens}, answer {s.answer_tokens}, flags: {escape(flags)}\n"
            + format_sample(tokenizer, s.input_ids, s.loss_mask, color=color, max_chars=max_chars))


def format_store_sample(url: str, n: str, storage_options: dict | None = None, model: str | None = None,
                        color: bool = False, max_chars: int | None = None) -> str:
    """Sample ``n`` (position or id) of a store, decoded with the store's own tokenizer (exported by extract)
    unless ``model`` names one, its loss mask marked, after a header line from its commit record."""
    import tempfile

    from hsstore.format import assets
    from hsstore.redaction import recordable_url
    from hsstore.store import reader

    from .target import load_tokenizer

    store = reader.open(url, **(storage_options or {}))
    store.admit()  # the admission's store-wide rules: nothing of a refused store is shown
    ids = store.sample_ids()
    index = int(n) if n.isdigit() else (ids.index(n) if n in ids else None)
    if index is None or not 0 <= index < len(store):
        raise ValueError(f"{url}: no sample {n!r} (it has {len(store)} samples)")
    ref = store.ref(index)
    rec = store.admitted(ref.shard)  # the header is the admitted record's, never a column it was not held to
    item = store.read(index, layers=store.layers[:1])
    if model:
        tokenizer = load_tokenizer(model)
    else:
        if not any(a.startswith(assets.TOKENIZER_DIR + "/") for a in assets.asset_names(store.fs, store.root)):
            raise ValueError(f"store {recordable_url(url)} holds no tokenizer (assets/{assets.TOKENIZER_DIR}/: "
                             "written by extract, and by import --model DIR): give --model DIR to decode with "
                             "that model's tokenizer")
        with tempfile.TemporaryDirectory() as tmp:
            assets.download_dir(store.fs, store.root, assets.TOKENIZER_DIR, tmp, url=url)
            tokenizer = load_tokenizer(tmp)
    flags = ", ".join(rec.samples["flags"][ref.local]) or "-"
    return (f"# {escape(ref.sample_id)} [{escape(rec.samples['source'][ref.local])}] {ref.stop - ref.start} "
            f"tokens, loss {int(item['loss_mask'].sum())}, thinking {rec.samples['thinking_tokens'][ref.local]}, "
            f"shard {escape(ref.shard)}, flags: {escape(flags)}\n"
            + format_sample(tokenizer, item["input_ids"].numpy(), item["loss_mask"].numpy(), color=color,
                            max_chars=max_chars))
