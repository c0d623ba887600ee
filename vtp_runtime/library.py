"""vtp_runtime inside ``torch.compile``: each op is one opaque ``torch.library`` custom op.

``loss`` (and every typed helper) called while dynamo traces a function goes through
``traced_loss``: what dynamo traces is plain tensor code (flattening to rows, masks,
reductions) around two custom ops, so dynamo never sees a metadata gather, a hash, a host
read or a backend, and ``fullgraph=True`` compiles.

- ``vtp_runtime::forward(op, inputs, index, mask, options...) -> (values, statistics, chosen)``
  runs at run time what an eager call runs -- the plan of the call's signature (the
  metadata gather on its first call, see ``vtp_runtime.plans``), dispatch, the backend's
  forward -- and returns the values, the backend's state as one ``[N, W]`` statistics
  tensor (``Compiles.statistics``; ``W`` the widest any compiling backend declares for the
  call, known when tracing), and ``chosen``: a small int64 CPU tensor naming the backend and
  this rank's shards.
- ``vtp_runtime::backward(grad, statistics, chosen, op, inputs, index, mask, options...) -> grads``
  rebuilds the backend's ``Call`` and state from what the forward returned (no plan lookup,
  no collective) and runs the backend's backward. ``register_autograd`` ties the two; the
  forward's inputs and outputs are what autograd saves.

Checked when tracing (the same checks as an eager call, on shapes, dtypes and option
values): the arguments of this rank. Checked when the graph runs, inside the op: everything
that needs the other ranks (the metadata gather and its checks) and the backend choice,
exactly as in eager mode. Only backends implementing the ``Compiles`` protocol for the op
run here. The forced backend (``backend=``, ``use_backend``, ``VTP_BACKEND*``) is read when
tracing. A process group cannot be an argument of a custom op: its name
(``group.group_name``) is, resolved through torch's own registry on every call (names
restart after ``destroy_process_group()``: no cache may map them).

The custom ops' scalar arguments are written from the option schema (``ops.OPS``): every
option any op hands its backends, then the layout, the group's name, the forced backend,
which inputs need gradients and whether the index is top-k. An option the op does not take
is passed as None.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from . import checks, dispatch, inputs, metadata, plans
from .backend import Call, Compiles, Request, value_dtype
from .invocation import Check, Invocation
from .ops import OPS, OpSpec, backend_options, features_of, get_spec
from .outputs import finish, values_shape
from .registry import REGISTRY

Tensor = torch.Tensor

# what every op hands its backends, by name (one Option per name across ops)
_BACKEND_OPTIONS = {o.name: o for spec in OPS.values() for o in spec.options.values() if o.backend}
_LAYOUT = ("vocab_start", "vocab_end", "global_vocab_size")
_SCHEMA_TYPES = {float: "float?", int: "SymInt?", bool: "bool?"}
# (name, schema type) of the scalar arguments both custom ops end with, in order
FIELDS: tuple[tuple[str, str], ...] = (
    *((name, _SCHEMA_TYPES[o.kind]) for name, o in sorted(_BACKEND_OPTIONS.items()) if o.kind is not None),
    *((name, "SymInt?") for name in _LAYOUT),
    ("group_name", "str"),
    ("backend", "str"),
    ("backend_source", "str"),
    ("needs_grad", "bool[]"),
    ("topk", "bool"),
)
_NAMES = tuple(name for name, _ in FIELDS)
_SCHEMA = ", ".join(f"{kind} {name}" for name, kind in FIELDS)
# the layout of ``chosen``: the backend (metadata.backend_key) and this rank's shards
_CHOSEN = ("backend", "rank", "vocab_start", "vocab_end", "vocab_size", "tp_size", "even_shards", "empty_shard")


def _args(scalars: tuple) -> dict[str, Any]:
    return dict(zip(_NAMES, scalars))


def _group(name: str) -> Any:
    """The process group registered under ``name`` ("" for none), looked up in torch's own
    registry on every call."""
    if not name:
        return None
    from torch.distributed import distributed_c10d as c10d

    resolve = getattr(c10d, "_resolve_process_group", None)
    if resolve is not None:  # torch 2.11, 2.13
        return resolve(name)
    group = next((pg for pg, pg_name in c10d._world.pg_names.items() if pg_name == name), None)
    if group is None:
        raise RuntimeError(f"no process group is registered as {name!r}")
    return group


def _options(spec: OpSpec, mask: Tensor | None, a: Mapping[str, Any]) -> dict[str, Any]:
    """The options of an eager call that the custom op's arguments stand for."""
    options: dict[str, Any] = {"tp_group": _group(a["group_name"])}
    for name in (*_BACKEND_OPTIONS, *_LAYOUT):
        if name in spec.options and a[name] is not None:
            options[name] = a[name]
    if mask is not None:
        options["mask"] = mask
    return options


def _backend_options(spec: OpSpec, a: Mapping[str, Any]) -> dict[str, Any]:
    """What the op's backends get in ``Call.options``, from the custom op's arguments (None:
    the op's default)."""
    return backend_options(spec, {**spec.defaults, **{k: v for k, v in a.items() if v is not None}})


def _values_shape(n: Any, index: Tensor | None, a: Mapping[str, Any]) -> tuple:
    return values_shape(n, index, a["topk"], bool(a["return_entropy"]))


def _width(op: str, options: Mapping[str, Any]) -> int:
    """The statistics width of a compiled call: the widest any registered backend that can
    run ``op`` in a compiled graph declares (a narrower backend's columns are padded)."""
    widths = [
        b.statistics_width(op, options)
        for b in REGISTRY.backends().values()
        if isinstance(b, Compiles) and op in b.compiled_ops
    ]
    if not widths:
        raise RuntimeError(f"no registered backend runs {op} inside torch.compile (the Compiles protocol)")
    assert all(isinstance(w, int) for w in widths)
    return max(widths)


def _forward(
    op: str, rows: list[Tensor], index: Tensor | None, mask: Tensor | None, *scalars: Any
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token values ``[N]`` (``[N, k]`` top-k log-probs; with ``return_entropy`` ``[N, k + 1]``,
    the entropy last), the ``[N, W]`` statistics backward needs, and ``chosen``, for ``rows``
    ``[N, V_local]``, ``index`` int64 ``[N]``/``[N, k]``, ``mask`` bool ``[N]`` (already
    combined with labels). Values and statistics are replicated on every rank."""
    a = _args(scalars)
    spec = get_spec(op)
    tensors = tuple(rows) + ((index,) if index is not None else ())
    options = _options(spec, mask, a)
    invocation = Invocation(
        op,
        tensors,
        options,
        traced_needs_grad=tuple(a["needs_grad"]),
        traced_backend=(a["backend"] or None, a["backend_source"]),
    )
    plan = plans.plan_for(invocation)
    backend = plan.backend
    assert isinstance(backend, Compiles)  # dispatch gave a compiled call to a backend that compiles
    call = plan.call(options["tp_group"])
    n = plan.num_tokens
    width = _width(op, plan.backend_options)
    dtype = value_dtype(rows[0].dtype)
    chosen = torch.tensor(
        [
            metadata.backend_key(backend.name, backend.priority),
            plan.rank,
            plan.vocab_start,
            plan.vocab_end,
            plan.request.vocab_size,
            plan.request.tp_size,
            int(plan.request.even_shards),
            int(plan.request.empty_shard),
        ],
        dtype=torch.int64,
    )
    if n == 0:  # no rank has a token: nothing to compute or communicate
        values = rows[0].new_zeros(_values_shape(0, index, a), dtype=dtype)
        return values, rows[0].new_zeros((0, width), dtype=dtype), chosen
    values, state = backend.forward(call, tuple(rows), index, mask)
    if state is None:
        raise RuntimeError(f"backend {backend.name!r} returned no state; it cannot run inside torch.compile")
    stats = backend.statistics(call, state)
    w = backend.statistics_width(op, plan.backend_options)
    if tuple(stats.shape) != (n, w):
        raise RuntimeError(
            f"backend {backend.name!r}: statistics() gave shape {tuple(stats.shape)}, "
            f"expected [N, statistics_width] = {(n, w)}"
        )
    if w < width:
        stats = torch.nn.functional.pad(stats, (0, width - w))
    return values, stats, chosen


forward_op = torch.library.custom_op(
    "vtp_runtime::forward",
    _forward,
    mutates_args=(),
    schema=f"(str op, Tensor[] inputs, Tensor? index, Tensor? mask, {_SCHEMA}) -> (Tensor, Tensor, Tensor)",
)


@forward_op.register_fake
def _(op, inputs, index, mask, *scalars):
    a = _args(scalars)
    spec = get_spec(op)
    z = inputs[0]
    n = z.shape[0]
    dtype = value_dtype(z.dtype)
    width = _width(op, _backend_options(spec, a))
    chosen = torch.empty((len(_CHOSEN),), dtype=torch.int64, device="cpu")
    return z.new_empty(_values_shape(n, index, a), dtype=dtype), z.new_empty((n, width), dtype=dtype), chosen


def _call_of(op: str, chosen: list[int], rows: list[Tensor], index: Tensor | None, mask, a) -> tuple[Compiles, Call]:
    """The backend and the ``Call`` a compiled forward ran, from what it returned."""
    c = dict(zip(_CHOSEN, chosen))
    backend = next(
        (b for b in REGISTRY.backends().values() if metadata.backend_key(b.name, b.priority) == c["backend"]), None
    )
    if not isinstance(backend, Compiles):
        raise RuntimeError(
            f"vtp_runtime: the backend that ran the forward of this {op} call is no longer registered; "
            f"keep the registry unchanged between a compiled forward and its backward"
        )
    spec = get_spec(op)
    options = _backend_options(spec, a)
    z = rows[0]
    request = Request(
        op=op,
        device_type=z.device.type,
        dtype=z.dtype,
        tp_size=c["tp_size"],
        vocab_size=c["vocab_size"],
        num_tokens=z.shape[0],
        even_shards=bool(c["even_shards"]),
        empty_shard=bool(c["empty_shard"]),
        features=features_of(
            spec,
            {**spec.defaults, **options, "mask": mask},
            topk=a["topk"],
            teacher_grad=len(rows) == 2 and a["needs_grad"][1],
        ),
        compiled=True,
    )
    call = Call(
        request=request,
        group=_group(a["group_name"]),
        rank=c["rank"],
        vocab_start=c["vocab_start"],
        vocab_end=c["vocab_end"],
        options=options,
        needs_grad=tuple(a["needs_grad"]),
        topk=a["topk"],
    )
    return backend, call


def _backward_op(
    grad: Tensor,
    statistics: Tensor,
    chosen: Tensor,
    op: str,
    rows: list[Tensor],
    index: Tensor | None,
    mask: Tensor | None,
    *scalars: Any,
) -> list[Tensor]:
    """The gradients of the inputs in ``needs_grad`` (only those), from the forward's
    ``statistics`` and ``chosen``. No collective."""
    a = _args(scalars)
    backend, call = _call_of(op, chosen.tolist(), rows, index, mask, a)  # chosen is on the host
    if call.request.num_tokens == 0:
        return [torch.zeros_like(t) for t, need in zip(rows, a["needs_grad"]) if need]
    w = backend.statistics_width(op, call.options)
    state = backend.from_statistics(call, tuple(rows), index, mask, statistics[:, :w])
    grads = backend.backward(call, state, grad.contiguous())
    out = []
    for g, need in zip(grads, a["needs_grad"]):
        if need:
            assert g is not None, f"backend {backend.name!r} gave no gradient for an input that needs one"
            out.append(g)
    return out


backward_op = torch.library.custom_op(
    "vtp_runtime::backward",
    _backward_op,
    mutates_args=(),
    schema=(
        f"(Tensor grad, Tensor statistics, Tensor chosen, str op, Tensor[] inputs, Tensor? index, Tensor? mask, "
        f"{_SCHEMA}) -> Tensor[]"
    ),
)


@backward_op.register_fake
def _(grad, statistics, chosen, op, inputs, index, mask, *scalars):
    return [torch.empty_like(t) for t, need in zip(inputs, _args(scalars)["needs_grad"]) if need]


def _setup_context(ctx, inputs, output):
    op, tensors, index, mask = inputs[:4]
    ctx.op, ctx.scalars, ctx.n = op, inputs[4:], len(tensors)
    ctx.save_for_backward(*tensors, index, mask, output[1], output[2])


def _backward(ctx, grad_values, grad_statistics, grad_chosen):
    saved = ctx.saved_tensors
    n = ctx.n
    tensors, (index, mask, stats, chosen) = list(saved[:n]), saved[n:]
    needs_grad = _args(ctx.scalars)["needs_grad"]
    grads = (
        iter(backward_op(grad_values, stats, chosen, ctx.op, tensors, index, mask, *ctx.scalars))
        if any(needs_grad)
        else iter(())
    )
    input_grads = [next(grads) if need else None for need in needs_grad]
    return (None, input_grads) + (None,) * (2 + len(FIELDS))


torch.library.register_autograd("vtp_runtime::forward", _backward, setup_context=_setup_context)


@torch.compiler.assume_constant_result
def _forced(op: str, argument: str | None) -> str:
    # read once when tracing (use_backend's ContextVar and the environment are not graph inputs)
    name, source = dispatch.forced_backend(op, argument)
    return f"{name or ''}\0{source}"


def traced_loss(op: str, tensors: tuple, passed: dict[str, Any], check: Check | None = None) -> Any:
    """``loss(op, *tensors, **options)`` as dynamo traces it: this rank's checks on what
    tracing knows (shapes, dtypes, option values), then the custom op. ``check`` (per-call
    data checks, which read the host) does not run here: callers make bad data NaN on the
    device instead."""
    spec = get_spec(op)
    n_inputs = len(spec.inputs)
    for t in tensors:
        if type(t) not in (Tensor, torch.nn.Parameter):
            raise TypeError(
                f"inside torch.compile vtp_runtime takes plain tensors, got {type(t).__name__}; "
                f"pass a DTensor's local shard (.to_local()) with tp_group, vocab_start and "
                f"vocab_end, and call a Head outside the compiled region"
            )
    checks.check_arguments(spec, tensors, passed)
    options = {**spec.defaults, **passed}
    index = tensors[n_inputs] if spec.index else None
    checks.check_tensors(spec, tensors[:n_inputs], index, options)
    group = options["tp_group"]
    forced = _forced(op, options["backend"]).split("\0")
    lead = tuple(tensors[0].shape[:-1])
    n = math.prod(lead)
    rows = [t.reshape(n, t.shape[-1]) for t in tensors[:n_inputs]]
    grad_on = torch.is_grad_enabled()
    topk = spec.name == "logprobs" and index is not None and index.dim() == len(lead) + 1
    index, mask = inputs.index_and_mask(spec, topk, n, index, options)
    scalars: dict[str, Any] = {name: None for name in _NAMES}
    for name in (*_BACKEND_OPTIONS, *_LAYOUT):
        if name in spec.options and options[name] is not None:
            value = spec.options[name].canonical(options[name])
            if spec.options[name].kind is float and not isinstance(value, float):
                value = float(value)  # a symbolic int (dynamic shapes) given for a float option
            scalars[name] = value
    scalars.update(
        group_name="" if group is None else group.group_name,
        backend=forced[0],
        backend_source=forced[1],
        needs_grad=[bool(grad_on and t.requires_grad) for t in tensors[:n_inputs]],
        topk=topk,
    )
    values, _, _ = forward_op(spec.name, rows, index, mask, *(scalars[name] for name in _NAMES))
    return finish(values, lead, topk, index, mask, options)
