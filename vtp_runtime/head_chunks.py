"""The chunk runner of ``vtp.Head`` inputs: a call computed token chunk by token chunk,
without the ``[tokens, V_local]`` logits ever existing in full.

How a call runs (the generic driver, ``ChunkedDriver``):

- Tokens are cut into chunks of ``rows`` rows. For each chunk, each Head input's logits are
  computed into a reused ``[rows, V_local]`` buffer (by the backend's ``head_logits``, else
  ``addmm``), and the backend's own ``head_forward`` (``forward``) runs on them: its
  cross-rank collectives run once per chunk, and the chunk count is the same on every rank
  because ``rows`` derives only from what every rank shares (N, the dtype, the largest
  V_local of the gathered layout, ``chunk_rows``).
- Scalar results (``reduction="sum"``/``"mean"``): the upstream gradient is one number, so
  the backend's ``head_backward`` runs on the chunk right away, with the upstream a plain
  backward of the result will send each token (``run.upstream``: 1 / count for a mean), and
  ``dh = dlogits @ W``, ``dW += dlogits.T @ h``, ``db += sum(dlogits)`` accumulate chunk by
  chunk in the forward pass. Backward only scales them by the upstream gradient it gets over
  that one (exactly 1 for a plain backward; in place, through the backend's
  ``scale_gradients``: the gradients are handed over, so a second backward through the same
  graph raises).
- Per-token results (``reduction="none"``): the backend's per-chunk state (O(rows)
  statistics, and the logits buffer it refers to) is kept; backward recomputes each chunk's
  logits into the same buffer (one more matmul per Head input) and runs ``head_backward``
  with that chunk's upstream gradient. No collective runs again. Between forward and
  backward the buffers' memory is released.
- The hidden gradient of a Head is a partial sum over this rank's vocabulary shard; it is
  all-reduced over ``tp_group`` (Megatron's column-parallel convention) unless
  ``reduce_hidden_grad=False``.
- A sequence-parallel Head (``sequence_parallel=True``, Megatron SP) holds this rank's
  contiguous shard of the tokens; the op runs over every rank's tokens. Its chunks take the
  same number of rows from each rank's shard (``vtp_runtime.head_gather.SequenceLayout``): each
  chunk's hidden rows are all-gathered from the ranks (the next chunk's gather in flight
  while this one computes), and each chunk's hidden gradient is reduce-scattered back to
  the ranks owning its rows. Inputs covering every token (labels, index, mask, logits, a
  plain Head) are read in that chunk order, and the values put back in token order.

A backend taking Head inputs subclasses ``vtp_runtime.backend.TakesHead`` and names the ops
in ``head_ops``. Under the generic driver its ``forward`` must keep the **input tensors
themselves** in its state (as the backend contract already asks: inputs and O(N)
statistics), since the driver refills them before calling backward. ``head_driver`` lets a
backend run Head calls its own way.

Precision: logits are computed in the weight's dtype (fp32 accumulation inside the matmul),
as ``hidden @ weight.T`` would be. ``dW`` accumulates over chunks in the weight's dtype:
one rounding per chunk, on top of fp32 accumulation within each chunk's matmul.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from .autograd import OpFunction
from .backend import Call, HeadDriver, TakesHead, meets_layout, value_dtype
from .comm import all_reduce
from .head import Head, grad_needed
from .head_gather import HiddenChunks, SequenceLayout

Tensor = torch.Tensor

# Budget of one [rows, V_local] logits buffer. Each chunk reads and writes the whole weight
# gradient once (addmm into dW), so fewer, larger chunks cost less, but the matmuls run best
# on rows in multiples of 256 (see chunk_rows); the sizes measured are in docs/benchmarks.md
# ("Fused head"). One buffer per Head input, alive for one call (until its backward for
# per-token results).
CHUNK_BYTES = 384 * 2**20


class HeadGradientConsumed(RuntimeError):
    """A second backward through a Head call whose gradients were computed in forward."""


def chunk_rows(num_tokens: int, max_v_local: int, itemsize: int, requested: int | None = None) -> int:
    """Token rows per chunk, from quantities every rank shares: ``requested`` if given, else
    at most the rows of a ``CHUNK_BYTES`` buffer of the widest shard, balanced over the
    chunks N needs (so that the last chunk's matmuls are not small) and rounded to a multiple
    of 256 rows, which keeps cuBLAS's 128- and 256-row tiles full (measured in
    ``docs/benchmarks.md``, "Fused head")."""
    if requested is not None:
        return max(1, min(requested, num_tokens))
    most = CHUNK_BYTES // max(1, max_v_local * itemsize)
    if most < 256:
        return max(1, min(most, num_tokens))
    most -= most % 256
    chunks = -(-num_tokens // most)
    rows = -(-num_tokens // max(chunks, 1))
    return max(1, min(most, -(-rows // 256) * 256, num_tokens))


# -- one call -------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class InputRows:
    """One floating input of the op, as rows: a Head (hidden ``[N, H]``, weight, bias) or
    plain logits ``[N, V_local]``; with what needs a gradient and the gradients so far. A
    sequence-parallel Head's hidden is this rank's ``[n_local, H]`` and ``gather`` brings in
    each chunk's rows from every rank."""

    hidden: Tensor | None = None
    weight: Tensor | None = None
    bias: Tensor | None = None
    logits: Tensor | None = None
    reduce_hidden_grad: bool = True
    needs: tuple[bool, bool, bool, bool] = (False, False, False, False)  # hidden, weight, bias, logits
    buffer: Tensor | None = None  # [rows, V_local] logits of the current chunk (Heads only)
    grads: list = dataclasses.field(default_factory=lambda: [None, None, None, None])
    sequence_parallel: bool = False  # a sequence-parallel Head (at TP > 1)
    gather: HiddenChunks | None = None  # its chunk gathers, for one pass over the chunks
    rows_now: Tensor | None = None  # the hidden rows of the current chunk (Heads only)

    @property
    def is_head(self) -> bool:
        return self.weight is not None

    @property
    def needs_grad(self) -> bool:
        return any(self.needs)

    def head_parts(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(hidden, weight, bias)`` of a Head input."""
        assert self.hidden is not None and self.weight is not None  # set together for a Head
        return self.hidden, self.weight, self.bias

    def logits_rows(self) -> Tensor:
        """The ``[N, V_local]`` logits of a logits input."""
        assert self.logits is not None  # set for a logits input
        return self.logits

    @property
    def primary(self) -> Tensor:
        """The tensor whose dtype and device this input has: a Head's weight, else its logits."""
        return self.weight if self.weight is not None else self.logits_rows()


@dataclasses.dataclass(eq=False)
class TokenChunks:
    """Everything a driver needs for one call with Head inputs on this rank.

    With a sequence-parallel Head (``sequence`` set), the chunks run in the layout's chunk
    order of the tokens (``order``: the token at each position, None for the identity):
    ``index`` and ``mask`` are given in that order, inputs covering every token are read in
    it, and ``ChunkedComputation`` puts the values back in token order."""

    backend: TakesHead
    call: Call
    inputs: list[InputRows]
    index: Tensor | None  # [N] or [N, k] int64
    mask: Tensor | None  # [N] bool
    num_tokens: int
    rows: int  # tokens per chunk (the largest chunk), the same on every rank
    scalar: bool  # reduction sum/mean: gradients during forward, scaled in backward
    states: list = dataclasses.field(default_factory=list)  # per chunk, per-token results only
    sequence: SequenceLayout | None = None  # a sequence-parallel Head's layout (TP > 1)
    order: Tensor | None = None  # [N] int64: the token at each position of the chunk order
    # scalar results: the per-token upstream gradient the forward's gradients are computed
    # for, 0-dim (a plain backward of a mean sends 1 / count); None: ones
    upstream: Tensor | None = None
    # per input, what the backend's head_logits returned for the current chunk (None where
    # the logits came from torch.mm, and for logits inputs)
    partials: tuple = ()

    @property
    def needs_grad(self) -> bool:
        return any(i.needs_grad for i in self.inputs)

    @property
    def scratch(self) -> tuple[bool, ...]:
        """Per op input: is it a logits buffer the driver owns (a Head's)?"""
        return tuple(i.is_head for i in self.inputs)

    def chunks(self):
        if self.sequence is not None:
            starts = self.sequence.starts()
            yield from zip(starts[:-1], starts[1:])
            return
        for lo in range(0, self.num_tokens, self.rows):
            yield lo, min(lo + self.rows, self.num_tokens)

    def upstream_like(self, values: Tensor) -> Tensor:
        """The upstream gradient of a chunk's ``values`` for the gradients computed in forward."""
        if self.upstream is None:
            return torch.ones_like(values)
        return torch.empty_like(values).fill_(self.upstream)

    def chunk_call(self, rows: int) -> Call:
        return dataclasses.replace(self.call, request=dataclasses.replace(self.call.request, num_tokens=rows))

    def _rows(self, t: Tensor, lo: int, hi: int) -> Tensor:
        """Rows ``[lo, hi)`` of the chunk order of ``t``, a tensor over every token."""
        return t[lo:hi] if self.order is None else t.index_select(0, self.order[lo:hi])

    def _put(self, out: Tensor, lo: int, hi: int, rows: Tensor) -> None:
        """Write ``rows``, positions ``[lo, hi)`` of the chunk order, into ``out``."""
        if self.order is None:
            out[lo:hi].copy_(rows)
        else:
            out.index_copy_(0, self.order[lo:hi], rows)

    def begin(self) -> None:
        """Start a pass over the chunks: the chunk gathers of sequence-parallel Heads."""
        assert self.sequence is not None or not any(x.sequence_parallel for x in self.inputs)
        for x in self.inputs:
            if x.sequence_parallel:
                assert self.sequence is not None and x.hidden is not None
                x.gather = HiddenChunks(x.hidden, self.sequence, self.call.group)

    def chunk_logits(self, lo: int, hi: int) -> tuple[Tensor, ...]:
        """Each input's logits for tokens ``[lo, hi)``: Heads computed into their buffer."""
        out: list[Tensor] = []
        partials: list = []
        for x in self.inputs:
            if not x.is_head:
                out.append(self._rows(x.logits_rows(), lo, hi))
                partials.append(None)
                continue
            hidden, weight, bias = x.head_parts()
            if x.buffer is None:
                x.buffer = torch.empty((self.rows, weight.shape[0]), dtype=weight.dtype, device=weight.device)
            z = x.buffer[: hi - lo]
            if x.gather is not None:
                h = x.gather.rows(x.gather.chunk_at(lo))
            else:
                h = self._rows(hidden, lo, hi)
            x.rows_now = h
            partial = self.backend.head_logits(self.call, h, weight, bias, z)
            if partial is None:
                if bias is None:
                    torch.mm(h, weight.t(), out=z)
                else:
                    torch.addmm(bias, h, weight.t(), out=z)
            partials.append(partial)
            out.append(z)
        self.partials = tuple(partials)
        return tuple(out)

    def index_at(self, lo: int, hi: int) -> Tensor | None:
        return None if self.index is None else self.index[lo:hi]

    def mask_at(self, lo: int, hi: int) -> Tensor | None:
        return None if self.mask is None else self.mask[lo:hi]

    def to_chunk_order(self, t: Tensor) -> Tensor:
        """A tensor over every token (per-token values, their gradients) in chunk order."""
        return t if self.order is None else t.index_select(0, self.order)

    def to_token_order(self, t: Tensor) -> Tensor:
        """Per-token values computed in chunk order, back in token order."""
        if self.order is None:
            return t
        return torch.empty_like(t).index_copy_(0, self.order, t)

    # -- gradients -------------------------------------------------------------------------
    def start_grads(self) -> None:
        """Fresh gradients: dh and dlogits written chunk by chunk, dW by the first chunk then
        accumulated, db accumulated in fp32 (fp64 for fp64 inputs)."""
        for x in self.inputs:
            nh, nw, nb, nl = x.needs
            if not x.is_head:
                x.grads = [None, None, None, torch.empty_like(x.logits_rows()) if nl else None]
                continue
            hidden, weight, bias = x.head_parts()
            acc = value_dtype(weight.dtype)
            # dh and dW are written by the first chunk (lo = 0); a sequence-parallel Head's dh
            # (this rank's rows) by the chunks' reduce-scatters
            x.grads = [
                torch.empty_like(hidden) if nh else None,
                torch.empty_like(weight) if nw else None,
                torch.zeros(bias.shape, dtype=acc, device=bias.device) if nb and bias is not None else None,
                None,
            ]

    def accumulate(self, lo: int, hi: int, dlogits: Sequence[Tensor | None]) -> None:
        """Fold one chunk's logits gradients into the gradients of each input."""
        for x, dz in zip(self.inputs, dlogits):
            if not x.needs_grad:
                continue
            assert dz is not None  # the backend gives dlogits for every input that needs a gradient
            dh, dw, db, dl = x.grads
            if dl is not None:
                self._put(dl, lo, hi, dz)
                continue
            _, weight, _ = x.head_parts()  # an input needing a gradient with no dlogits is a Head
            h = x.rows_now
            assert h is not None  # chunk_logits ran for this chunk
            if dw is not None and lo == 0:
                torch.mm(dz.t(), h, out=dw)
            elif dw is not None:
                dw.addmm_(dz.t(), h)
            if db is not None:
                db.add_(dz.sum(dim=0, dtype=db.dtype))
            # dh last: a sequence-parallel Head's previous reduce-scatter ran during the above
            if dh is not None:
                if x.gather is not None:  # this rank's rows of the sum over the vocabulary shards
                    c = x.gather.chunk_at(lo)
                    partial = torch.mm(dz, weight, out=x.gather.grad_rows(c))
                    x.gather.scatter(c, partial, dh)
                elif self.order is None:
                    torch.mm(dz, weight, out=dh[lo:hi])
                else:
                    self._put(dh, lo, hi, dz @ weight)

    def finish_grads(self) -> list[Tensor | None]:
        """The gradients, one per flat tensor (hidden, weight, bias per Head; logits per
        logits input), hidden gradients all-reduced over the group where asked (a
        sequence-parallel Head's: reduce-scattered chunk by chunk, waited for here)."""
        out = []
        for x in self.inputs:
            dh, dw, db, dl = x.grads
            x.grads = [None, None, None, None]
            if x.is_head:
                # a sequence-parallel Head's dh: complete, reduce-scattered by the chunk pass
                if dh is not None and x.reduce_hidden_grad and not x.sequence_parallel:
                    all_reduce(dh, self.call.group, "sum")
                # the bias has the weight's dtype (checked with the Head)
                out += [dh, dw, None if db is None else db.to(x.primary.dtype)]
            else:
                out.append(dl)
        return out

    def end(self) -> None:
        """End a pass over the chunks: wait for what is in flight, drop the gather buffers."""
        for x in self.inputs:
            if x.gather is not None:
                x.gather.release()
            x.gather = x.rows_now = None
        self.partials = ()  # the last chunk's: not kept until backward

    def release_buffers(self) -> None:
        """Free the logits buffers' memory; the states keep referring to the (empty) storage."""
        for x in self.inputs:
            if x.buffer is not None:
                x.buffer.untyped_storage().resize_(0)

    def restore_buffers(self) -> None:
        for x in self.inputs:
            if x.buffer is not None:
                x.buffer.untyped_storage().resize_(x.buffer.numel() * x.buffer.element_size())

    def drop_inputs(self) -> None:
        """Forget the inputs' tensors (after a scalar call's forward: nothing of them is needed)."""
        for x in self.inputs:
            x.hidden = x.weight = x.bias = x.logits = x.buffer = None


class ChunkedDriver(HeadDriver):
    """The generic driver: token chunks, the backend's own forward/head_backward per chunk."""

    def forward(self, run: TokenChunks) -> Tensor:
        values = []
        grad_now = run.scalar and run.needs_grad
        if grad_now:
            run.start_grads()
        run.begin()
        try:
            for lo, hi in run.chunks():
                call = run.chunk_call(hi - lo)
                inputs = run.chunk_logits(lo, hi)
                vals, state = run.backend.head_forward(
                    call, inputs, run.index_at(lo, hi), run.mask_at(lo, hi), run.partials
                )
                values.append(vals)
                if grad_now:
                    run.accumulate(lo, hi, run.backend.head_backward(call, state, run.upstream_like(vals), run.scratch))
                elif run.needs_grad:
                    run.states.append(state)
            if grad_now:
                for x in run.inputs:  # the scatters finish before the gathers' buffers go
                    if x.gather is not None:
                        x.gather.finish()
        finally:
            run.end()
            if run.states:
                run.release_buffers()
            else:
                for x in run.inputs:
                    x.buffer = None
        return torch.cat(values)

    def backward(self, run: TokenChunks, grad: Tensor) -> None:
        run.start_grads()
        run.restore_buffers()
        run.begin()
        try:
            for (lo, hi), state in zip(run.chunks(), run.states):
                run.chunk_logits(lo, hi)
                run.accumulate(
                    lo,
                    hi,
                    run.backend.head_backward(run.chunk_call(hi - lo), state, grad[lo:hi].contiguous(), run.scratch),
                )
            for x in run.inputs:
                if x.gather is not None:
                    x.gather.finish()
        finally:
            run.end()
            run.release_buffers()


CHUNKED = ChunkedDriver()


class ChunkedComputation:
    """A call with Head inputs, as ``autograd.OpFunction`` runs it: the driver's forward;
    scalar results keep the gradients computed there (scaled in backward, in place: handed
    over, so a second backward raises), per-token results save the flat inputs (so an input
    modified in place before backward raises) and recompute in backward."""

    def __init__(self, run: TokenChunks, driver: HeadDriver, shapes: list) -> None:
        self.run, self.driver, self.shapes = run, driver, shapes
        self.op = run.call.op
        self.grads: list[Tensor | None] | None = None

    def forward(self, flat: tuple[Tensor | None, ...]) -> tuple[Tensor, tuple[Tensor | None, ...]]:
        run = self.run
        values = run.to_token_order(self.driver.forward(run))
        if not run.scalar:
            return values, flat
        self.grads = run.finish_grads() if run.needs_grad else None
        run.drop_inputs()
        return values, ()

    def backward(self, saved: tuple[Tensor | None, ...], grad: Tensor) -> tuple[Tensor | None, ...]:
        run = self.run
        if run.scalar:
            grads, self.grads = self.grads, None
            if grads is None:
                raise HeadGradientConsumed(
                    "backward ran twice through a vtp call with Head inputs and reduction='sum'/'mean': its "
                    "gradients are computed in the forward pass and handed over (scaled in place) by the first "
                    "backward. Run backward once, or use reduction='none' (gradients recomputed in backward) "
                    "and reduce the result yourself."
                )
            if grad.numel():
                scale = grad.reshape(-1)[0]  # the upstream gradient of a sum/mean is one number
                if run.upstream is not None:  # exactly 1 for a plain backward of the result
                    scale = scale / run.upstream
                run.backend.scale_gradients([g for g in grads if g is not None], scale)
        else:
            self.driver.backward(run, run.to_chunk_order(grad))
            grads = run.finish_grads()
        # rows back to the inputs' shapes ([N, H] -> [..., H], [N, V_local] -> [..., V_local])
        return tuple(None if g is None else g.view(shape) for g, shape in zip(grads, self.shapes))


def run_head_values(
    backend: TakesHead,
    call: Call,
    inputs: Sequence[Any],
    index: Tensor | None,
    mask: Tensor | None,
    scalar: bool,
    rows: int,
    sequence: SequenceLayout | None = None,
    upstream: Tensor | None = None,
) -> Tensor:
    """Values ``[N]`` (``[N, k]``) of ``call`` whose ``inputs`` are each a Head or logits
    ``[..., V_local]``; ``rows`` tokens per chunk (the same on every rank); ``scalar``: the
    result is reduced to one number (gradients during forward, for the per-token upstream
    gradient ``upstream``, 0-dim, or ones); ``sequence``: the layout of the
    sequence-parallel Heads among ``inputs`` (at TP > 1)."""
    run = _token_chunks(backend, call, inputs, index, mask, scalar, rows, sequence)
    run.upstream = upstream if scalar else None
    flat: list[Tensor | None] = []
    for x in inputs:
        flat += [x.hidden, x.weight, x.bias] if isinstance(x, Head) else [x]
    driver = backend.head_driver(call) or CHUNKED
    shapes = [None if t is None else t.shape for t in flat]
    return OpFunction.apply(ChunkedComputation(run, driver, shapes), *flat)


def _token_chunks(backend, call, inputs, index, mask, scalar, rows, sequence) -> TokenChunks:
    n = call.request.num_tokens
    run_inputs = []
    for x in inputs:
        if not isinstance(x, Head):
            z = x.reshape(n, x.shape[-1])
            if not meets_layout(z, backend.input_layout):  # chunks are row slices of it: 2-D
                z = z.contiguous()
            run_inputs.append(InputRows(logits=z, needs=(False, False, False, grad_needed(x))))
            continue
        spread = x.sequence_parallel and sequence is not None
        run_inputs.append(
            InputRows(
                hidden=x.hidden.reshape(math.prod(x.hidden.shape[:-1]) if spread else n, x.hidden.shape[-1]),
                weight=x.weight,
                bias=x.bias,
                reduce_hidden_grad=x.reduce_hidden_grad,
                needs=(grad_needed(x.hidden), grad_needed(x.weight), grad_needed(x.bias), False),
                sequence_parallel=spread,
            )
        )
    order = None if sequence is None else sequence.order(run_inputs[0].primary.device)
    if order is not None:  # the chunks run in the layout's order of the tokens
        index = None if index is None else index.index_select(0, order)
        mask = None if mask is None else mask.index_select(0, order)
    return TokenChunks(
        backend=backend,
        call=call,
        inputs=run_inputs,
        index=index,
        mask=mask,
        num_tokens=n,
        rows=rows,
        scalar=scalar,
        sequence=sequence,
        order=order,
    )


def run_head_ids(backend: Any, call: Call, x: Head, rows: int, sequence: SequenceLayout | None) -> Tensor:
    """The ids an op returning them (argmax) gives for a Head, chunk by chunk (the chunk
    count is the same on every rank: ``rows`` and ``sequence`` derive from what they share)."""
    run = _token_chunks(backend, call, (x,), None, None, False, rows, sequence)
    out = [torch.zeros(0, dtype=torch.int64, device=x.weight.device)]
    run.begin()
    try:
        for lo, hi in run.chunks():
            out.append(backend.forward(run.chunk_call(hi - lo), run.chunk_logits(lo, hi), None, None)[0])
    finally:
        run.end()
    return run.to_token_order(torch.cat(out))


@dataclasses.dataclass(frozen=True)
class Chunking:
    """What the tokens per chunk of a call with Head inputs derive from besides the token
    count, the same on every rank: the widest shard, the weight's element size and the rows
    the Heads ask for. A plan keeps it and sizes each call's chunks by its token count."""

    max_v_local: int
    itemsize: int
    requested: int | None

    def rows(self, num_tokens: int) -> int:
        """Tokens per chunk of a call on ``num_tokens`` tokens (``chunk_rows``)."""
        return chunk_rows(num_tokens, self.max_v_local, self.itemsize, self.requested)


def chunking(max_v_local: int, heads: Sequence[Any]) -> Chunking:
    """The ``Chunking`` of a call whose inputs include ``heads``; ``max_v_local``: the widest
    shard of the gathered layout."""
    head_inputs = [h for h in heads if isinstance(h, Head)]
    requested = [h.chunk_rows for h in head_inputs if h.chunk_rows is not None]
    return Chunking(max_v_local, head_inputs[0].weight.element_size(), min(requested) if requested else None)


def rows_per_chunk(num_tokens: int, max_v_local: int, heads: Sequence[Any]) -> int:
    """Tokens per chunk of a call whose inputs include ``heads`` (``chunk_rows``, from what
    every rank shares)."""
    return chunking(max_v_local, heads).rows(num_tokens)


def sequence_layout(rows: tuple[int, ...], rank: int, max_v_local: int, heads: Sequence[Any]) -> SequenceLayout:
    """The chunks of a call with a sequence-parallel Head whose ranks hold ``rows`` tokens
    each: every rank gives each chunk ``per_rank`` of its rows, so that a chunk is at most as
    many tokens as ``rows_per_chunk`` allows (and one buffer serves every chunk)."""
    n, world = sum(rows), len(rows)
    return SequenceLayout(rows=rows, rank=rank, per_rank=max(1, rows_per_chunk(n, max_v_local, heads) // world))


__all__ = ["InputRows", "TokenChunks", "ChunkedDriver", "Chunking", "HeadGradientConsumed", "CHUNK_BYTES", "chunk_rows"]
