"""The call pipeline: the one way every op call is computed.

    run(op, tensors, options)
      1. inputs.normalize   input forms (DTensor, a Head with a DTensor weight) -> local tensors
      2. plans.plan_for     the plan of the call's signature: looked up, or made by the full
                            path -- this rank's checks (``checks``), the metadata gather and its
                            checks (``metadata``), dispatch (``dispatch``)
      3. execute            the backend under one autograd node (``autograd``): logits rows,
                            or Head inputs in token chunks (``head_chunks``)
      4. outputs.finish     the per-token values back to the token shape, reduced

With a TP group, any failure on this rank before the metadata gather -- of any type, in
any step before it, the input forms included -- travels through the gather as a flag
instead of being raised before it (which would leave the other ranks waiting in the gather
forever); then every rank raises, this one its own exception. With an ``sp_group``, the
ranks of that group agree after step 2 (``sequence.agree``): a failure of step 2 (raised
on every rank of its TP group) reaches the other TP groups' ranks there, and step 4 sums a
reduced result over the group. Inside a ``torch.compile``'d graph steps 2 and 3 run inside
two custom ops (``library``), steps 1 and 4 in the graph.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NoReturn

import torch

from . import autograd, checks, dispatch, head_chunks, inputs, library, metadata, plans, sequence
from .backend import TakesHead, reduces, value_dtype
from .comm import group_rank, group_size, is_group
from .head import Head
from .invocation import Check, Invocation
from .outputs import backend_reduction, finish, head_reduction, plain_upstream, values_shape

Tensor = torch.Tensor


def run(
    op: str,
    tensors: tuple,
    options: dict[str, Any],
    *,
    check: Check | None = None,
    failure: Exception | None = None,
    agree: str = "",
) -> Any:
    """``loss(op, *tensors, **options)``. ``check``: per-call data checks of a composite op
    (``vtp_runtime.topk``), run before any collective, on every call; ``failure``: an error
    the caller met on this rank before the call, raised on every rank through the gather;
    ``agree``: what else the ranks of ``sp_group`` must agree on (a composite op's own
    options, as ``name=value|...``)."""
    if torch.compiler.is_compiling():  # traced by dynamo: one opaque custom op per call
        if options.get("sp_group") is not None:  # the SP agreement reads the host: a graph break
            return _eager(op, tensors, options, check=check, failure=failure, agree=agree)
        return library.traced_loss(op, tensors, options, check)
    tensors, options, wrap, normalized = inputs.normalize(op, tensors, options)
    failure = failure or normalized
    sp = options.get("sp_group")
    invocation = Invocation(op, tensors, options, check, failure)
    if not sequence.active(sp):
        plan = plans.plan_for(invocation)
    else:  # every rank of sp_group reaches the agreement, whatever its TP step gave
        planned: plans.Plan | None = None
        try:
            planned = plans.plan_for(invocation)
        except Exception as exc:
            failure = exc
        text = None if planned is None else sequence.call_text(planned.fingerprint, options, agree)
        # per-call data checks (a TopK teacher's) read the host anyway, and fail on some ranks
        # only: their outcome is gathered on every call
        sequence.agree(
            sp, text, options.get("normalizer"), failure, checks.device_of(tensors), every_call=check is not None
        )
        assert planned is not None  # agree raised otherwise
        plan = planned
    out = execute(plan, tensors, options)
    if wrap is None:
        return out
    return tuple(map(wrap, out)) if isinstance(out, tuple) else wrap(out)


def ids(op: str, logits: Any, options: dict[str, Any]) -> Tensor:
    """``run(op, (logits,), options)`` for ``argmax`` and ``sample`` outside a compiled graph:
    a call on one plain tensor without a group finds its plan by the call as passed
    (``plans.direct_key``), with the per-call checks of its seed, and goes straight to the
    backend; any other call takes ``run``. The first call of a key is planned by
    ``plans.plan_for``, as ``run`` plans it."""
    key = plans.direct_key(op, logits, options)
    if key is None:
        return run(op, (logits,), options)
    direct = plans.direct_plan(key)
    if direct is None:
        plan = plans.plan_for(Invocation(op, (logits,), options))
        # made again: the first call of a process loads the plugins, which changes the key
        plans.keep_direct(plans.direct_key(op, logits, options) or key, plan, logits)
        return _no_grad_ids(plan, plan.call(None, options), logits)
    plan = direct.plan
    failure = checks.per_call_failure(plan.spec, options, None)
    if failure is not None:
        raise failure
    call = direct.call or plan.call(None, options)
    if direct.as_is and not logits.requires_grad:  # the common decode step: straight to the backend
        return plan.backend.forward(call, (logits,), None, None)[0]
    return _no_grad_ids(plan, call, logits)


def _no_grad_ids(plan: plans.Plan, call: Any, logits: Tensor) -> Tensor:
    with torch.no_grad():  # ids have no gradient: no graph of the backend's ops
        return _ids(plan, call, logits).view(plan.lead)


_eager = torch.compiler.disable(run)  # a call with sp_group inside a compiled function runs eagerly


def execute(plan: plans.Plan, tensors: tuple, options: Mapping[str, Any]) -> Tensor | tuple[Tensor, Tensor]:
    """Run a planned call on this call's tensors; ``options``: its options as passed."""
    spec, n = plan.spec, plan.num_tokens
    n_inputs = len(spec.inputs)
    index, mask = inputs.index_and_mask(spec, plan.topk, n, tensors[n_inputs] if spec.index else None, options)
    # a backend that reduces itself (on logits, with tokens) makes the result in its kernels
    reduction = "none"
    if n and plan.head_rows is None and reduces(plan.backend, spec.name):
        reduction = backend_reduction(options, plan.topk, plan.backend.reduces_pairs)
    call = plan.call(options.get("tp_group"), options, reduction)
    inputs_ = tensors[:n_inputs]
    if spec.returns_ids:  # argmax, sample: token ids, no gradient
        with torch.no_grad():
            return _ids(plan, call, inputs_[0]).view(plan.lead)
    if n == 0:  # no rank has a token: nothing to compute or communicate
        parts = [p for x in inputs_ for p in ((x.hidden, x.weight, x.bias) if isinstance(x, Head) else (x,))]
        values = autograd.no_tokens(call, _empty_values_shape(plan, index), tuple(parts))
    elif plan.head_rows is not None:
        assert isinstance(plan.backend, TakesHead)  # dispatch gave Head inputs to a backend taking them
        scalar = head_reduction(options) != "none"
        upstream = None
        if scalar:  # the gradients computed in forward are for what a plain backward sends
            upstream = plain_upstream(options, index, mask, n, value_dtype(inputs_[0].dtype), inputs_[0].device)
        values = head_chunks.run_head_values(
            plan.backend, call, inputs_, index, mask, scalar, plan.head_rows, plan.sequence, upstream
        )
    else:
        values = autograd.run_logits(plan.backend, call, inputs_, index, mask)
        if reduction != "none":  # the backend's 0-dim result, or [2] with the entropy
            if values.dim():
                lp, h = values.unbind(0)
                return lp, h
            return values
    return finish(values, plan.lead, plan.topk, index, mask, options)


def _ids(plan: plans.Plan, call: Any, x: Any) -> Tensor:
    """The ids an op returning them gives for logits ``x``, or for a Head chunk by chunk."""
    n, layout = plan.num_tokens, plan.backend.input_layout
    if not isinstance(x, Head):
        if n == 0:
            return torch.zeros(0, dtype=torch.int64, device=x.device)
        return plan.backend.forward(call, (autograd.rows(x, n, layout),), None, None)[0]
    assert plan.head_rows is not None  # planned with a Head
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=x.weight.device)
    return head_chunks.run_head_ids(plan.backend, call, x, plan.head_rows, plan.sequence)


def fail(exc: Exception, options: Mapping[str, Any], device: torch.device | None) -> NoReturn:
    """Raise ``exc``, met on this rank before a call, on every rank of the call's
    ``tp_group`` (through its metadata gather) and then of its ``sp_group``."""
    try:
        metadata.fail(exc, options.get("tp_group"), device)
    except Exception as raised:
        sequence.fail(raised, options.get("sp_group"), device)


def _empty_values_shape(plan: plans.Plan, index: Tensor | None) -> tuple[int, ...]:
    return values_shape(0, index, plan.topk, bool(plan.backend_options.get("return_entropy")))


# -- explain --------------------------------------------------------------------------------


def explain(op: str, tensors: tuple, options: dict[str, Any], gather: bool = False) -> dispatch.Explanation:
    """Which backend ``run(op, tensors, options)`` would use and why not the others; see
    ``vtp.explain``."""
    tensors, options, _, failure = inputs.normalize(op, tensors, options)
    group = options.get("tp_group")
    world = group_size(group) if is_group(group) else 1
    if gather and world > 1:
        checked, _, shards, _, _ = plans.gathered(Invocation(op, tensors, options, failure=failure))
        ex = dispatch.explain_request(
            plans.request_of(checked, shards, False), shards, checked.forced, checked.forced_by
        )
        return _with_head_logits(ex, checked)
    if failure is not None:
        raise failure
    checked = checks.this_rank(Invocation(op, tensors, options))
    n, v_local = math.prod(checked.lead), checked.inputs[0].shape[-1]
    start, vocab_size = checked.options["vocab_start"], checked.options["global_vocab_size"]
    if world == 1:
        shards = metadata.single_rank_shards(v_local, start, vocab_size, n)
        ex = dispatch.explain_request(
            plans.request_of(checked, shards, False), shards, checked.forced, checked.forced_by
        )
        return _with_head_logits(ex, checked)
    rank = group_rank(group)
    assumed = metadata.alike_shards(rank, world, v_local, start, vocab_size, n)
    ex = dispatch.explain_request(plans.request_of(checked, assumed, False), None, checked.forced, checked.forced_by)
    ex.view = (
        f"this rank's view: rank {rank} of {world}, other ranks assumed alike "
        f"(shards {'even' if assumed.even_shards else 'uneven'}); explain(..., gather=True) on every rank "
        f"checks them all"
    )
    return _with_head_logits(ex, checked)


def _with_head_logits(ex: dispatch.Explanation, checked: checks.CheckedCall) -> dispatch.Explanation:
    """How the selected backend computes the logits of this rank's Head inputs."""
    parts = [(h.hidden, h.weight, h.bias) for h in checked.heads or () if h is not None]
    return dispatch.with_head_logits(ex, checked.options, parts)
