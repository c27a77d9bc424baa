"""DFlash training objective: anchors, same-position labels, decayed weights, weighted cross entropy.

For an anchor p the drafter gets the block [x_p, MASK, ..., MASK] (S tokens) and its output k
(k = 1 .. S-1) must predict x_{p+k}: the token AT position p+k, no shift (the block's position k
already stands for position p+k). Output 0 is the anchor itself and is never trained.

    weight(p, k) = loss_mask[p+k] * exp(-(k-1) / gamma)      (0 for k = 0 and for p+k >= seq_len)
    loss         = sum(weight * CE) / sum(weight)            over all anchors of the (global) batch

Under DDP "the batch" is the union of the ranks' batches: the trainer passes the all-reduced weight sum
(``weight_total``, see ``train.build.DraftLoss``), so ranks whose batches weigh differently still take
the step one process would take on all of them.

Early positions get more weight because a draft is only accepted up to its first miss.

Batch format (a dict; extra keys are ignored):
    input_ids      [B, T] long
    loss_mask      [B, T] (bool or 0/1)            1 on tokens to learn (the responses)
    hidden_states  [B, T, L, H] (any float dtype)  tapped target features, L = len(target_layers)
    attention_mask [B, T] bool, optional            False on right padding
    anchors        [B, A] long, optional            precomputed anchors (-1 = padding), e.g. in collate
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import pointwise

IGNORE = -100

_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """Decay constant of the position weights: 7 for block 16, 5 for 10, 4 for 8 (DFlash recipe)."""
    if block_size not in _GAMMA:
        raise ValueError(f"no default gamma for block_size {block_size} (known: {sorted(_GAMMA)}); pass gamma")
    return _GAMMA[block_size]


def sample_anchors(loss_mask: torch.Tensor, n_max: int = 512, generator: torch.Generator | None = None):
    """Anchor positions for one sequence: a uniform sample without replacement, returned sorted.

    Candidates are positions p with loss_mask[p] and loss_mask[p+1] (so p+1 < T): the anchor is a
    response token and at least its first draft position has a label. Returns at most n_max of them
    (fewer if there are fewer candidates, possibly none). Runs on CPU.
    """
    m = loss_mask.detach().bool().cpu()
    cand = torch.nonzero(m[:-1] & m[1:]).flatten()
    if cand.numel() > n_max:
        pick = torch.randperm(cand.numel(), generator=generator)[:n_max]
        cand = cand[pick].sort().values
    return cand


def batch_anchors(loss_mask: torch.Tensor, n_max: int = 512, generator=None) -> torch.Tensor:
    """sample_anchors for every row of loss_mask [B, T], padded with -1 into [B, A] (A = largest count)."""
    per_row = [sample_anchors(row, n_max, generator) for row in loss_mask]
    A = max((a.numel() for a in per_row), default=0)
    out = torch.full((len(per_row), A), -1, dtype=torch.long)
    for i, a in enumerate(per_row):
        out[i, : a.numel()] = a
    return out


def block_targets(input_ids, loss_mask, anchors, block_size: int, gamma: float):
    """Labels and weights [B, A, S] for the drafter's outputs.

    labels[b, a, k]  = input_ids[b, p+k]   (p = anchors[b, a]; IGNORE where p+k >= T, k = 0 or padding)
    weights[b, a, k] = loss_mask[b, p+k] * exp(-(k-1)/gamma) on the labelled positions, else 0.
    Right padding must already be zero in loss_mask.
    """
    B, T = input_ids.shape
    dev = input_ids.device
    anchors = anchors.to(dev)
    k = torch.arange(block_size, device=dev)
    pos = anchors[:, :, None] + k  # [B, A, S]
    ok = (anchors[:, :, None] >= 0) & (k >= 1) & (pos < T)
    pos_c = pos.clamp(0, T - 1).flatten(1)
    labels = torch.gather(input_ids, 1, pos_c).view_as(pos).masked_fill(~ok, IGNORE)
    lm = torch.gather(loss_mask.to(dev).float(), 1, pos_c).view_as(pos)
    decay = torch.exp(-(k - 1).clamp(min=0).float() / gamma)
    weights = lm * decay * ok
    return labels, weights


CE_IMPLS = ("fused", "checkpoint", "full")


def _ce_and_argmax(h, w, y):
    logits = F.linear(h.to(w.dtype), w)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # CE in >= fp32
    return F.cross_entropy(logits, y, reduction="none"), logits.argmax(-1)


@pointwise.fused(without_grad=True)
def _softmax_grad(logits, y):
    """One chunk's CE [c], top-1 [c] and dCE/dlogits [c, V] in the logits' dtype (softmax - onehot, 0 on IGNORE
    rows), the softmax in >= fp32. Compiled (the GPU), one reduction over each row's logits (max, exp-sum,
    argmax) and one pass writing the gradient, where the eager casts, log-softmax, exp, argmax and multiply each
    read and write the whole chunk (docs/PERFORMANCE.md, "Training step"). Eager, the log-softmax in place: one
    fp32 chunk held, not a copy of the logits too."""
    keep = y != IGNORE
    yc = y.clamp(min=0)
    pred = logits.argmax(-1)
    if torch.compiler.is_compiling():  # one pass: the onehot is an index compare inside the kernel
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        lse = torch.logsumexp(x, -1)
        ce = torch.where(keep, lse - x.gather(1, yc[:, None]).squeeze(1), 0.0)
        label = torch.arange(x.shape[1], device=x.device)[None, :] == yc[:, None]
        p = torch.exp(x - lse[:, None])
        g = torch.where(label, p - 1, p) * keep[:, None]
        return ce, pred, g.to(logits.dtype)
    lsm = F.log_softmax(logits, -1, dtype=torch.promote_types(logits.dtype, torch.float32))
    ce = torch.where(keep, -lsm.gather(1, yc[:, None]).squeeze(1), 0.0)
    g = lsm.exp_()  # softmax, in place
    g.scatter_add_(1, yc[:, None], torch.full_like(yc[:, None], -1, dtype=g.dtype))
    g.mul_(keep[:, None])
    return ce, pred, g.to(logits.dtype)


def _fused_chunks(h, w, y, chunk: int, want_grad: bool):
    """CE [N], top-1 [N] and, with ``want_grad``, dCE_i/dh_i [N, H], one chunk of logits at a time.

    The CE is what ``F.cross_entropy`` computes (log-softmax in >= fp32, then the label's entry; rows
    labelled IGNORE give 0); its gradient with respect to the logits is softmax - onehot, which the
    log-softmax of the forward already holds (``_softmax_grad``), so the gradient with respect to h costs one
    matmul here and none in backward (the checkpointed path recomputes the logits there: one V x H matmul more
    per row)."""
    N = h.shape[0]
    ct = torch.promote_types(torch.promote_types(h.dtype, w.dtype), torch.float32)
    ce = h.new_empty(N, dtype=ct)
    pred = y.new_empty(N)
    dh = torch.empty_like(h) if want_grad else None
    for s in range(0, N, chunk):
        logits = F.linear(h[s:s + chunk].to(w.dtype), w)
        ys = y[s:s + chunk]
        if want_grad:
            ce[s:s + chunk], pred[s:s + chunk], g = _softmax_grad(logits, ys)
            del logits
            dh[s:s + chunk] = (g @ w).to(h.dtype)
            continue
        pred[s:s + chunk] = logits.argmax(-1)
        lsm = F.log_softmax(logits, -1, dtype=ct)  # == log_softmax(logits.to(ct)): no fp32 copy of the logits
        del logits
        ce[s:s + chunk] = torch.where(ys != IGNORE, -lsm.gather(1, ys.clamp(min=0)[:, None]).squeeze(1), 0.0)
        del lsm
    return ce, pred, dh


class _FusedLinearCE(torch.autograd.Function):
    """Rows' CE of h @ w.T with the gradient taken in the forward pass; w is frozen (no gradient)."""

    @staticmethod
    def forward(ctx, h, w, y, chunk):
        ce, pred, dh = _fused_chunks(h, w, y, chunk, want_grad=True)
        ctx.save_for_backward(dh)
        ctx.mark_non_differentiable(pred)
        return ce, pred

    @staticmethod
    def backward(ctx, grad_ce, grad_pred):
        (dh,) = ctx.saved_tensors
        return dh * grad_ce[:, None].to(dh.dtype), None, None, None


def chunked_cross_entropy(h: torch.Tensor, lm_head: torch.Tensor, labels: torch.Tensor, chunk: int = 1024,
                          impl: str = "fused"):
    """CE [N] and top-1 predictions [N] for rows h [N, H] (logits h @ lm_head.T; lm_head frozen).

    ``impl``:
      * "fused" (default): ``chunk`` rows of logits at a time; each chunk's gradient with respect to its
        rows of h is computed right away (softmax - onehot) @ lm_head and kept ([N, H], the size of h),
        so backward only scales it: one chunk's logits live at any time, and no logits are recomputed; each
        chunk's softmax, gradient, CE and argmax are one compiled pass on the GPU (``pointwise.fused``);
      * "checkpoint": ``chunk`` rows at a time under activation checkpointing: the same peak for the
        logits, but backward recomputes each chunk's logits (one V x H matmul per row more);
      * "full": all N x V logits at once, kept for backward by autograd (the reference; memory N x V).
    Rows labelled IGNORE get CE 0 and no gradient, as in ``F.cross_entropy``.
    """
    if impl not in CE_IMPLS:
        raise ValueError(f"cross-entropy impl must be one of {CE_IMPLS}, not {impl!r}")
    if chunk < 1:
        raise ValueError(f"ce chunk must be >= 1 row, not {chunk}")
    if h.shape[0] == 0:
        return h.new_zeros(0, dtype=torch.float32), labels.new_zeros(0)
    want_grad = torch.is_grad_enabled() and h.requires_grad
    if impl == "full":
        return _ce_and_argmax(h, lm_head, labels)
    if impl == "fused":
        if lm_head.requires_grad:
            raise ValueError("the fused cross entropy treats lm_head as frozen, but it requires grad; "
                             "use impl='checkpoint' to train it")
        if want_grad:
            return _FusedLinearCE.apply(h, lm_head, labels, chunk)
        ce, pred, _ = _fused_chunks(h, lm_head, labels, chunk, want_grad=False)
        return ce, pred
    ces, preds = [], []
    for s in range(0, h.shape[0], chunk):
        args = (h[s : s + chunk], lm_head, labels[s : s + chunk])
        ce, pred = checkpoint(_ce_and_argmax, *args, use_reentrant=False) if want_grad else _ce_and_argmax(*args)
        ces.append(ce)
        preds.append(pred)
    return torch.cat(ces), torch.cat(preds)


def dflash_loss(model, batch: dict, anchors_per_seq: int = 512, generator: torch.Generator | None = None,
                gamma: float | None = None, ce_chunk: int = 1024, weight_total: float | torch.Tensor | None = None,
                ce_impl: str = "fused"):
    """Weighted block cross entropy of ``model`` (a DFlashDrafter) on ``batch``.

    Anchors come from batch["anchors"] if present, else are sampled here (sample_anchors per row). With them,
    ``batch["selected"]`` (the flat indices of the weighted positions, ``selected_positions``) and
    ``batch["key_lengths"]`` (``DFlashDrafter.key_lengths``), both worked out on the CPU beforehand
    (``train.data.add_anchors``), let the step run without waiting for the GPU once; without them it
    works them out here.
    ``weight_total`` replaces this batch's weight sum as the loss's denominator (DDP: see the module doc).
    ``ce_chunk`` / ``ce_impl``: how the lm_head and CE run over the weighted rows (``chunked_cross_entropy``);
    every impl gives the same loss, gradients and metrics, they differ in memory and time only.
    Returns (loss, metrics); loss is a scalar with grad (0 with grad if the batch has no anchors).
    metrics (detached tensors, call .item() when logging):
        acc          top-1 accuracy over all weighted positions (unweighted mean)
        acc_k        [S-1] accuracy of draft position k = 1 .. S-1 (nan where no labels)
        tau          mean over anchors of 1 + length of the correct prefix of the block (a teacher-forced
                     estimate of acceptance length; a label outside loss_mask ends the prefix)
        num_anchors, num_tokens (positions with weight > 0), weight_sum
        ce_sum       sum(weight * CE): with weight_sum, the weighted mean over any set of batches or ranks
        hits_k, labels_k   [S-1] correct and labelled positions per draft position (acc_k = hits / labels)
        accept_k     [S-1] anchors whose drafts 1..k are all correct (the prefix tau counts), k = 1 .. S-1
    """
    cfg = model.config
    S = cfg.block_size
    gamma = default_gamma(S) if gamma is None else gamma
    dev = next(model.parameters()).device
    input_ids = batch["input_ids"].to(dev)
    B, T = input_ids.shape
    attn = batch.get("attention_mask")
    attn = torch.ones(B, T, dtype=torch.bool, device=dev) if attn is None else attn.to(dev).bool()
    loss_mask = batch["loss_mask"].to(dev).bool() & attn

    anchors = batch.get("anchors")
    given = anchors is not None
    if not given:
        anchors = batch_anchors(loss_mask, anchors_per_seq, generator)
    anchors = anchors.to(dev)

    labels, weights = block_targets(input_ids, loss_mask, anchors, S, gamma)  # [B, A, S]
    idx = batch.get("selected") if given else None
    idx = selected_positions(weights) if idx is None else idx.to(dev)  # the rows with weight > 0, in order
    if idx.numel() == 0:
        zero = sum(p.sum() for p in model.parameters()) * 0.0
        nan = torch.tensor(float("nan"))
        none = torch.zeros(S - 1, dtype=torch.long)
        return zero, dict(acc=nan, acc_k=torch.full((S - 1,), float("nan")), tau=nan,
                          num_anchors=torch.tensor(0), num_tokens=torch.tensor(0), weight_sum=torch.tensor(0.0),
                          ce_sum=torch.tensor(0.0), hits_k=none, labels_k=none, accept_k=none)

    h = model.draft_hidden(batch["hidden_states"].to(dev), input_ids, anchors, attn,
                           key_lengths=batch.get("key_lengths") if given else None)  # [B, A, S, H]
    # gathers by index, not boolean masks: their sizes are known, so nothing waits for the device
    y = labels.flatten().index_select(0, idx)
    ce, pred = chunked_cross_entropy(h.flatten(0, 2).index_select(0, idx), model.lm_head, y, ce_chunk, ce_impl)
    w = weights.flatten().index_select(0, idx)
    ce_sum = (w * ce).sum()
    loss = ce_sum / (w.sum() if weight_total is None else weight_total)

    with torch.no_grad():
        sel = weights > 0
        correct = torch.zeros(sel.numel(), dtype=torch.bool, device=dev).index_put_((idx,), pred == y)
        correct = correct.view_as(sel)
        hits = correct[:, :, 1:].sum((0, 1))
        counts = sel[:, :, 1:].sum((0, 1))
        acc_k = torch.where(counts > 0, hits / counts.clamp(min=1), torch.full_like(counts, float("nan"),
                                                                                      dtype=torch.float32))
        real = anchors >= 0
        accepted = correct[:, :, 1:].long().cumprod(-1) * real[..., None]  # [B, A, S-1]: drafts 1..k all correct
        n_real = real.sum()
        tau = (real.long() + accepted.sum(-1)).sum().float() / n_real  # mean over real anchors of 1 + prefix
        metrics = dict(
            acc=hits.sum() / counts.sum(), acc_k=acc_k, tau=tau,
            num_anchors=n_real, num_tokens=torch.tensor(idx.numel()), weight_sum=w.sum(), ce_sum=ce_sum.detach(),
            hits_k=hits, labels_k=counts, accept_k=accepted.sum((0, 1)),
        )
    return loss, metrics


def selected_positions(weights: torch.Tensor) -> torch.Tensor:
    """Flat indices [N] (long, ascending) of the block positions with a weight > 0 (``block_targets``): the
    rows the loss runs on, in the order a boolean mask would take them. Its size depends on the values, so
    on a GPU this waits for the device: ``add_anchors`` works it out on the CPU instead."""
    return (weights > 0).flatten().nonzero().squeeze(1)
