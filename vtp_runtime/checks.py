"""This rank's checks of a call: what it can verify and look up on its own, before any
collective.

Everything here raises ``ValueError``/``TypeError`` (or ``UnknownBackend``) saying what to
change; the caller (``vtp_runtime.plans``) routes a failure through the metadata gather so
that every rank of the group raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import dispatch, head
from .comm import group_size, is_group
from .errors import UnknownBackend
from .head import Head
from .invocation import Check, Invocation
from .ops import OpSpec, check_options, get_spec, normalize_options
from .registry import REGISTRY

Tensor = torch.Tensor


@dataclass(frozen=True)
class CheckedCall:
    """A call after this rank's own checks: what the metadata gather and dispatch need."""

    spec: OpSpec
    options: Mapping[str, Any]  # every option of the op, defaults filled in
    inputs: tuple[Tensor, ...]  # the logits, or a stand-in (shape, dtype, device) for each Head
    heads: tuple[Head | None, ...] | None  # per input, its Head (None for logits); None: no Head
    index: Tensor | None
    lead: tuple[int, ...]  # the logits' leading (token) dims
    topk: bool  # logprobs with an [..., k] index
    needs_grad: tuple[bool, ...]  # per floating input
    forced: str | None
    forced_by: str
    # a sequence-parallel Head at TP > 1: its hidden's local token shape, and whether another
    # input covers every rank's tokens (else lead[0] is this rank's and the gather sums them)
    sequence: tuple[int, ...] | None = None
    covered: bool = True


def check_arguments(spec: OpSpec, tensors: tuple, options: Mapping[str, Any]) -> None:
    """The number of tensors and the option names (``options`` as passed)."""
    if len(tensors) != spec.n_tensors:
        names = ", ".join(spec.inputs + ((spec.index,) if spec.index else ()))
        raise TypeError(f"{spec.name} takes {spec.n_tensors} tensor argument(s) ({names}), got {len(tensors)}")
    unknown = sorted(options.keys() - spec.options.keys())
    if unknown:
        raise TypeError(f"{spec.name} got unknown option(s) {', '.join(unknown)}; it takes: {', '.join(spec.options)}")


def this_rank(invocation: Invocation) -> CheckedCall:
    """Everything this rank can check and look up on its own about ``invocation``; raises on a
    bad invocation."""
    spec, tensors = get_spec(invocation.op), invocation.tensors
    check_arguments(spec, tensors, invocation.options)
    options = {**spec.defaults, **invocation.options}
    normalize_options(spec, options, invocation.options)
    index = tensors[len(spec.inputs)] if spec.index else None
    group = options["tp_group"]
    world = group_size(group) if is_group(group) else 1
    inputs = tensors[: len(spec.inputs)]
    tokens = _covering_tokens(inputs, index, options) if world > 1 else None
    # Head inputs are checked and validated through stand-ins of their logits
    heads, logits = head.stand_ins(inputs, spec.inputs, world=world, tokens=tokens)
    sequence = head.sequence_tokens(heads) if world > 1 else None
    check_tensors(spec, logits, index, options)
    lead = tuple(logits[0].shape[:-1])
    grad_on = torch.is_grad_enabled()
    needs_grad = tuple(grad_on and t.requires_grad for t in logits)
    forced, forced_by = invocation.traced_backend or dispatch.forced_backend(spec.name, options["backend"])
    if invocation.traced_needs_grad is not None:
        needs_grad = invocation.traced_needs_grad
    registered = REGISTRY.backends()  # under VTP_STRICT_PLUGINS=1, a plugin that failed raises here
    if forced is not None and forced not in registered:
        raise UnknownBackend(
            f"unknown backend {forced!r} (from {forced_by}); registered backends: {', '.join(sorted(registered))}"
        )
    return CheckedCall(
        spec=spec,
        options=options,
        inputs=logits,
        heads=heads,
        index=index,
        lead=lead,
        topk=spec.name == "logprobs" and index is not None and index.dim() == len(lead) + 1,
        needs_grad=needs_grad,
        forced=forced,
        forced_by=forced_by,
        sequence=sequence,
        covered=sequence is None or tokens is not None,
    )


def _covering_tokens(inputs: tuple, index: Tensor | None, options: Mapping[str, Any]) -> int | None:
    """The first token dimension of an input that covers every rank's tokens of a
    sequence-parallel Head (another input, the index, mask or labels), or None."""
    for t in inputs:
        if isinstance(t, Head):
            if t.sequence_parallel:
                continue
            t = t.hidden
        if isinstance(t, Tensor) and t.dim() >= 2:
            return t.shape[0]
    for t in (index, options.get("mask"), options.get("labels")):
        if isinstance(t, Tensor) and t.dim() >= 1:
            return t.shape[0]
    return None


def check_tensors(spec: OpSpec, logits: tuple, index: Tensor | None, options: Mapping[str, Any]) -> None:
    """Raise ValueError/TypeError describing what is wrong with this rank's arguments."""
    check_options(spec, options)
    for name, t in zip(spec.inputs, logits):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
        if t.dim() < 1:
            raise ValueError(f"{name} must have a vocabulary dimension: shape [..., V_local]")
    first = logits[0]
    if len(logits) == 2:
        student, teacher = logits
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
    lead = tuple(first.shape[:-1])
    extra = {spec.index: index} if spec.index else {"mask": options.get("mask"), "labels": options.get("labels")}
    for name, t in extra.items():
        if t is None:
            if spec.index:
                raise TypeError(f"{spec.name} needs {name}")
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != first.device:
            raise ValueError(f"{name} ({t.device}) must be on the logits' device ({first.device})")
        if name == "mask":
            if t.dtype != torch.bool:
                raise TypeError(f"mask must be a bool tensor (True = keep), got {t.dtype}")
        elif t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
        shapes = [lead, lead + tuple(t.shape[-1:])] if name == "index" and t.dim() == len(lead) + 1 else [lead]
        if tuple(t.shape) not in shapes:
            want = "logits.shape[:-1] or logits.shape[:-1] + (k,)" if name == "index" else "logits.shape[:-1]"
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want} = {lead}")
    sp_group = options.get("sp_group")
    if sp_group is not None and sp_group is options.get("tp_group"):
        raise ValueError(
            "sp_group is tp_group: the ranks of tp_group hold vocabulary shards of the same tokens, those of "
            "sp_group other tokens; pass two groups (on a TP x SP grid each rank is in one of each)"
        )
    start, end = options["vocab_start"], options["vocab_end"]
    if (start is None) != (end is None):
        raise ValueError("pass both vocab_start and vocab_end, or neither (rank order is the default)")
    if start is not None:
        v_local = first.shape[-1]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start and end - start == v_local):
            raise ValueError(
                f"vocab_start={start}, vocab_end={end} must be ints with 0 <= vocab_start "
                f"and vocab_end - vocab_start == V_local = {v_local}"
            )


def per_call_failure(spec: OpSpec, options: Mapping[str, Any], check: Check | None) -> Exception | None:
    """What is wrong with a planned call's per-call data (its signature was checked before):
    a number option given per call (``normalizer``, ``seed``) and ``check``."""
    try:
        for name in spec.per_call:
            option = spec.options[name]
            value = option.canonical(options.get(name))
            if type(value) in (int, float) and option.valid is not None and not option.valid(value):
                raise option.error(f"{name} must be {option.rule}, got {value!r}")
        if check is not None:
            check()
    except Exception as exc:
        return exc
    return None


def fingerprint(checked: CheckedCall, compiled: bool, per_call: bool = True) -> str:
    """``name=value|...`` of everything about a call that every rank must agree on (beyond the
    shapes and dtypes gathered on their own); shown per option when ranks disagree.
    ``per_call=False``: per-call options (a number normalizer) by kind only, as a plan keeps it."""
    options = checked.options
    parts = [
        f"op={checked.spec.name}",
        f"top-k size={checked.index.shape[-1] if checked.topk and checked.index is not None else 0}",
        f"requires_grad={checked.needs_grad}",
        f"mask={options.get('mask') is not None}",
        f"labels={options.get('labels') is not None}",
        f"leading dims={len(checked.lead)}",
    ]
    for name in sorted(options):
        if not checked.spec.options[name].compared:
            continue
        value = options[name]
        # a tensor normalizer is compared by kind only: reading its value would sync the device
        if isinstance(value, Tensor):
            shown = "<tensor>"
        elif not per_call and checked.spec.options[name].per_call and value is not None:
            shown = "<number>"
        else:
            shown = repr(value)
        parts.append(f"{name}={shown}")
    return "|".join(parts) + head.fingerprint(checked.heads) + ("|torch.compile=True" if compiled else "")


def device_of(tensors: tuple) -> torch.device | None:
    first = tensors[0] if tensors else None
    if isinstance(first, Head):
        first = first.weight
    return first.device if isinstance(first, Tensor) else None
