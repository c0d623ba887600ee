"""What a backend is: declared capabilities per op, an environment probe, forward and backward.

The core contract (``docs/backend-authors.md`` shows a whole backend on one page): a
``Backend`` with a ``name``, a ``priority``, its ``ops`` (one ``OpCapability`` each), a
``probe`` of the environment, ``forward`` and ``backward``. A backend never sees reductions,
reshaping, cross-rank metadata or zero tokens: the core flattens the inputs to rows, gathers
and validates metadata, picks the backend, wraps it in autograd and reduces the per-token
result. A backend computes per-token values on its local shard and combines statistics
across ``call.group`` with the collectives of ``vtp_runtime.comm``, whose number never
depends on the local vocabulary size (uneven shards would deadlock otherwise).

Contract of ``forward(call, inputs, index, mask)``:

- ``inputs``: one (``cross_entropy``, ``logprobs``, ``entropy``) or two (``kl``, ``jsd``:
  student, teacher) floating tensors of shape ``[N, V_local]``, in the memory layout the
  backend declares with ``Backend.input_layout`` (``INPUT_LAYOUTS``; the core copies an
  input only when it is not in that layout). ``N >= 1``; ``V_local`` may be 0.
- ``index``: int64 ``[N]`` labels (``cross_entropy``), ``[N]`` or ``[N, k]`` (``logprobs``)
  holding **global** vocabulary ids or ``call.options["ignore_index"]``; else None.
- ``mask``: bool ``[N]`` (True = keep) for ``entropy``/``kl``/``jsd``, already combined with
  their ``labels``; None when every token counts.
- returns ``(values, state)``: values fp32 (fp64 for fp64 inputs) ``[N]`` (``[N, k]`` for
  top-k log-probs), replicated on every rank, exactly 0 on masked tokens. ``logprobs``
  with ``call.options["return_entropy"]`` (the ``return_entropy`` feature) returns
  ``[N, k + 1]`` (``k = 1`` for an ``[N]`` index): the log-probs, then each token's entropy
  in the last column (0 where every index entry is ``ignore_index``); ``state`` a
  ``SavedState`` (a dataclass of tensors) holding what backward needs, or None. Keep it to
  the inputs and O(N) statistics where the math allows: the core holds it until backward
  (the ``liger`` backend is the exception: Liger's kernels keep an fp32 ``[N, V_local]``
  buffer).

Contract of ``backward(call, state, grad)``: ``state`` is an equal ``SavedState`` rebuilt
from the tensors forward saved; ``grad`` is the upstream gradient shaped like ``values``
(with ``return_entropy``: the log-probs' gradients, then the entropy's in the last column);
return one gradient per input (shape and dtype of that input) or None where
``call.needs_grad`` is False. No collectives: every rank back-propagates the same values.
``state``'s tensors must not be modified, so that a second backward through a retained
graph is right (or raise a ``RuntimeError`` saying why it cannot be).
Backward runs without building a graph: the core makes differentiating its result (a
gradient penalty after ``create_graph=True``) raise, so no backend computes second order.

Beyond the core, a backend may opt into three protocols by subclassing them (all are
``Backend`` subclasses, so one class may take several): ``TakesHead`` (``vtp.Head`` inputs:
the fused linear head), ``Compiles`` (running inside a ``torch.compile``'d graph, where its
state must be the op's inputs plus one statistics tensor of a width known when tracing) and
``Reduces`` (a sum or mean computed by the backend itself, in its own kernels, instead of
by the core in torch ops). A backend may also set ``strided_upstream`` to take the upstream
gradient of ``backward`` in any strides (an expanded, stride-0 one too) instead of a
contiguous copy.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeGuard, TypeVar

import torch

from .ops import FEATURES, OPS, dtype_name

ALL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64})
LOW_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


def value_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the values, statistics and accumulations of a call on inputs of
    ``dtype``: fp64 for fp64 inputs, fp32 for every other."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# The memory layouts a backend can declare for its inputs (``Backend.input_layout``).
INPUT_LAYOUTS = {
    "contiguous": "[N, V_local], contiguous",
    "unit_vocab_stride": "[N, V_local], stride 1 on the vocabulary dim, rows of any stride (0 too)",
    "unit_vocab_stride_3d": "as unit_vocab_stride, or a 3-D [A, B, V_local] view whose rows have no single "
    "stride (e.g. logits[:, :-1]), stride 1 on the vocabulary dim",
    "any": "[N, V_local] of any strides",
}


def meets_layout(t: torch.Tensor, layout: str) -> bool:
    """Whether ``t`` is in ``layout`` (a key of ``INPUT_LAYOUTS``). A tensor with no elements,
    or at most one vocabulary column, has no vocabulary stride to get wrong."""
    if layout == "any":
        return t.dim() == 2
    if layout == "contiguous":
        return t.dim() == 2 and t.is_contiguous()
    unit = t.shape[-1] <= 1 or t.stride(-1) == 1 or t.numel() == 0
    if layout == "unit_vocab_stride":
        return t.dim() == 2 and unit
    if layout == "unit_vocab_stride_3d":
        return t.dim() in (2, 3) and unit
    raise ValueError(f"unknown input layout {layout!r}; the layouts: {', '.join(INPUT_LAYOUTS)}")


@dataclass(frozen=True)
class OpCapability:
    """What one backend can do for one op. Everything not listed is refused by dispatch."""

    device_types: frozenset[str] | None  # None: any device type
    dtypes: frozenset[torch.dtype] = LOW_DTYPES
    features: frozenset[str] = frozenset()  # subset of ops.FEATURES
    tp_sizes: frozenset[int] | None = None  # None: any TP size
    even_shards_only: bool = False
    empty_shards: bool = True  # can a rank hold V_local = 0?

    def __post_init__(self) -> None:
        unknown = set(self.features) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown features {sorted(unknown)}; known: {', '.join(FEATURES)}")


@dataclass(frozen=True)
class Request:
    """A call as every rank sees it, built from the gathered metadata. Hashable."""

    op: str
    device_type: str
    dtype: torch.dtype
    tp_size: int
    vocab_size: int  # global V
    num_tokens: int
    even_shards: bool
    empty_shard: bool  # some rank holds V_local = 0
    features: frozenset[str] = frozenset()
    head_inputs: bool = False  # some input is a vtp_runtime.Head
    head_per_token: bool = False  # ... and the result is per token (reduction="none")
    head_sequence_parallel: bool = False  # ... a sequence-parallel one, at TP > 1
    compiled: bool = False  # called from a torch.compile'd graph (vtp_runtime.library)


@dataclass(eq=False, slots=True)
class Call:
    """Everything a backend needs for one call on this rank. Made for every call (cheaply:
    this is on every call's path) and shared with whatever the call hands it to: never
    modify one."""

    request: Request
    group: Any  # torch.distributed ProcessGroup, or None for a single device
    rank: int  # rank within the group
    vocab_start: int  # global id of this rank's first local column
    vocab_end: int
    options: Mapping[str, Any]  # op options: temperature, ignore_index, beta, ...
    needs_grad: tuple[bool, ...]  # per floating input
    topk: bool = False
    # "sum" or "mean": the backend reduces this call itself (the ``Reduces`` protocol); else "none"
    reduction: str = "none"

    @property
    def op(self) -> str:
        return self.request.op

    @property
    def vocab_size(self) -> int:
        return self.request.vocab_size


class SavedState:
    """What a backend's ``forward`` keeps for its ``backward``. Subclass it as a dataclass
    whose fields are all tensors (None for an optional tensor that is absent)::

        @dataclass
        class EntropyState(SavedState):
            logits: torch.Tensor  # [N, V_local], the input itself
            log_sum: torch.Tensor  # [N] fp32
            mask: torch.Tensor | None = None

    The core saves the fields with ``ctx.save_for_backward`` (so autograd detects an input
    modified in place before backward) and hands ``backward`` an object of the same class
    rebuilt from them with ``from_tensors``. Facts that are not tensors belong in ``call``,
    which backward receives too.
    """

    @classmethod
    def tensor_names(cls) -> tuple[str, ...]:
        """The field names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]  # subclasses are dataclasses

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The fields' values, in declaration order."""
        getter = _GETTERS.get(type(self))
        if getter is None:  # once per class: this is on every call's path
            getter = _GETTERS[type(self)] = _fields_getter(self.tensor_names())
        return getter(self)

    @classmethod
    def from_tensors(cls: type[_State], tensors: Sequence[torch.Tensor | None]) -> _State:
        """The state whose ``tensors()`` are ``tensors``."""
        return cls(*tensors)


_State = TypeVar("_State", bound=SavedState)
_GETTERS: dict[type, Callable[[SavedState], tuple]] = {}


def _fields_getter(names: tuple[str, ...]) -> Callable[[SavedState], tuple]:
    if len(names) == 1:  # attrgetter of one name returns the value itself, not a 1-tuple
        return lambda state: (getattr(state, names[0]),)
    return operator.attrgetter(*names) if names else (lambda state: ())


class Backend:
    """Base class of every backend. Subclasses set ``name``, ``priority`` and ``ops``.

    Higher priority wins. The built-in ones: eager 0, liger 10, triton 20, triton_xpu 20.
    ``input_layout`` (a key of ``INPUT_LAYOUTS``) is the memory layout ``forward`` accepts
    for its inputs: the core passes a view of the caller's tensor when one is in that
    layout, and a contiguous ``[N, V_local]`` copy otherwise.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    ops: ClassVar[Mapping[str, OpCapability]]
    input_layout: ClassVar[str] = "unit_vocab_stride"
    # True: backward's ``grad`` comes in whatever strides autograd made it (the expanded,
    # stride-0 upstream of a sum or mean too); False: a contiguous copy
    strided_upstream: ClassVar[bool] = False

    # -- environment -------------------------------------------------------------------
    def probe(self, device_type: str) -> list[str]:
        """Reasons this process cannot run the backend on ``device_type`` (missing imports,
        no device, compute capability). Must never raise. Empty list: it can."""
        return []

    def probe_reasons(self, device_type: str) -> list[str]:
        """``probe`` cached per device type (for the life of the backend object); exceptions
        become reasons."""
        cache = self.__dict__.setdefault("_probe_cache", {})
        if device_type not in cache:
            try:
                reasons = list(self.probe(device_type))
            except Exception as exc:  # a probe that raises is a reason, never a crash
                reasons = [f"environment probe raised {type(exc).__name__}: {exc}"]
            cache[device_type] = reasons
        return cache[device_type]

    def clear_probe_cache(self) -> None:
        """Forget ``probe_reasons``' answers: the next one probes again."""
        self.__dict__.pop("_probe_cache", None)

    # -- capabilities ------------------------------------------------------------------
    def capability_reasons(self, request: Request) -> list[str]:
        """Why the declared capabilities exclude ``request`` (no environment checks)."""
        cap = self.ops.get(request.op)
        if cap is None:
            return [f"does not implement op {request.op!r}"]
        out = []
        if cap.device_types is not None and request.device_type not in cap.device_types:
            out.append(
                f"device type {request.device_type!r} not supported (supports {', '.join(sorted(cap.device_types))})"
            )
        if request.dtype not in cap.dtypes:
            names = ", ".join(sorted(dtype_name(d) for d in cap.dtypes))
            out.append(f"dtype {dtype_name(request.dtype)} not supported (supports {names})")
        if cap.tp_sizes is not None and request.tp_size not in cap.tp_sizes:
            out.append(f"TP size {request.tp_size} not supported (supports {sorted(cap.tp_sizes)})")
        if cap.even_shards_only and not request.even_shards:
            out.append("needs even vocabulary shards in rank order (vocab_start = rank * V_local)")
        if not cap.empty_shards and request.empty_shard:
            out.append("cannot handle a rank with an empty vocabulary shard (V_local = 0)")
        for feature in sorted(request.features - cap.features):
            out.append(f"does not support {feature}")
        head = head_support(self, request.op)
        if request.head_inputs and head is None:
            out.append("head inputs not supported (pass logits, or force a backend that takes vtp.Head)")
        elif request.head_per_token and head is not None and not head.per_token:
            out.append("head inputs with a per-token result not supported (use reduction='sum' or 'mean')")
        if request.head_sequence_parallel and head is not None and not head.sequence_parallel:
            out.append(
                "sequence-parallel head inputs not supported (Head(sequence_parallel=True) at TP > 1: gather "
                "the hidden states and pass a plain Head, or force a backend that declares them)"
            )
        if request.compiled and not compiles(self, request.op):
            out.append(
                "cannot run inside torch.compile (it does not implement the Compiles protocol for this op: "
                "its saved state as the op's inputs plus fixed-width statistics)"
            )
        return out

    def reasons(self, request: Request) -> list[str]:
        """Why this backend cannot run ``request`` here; empty list means it can."""
        return self.probe_reasons(request.device_type) + self.capability_reasons(request)

    # -- compute -----------------------------------------------------------------------
    def forward(
        self, call: Call, inputs: tuple[torch.Tensor, ...], index: torch.Tensor | None, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, SavedState | None]:
        raise NotImplementedError

    def backward(self, call: Call, state: SavedState | None, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        raise NotImplementedError


# -- opt-in protocols -------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadSupport:
    """How a backend takes ``vtp.Head`` inputs for one op."""

    # also a per-token result (reduction="none"), whose gradients need the per-token upstream
    # gradient in backward; False: only sum/mean (gradients in forward)
    per_token: bool = True
    # also a sequence-parallel Head (Head(sequence_parallel=True) at TP > 1): the token-chunk
    # driver gathers each chunk's hidden rows from the ranks and reduce-scatters their
    # gradient, so a backend using it need do nothing more; a head_driver of its own must run
    # them through TokenChunks as HeadDriver says
    sequence_parallel: bool = False


class TakesHead(Backend):
    """A ``Backend`` that takes ``vtp.Head`` inputs (the fused linear head,
    ``vtp_runtime/head.py``). By default the core's token-chunk driver
    (``vtp_runtime/head_chunks.py``) computes each chunk's logits into a reused buffer and
    calls ``forward`` and ``head_backward`` on them: ``state`` must then refer to the input
    tensors themselves (the driver refills the buffer before backward)."""

    head_ops: ClassVar[Mapping[str, HeadSupport]]  # the ops that take Head inputs

    def head_driver(self, call: Call) -> Any:
        """A ``HeadDriver`` that runs a call with Head inputs its own way
        (e.g. a library's fused linear cross entropy), or None for the token-chunk driver."""
        return None

    def head_logits(
        self, call: Call, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
    ) -> Any:
        """Under the chunk driver: compute one token chunk's logits ``hidden [rows, H] @
        weight.T (+ bias)`` into ``out [rows, V_local]`` (the weight's dtype) this backend's
        own way, and return what ``head_forward`` gets for them (e.g. statistics computed on
        the way); None: not handled, the driver computes them with ``torch.mm`` (cuBLAS on
        CUDA). Called for every chunk, in forward and when backward recomputes the logits of
        per-token results; ``call`` is the whole call's (``call.request.num_tokens`` is N)."""
        return None

    def head_forward(
        self,
        call: Call,
        inputs: tuple[torch.Tensor, ...],
        index: torch.Tensor | None,
        mask: torch.Tensor | None,
        partials: tuple[Any, ...],
    ) -> tuple[torch.Tensor, SavedState | None]:
        """``forward`` of one token chunk under the chunk driver; ``partials[i]`` is what
        ``head_logits`` returned for input i's logits (None for logits it did not compute,
        and for logits inputs). The default calls ``forward``."""
        return self.forward(call, inputs, index, mask)

    def head_logits_route(
        self,
        device_type: str,
        request: Request | None = None,
        options: Mapping[str, Any] | None = None,
        parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = (),
    ) -> str:
        """How this backend computes the logits of Head inputs, in a few words, for
        ``vtp.explain`` and ``vtp-runtime info``: for ``request`` (with its ``options`` and
        this rank's Heads' ``(hidden, weight, bias)``) where given, else on ``device_type`` in
        general."""
        return "cuBLAS chunks (torch.mm into the chunk buffer)"

    def head_backward(
        self, call: Call, state: SavedState | None, grad: torch.Tensor, scratch: tuple[bool, ...]
    ) -> tuple[torch.Tensor | None, ...]:
        """``backward`` of one token chunk under the chunk driver. ``scratch[i]``: input i is
        a logits buffer the driver owns and refills before any later use, so its gradient
        may be written into it in place (one ``[rows, V_local]`` buffer less). The default
        calls ``backward``."""
        return self.backward(call, state, grad)

    def scale_gradients(self, grads: list[torch.Tensor], scale: torch.Tensor) -> None:
        """Multiply, in place, the gradients a scalar (sum/mean) Head call computed in its
        forward pass by the upstream gradient ``scale`` (0-dim, on their device, read there:
        no host synchronization). The default is one multi-tensor pass in fp32 math (a
        ``mul_`` by a 0-dim fp32 tensor would send bf16 gradients through torch's unvectorized
        casting kernel); a backend may skip the pass on the device where ``scale`` is 1."""
        torch._foreach_mul_(grads, scale)


class HeadDriver:
    """How a call with Head inputs runs on a backend (``TakesHead.head_driver``). ``run`` is
    the call cut in token chunks, a ``vtp_runtime.head_chunks.TokenChunks``. ``forward`` returns the per-token values
    (fp32, fp64 for fp64 inputs; ``[N]`` or ``[N, k]``) and, when ``run.scalar`` and
    ``run.needs_grad``, leaves the gradients for the upstream gradient
    ``run.upstream_like(values)`` in the inputs' accumulators (after ``run.start_grads()``);
    a driver that computes them for ones sets ``run.upstream = None``. ``backward``
    (per-token results only) does the same for the upstream gradient ``grad``. The caller
    all-reduces hidden gradients.

    A driver of a backend declaring ``HeadSupport(sequence_parallel=True)`` also gets calls
    with a sequence-parallel Head (``run.sequence`` set): it runs over ``run.chunks()`` after
    ``run.begin()``, and before ``run.end()``, with ``run.chunk_logits`` and
    ``run.accumulate``, which gather the hidden rows and scatter their gradient, and returns
    the values in the chunk order (the order of ``run.index`` and ``run.mask``)."""

    def forward(self, run: Any) -> torch.Tensor:
        raise NotImplementedError

    def backward(self, run: Any, grad: torch.Tensor) -> None:
        raise NotImplementedError


class Compiles(Backend):
    """A ``Backend`` that runs inside a ``torch.compile``'d graph
    (``vtp_runtime/library.py``). There every tensor an op returns, and so what backward
    gets, must have a shape known when the graph is traced, before any backend is chosen:
    the core keeps the call's own inputs (floating inputs as ``[N, V_local]`` rows, index,
    mask) and one ``[N, W]`` statistics tensor instead of the state."""

    compiled_ops: ClassVar[frozenset[str]]

    def statistics_width(self, op: str, options: Mapping[str, Any]) -> int:
        """``W`` of this backend's statistics for a call of ``op`` with these options (those
        that reach backends): the same for every call of one signature."""
        raise NotImplementedError

    def statistics(self, call: Call, state: SavedState) -> torch.Tensor:
        """Everything ``state`` holds beyond the call's own inputs, as one new ``[N, W]``
        tensor, fp32 (fp64 for fp64 inputs)."""
        raise NotImplementedError

    def from_statistics(
        self,
        call: Call,
        inputs: tuple[torch.Tensor, ...],
        index: torch.Tensor | None,
        mask: torch.Tensor | None,
        statistics: torch.Tensor,
    ) -> SavedState:
        """The state forward returned, rebuilt from the call's inputs (as forward got them)
        and ``statistics()``."""
        raise NotImplementedError


class Reduces(Backend):
    """A ``Backend`` that reduces its per-token values itself for the ops in
    ``reduced_ops``: the core then skips its own reduction (a few torch ops in forward and
    backward) on calls where the result is one number known on this rank alone -- logits
    inputs (not a ``vtp.Head``), outside ``torch.compile``, ``reduction`` "sum" or "mean"
    with no ``normalizer``, no ``sp_group`` of more than one rank, and no ``return_entropy``
    unless ``reduces_pairs``. Such a call has ``call.reduction`` "sum" or "mean" (else
    "none": per-token values as always), and then:

    - ``forward`` returns a 0-dim value (fp32; fp64 for fp64 inputs): the sum of the
      per-token values, or for "mean" that sum divided by the count of what counts -- the
      index entries that are not ``ignore_index`` where the op takes an index, the mask's
      True tokens where there is a mask, else every token -- at least 1.
    - ``backward`` gets the 0-dim upstream gradient ``g`` and back-propagates ``g`` to
      every per-token value ("sum"), or ``g / count`` as one correctly rounded division in
      the values' dtype ("mean"): bit for bit what the core's reduction sends for a plain
      ``loss.backward()`` (``outputs.plain_upstream``: exactly ``1 / count``).
    - with ``reduces_pairs`` True, a ``logprobs`` call with ``return_entropy`` and an
      ``[N]`` index is reduced too: ``forward`` returns ``[2]``, the log-probs' and the
      entropy's sum (or mean, over the one count of index entries that are not
      ``ignore_index``), and ``backward`` gets the ``[2]`` upstream gradient of the two.
    """

    reduced_ops: ClassVar[frozenset[str]]
    reduces_pairs: ClassVar[bool] = False


def reduces(backend: Backend, op: str) -> TypeGuard[Reduces]:
    """Whether ``backend`` reduces calls of ``op`` itself (the ``Reduces`` protocol)."""
    return isinstance(backend, Reduces) and op in backend.reduced_ops


def head_support(backend: Backend, op: str) -> HeadSupport | None:
    """How ``backend`` takes Head inputs for ``op``, or None where it does not."""
    return backend.head_ops.get(op) if isinstance(backend, TakesHead) else None


def compiles(backend: Backend, op: str) -> bool:
    """Whether ``backend`` runs ``op`` inside a torch.compile'd graph."""
    return isinstance(backend, Compiles) and op in backend.compiled_ops


def check_backend(backend: Backend) -> None:
    """Validate a backend at registration time (fail early, not at call time)."""
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or not name.isidentifier() or name != name.lower():
        raise ValueError(f"backend name must be a lowercase identifier, got {name!r}")
    if not isinstance(backend.priority, int):
        raise ValueError(f"backend {name!r}: priority must be an int")
    if not isinstance(backend.input_layout, str) or backend.input_layout not in INPUT_LAYOUTS:
        raise ValueError(
            f"backend {name!r}: input_layout must be one of {', '.join(INPUT_LAYOUTS)}, got {backend.input_layout!r}"
        )
    ops = getattr(backend, "ops", None)
    if not isinstance(ops, Mapping) or not ops:
        raise ValueError(f"backend {name!r}: ops must be a non-empty mapping op -> OpCapability")
    for op, cap in ops.items():
        if op not in OPS:
            raise ValueError(f"backend {name!r}: unknown op {op!r}; the ops are {', '.join(OPS)}")
        if not isinstance(cap, OpCapability):
            raise ValueError(f"backend {name!r}: ops[{op!r}] must be an OpCapability")
    # head_ops and compiled_ops may name ops beyond ``ops`` (a subclass narrowing its ops):
    # those are never dispatched
    if isinstance(backend, TakesHead):
        for op, head in backend.head_ops.items():
            if op not in OPS or not isinstance(head, HeadSupport):
                raise ValueError(f"backend {name!r}: head_ops[{op!r}] must be a HeadSupport of a known op")
    if isinstance(backend, Reduces) and not set(backend.reduced_ops) <= set(OPS):
        raise ValueError(f"backend {name!r}: reduced_ops {sorted(backend.reduced_ops)} must be known ops")
    if not isinstance(backend.strided_upstream, bool):
        raise ValueError(f"backend {name!r}: strided_upstream must be a bool")
    if isinstance(backend, Compiles) and not set(backend.compiled_ops) <= set(OPS):
        raise ValueError(f"backend {name!r}: compiled_ops {sorted(backend.compiled_ops)} must be known ops")
