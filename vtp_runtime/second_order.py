"""Second-order gradients through the ops are refused, never silently wrong.

Backends compute gradients from saved statistics without building a graph, so a gradient
taken with ``create_graph=True`` has no second-order term. Differentiating it (a gradient
penalty) must raise rather than drop that term: under ``create_graph=True`` the core passes
the gradients through ``_SecondOrderError``, an identity whose backward raises.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Tensor = torch.Tensor

MESSAGE = (
    "second-order gradients through vtp_runtime ops are not supported: a gradient of {op} taken with "
    "create_graph=True was differentiated (a gradient penalty, say). Detach that gradient (g.detach()) "
    "where the penalty needs no gradient of its own, or compute the loss the penalty differentiates "
    "with plain PyTorch ops (torch.nn.functional.log_softmax on logits gathered over the vocabulary)."
)


class _SecondOrderError(torch.autograd.Function):
    """The gradients, unchanged; differentiating them raises. Its inputs after the gradients
    link it to the graphs of the op's inputs and of the upstream gradient, so every backward
    that would need the second-order term reaches it (``autograd.grad(penalty, params)``
    skips nodes that lead to no requested input)."""

    @staticmethod
    def forward(ctx, op: str, n: int, *tensors):
        ctx.op = op
        return tuple(g.detach() for g in tensors[:n])

    @staticmethod
    def backward(ctx, *unused):
        raise RuntimeError(MESSAGE.format(op=ctx.op))


def graph_links(inputs: tuple[Tensor, ...], saved: tuple) -> tuple[Tensor, ...]:
    """For each input that needs a gradient but is not in ``saved`` (the backend keeps other
    state): an empty tensor computed from it, which keeps none of its memory but links to its
    graph. Called in the op's forward, which runs without grad mode."""
    links = []
    for t in inputs:
        if t.requires_grad and not any(s is t for s in saved):
            with torch.enable_grad():
                links.append(t[..., :0].clone())
    return tuple(links)


def refuse(op: str, grads: tuple, links: tuple) -> tuple:
    """``grads`` (None where not needed) made to raise when differentiated. ``links``: tensors
    (None allowed) whose graphs lead to what a second-order term would reach -- the op's
    saved inputs, ``graph_links``, the upstream gradient."""
    computed = [i for i, g in enumerate(grads) if g is not None]
    if not computed:
        return grads
    # the gradients themselves as stand-in leaves: a plain .backward() reaches the error
    # even where nothing else links to the graph
    fakes = [grads[i].detach().requires_grad_() for i in computed]
    linked = [t for t in links if t is not None and t.requires_grad]
    wrapped = _SecondOrderError.apply(op, len(fakes), *fakes, *linked)
    out = list(grads)
    for i, g in zip(computed, wrapped):
        out[i] = g
    return tuple(out)


def gradients(op: str, compute: Callable[[], tuple], n_leading: int, links: tuple) -> tuple:
    """An autograd Function's ``backward``: ``compute()``'s gradients, the first ``n_leading``
    of them the None of its non-tensor arguments. Under ``create_graph=True`` (grad mode on
    in backward) they are computed as usual, without grad, and made to raise when
    differentiated (see ``refuse`` for ``links``): no backend computes second order."""
    if not torch.is_grad_enabled():
        return compute()
    with torch.no_grad():
        grads = compute()
    return (*grads[:n_leading], *refuse(op, grads[n_leading:], links))
