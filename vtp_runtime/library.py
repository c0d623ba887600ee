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
- ``vtp_runtime::backward(grad, statistics, inputs, index, mask, ...) -> grads`` finds the
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
from typing import Any, Optional

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

        if hasattr(c10d, "_resolve_process_group"):  # torch 2.11, 2.13
            group = c10d._resolve_process_group(name)
        else:  # the registry it reads
            group = next((pg for pg, pg_name in c10d._world.pg_names.items() if pg_name == name), None)
            if group is None:
                raise RuntimeError(f"no process group is registered as {name!r}")
        _GROUPS[name] = group
    return group


def _given(
    op: str,
    group_name: str,
    mask: Tensor | None,
    temperature: float,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    beta: float,
    reverse: bool,
    return_entropy: bool,
    vocab_start: int,
    vocab_end: int,
    global_vocab_size: int,
) -> dict[str, Any]:
    """The options of an eager call that the op's arguments stand for (-1: not given)."""
    given: dict[str, Any] = {"tp_group": _group(group_name), "temperature": temperature}
    if vocab_start >= 0:
        given["vocab_start"], given["vocab_end"] = vocab_start, vocab_end
    if global_vocab_size >= 0:
        given["global_vocab_size"] = global_vocab_size
    spec = get_spec(op)
    if "ignore_index" in spec.options:
        given["ignore_index"] = ignore_index
    if op == "cross_entropy":
        given["label_smoothing"], given["z_loss"] = label_smoothing, z_loss
    if op == "logprobs":
        given["return_entropy"] = return_entropy
    if op == "kl":
        given["reverse"] = reverse
    if op == "jsd":
        given["beta"] = beta
    if mask is not None:
        given["mask"] = mask
    return given


def _plan(
    op,
    inputs,
    index,
    mask,
    group_name,
    temperature,
    ignore_index,
    label_smoothing,
    z_loss,
    beta,
    reverse,
    return_entropy,
    vocab_start,
    vocab_end,
    global_vocab_size,
    backend,
    backend_source,
    needs_grad,
):
    tensors = tuple(inputs) + ((index,) if index is not None else ())
    given = _given(
        op,
        group_name,
        mask,
        temperature,
        ignore_index,
        label_smoothing,
        z_loss,
        beta,
        reverse,
        return_entropy,
        vocab_start,
        vocab_end,
        global_vocab_size,
    )
    traced = api.Traced(tuple(needs_grad), backend or None, backend_source)
    return api._planned(op, tensors, given, traced), tensors, given


# Optional[...] rather than "| None" in the custom ops' signatures: the schema is inferred
# from them, and torch before 2.6 reads only Optional there
@torch.library.custom_op("vtp_runtime::forward", mutates_args=())
def forward_op(
    op: str,
    inputs: list[Tensor],
    index: Optional[Tensor],  # noqa: UP045
    mask: Optional[Tensor],  # noqa: UP045
    group_name: str,
    temperature: float,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    beta: float,
    reverse: bool,
    return_entropy: bool,
    vocab_start: int,
    vocab_end: int,
    global_vocab_size: int,
    backend: str,
    backend_source: str,
    needs_grad: list[bool],
    topk: bool,
) -> tuple[Tensor, Tensor]:
    """Per-token values ``[N]`` (``[N, k]`` top-k log-probs; with ``return_entropy`` ``[N, k + 1]``,
    the entropy last) and the ``[N, W]`` statistics
    backward needs, for ``inputs`` as ``[N, V_local]`` rows, ``index`` int64 ``[N]``/``[N, k]``,
    ``mask`` bool ``[N]`` (already combined with labels). Replicated on every rank."""
    made, _, _ = _plan(
        op,
        inputs,
        index,
        mask,
        group_name,
        temperature,
        ignore_index,
        label_smoothing,
        z_loss,
        beta,
        reverse,
        return_entropy,
        vocab_start,
        vocab_end,
        global_vocab_size,
        backend,
        backend_source,
        needs_grad,
    )
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


@forward_op.register_fake
def _(
    op,
    inputs,
    index,
    mask,
    group_name,
    temperature,
    ignore_index,
    label_smoothing,
    z_loss,
    beta,
    reverse,
    return_entropy,
    vocab_start,
    vocab_end,
    global_vocab_size,
    backend,
    backend_source,
    needs_grad,
    topk,
):
    z = inputs[0]
    n = z.shape[0]
    dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
    if op == "logprobs" and return_entropy:
        shape = (n, (index.shape[1] if topk else 1) + 1)
    else:
        shape = (n, index.shape[1]) if topk else (n,)
    values = z.new_empty(shape, dtype=dtype)
    width = statistics_width(op, {"beta": beta, "return_entropy": return_entropy})
    return values, z.new_empty((n, width), dtype=dtype)


@torch.library.custom_op("vtp_runtime::backward", mutates_args=())
def backward_op(
    grad: Tensor,
    statistics: Tensor,
    inputs: list[Tensor],
    index: Optional[Tensor],  # noqa: UP045
    mask: Optional[Tensor],  # noqa: UP045
    op: str,
    group_name: str,
    temperature: float,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    beta: float,
    reverse: bool,
    return_entropy: bool,
    vocab_start: int,
    vocab_end: int,
    global_vocab_size: int,
    backend: str,
    backend_source: str,
    needs_grad: list[bool],
    topk: bool,
) -> list[Tensor]:
    """The gradients of the inputs in ``needs_grad`` (only those), from the forward's plan
    and statistics. No collective."""
    from . import plan

    tensors = tuple(inputs) + ((index,) if index is not None else ())
    given = _given(
        op,
        group_name,
        mask,
        temperature,
        ignore_index,
        label_smoothing,
        z_loss,
        beta,
        reverse,
        return_entropy,
        vocab_start,
        vocab_end,
        global_vocab_size,
    )
    forced = (backend or None, backend_source)
    key = plan.signature(op, tensors, given, forced, api.REGISTRY.version, tuple(needs_grad))
    made = None if key is None else plan.lookup(key)
    if made is None or made.state_type is None:
        raise RuntimeError(
            f"vtp_runtime: no plan for the backward of this {op} call: its forward ran under "
            f"another registry of backends, or more than {2 * plan.MAX_PLANS} other signatures "
            f"ran since; run backward sooner, or call vtp_runtime.plan.clear() on no rank in between"
        )
    state = made.state_type.from_statistics(made.call, tuple(inputs), index, mask, statistics)
    grads = made.backend.backward(made.call, state, grad.contiguous())
    return [g for g, need in zip(grads, needs_grad) if need]


@backward_op.register_fake
def _(
    grad,
    statistics,
    inputs,
    index,
    mask,
    op,
    group_name,
    temperature,
    ignore_index,
    label_smoothing,
    z_loss,
    beta,
    reverse,
    return_entropy,
    vocab_start,
    vocab_end,
    global_vocab_size,
    backend,
    backend_source,
    needs_grad,
    topk,
):
    return [torch.empty_like(t) for t, need in zip(inputs, needs_grad) if need]


_SCALARS = (
    "group_name",
    "temperature",
    "ignore_index",
    "label_smoothing",
    "z_loss",
    "beta",
    "reverse",
    "return_entropy",
    "vocab_start",
    "vocab_end",
    "global_vocab_size",
    "backend",
    "backend_source",
    "needs_grad",
    "topk",
)


def _setup_context(ctx, inputs, output):
    op, tensors, index, mask = inputs[:4]
    ctx.op, ctx.scalars, ctx.n = op, inputs[4:], len(tensors)
    ctx.save_for_backward(*tensors, index, mask, output[1])


def _backward(ctx, grad_values, grad_statistics):
    saved = ctx.saved_tensors
    n = ctx.n
    tensors, (index, mask, stats) = list(saved[:n]), saved[n:]
    scalars = dict(zip(_SCALARS, ctx.scalars))
    needs_grad = scalars["needs_grad"]
    grads = (
        iter(backward_op(grad_values, stats, tensors, index, mask, ctx.op, *ctx.scalars))
        if any(needs_grad)
        else iter(())
    )
    input_grads = [next(grads) if need else None for need in needs_grad]
    return (None, input_grads) + (None,) * (2 + len(_SCALARS))


torch.library.register_autograd("vtp_runtime::forward", _backward, setup_context=_setup_context)


@torch.compiler.assume_constant_result
def _forced(op: str, argument: str | None) -> str:
    # read once when tracing (use_backend's ContextVar and the environment are not graph inputs)
    name, source = dispatch.forced_backend(op, argument)
    return f"{name or ''}\0{source}"


def traced_loss(op: str, tensors: tuple, options: dict[str, Any]) -> Tensor:
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
    values, _ = forward_op(
        spec.name,
        rows,
        index,
        mask,
        group_name,
        float(options["temperature"]),
        int(ignore_index),
        float(options.get("label_smoothing", 0.0)),
        float(options.get("z_loss", 0.0)),
        float(options.get("beta", 0.5)),
        bool(options.get("reverse", False)),
        bool(options.get("return_entropy", False)),
        -1 if vocab_start is None else vocab_start,
        -1 if vocab_start is None else options["vocab_end"],
        -1 if options["global_vocab_size"] is None else options["global_vocab_size"],
        forced[0],
        forced[1],
        needs_grad,
        topk,
    )
    if options.get("return_entropy"):
        return api._logprobs_and_entropy(values, lead, topk, index, options, ignore_index)
    if len(lead) != 1:
        values = values.view(lead + ((index.shape[-1],) if topk else ()))
    return api._reduce(values, options, index, mask, ignore_index)
