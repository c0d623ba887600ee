"""A call's per-token values back to the token shape, and reduced.

Backends return ``[N]`` values (``[N, k]`` for top-k log-probs, ``[N, k + 1]`` with the
entropy); the core gives them the logits' leading shape and applies ``reduction`` and
``normalizer``, in plain tensor code that ``torch.compile`` traces. With an ``sp_group``
(ranks holding other tokens of the batch: DeepSpeed Ulysses, context parallel) a sum or mean
is summed over that group's ranks in one all-reduce of a few numbers, replicated there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .comm import all_reduce, group_size

Tensor = torch.Tensor


def values_shape(n: Any, index: Tensor | None, topk: bool, return_entropy: bool) -> tuple:
    """The shape of a backend's per-token values for ``n`` tokens: ``[N]``, ``[N, k]`` for
    top-k log-probs, ``[N, k + 1]`` with ``return_entropy`` (``k = 1`` for an ``[N]`` index)."""
    k = index.shape[-1] if topk and index is not None else 1
    if return_entropy:
        return (n, k + 1)
    return (n, k) if topk else (n,)


def finish(
    values: Tensor, lead: tuple[int, ...], topk: bool, index: Tensor | None, mask: Tensor | None, options
) -> Tensor | tuple[Tensor, Tensor]:
    """The backend's ``[N]`` (``[N, k]``; ``[N, k + 1]`` with ``return_entropy``) values back to
    the token shape and reduced as ``options`` say."""
    ignore_index = options.get("ignore_index", -100)
    if options.get("return_entropy"):
        assert index is not None  # return_entropy is an option of logprobs, which takes an index
        if not topk and _reduced_here(options):
            return _reduced_pair(values, index, options["reduction"], ignore_index)
        lp, h = values[:, :-1], values[:, -1]
        lp = lp.reshape(*lead, lp.shape[1]) if topk else lp.reshape(lead)
        # an entropy counts (for "mean") where some entry of its token's index is not ignored
        kept = (index != ignore_index).any(1) if topk else index != ignore_index
        lp, h = _reduced([(lp, index, None), (h.reshape(lead), None, kept)], options, ignore_index)
        return lp, h
    if len(lead) != 1:  # lead is () for 1-D logits: one token
        assert index is not None or not topk
        values = values.view(lead + ((index.shape[-1],) if topk and index is not None else ()))
    return reduce(values, options, index, mask, ignore_index)


def reduce(values: Tensor, options, index: Tensor | None, mask: Tensor | None, ignore_index: int) -> Tensor:
    """Per-token ``values`` reduced as ``options["reduction"]`` and ``normalizer`` say: "mean"
    over unmasked tokens (index entries for top-k log-probs), 0 when all are masked. With an
    ``sp_group`` a sum or mean covers the tokens of every rank of that group (see
    ``SequenceSum``)."""
    return _reduced([(values, index, mask)], options, ignore_index)[0]


def _reduced_pair(values: Tensor, index: Tensor, reduction: str, ignore_index: int) -> tuple[Tensor, Tensor]:
    """Log-probs and entropy of an ``[N]`` index from the ``[N, 2]`` values, summed or averaged
    in one reduction of both columns: they count the same tokens (those whose index is not
    ignored), so each op here serves both outputs, in the forward and the backward."""
    totals = values.sum(0)
    if reduction == "mean":
        totals = totals / (index != ignore_index).sum().clamp(min=1)
    lp, h = totals.unbind(0)
    return lp, h


def _reduced(parts, options, ignore_index: int) -> list[Tensor]:
    """``reduce`` of several outputs of one call: one collective over ``sp_group`` for all."""
    reduction, normalizer = options.get("reduction", "none"), options.get("normalizer")
    group = options.get("sp_group")
    spread = reduction != "none" and group_size(group) > 1
    if not spread and normalizer is None:  # the common case, in as few ops as it takes
        if reduction == "none":
            return [values for values, _, _ in parts]
        if reduction == "sum":
            return [values.sum() for values, _, _ in parts]
        return [_mean(values, index, mask, ignore_index) for values, index, mask in parts]
    totals = [values if reduction == "none" else values.sum() for values, _, _ in parts]
    counts = (
        [_count(values, index, mask, ignore_index) for values, index, mask in parts]
        if reduction == "mean" and normalizer is None
        else []
    )
    if spread:
        totals, counts = sequence_sum(totals, counts, group)
    if normalizer is not None:
        if isinstance(normalizer, Tensor):
            normalizer = normalizer.to(device=totals[0].device, dtype=totals[0].dtype).reshape(())
            # not read on the host (no sync): a count that is not finite and > 0 gives NaN
            normalizer = torch.where((normalizer > 0) & (normalizer < math.inf), normalizer, math.nan)
        return [total / normalizer for total in totals]
    if not counts:
        return totals
    return [total / count.clamp(min=1).to(total.dtype) for total, count in zip(totals, counts)]


def _mean(values: Tensor, index: Tensor | None, mask: Tensor | None, ignore_index: int) -> Tensor:
    """The mean over unmasked tokens on this rank alone; 0 when all are masked."""
    if index is None and mask is None:  # every token counts: one op (nothing: 0, a sum over nothing)
        return values.mean() if values.numel() else values.sum()
    # an int64 count divides a float total in the total's dtype
    return values.sum() / _count(values, index, mask, ignore_index).clamp(min=1)


def backend_reduction(options: Mapping[str, Any], topk: bool, pairs: bool) -> str:
    """The reduction a backend that ``Reduces`` computes itself for a call on logits with
    these ``options`` (as passed): "sum" or "mean" where the result is one number per output
    known on this rank alone, "none" where the core reduces (or nothing is reduced): a
    ``normalizer``, sums over ``sp_group``, two outputs (``return_entropy``) unless the
    backend reduces pairs (``pairs``) and the index is ``[N]`` (not ``topk``)."""
    if not _reduced_here(options) or (options.get("return_entropy") and (topk or not pairs)):
        return "none"
    return options["reduction"]


def _reduced_here(options: Mapping[str, Any]) -> bool:
    """Whether the reduction makes one number per output from this rank's tokens alone: "sum"
    or "mean", no ``normalizer``, no ``sp_group`` to sum over."""
    return (
        options.get("reduction", "none") != "none"
        and options.get("normalizer") is None
        and group_size(options.get("sp_group")) <= 1
    )


def plain_upstream(
    options: Mapping[str, Any],
    index: Tensor | None,
    mask: Tensor | None,
    num_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor | None:
    """The gradient a backward from 1 through ``reduce`` sends to each per-token value (of
    ``dtype``) of a call on ``num_tokens`` tokens, as a 0-dim tensor on ``device``, bit for
    bit what torch's backward of that reduction computes: 1 for "sum", 1 / the count for
    "mean" (without index or mask, one value per token). None where it is not one number
    known before the reduction runs: per-token results, a ``normalizer``, sums over
    ``sp_group``."""
    if not _reduced_here(options):
        return None
    one = torch.ones((), dtype=dtype, device=device)
    if options["reduction"] == "sum" or num_tokens == 0:  # a mean over nothing is a sum over nothing
        return one
    if index is None and mask is None:  # values.mean(): its backward divides by the count of values
        return one / num_tokens
    return one / _count(one, index, mask, options.get("ignore_index", -100)).clamp(min=1)


def _count(values: Tensor, index: Tensor | None, mask: Tensor | None, ignore_index: int) -> Tensor:
    """The tokens (index entries for top-k log-probs) a "mean" divides by."""
    if index is not None:
        return (index != ignore_index).sum()
    if mask is not None:
        return mask.sum()
    # a fill on the device: torch.tensor(n, device=cuda) would wait for the stream
    return torch.full((), values.numel(), device=values.device)


class SequenceSum(torch.autograd.Function):
    """The sum over the ranks of ``sp_group`` of a vector of per-rank partial sums,
    replicated on every rank; backward is the identity.

    Every rank backprops the replicated global loss once, and each rank's partial sum enters
    that loss with weight 1: the gradient of the global loss with respect to this rank's
    partial sum is the upstream gradient itself. (An all-reduce in backward as well would
    count every rank's gradient ``sp_size`` times.)
    """

    @staticmethod
    def forward(ctx: Any, parts: Tensor, group: Any) -> Tensor:
        return all_reduce(parts.clone(), group, "sum")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def sequence_sum(totals: list[Tensor], counts: list[Tensor], group: Any) -> tuple[list[Tensor], list[Tensor]]:
    """``totals`` and ``counts`` each summed over ``group``, in one all-reduce of a float64
    vector (exact counts past 2**24 tokens, and the totals summed in float64); the totals back
    in their dtype, differentiable (``SequenceSum``)."""
    parts = torch.stack([t.reshape(()).to(torch.float64) for t in (*totals, *counts)])
    summed = SequenceSum.apply(parts, group)
    n = len(totals)
    return [summed[i].to(t.dtype) for i, t in enumerate(totals)], list(summed[n:].unbind(0))


def head_reduction(options: Mapping[str, Any]) -> str:
    """How a call with Head inputs runs: per token (``"none"``: gradients in backward) or as a
    scalar (gradients during forward, for one upstream number). ``return_entropy`` gives two
    outputs reduced apart, so its upstream gradient is not one number: per token."""
    return "none" if options.get("return_entropy") else options.get("reduction", "none")
