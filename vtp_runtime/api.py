"""The public API: ``loss`` and the typed helpers, ``explain``.

Every call: validate locally (with a TP group, a local error is held until after the gather,
so that no rank is left waiting in it), gather the metadata of every rank in one collective,
validate the gathered table, pick the backend, run it under one autograd Function, reduce.
Outputs are replicated on every rank. All but the last two steps are made once per call
signature and kept as a plan (``vtp_runtime.plan``); inside ``torch.compile`` a call is one
custom op (``vtp_runtime.library``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from . import dispatch, head, inputs, plan, second_order, shards, topk
from .backend import Backend, Call, Request, SavedState, meets_layout
from .errors import UnknownBackend
from .ops import COMMON_OPTIONS, OPS, OpSpec, check_options, features_of, get_spec, normalize_options
from .registry import REGISTRY

Tensor = torch.Tensor
Logits = Tensor | head.Head  # logits [..., V_local], or a lazy hidden @ weight.T shard


class _Prepared:
    """A call after local validation and the metadata gather: what selection and the run need."""

    spec: OpSpec
    inputs: tuple[Tensor, ...]
    index: Tensor | None
    options: dict[str, Any]
    lead: tuple[int, ...]
    topk: bool
    needs_grad: tuple[bool, ...]
    request: Request
    layout: shards.Layout
    forced: str | None
    forced_by: str
    heads: Any  # head.stand_ins' description of Head inputs, or None
    metadata: Any
    __slots__ = (
        "spec",
        "inputs",
        "index",
        "options",
        "lead",
        "topk",
        "needs_grad",
        "request",
        "layout",
        "forced",
        "forced_by",
        "heads",
        "metadata",
    )


def _local_checks(spec: OpSpec, inputs, index, options) -> None:
    """Raise ValueError/TypeError describing what is wrong with this rank's arguments."""
    check_options(spec, options)
    logits = inputs[0]
    for name, t in zip(spec.inputs, inputs):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
        if t.dim() < 1:
            raise ValueError(f"{name} must have a vocabulary dimension: shape [..., V_local]")
    if len(inputs) == 2:
        student, teacher = inputs
        if student.shape != teacher.shape:
            raise ValueError(
                f"student_logits {tuple(student.shape)} and teacher_logits "
                f"{tuple(teacher.shape)} must have the same shape"
            )
        if student.dtype != teacher.dtype:
            raise TypeError(
                f"student_logits ({student.dtype}) and teacher_logits ({teacher.dtype}) must have the same dtype"
            )
        if student.device != teacher.device:
            raise ValueError(
                f"student_logits ({student.device}) and teacher_logits ({teacher.device}) must be on the same device"
            )
    lead = tuple(logits.shape[:-1])
    extra = {spec.index: index} if spec.index else {"mask": options.get("mask"), "labels": options.get("labels")}
    for name, t in extra.items():
        if t is None:
            if spec.index:
                raise TypeError(f"{spec.name} needs {name}")
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != logits.device:
            raise ValueError(f"{name} ({t.device}) must be on the logits' device ({logits.device})")
        if name == "mask":
            if t.dtype != torch.bool:
                raise TypeError(f"mask must be a bool tensor (True = keep), got {t.dtype}")
        elif t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
        shapes = [lead, lead + tuple(t.shape[-1:])] if name == "index" and t.dim() == len(lead) + 1 else [lead]
        if tuple(t.shape) not in shapes:
            want = "logits.shape[:-1] or logits.shape[:-1] + (k,)" if name == "index" else "logits.shape[:-1]"
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want} = {lead}")
    start, end = options["vocab_start"], options["vocab_end"]
    if (start is None) != (end is None):
        raise ValueError("pass both vocab_start and vocab_end, or neither (rank order is the default)")
    if start is not None:
        v_local = logits.shape[-1]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start and end - start == v_local):
            raise ValueError(
                f"vocab_start={start}, vocab_end={end} must be ints with 0 <= vocab_start "
                f"and vocab_end - vocab_start == V_local = {v_local}"
            )
    gv = options["global_vocab_size"]
    if gv is not None and not (isinstance(gv, int) and gv > 0):
        raise ValueError(f"global_vocab_size must be a positive int, got {gv!r}")
    forced = options["backend"]
    if forced is not None and not isinstance(forced, str):
        raise TypeError(f"backend must be a backend name (str), got {type(forced).__name__}")


def _fingerprint(spec: OpSpec, options, index, topk: bool, needs_grad, lead_ndim: int) -> str:
    """``name=value|...`` of everything about a call that every rank must agree on (beyond the
    shapes and dtypes gathered on their own); shown per option when ranks disagree."""
    parts = [
        f"op={spec.name}",
        f"top-k size={index.shape[-1] if topk else 0}",
        f"requires_grad={needs_grad}",
        f"mask={options.get('mask') is not None}",
        f"labels={options.get('labels') is not None}",
        f"leading dims={lead_ndim}",
    ]
    for name in sorted(options):
        if name in ("tp_group", "mask", "labels", "backend", "vocab_start", "vocab_end", "global_vocab_size"):
            continue  # compared elsewhere, or per rank by nature
        value = options[name]
        # a tensor normalizer is compared by kind only: reading its value would sync the device
        parts.append(f"{name}={'<tensor>' if isinstance(value, torch.Tensor) else repr(value)}")
    return "|".join(parts)


# every option of each op with its default, built once (this is on every call's path)
_DEFAULTS = {name: {**COMMON_OPTIONS, **spec.options} for name, spec in OPS.items()}


def _check_arguments(op: str, tensors: tuple, given: dict[str, Any]) -> None:
    """The number of tensors and the option names."""
    spec = get_spec(op)
    n_expected = len(spec.inputs) + (1 if spec.index else 0)
    if len(tensors) != n_expected:
        names = ", ".join(spec.inputs + ((spec.index,) if spec.index else ()))
        raise TypeError(f"{op} takes {n_expected} tensor argument(s) ({names}), got {len(tensors)}")
    allowed = _DEFAULTS[spec.name]
    unknown = sorted(given.keys() - allowed.keys())
    if unknown:
        raise TypeError(f"{op} got unknown option(s) {', '.join(unknown)}; it takes: {', '.join(allowed)}")


class Traced:
    """What a call made from a ``torch.compile``'d graph (``vtp_runtime.library``) fixed when
    it was traced: which inputs need gradients (inside the op nothing requires grad) and the
    forced backend."""

    __slots__ = ("needs_grad", "forced", "forced_by")

    def __init__(self, needs_grad: tuple[bool, ...], forced: str | None, forced_by: str) -> None:
        self.needs_grad, self.forced, self.forced_by = needs_grad, forced, forced_by


def _local(op: str, tensors: tuple, given: dict[str, Any], traced: Traced | None = None) -> _Prepared:
    """Everything this rank can check and look up on its own; raises on a bad call."""
    spec = get_spec(op)
    _check_arguments(op, tensors, given)
    options = {**_DEFAULTS[spec.name], **given}
    normalize_options(options, given)
    inputs = tuple(tensors[: len(spec.inputs)])
    index = tensors[len(spec.inputs)] if spec.index else None

    p = _Prepared()
    p.spec, p.options, p.index = spec, options, index
    # Head inputs (vtp_runtime/head.py) are checked and validated through logits stand-ins
    p.heads, inputs = head.stand_ins(inputs, spec.inputs)
    _local_checks(spec, inputs, index, options)
    p.inputs = inputs
    p.lead = tuple(inputs[0].shape[:-1])
    p.topk = spec.name == "logprobs" and index is not None and index.dim() == len(p.lead) + 1
    grad_on = torch.is_grad_enabled()
    p.needs_grad = tuple(grad_on and t.requires_grad for t in inputs)
    p.forced, p.forced_by = dispatch.forced_backend(spec.name, options["backend"])
    if traced is not None:
        p.needs_grad, p.forced, p.forced_by = traced.needs_grad, traced.forced, traced.forced_by
    registered = REGISTRY.backends()  # under VTP_STRICT_PLUGINS=1, a plugin that failed raises here
    if p.forced is not None and p.forced not in registered:
        raise UnknownBackend(
            f"unknown backend {p.forced!r} (from {p.forced_by}); registered backends: {', '.join(sorted(registered))}"
        )
    return p


def _local_call(p: _Prepared, compiled: bool) -> shards.LocalCall:
    """This rank's part of the metadata gather."""
    logits, options = p.inputs[0], p.options
    device = logits.device
    checksums = None
    if shards.check_enabled():
        normalizer = options["normalizer"]
        checksums = shards.checksums(
            p.index if p.spec.index else options["labels"],
            options.get("mask"),
            normalizer if isinstance(normalizer, Tensor) else None,
            device,
        )
    return shards.LocalCall(
        op=p.spec.name,
        v_local=logits.shape[-1],
        vocab_start=options["vocab_start"],
        vocab_end=options["vocab_end"],
        global_vocab_size=options["global_vocab_size"],
        num_tokens=math.prod(p.lead),
        dtype=logits.dtype,
        device_type=device.type,
        options_fingerprint=(
            _fingerprint(p.spec, options, p.index, p.topk, p.needs_grad, len(p.lead))
            + head.fingerprint(p.heads)
            + ("|torch.compile=True" if compiled else "")
        ),
        forced=p.forced,
        forced_by=p.forced_by,
        available=dispatch.local_availability(device.type),
        checksums=checksums,
    )


def _device_of(tensors: tuple) -> torch.device | None:
    first = tensors[0] if tensors else None
    return first.device if isinstance(first, Tensor) else None


def _gather(
    op: str, tensors: tuple, given: dict[str, Any], group, table: list[list[int]] | None, traced: Traced | None
) -> tuple[_Prepared, shards.Layout]:
    """``_local``, then the metadata gather and its checks. Any local failure, of any type,
    travels through the gather as a flag instead of being raised before it (which would leave
    the other ranks waiting in the gather forever); then every rank raises, this one its own
    exception. ``table``: this call's table, gathered already (by a planned call whose
    gathered table was not the planned one)."""
    p: _Prepared | None = None
    local: shards.LocalCall | None = None
    failure: Exception | None = None
    try:
        p = _local(op, tensors, given, traced)
        local = _local_call(p, traced is not None)
        row = shards.pack(local, group, p.inputs[0].device)
    except Exception as exc:  # whatever it is, every rank must still reach the gather
        failure, row = exc, shards.pack_failure(group, _device_of(tensors))
    if table is None:
        table = shards.gather(row, group)
    layout = shards.validate(table, local, group, row.device, failure)
    # validate raised on every rank if any rank failed before the gather
    assert p is not None and local is not None
    if local.checksums is None:
        p.metadata = (row, table)
    else:  # a plan gathers again without this call's checksums (see _planned); no table matches it
        p.metadata = (shards.pack(dataclasses.replace(local, checksums=None), group, row.device), None)
    return p, layout


def _request(
    p: _Prepared,
    tp_size: int,
    vocab_size: int,
    num_tokens: int,
    even_shards: bool,
    empty_shard: bool,
    compiled: bool = False,
) -> Request:
    logits = p.inputs[0]
    return Request(
        op=p.spec.name,
        device_type=logits.device.type,
        dtype=logits.dtype,
        tp_size=tp_size,
        vocab_size=vocab_size,
        num_tokens=num_tokens,
        even_shards=even_shards,
        empty_shard=empty_shard,
        features=features_of(p.spec.name, p.options, topk=p.topk, teacher_grad=len(p.inputs) == 2 and p.needs_grad[1]),
        head_inputs=p.heads is not None,
        head_per_token=p.heads is not None and _head_reduction(p.options) == "none",
        compiled=compiled,
    )


def _head_reduction(options) -> str:
    """How a call with Head inputs runs: per token (``"none"``: gradients in backward) or as a
    scalar (gradients during forward, for one upstream number). ``return_entropy`` gives two
    outputs reduced apart, so its upstream gradient is not one number: per token."""
    return "none" if options.get("return_entropy") else options.get("reduction", "none")


def _prepare(
    op: str, tensors: tuple, given: dict[str, Any], table: list[list[int]] | None = None, traced: Traced | None = None
) -> _Prepared:
    group = given.get("tp_group")
    if shards.group_size(group) == 1:  # the hot path of single-device training: no gather
        p = _local(op, tensors, given, traced)
        layout = shards.single_rank_layout(
            p.inputs[0].shape[-1], p.options["vocab_start"], p.options["global_vocab_size"], math.prod(p.lead)
        )
        p.metadata = None
    else:
        p, layout = _gather(op, tensors, given, group, table, traced)
    p.layout = layout
    p.request = _request(
        p,
        layout.tp_size,
        layout.vocab_size,
        layout.num_tokens,
        layout.even_shards,
        0 in layout.sizes,
        compiled=traced is not None,
    )
    return p


def _rows(t: Tensor, n: int, layout: str) -> Tensor:
    """``[..., V]`` in the backend's declared ``input_layout``: a view of ``t`` (``[N, V]``,
    or ``t`` itself as ``[A, B, V]`` where the layout allows it) when one fits, else a
    contiguous ``[N, V]`` copy. The only copy of the inputs the core makes."""
    try:
        rows = t.view(n, t.shape[-1])
    except RuntimeError:  # the leading dims have no single stride, e.g. logits[:, :-1]
        rows = t
    if meets_layout(rows, layout):
        return rows
    return t.contiguous().view(n, t.shape[-1])


class _VocabParallelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend: Backend, call: Call, index, mask, *inputs):
        values, state = backend.forward(call, inputs, index, mask)
        ctx.backend, ctx.call, ctx.state_type = backend, call, _state_type(backend, state)
        saved = () if state is None else state.tensors()
        ctx.save_for_backward(*saved)
        ctx.links = second_order.graph_links(inputs, saved)
        return values

    @staticmethod
    def backward(ctx, grad):
        links = (*ctx.saved_tensors, *ctx.links, grad)
        return second_order.gradients(ctx.call.op, lambda: _backward(ctx, grad), 4, links)


def _backward(ctx, grad):
    state = None if ctx.state_type is None else ctx.state_type.from_tensors(ctx.saved_tensors)
    grads = ctx.backend.backward(ctx.call, state, grad.contiguous())
    return (None, None, None, None, *grads)


def _state_type(backend: Backend, state) -> type[SavedState] | None:
    if state is None:
        return None
    if not isinstance(state, SavedState):
        raise TypeError(
            f"backend {backend.name!r}: forward must return (values, state) with state a "
            f"vtp_runtime.SavedState dataclass or None, got {type(state).__name__}"
        )
    return type(state)


class _Plan:
    """What every call with one signature shares (see ``vtp_runtime.plan``): the backend,
    the ``Call`` it gets, and how the per-call tensors are shaped around it."""

    spec: OpSpec
    backend: Backend
    call: Call
    n: int
    n_inputs: int
    lead: tuple[int, ...]
    out_shape: tuple[int, ...] | None
    topk: bool
    ignore_index: int
    metadata: Any
    state_type: Any
    heads: Any
    stand_ins: tuple[Tensor, ...]
    max_v_local: int
    __slots__ = (
        "spec",
        "backend",
        "call",
        "n",
        "n_inputs",
        "lead",
        "out_shape",
        "topk",
        "ignore_index",
        "metadata",
        "state_type",
        "heads",
        "stand_ins",
        "max_v_local",
    )


def _make_plan(p: _Prepared) -> _Plan:
    spec, options, layout = p.spec, p.options, p.layout
    backend = dispatch.select(p.request, layout, p.forced, p.forced_by)
    call_options = {k: options[k] for k in spec.options if k not in ("mask", "labels")}
    call_options["temperature"] = float(options["temperature"])
    made = _Plan()
    made.spec, made.backend, made.n, made.n_inputs = spec, backend, layout.num_tokens, len(spec.inputs)
    made.call = Call(
        request=p.request,
        group=options["tp_group"],
        rank=layout.rank,
        vocab_start=layout.vocab_start,
        vocab_end=layout.vocab_end,
        options=call_options,
        needs_grad=p.needs_grad,
        topk=p.topk,
    )
    made.lead, made.topk, made.metadata, made.state_type = p.lead, p.topk, p.metadata, None
    made.ignore_index = options.get("ignore_index", -100)
    # the backend returns [N] (or [N, k]); a view back to the leading dims only where they
    # differ (lead is () for 1-D logits: one token)
    made.out_shape = None if len(p.lead) == 1 else p.lead + _topk_dims(p.index, p.topk)
    # Head inputs (never planned: see plan.signature) run through head.run_call
    made.heads, made.stand_ins, made.max_v_local = p.heads, p.inputs, max(layout.sizes)
    return made


def _execute(made: _Plan, tensors: tuple, options: dict[str, Any]) -> Tensor | tuple[Tensor, Tensor]:
    """Run a planned call on this call's tensors; ``options`` as given (defaults may be absent)."""
    spec, n, backend = made.spec, made.n, made.backend
    index = mask = None
    if spec.index:
        index = tensors[made.n_inputs]
        index = index.reshape(n, index.shape[-1]) if made.topk else index.reshape(n)
        index = index.long()
    else:
        mask, labels = options.get("mask"), options.get("labels")
        if mask is not None:
            mask = mask.reshape(n)
        if labels is not None:
            keep = labels.reshape(n) != made.ignore_index
            mask = keep if mask is None else mask & keep
    if made.heads is not None:
        values = head.run_call(
            backend, made.call, made.heads, made.stand_ins, index, mask, _head_reduction(options), made.max_v_local
        )
    else:
        rows = tuple(_rows(t, n, backend.input_layout) for t in tensors[: made.n_inputs])
        values = _VocabParallelFunction.apply(backend, made.call, index, mask, *rows)
    if made.call.options.get("return_entropy"):
        assert index is not None  # return_entropy is an option of logprobs, which takes an index
        return _logprobs_and_entropy(values, made.lead, made.topk, index, options, made.ignore_index)
    if made.out_shape is not None:
        values = values.view(made.out_shape)
    return _reduce(values, options, index, mask, made.ignore_index)


def _run(p: _Prepared) -> Tensor | tuple[Tensor, Tensor]:
    return _execute(_make_plan(p), p.inputs + ((p.index,) if p.spec.index else ()), p.options)


def _call(op: str, tensors: tuple, given: dict[str, Any]) -> Tensor | tuple[Tensor, Tensor]:
    return _execute(_planned(op, tensors, given), tensors, given)


def _planned(op: str, tensors: tuple, given: dict[str, Any], traced: Traced | None = None) -> _Plan:
    """The plan of a call (see ``vtp_runtime.plan``): the first call of a signature is
    checked and planned in full, later ones reuse the plan. With a TP group, whether the
    metadata is gathered again depends on ``plan.metadata_mode``."""
    if traced is None:
        forced = dispatch.forced_backend(op, given.get("backend"))
        grads = None
    else:
        forced, grads = (traced.forced, traced.forced_by), traced.needs_grad
    key = None
    if type(forced[0]) in (str, type(None)):
        key = plan.signature(op, tensors, given, forced, REGISTRY.version, grads)
    found = None if key is None else plan.lookup(key)
    table = None
    if found is not None:
        if found.metadata is None:  # a single rank: nothing to agree on
            return found
        row, planned_table = found.metadata
        mode = plan.metadata_mode(row.device.type == "cpu")
        if mode == "once":
            return found
        if mode == "gather":  # on the host: every rank gathers once per call, whatever it holds
            table = shards.gather(row, found.call.group)
            if table == planned_table:
                return found
    version = REGISTRY.version
    made = _make_plan(_prepare(op, tensors, given, table, traced))
    if key is not None:
        if REGISTRY.version != version:  # the first call loaded the plugins
            key = plan.signature(op, tensors, given, forced, REGISTRY.version, grads)
            assert key is not None  # only the registry version changed, which any key can hold
        plan.store(key, made)
    return made


def _topk_dims(index: Tensor | None, topk: bool) -> tuple[int, ...]:
    """The trailing dims of a per-token result: ``(k,)`` for top-k log-probs, else none."""
    if not topk:
        return ()
    assert index is not None  # top-k is logprobs with an [..., k] index
    return (index.shape[-1],)


def _logprobs_and_entropy(
    values: Tensor, lead: tuple, topk: bool, index: Tensor, options, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """``logprobs`` with ``return_entropy``: the backend's ``[N, k + 1]`` values split into the
    log-probs and the entropy, each reduced by the same rules. For ``reduction="mean"`` an
    entropy counts where some entry of its token's index is not ``ignore_index``."""
    lp, h = values[:, :-1], values[:, -1]
    lp = lp.reshape(*lead, lp.shape[1]) if topk else lp.reshape(lead)
    kept = (index != ignore_index).any(1) if topk else index != ignore_index
    return (
        _reduce(lp, options, index, None, ignore_index),
        _reduce(h.reshape(lead), options, None, kept, ignore_index),
    )


def _reduce(values: Tensor, options, index, mask, ignore_index: int) -> Tensor:
    reduction, normalizer = options.get("reduction", "none"), options.get("normalizer")
    total = values if reduction == "none" else values.sum()
    if normalizer is not None:
        if isinstance(normalizer, torch.Tensor):
            normalizer = normalizer.to(device=total.device, dtype=total.dtype).reshape(())
            # not read on the host (no sync): a count that is not finite and > 0 gives NaN
            normalizer = torch.where((normalizer > 0) & (normalizer < math.inf), normalizer, math.nan)
        elif not 0 < normalizer < math.inf:
            # a planned call reuses the checks of its signature; a number normalizer is per-call
            # data, checked here, after the backend's collectives, so that a rank raising alone
            # leaves no other rank waiting
            raise ValueError(f"normalizer must be a finite number > 0 (e.g. num_items_in_batch), got {normalizer!r}")
        return total / normalizer
    if reduction != "mean":
        return total
    # mean over unmasked tokens (index entries for top-k log-probs); 0 when all are masked
    if index is not None:
        count = (index != ignore_index).sum()
    elif mask is not None:
        count = mask.sum()
    else:
        # a fill on the device: torch.tensor(n, device=cuda) would wait for the stream
        count = torch.full((), values.numel(), device=values.device)
    return total / count.clamp(min=1).to(total.dtype)


# -- public functions ----------------------------------------------------------------------


def loss(op: str, *tensors: Any, **options: Any) -> Any:
    """Compute ``op`` on vocabulary-sharded logits; see the typed helpers for each op.

    ``tensors`` are the op's inputs in order (logits [, labels/index] or student, teacher),
    each rank passing its local ``[..., V_local]`` shard, or a ``vtp.Head`` standing for it
    (``hidden @ weight_shard.T + bias``, never formed in full; see ``vtp_runtime/head.py``).
    The result is fp32 (fp64 for fp64 inputs), shaped ``logits.shape[:-1]`` (``+ (k,)`` for
    top-k log-probs) or a scalar when reduced, and identical on every rank of ``tp_group``.
    DTensor logits give a DTensor result on their mesh (see ``vtp_runtime.inputs``).
    ``logprobs`` with ``return_entropy=True`` gives a pair ``(logprobs, entropy)``.
    """
    if op in OPS and OPS[op].returns_ids:
        raise TypeError(f"{op} returns token ids, not a loss: call vtp.{op}(logits, ...)")
    if torch.compiler.is_compiling():  # traced by dynamo: one opaque custom op per call
        from .library import traced_loss

        return traced_loss(op, tensors, options)
    if op == "kl" and len(tensors) == 2 and isinstance(tensors[1], topk.TopK):
        return topk.kl(*tensors, **options)
    tensors, options, wrap = inputs.normalize(op, tensors, options)
    out = _call(op, tensors, options)
    if wrap is None:
        return out
    return tuple(map(wrap, out)) if isinstance(out, tuple) else wrap(out)


def explain(op: str, *tensors: Any, gather: bool = False, **options: Any) -> dispatch.Explanation:
    """Which backend ``loss(op, *tensors, **options)`` would use and why not the others.

    By default this rank's view, with no communication, so it may be called on one rank only
    (``if rank == 0: print(vtp.explain(...))``): the other ranks' shards are assumed to be like
    this one's (rank order, equal sizes) unless ``global_vocab_size`` or ``vocab_start`` say
    otherwise, and their backends like this rank's. ``gather=True`` gathers the metadata as
    ``loss`` does and gives the verdict of the real call, the same on every rank: then, like
    ``loss``, every rank of ``tp_group`` must call it. With a ``vtp.TopK`` teacher, ``kl``'s
    verdict is that of the student's top-k log-probs, the one op it runs.
    """
    if op == "kl" and len(tensors) == 2 and isinstance(tensors[1], topk.TopK):
        return topk.explain(*tensors, gather=gather, **options)
    tensors, options, _ = inputs.normalize(op, tensors, options)
    group = options.get("tp_group")
    world = shards.group_size(group)
    if gather or world == 1:
        p = _prepare(op, tensors, options)
        return dispatch.explain_request(p.request, p.layout, p.forced, p.forced_by)
    p = _local(op, tensors, options)
    v_local, rank = p.inputs[0].shape[-1], shards.group_rank(group)
    start, given = p.options["vocab_start"], p.options["global_vocab_size"]
    vocab_size = v_local * world if given is None else given
    even = vocab_size == v_local * world and start in (None, rank * v_local)
    request = _request(p, world, vocab_size, math.prod(p.lead), even, v_local == 0)
    ex = dispatch.explain_request(request, None, p.forced, p.forced_by)
    ex.view = (
        f"this rank's view: rank {rank} of {world}, other ranks assumed alike "
        f"(shards {'even' if even else 'uneven'}); explain(..., gather=True) on every rank "
        f"checks them all"
    )
    return ex


def cross_entropy(
    logits: Logits,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    **options: Any,
) -> Tensor:
    """Cross entropy of ``logits`` [..., V_local] against global ``labels`` [...] (int).

    ``(1-e)(lse - x[y]) + e(lse - mean_j x_j) + z_loss * lse^2`` with ``x = logits / T`` and
    the mean over the global vocabulary. ``ignore_index`` tokens give exactly 0.
    """
    return loss(
        "cross_entropy",
        logits,
        labels,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        **options,
    )


def logprobs(
    logits: Logits, index: Tensor, *, ignore_index: int = -100, return_entropy: bool = False, **options: Any
) -> Tensor | tuple[Tensor, Tensor]:
    """``log softmax(logits / T)`` at global vocabulary ids ``index`` (int, ``[...]`` or
    ``[..., k]``): shaped like ``logits.shape[:-1]`` or with a trailing top-k dimension;
    entries equal to ``ignore_index`` give 0.

    ``return_entropy=True`` returns ``(logprobs, entropy)`` from one read of the logits,
    ``entropy = -sum p log p`` of ``softmax(logits / T)`` shaped ``logits.shape[:-1]``, both
    differentiable (e.g. ``(lp * adv).sum() + c * ent.sum()``). A token's entropy is 0 when
    every entry of its index is ``ignore_index`` (the one entry of an ``[...]`` index, all k
    of an ``[..., k]`` one). ``reduction`` and ``normalizer`` apply to both outputs alike:
    ``"sum"`` sums each, ``normalizer`` divides each; ``"mean"`` divides the log-probs by
    their count of non-ignored entries and the entropy by its count of unmasked tokens.
    Both are replicated on every rank of ``tp_group``."""
    return loss("logprobs", logits, index, ignore_index=ignore_index, return_entropy=return_entropy, **options)


def entropy(logits: Logits, **options: Any) -> Tensor:
    """Entropy ``-sum p log p`` of ``softmax(logits / T)`` over the global vocabulary.
    Takes ``mask=`` (bool, True = keep) or ``labels=`` with ``ignore_index``."""
    return loss("entropy", logits, **options)


def kl(
    student_logits: Logits,
    teacher_logits: Logits | topk.TopK,
    *,
    reverse: bool = False,
    tail: bool = False,
    **options: Any,
) -> Tensor:
    """Forward ``KL(p_teacher || p_student)``, or reverse ``KL(p_student || p_teacher)``.

    A teacher given as ``vtp.TopK(logprobs, index)`` (its top-k log-probs and global ids,
    ``[..., k]``, replicated) gives the KL over those k ids, with ``tail=True`` plus the
    residual-mass term ``r_t log(r_t / r_s)``; see ``vtp_runtime.topk``."""
    if isinstance(teacher_logits, topk.TopK):
        return topk.kl(student_logits, teacher_logits, reverse=reverse, tail=tail, **options)
    if tail is not False:
        raise ValueError(
            "tail= applies to a teacher given as vtp.TopK(logprobs, index); with dense "
            "teacher logits the KL already covers the whole vocabulary"
        )
    return loss("kl", student_logits, teacher_logits, reverse=reverse, **options)


def jsd(student_logits: Logits, teacher_logits: Logits, *, beta: float = 0.5, **options: Any) -> Tensor:
    """Generalized JSD ``b KL(p_t||M) + (1-b) KL(p_s||M)``, ``M = b p_t + (1-b) p_s``;
    ``beta=0`` is forward KL(teacher||student), ``beta=1`` reverse KL(student||teacher)."""
    return loss("jsd", student_logits, teacher_logits, beta=beta, **options)
