"""What a backend is: declared capabilities per op, an environment probe, forward and backward.

A backend never sees reductions, reshaping or cross-rank metadata: the core flattens the
inputs to rows, gathers and validates metadata, picks the backend, wraps it in autograd and
reduces the per-token result. A backend computes per-token values on its local shard and
combines statistics across ``call.group`` with collectives whose number never depends on
the local vocabulary size (uneven shards would deadlock otherwise).

Contract of ``forward(call, inputs, index, mask)``:

- ``inputs``: one (``cross_entropy``, ``logprobs``, ``entropy``) or two (``kl``, ``jsd``:
  student, teacher) floating tensors of shape ``[N, V_local]``, in the memory layout the
  backend declares with ``Backend.input_layout`` (``INPUT_LAYOUTS``; the core copies an
  input only when it is not in that layout). ``V_local`` may be 0 and ``N`` may be 0.
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
``state``'s tensors must not be modified, so a second backward through a retained graph is
right.
Backward runs without building a graph: the core makes differentiating its result (a
gradient penalty after ``create_graph=True``) raise, so no backend computes second order.

Head inputs (``vtp.Head``, ``OpCapability(head_inputs=True)``): the core's driver in
``vtp_runtime/head.py`` calls ``forward``/``head_backward`` once per token chunk on logits it
computes into a reused buffer, so ``state`` must refer to the input tensors themselves (the
driver refills the buffer before backward); ``head_driver`` may take over the whole call.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .ops import FEATURES, OPS

ALL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64})
LOW_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})

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
    empty_tokens: bool = True  # can N be 0?
    # a second backward through a retained graph gives the same gradient (True), or raises a
    # RuntimeError saying why (False: e.g. a kernel that overwrites what it saved)
    repeat_backward: bool = True
    # takes ``vtp_runtime.Head`` inputs (the fused linear head, vtp_runtime/head.py); kept
    # apart from ``features``: it is a form of input, not an option of the op
    head_inputs: bool = False
    # with Head inputs, also a per-token result (reduction="none"), whose gradients need the
    # per-token upstream gradient in backward; False: only sum/mean (gradients in forward)
    head_per_token: bool = True
    # runs inside a torch.compile'd graph: its SavedState implements statistics() and
    # from_statistics(), so the state is the op's inputs plus one [N, W] statistics tensor
    compiled: bool = False

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
    compiled: bool = False  # called from a torch.compile'd graph (vtp_runtime.library)


@dataclass(frozen=True, eq=False)
class Call:
    """Everything a backend needs for one call on this rank."""

    request: Request
    group: Any  # torch.distributed ProcessGroup, or None for a single device
    rank: int  # rank within the group
    vocab_start: int  # global id of this rank's first local column
    vocab_end: int
    options: Mapping[str, Any]  # op options: temperature, ignore_index, beta, ...
    needs_grad: tuple[bool, ...]  # per floating input
    topk: bool = False

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
    which backward receives too. ``tensors()`` lists the fields in declaration order: the
    outputs, besides the values, that a registered custom op would return.
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
    def from_tensors(cls, tensors: Sequence[torch.Tensor | None]) -> SavedState:
        """The state whose ``tensors()`` are ``tensors``."""
        return cls(*tensors)

    # Inside a torch.compile'd graph every output of an op, and so what backward gets, must
    # have a shape known when the graph is traced, before any backend is chosen. There the
    # core keeps the call's own inputs (floating inputs as [N, V_local] rows, index, mask)
    # and one statistics tensor instead of the state; backends that declare
    # OpCapability(compiled=True) convert both ways.
    def statistics(self) -> torch.Tensor:
        """Everything this state holds beyond the call's own inputs, as one new ``[N, W]``
        tensor: fp32 (fp64 for fp64 inputs), ``W = statistics_width(call.op, call.options)``."""
        raise NotImplementedError(f"{type(self).__name__} cannot be saved inside torch.compile")

    @classmethod
    def from_statistics(
        cls,
        call: Call,
        inputs: tuple[torch.Tensor, ...],
        index: torch.Tensor | None,
        mask: torch.Tensor | None,
        statistics: torch.Tensor,
    ) -> SavedState:
        """The state forward returned, rebuilt from the call's inputs (as forward got them)
        and ``statistics()``."""
        raise NotImplementedError(f"{cls.__name__} cannot be rebuilt inside torch.compile")


def statistics_width(op: str, options: Mapping[str, Any]) -> int:
    """``W`` of the ``[N, W]`` statistics a call from a compiled graph keeps for backward:
    cross_entropy and logprobs 2 (anchor, log-sum), entropy and logprobs with return_entropy 3
    (and the entropy), kl 5 (both anchors and log-sums, the KL), jsd 6 (both anchors and
    log-sums, KL(p_s||M), KL(p_t||M)); jsd at beta 0 or 1 is a plain KL: 5."""
    if op == "jsd" and options["beta"] in (0.0, 1.0):
        return 5
    if op == "logprobs" and options["return_entropy"]:
        return 3
    return _STATISTICS_WIDTH[op]


_STATISTICS_WIDTH = {"cross_entropy": 2, "logprobs": 2, "entropy": 3, "kl": 5, "jsd": 6}


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

    # -- environment -------------------------------------------------------------------
    def probe(self, device_type: str) -> list[str]:
        """Reasons this process cannot run the backend on ``device_type`` (missing imports,
        no device, compute capability). Must never raise. Empty list: it can."""
        return []

    def probe_reasons(self, device_type: str) -> list[str]:
        """``probe`` cached per device type; exceptions become reasons."""
        cache = self.__dict__.setdefault("_probe_cache", {})
        if device_type not in cache:
            try:
                found = list(self.probe(device_type))
            except Exception as exc:  # a probe that raises is a reason, never a crash
                found = [f"environment probe raised {type(exc).__name__}: {exc}"]
            cache[device_type] = found
        return cache[device_type]

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
            names = ", ".join(sorted(str(d).replace("torch.", "") for d in cap.dtypes))
            out.append(f"dtype {str(request.dtype).replace('torch.', '')} not supported (supports {names})")
        if cap.tp_sizes is not None and request.tp_size not in cap.tp_sizes:
            out.append(f"TP size {request.tp_size} not supported (supports {sorted(cap.tp_sizes)})")
        if cap.even_shards_only and not request.even_shards:
            out.append("needs even vocabulary shards in rank order (vocab_start = rank * V_local)")
        if not cap.empty_shards and request.empty_shard:
            out.append("cannot handle a rank with an empty vocabulary shard (V_local = 0)")
        if not cap.empty_tokens and request.num_tokens == 0:
            out.append("cannot handle zero tokens")
        for feature in sorted(request.features - cap.features):
            out.append(f"does not support {feature}")
        if request.head_inputs and not cap.head_inputs:
            out.append("head inputs not supported (pass logits, or force a backend that takes vtp.Head)")
        elif request.head_per_token and not cap.head_per_token:
            out.append("head inputs with a per-token result not supported (use reduction='sum' or 'mean')")
        if request.compiled and not cap.compiled:
            out.append(
                "cannot run inside torch.compile (its saved state is not the op's inputs plus "
                "fixed-width statistics: OpCapability(compiled=False))"
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

    # -- the fused head (vtp_runtime/head.py), for backends declaring head_inputs --------
    def head_driver(self, call: Call):
        """A ``vtp_runtime.head.HeadDriver`` that runs a call with Head inputs its own way
        (e.g. a library's fused linear cross entropy), or None for the generic token-chunk
        driver, which calls ``forward``/``head_backward`` on each chunk's logits."""
        return None

    def head_backward(
        self, call: Call, state: SavedState | None, grad: torch.Tensor, scratch: tuple[bool, ...]
    ) -> tuple[torch.Tensor | None, ...]:
        """``backward`` of one token chunk under the generic head driver. ``scratch[i]``:
        input i is a logits buffer the driver owns and refills before any later use, so
        its gradient may be written into it in place (one ``[rows, V_local]`` buffer less).
        The default calls ``backward``."""
        return self.backward(call, state, grad)


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
