"""vtp_runtime inside ``torch.compile``: each op is one opaque ``torch.library`` custom op.

``loss`` (and every typed helper) called while dynamo traces a function goes through
``traced_loss``: what dynamo traces is plain tensor code (flattening to rows, masks,
reductions) around two custom ops, so dynamo never sees a metadata gather, a hash, a host
read or a backend, and ``fullgraph=True`` compiles.

- ``vtp_runtime::forward(op, inputs, index, mask, group_name, options...) -> (values, statistics)``
  runs at run time what an eager call runs -- the plan of the call's signature (the
  metadata gather on its first call, see ``vtp_runtime.plan``), dispatch, the backend's
  forward -- and returns the values and the backend's state as one ``[N, W]`` statistics
  tensor (``backend.statistics_width``), so that both have shapes known when tracing.
- ``vtp_runtime::backward(grad, statistics, op, inputs, index, mask, options...) -> grads`` finds the
  same plan (it never gathers) and runs the backend's backward. ``register_autograd`` ties
  the two; the forward's inputs and statistics are what autograd saves.

Checked when tracing (the same checks as an eager call, on shapes, dtypes and option
values): the arguments of this rank. Checked when the graph runs, inside the op: everything
that needs the other ranks (the metadata gather and its checks) and the backend choice,
exactly as in eager mode. Only backends declaring ``OpCapability(compiled=True)`` run here
(eager, triton, triton_xpu). The forced backend (``backend=``, ``use_backend``,
``VTP_BACKEND*``) is read when tracing. A process group cannot be an argument of a custom
op: its name (``group.group_name``) is, resolved at run time.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, get_type_hints

import torch

from . import api, dispatch
from .backend import statistics_width
from .ops import get_spec

Tensor = torch.Tensor

_GROUPS: dict[str, Any] = {}


def _group(name: str):
    """The process group registered under ``name`` ("" for none)."""
    if not name:
        return None
    group = _GROUPS.get(name)
    if group is None:
        from torch.distributed import distributed_c10d as c10d

        resolve = getattr(c10d, "_resolve_process_group", None)
        if resolve is not None:  # torch 2.11, 2.13
            group = resolve(name)
        else:  # the registry it reads
            group = next((pg for pg, pg_name in c10d._world.pg_names.items() if pg_name == name), None)
            if group is None:
                raise RuntimeError(f"no process group is registered as {name!r}")
        _GROUPS[name] = group
    return group


class Options(NamedTuple):
    """The scalar arguments both custom ops end with, in their schema's order (-1: not given).
    The schemas are written from these fields, so the argument list is written here only."""

    group_name: str
    temperature: float
    ignore_index: int
    label_smoothing: float
    z_loss: float
    beta: float
    reverse: bool
    return_entropy: bool
    vocab_start: int
    vocab_end: int
    global_vocab_size: int
    backend: str
    backend_source: str
    needs_grad: list[bool]
    topk: bool


# as torch.library.infer_schema writes them (an int may be symbolic when tracing: SymInt)
_SCHEMA_TYPES = {str: "str", float: "float", int: "SymInt", bool: "bool", list[bool]: "bool[]"}
_OPTIONS_SCHEMA = ", ".join(f"{_SCHEMA_TYPES[t]} {name}" for name, t in get_type_hints(Options).items())


def _given(op: str, mask: Tensor | None, o: Options) -> dict[str, Any]:
    """The options of an eager call that the op's arguments stand for."""
    given: dict[str, Any] = {"tp_group": _group(o.group_name), "temperature": o.temperature}
    if o.vocab_start >= 0:
        given["vocab_start"], given["vocab_end"] = o.vocab_start, o.vocab_end
    if o.global_vocab_size >= 0:
        given["global_vocab_size"] = o.global_vocab_size
    spec = get_spec(op)
    if "ignore_index" in spec.options:
        given["ignore_index"] = o.ignore_index
    if op == "cross_entropy":
        given["label_smoothing"], given["z_loss"] = o.label_smoothing, o.z_loss
    if op == "logprobs":
        given["return_entropy"] = o.return_entropy
    if op == "kl":
        given["reverse"] = o.reverse
    if op == "jsd":
        given["beta"] = o.beta
    if mask is not None:
        given["mask"] = mask
    return given


def _forward(
    op: str, inputs: list[Tensor], index: Tensor | None, mask: Tensor | None, *options: Any
) -> tuple[Tensor, Tensor]:
    """Per-token values ``[N]`` (``[N, k]`` top-k log-probs; with ``return_entropy`` ``[N, k + 1]``,
    the entropy last) and the ``[N, W]`` statistics
    backward needs, for ``inputs`` as ``[N, V_local]`` rows, ``index`` int64 ``[N]``/``[N, k]``,
    ``mask`` bool ``[N]`` (already combined with labels). Replicated on every rank."""
    o = Options(*options)
    tensors = tuple(inputs) + ((index,) if index is not None else ())
    traced = api.Traced(tuple(o.needs_grad), o.backend or None, o.backend_source)
    made = api._planned(op, tensors, _given(op, mask, o), traced)
    values, state = made.backend.forward(made.call, tuple(inputs), index, mask)
    if state is None:
        raise RuntimeError(f"backend {made.backend.name!r} returned no state; it cannot run inside torch.compile")
    made.state_type = type(state)
    stats = state.statistics()
    width = statistics_width(op, made.call.options)
    if tuple(stats.shape) != (values.shape[0], width):
        raise RuntimeError(
            f"backend {made.backend.name!r}: statistics() gave shape {tuple(stats.shape)}, "
            f"expected [N, {width}] = {(values.shape[0], width)}"
        )
    return values, stats


forward_op = torch.library.custom_op(
    "vtp_runtime::forward",
    _forward,
    mutates_args=(),
    schema=f"(str op, Tensor[] inputs, Tensor? index, Tensor? mask, {_OPTIONS_SCHEMA}) -> (Tensor, Tensor)",
)


@forward_op.register_fake
def _(op, inputs, index, mask, *options):
    o = Options(*options)
    z = inputs[0]
    n = z.shape[0]
    dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
    if op == "logprobs" and o.return_entropy:
        shape = (n, (index.shape[1] if o.topk else 1) + 1)
    else:
        shape = (n, index.shape[1]) if o.topk else (n,)
    values = z.new_empty(shape, dtype=dtype)
    width = statistics_width(op, {"beta": o.beta, "return_entropy": o.return_entropy})
    return values, z.new_empty((n, width), dtype=dtype)


def _backward_op(
    grad: Tensor,
    statistics: Tensor,
    op: str,
    inputs: list[Tensor],
    index: Tensor | None,
    mask: Tensor | None,
    *options: Any,
) -> list[Tensor]:
    """The gradients of the inputs in ``needs_grad`` (only those), from the forward's plan
    and statistics. No collective."""
    from . import plan

    o = Options(*options)
    tensors = tuple(inputs) + ((index,) if index is not None else ())
    forced = (o.backend or None, o.backend_source)
    key = plan.signature(op, tensors, _given(op, mask, o), forced, api.REGISTRY.version, tuple(o.needs_grad))
    made = None if key is None else plan.lookup(key)
    if made is None or made.state_type is None:
        raise RuntimeError(
            f"vtp_runtime: no plan for the backward of this {op} call: its forward ran under "
            f"another registry of backends, or more than {2 * plan.MAX_PLANS} other signatures "
            f"ran since; run backward sooner, or call vtp_runtime.plan.clear() on no rank in between"
        )
    state = made.state_type.from_statistics(made.call, tuple(inputs), index, mask, statistics)
    grads = made.backend.backward(made.call, state, grad.contiguous())
    return [g for g, need in zip(grads, o.needs_grad) if need]


backward_op = torch.library.custom_op(
    "vtp_runtime::backward",
    _backward_op,
    mutates_args=(),
    schema=(
        f"(Tensor grad, Tensor statistics, str op, Tensor[] inputs, Tensor? index, Tensor? mask, "
        f"{_OPTIONS_SCHEMA}) -> Tensor[]"
    ),
)


@backward_op.register_fake
def _(grad, statistics, op, inputs, index, mask, *options):
    return [torch.empty_like(t) for t, need in zip(inputs, Options(*options).needs_grad) if need]


def _setup_context(ctx, inputs, output):
    op, tensors, index, mask = inputs[:4]
    ctx.op, ctx.options, ctx.n = op, inputs[4:], len(tensors)
    ctx.save_for_backward(*tensors, index, mask, output[1])


def _backward(ctx, grad_values, grad_statistics):
    saved = ctx.saved_tensors
    n = ctx.n
    tensors, (index, mask, stats) = list(saved[:n]), saved[n:]
    needs_grad = Options(*ctx.options).needs_grad
    grads = (
        iter(backward_op(grad_values, stats, ctx.op, tensors, index, mask, *ctx.options))
        if any(needs_grad)
        else iter(())
    )
    input_grads = [next(grads) if need else None for need in needs_grad]
    return (None, input_grads) + (None,) * (2 + len(Options._fields))


torch.library.register_autograd("vtp_runtime::forward", _backward, setup_context=_setup_context)


@torch.compiler.assume_constant_result
def _forced(op: str, argument: str | None) -> str:
    # read once when tracing (use_backend's ContextVar and the environment are not graph inputs)
    name, source = dispatch.forced_backend(op, argument)
    return f"{name or ''}\0{source}"


def traced_loss(op: str, tensors: tuple, options: dict[str, Any]) -> Tensor | tuple[Tensor, Tensor]:
    """``loss(op, *tensors, **options)`` as dynamo traces it: local checks on what tracing
    knows (shapes, dtypes, option values), then the custom op."""
    spec = get_spec(op)
    n_inputs = len(spec.inputs)
    for t in tensors:
        if type(t) not in (Tensor, torch.nn.Parameter):
            raise TypeError(
                f"inside torch.compile vtp_runtime takes plain tensors, got {type(t).__name__}; "
                f"pass a DTensor's local shard (.to_local()) with tp_group, vocab_start and "
                f"vocab_end, and call a Head outside the compiled region"
            )
    given = options
    api._check_arguments(op, tensors, given)
    options = {**api._DEFAULTS[spec.name], **given}
    api._local_checks(spec, tensors[:n_inputs], tensors[n_inputs] if spec.index else None, options)
    group = options["tp_group"]
    group_name = "" if group is None else group.group_name
    forced = _forced(op, options["backend"]).split("\0")
    inputs = tuple(tensors[:n_inputs])
    lead = tuple(inputs[0].shape[:-1])
    n = math.prod(lead)
    rows = [t.reshape(n, t.shape[-1]) for t in inputs]
    grad_on = torch.is_grad_enabled()
    needs_grad = [bool(grad_on and t.requires_grad) for t in inputs]
    ignore_index = options.get("ignore_index", -100)
    index = mask = None
    topk = False
    if spec.index:
        index = tensors[n_inputs]
        topk = spec.name == "logprobs" and index.dim() == len(lead) + 1
        index = (index.reshape(n, index.shape[-1]) if topk else index.reshape(n)).long()
    else:
        if options["mask"] is not None:
            mask = options["mask"].reshape(n)
        if options["labels"] is not None:
            keep = options["labels"].reshape(n) != ignore_index
            mask = keep if mask is None else mask & keep
    vocab_start = options["vocab_start"]
    options_given = Options(
        group_name=group_name,
        temperature=float(options["temperature"]),
        ignore_index=int(ignore_index),
        label_smoothing=float(options.get("label_smoothing", 0.0)),
        z_loss=float(options.get("z_loss", 0.0)),
        beta=float(options.get("beta", 0.5)),
        reverse=bool(options.get("reverse", False)),
        return_entropy=bool(options.get("return_entropy", False)),
        vocab_start=-1 if vocab_start is None else vocab_start,
        vocab_end=-1 if vocab_start is None else options["vocab_end"],
        global_vocab_size=-1 if options["global_vocab_size"] is None else options["global_vocab_size"],
        backend=forced[0],
        backend_source=forced[1],
        needs_grad=needs_grad,
        topk=topk,
    )
    values, _ = forward_op(spec.name, rows, index, mask, *options_given)
    if options.get("return_entropy"):
        assert index is not None  # return_entropy is an option of logprobs, which takes an index
        return api._logprobs_and_entropy(values, lead, topk, index, options, ignore_index)
    if len(lead) != 1:
        values = values.view(lead + api._topk_dims(index, topk))
    return api._reduce(values, options, index, mask, ignore_index)
