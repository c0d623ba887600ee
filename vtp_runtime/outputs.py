"""A call's per-token values back to the token shape, and reduced.

Backends return ``[N]`` values (``[N, k]`` for top-k log-probs, ``[N, k + 1]`` with the
entropy); the core gives them the logits' leading shape and applies ``reduction`` and
``normalizer``, in plain tensor code that ``torch.compile`` traces.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

Tensor = torch.Tensor


def finish(
    values: Tensor, lead: tuple[int, ...], topk: bool, index: Tensor | None, mask: Tensor | None, options
) -> Tensor | tuple[Tensor, Tensor]:
    """The backend's ``[N]`` (``[N, k]``; ``[N, k + 1]`` with ``return_entropy``) values back to
    the token shape and reduced as ``options`` say."""
    ignore_index = options.get("ignore_index", -100)
    if options.get("return_entropy"):
        assert index is not None  # return_entropy is an option of logprobs, which takes an index
        lp, h = values[:, :-1], values[:, -1]
        lp = lp.reshape(*lead, lp.shape[1]) if topk else lp.reshape(lead)
        # an entropy counts (for "mean") where some entry of its token's index is not ignored
        kept = (index != ignore_index).any(1) if topk else index != ignore_index
        return reduce(lp, options, index, None, ignore_index), reduce(
            h.reshape(lead), options, None, kept, ignore_index
        )
    if len(lead) != 1:  # lead is () for 1-D logits: one token
        assert index is not None or not topk
        values = values.view(lead + ((index.shape[-1],) if topk and index is not None else ()))
    return reduce(values, options, index, mask, ignore_index)


def reduce(values: Tensor, options, index: Tensor | None, mask: Tensor | None, ignore_index: int) -> Tensor:
    """Per-token ``values`` reduced as ``options["reduction"]`` and ``normalizer`` say: "mean"
    over unmasked tokens (index entries for top-k log-probs), 0 when all are masked."""
    reduction, normalizer = options.get("reduction", "none"), options.get("normalizer")
    if normalizer is not None:
        total = values if reduction == "none" else values.sum()
        if isinstance(normalizer, Tensor):
            normalizer = normalizer.to(device=total.device, dtype=total.dtype).reshape(())
            # not read on the host (no sync): a count that is not finite and > 0 gives NaN
            normalizer = torch.where((normalizer > 0) & (normalizer < math.inf), normalizer, math.nan)
        return total / normalizer
    if reduction == "none":
        return values
    if reduction == "sum":
        return values.sum()
    if index is not None:
        count = (index != ignore_index).sum()
    elif mask is not None:
        count = mask.sum()
    else:  # every token counts: one op (an empty call gives 0, a sum over nothing)
        return values.mean() if values.numel() else values.sum()
    # an int64 count divides a float total in the total's dtype; 0 when all are masked
    return values.sum() / count.clamp(min=1)


def head_reduction(options: Mapping[str, Any]) -> str:
    """How a call with Head inputs runs: per token (``"none"``: gradients in backward) or as a
    scalar (gradients during forward, for one upstream number). ``return_entropy`` gives two
    outputs reduced apart, so its upstream gradient is not one number: per token."""
    return "none" if options.get("return_entropy") else options.get("reduction", "none")
