"""The one autograd node of every op call, and the computation of calls on logits.

``OpFunction.apply(computation, *flat)`` runs ``computation.forward(flat)`` in forward and
``computation.backward(saved, grad)`` in backward. A computation is how a call is computed:

- ``LogitsComputation``: the backend's ``forward`` on the logits rows, its ``backward`` from the
  state it returned (a ``SavedState``, whose tensors autograd saves: an input modified in
  place before backward raises).
- ``vtp_runtime.head_chunks.ChunkedComputation``: ``vtp.Head`` inputs, through token chunks.

Both hand autograd the tensors to save and get them back in backward; whatever else a
computation keeps lives on the computation, which the graph holds until it is freed. Inside
``torch.compile`` the same backend calls run in two custom ops instead
(``vtp_runtime.library``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from . import second_order
from .backend import Backend, Call, SavedState, meets_layout, value_dtype

Tensor = torch.Tensor


class Computation(Protocol):
    op: str

    def forward(self, flat: tuple[Tensor | None, ...]) -> tuple[Tensor, tuple[Tensor | None, ...]]:
        """``(values, tensors for autograd to save)``."""
        ...

    def backward(self, saved: tuple[Tensor | None, ...], grad: Tensor) -> tuple[Tensor | None, ...]:
        """One gradient per flat input (None where none is needed)."""
        ...


class OpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, computation: Computation, *flat: Tensor | None) -> Tensor:
        values, saved = computation.forward(flat)
        ctx.computation = computation
        ctx.save_for_backward(*saved)
        ctx.links = second_order.graph_links(tuple(t for t in flat if t is not None), saved)
        return values

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors  # raises if an input was modified in place since forward
        links = (*saved, *ctx.links, grad)
        return second_order.gradients(
            ctx.computation.op, lambda: (None, *ctx.computation.backward(saved, grad)), 1, links
        )


def state_type(backend: Backend, state: Any) -> type[SavedState] | None:
    """The class of a backend's state, checked: a ``SavedState`` or None."""
    if state is None:
        return None
    if not isinstance(state, SavedState):
        raise TypeError(
            f"backend {backend.name!r}: forward must return (values, state) with state a "
            f"vtp_runtime.SavedState dataclass or None, got {type(state).__name__}"
        )
    return type(state)


class LogitsComputation:
    """A call on logits rows ``[N, V_local]``: the backend's forward and backward."""

    def __init__(self, backend: Backend, call: Call, index: Tensor | None, mask: Tensor | None) -> None:
        self.backend, self.call, self.index, self.mask = backend, call, index, mask
        self.op = call.op
        self.state_type: type[SavedState] | None = None

    def forward(self, flat: tuple[Tensor | None, ...]) -> tuple[Tensor, tuple[Tensor | None, ...]]:
        inputs = tuple(t for t in flat if t is not None)
        values, state = self.backend.forward(self.call, inputs, self.index, self.mask)
        self.state_type = state_type(self.backend, state)
        return values, () if state is None else state.tensors()

    def backward(self, saved: tuple[Tensor | None, ...], grad: Tensor) -> tuple[Tensor | None, ...]:
        state = None if self.state_type is None else self.state_type.from_tensors(saved)
        return self.backend.backward(self.call, state, grad.contiguous())


def rows(t: Tensor, n: int, layout: str) -> Tensor:
    """``[..., V]`` in the backend's declared ``input_layout``: a view of ``t`` (``[N, V]``,
    or ``t`` itself as ``[A, B, V]`` where the layout allows it) when one fits, else a
    contiguous ``[N, V]`` copy. The only copy of the inputs the core makes."""
    try:
        flat = t.view(n, t.shape[-1])
    except RuntimeError:  # the leading dims have no single stride, e.g. logits[:, :-1]
        flat = t
    if meets_layout(flat, layout):
        return flat
    return t.contiguous().view(n, t.shape[-1])


def run_logits(backend: Backend, call: Call, inputs: tuple[Tensor, ...], index, mask) -> Tensor:
    """Per-token values of a call on logits, differentiable in each input."""
    n = call.request.num_tokens
    flat = tuple(rows(t, n, backend.input_layout) for t in inputs)
    return OpFunction.apply(LogitsComputation(backend, call, index, mask), *flat)


def no_tokens(call: Call, values_shape: tuple[int, ...], parts: tuple[Tensor | None, ...]) -> Tensor:
    """The values of a call with zero tokens on every rank (the backend is not run): an
    empty tensor of ``values_shape``, differentiable in ``parts`` (each gets a zero
    gradient). Nothing is communicated: every rank knows N is 0."""
    like = next(t for t in parts if t is not None)
    dtype = value_dtype(like.dtype)
    out = torch.zeros(values_shape, dtype=dtype, device=like.device)
    for t in parts:
        if t is not None and t.requires_grad and torch.is_grad_enabled():
            out = out + t.sum().to(dtype) * 0
    return out
