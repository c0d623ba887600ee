"""Distillation from a teacher given only by its top-k log-probs and their global ids.

Offline distillation stores, per token, the teacher's k largest log-probs and their global
vocabulary ids. ``kl(student_logits, TopK(logprobs, index))`` is the KL divergence over those
k ids, optionally with the residual mass of the rest of the vocabulary as one more outcome::

    KL_k  = sum_k p_t,k (log p_t,k - log p_s,k)                      (tail=False)
    KL_k + r_t (log r_t - log r_s),  r = 1 - sum_k p_k                (tail=True)

``reverse=True`` swaps the roles: ``sum_k p_s,k (log p_s,k - log p_t,k)`` (+ ``r_s (log r_s -
log r_t)``). ``log p_t,k`` are the given log-probs; ``log p_s,k`` the student's **global**
log-softmax at the k ids (vocabulary-parallel: an id may live on any rank), computed by the
``logprobs`` op with a top-k index, so every backend that runs top-k log-probs runs this;
the rest is O(N k) elementwise torch, differentiated by autograd (to the student's logits,
and to the teacher's log-probs when they require grad).

Residuals. ``log r`` is ``log1mexp(L)`` with ``L = logsumexp_k log p_k``: Mächler's two
branches, so no ``1 - sum`` is formed in linear space. ``r_s`` is still only as precise as
the student's log-probs: about the accumulation dtype's epsilon (fp32: 1.2e-7) in absolute
terms. ``log r`` is floored at ``log(eps)`` (a residual below it cannot be resolved from
log-probs in that precision; a student putting all but 1e-9 of its mass on the k ids would
otherwise give ``r_s = 0`` and an infinite loss); the weight ``r`` in front of the log is
not floored, so a residual that is exactly 0 adds exactly 0. Pass fp64 logits for more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from . import checks, inputs, metadata, pipeline
from .ops import check_options, get_spec, normalize_options
from .outputs import reduce

Tensor = torch.Tensor

_KL = get_spec("kl")
# the options kl takes with a TopK teacher, besides tail (reverse is one of kl's own)
_OPTIONS = {name: o.default for name, o in _KL.options.items()}
# those passed on to the student's logprobs call
_LOGPROBS_OPTIONS = ("tp_group", "sp_group", "temperature", "vocab_start", "vocab_end", "global_vocab_size", "backend")
# TopK log-probs whose probabilities sum above this, on a token, are not log-probabilities
# (raw logits passed by mistake, say); the margin is far above the rounding of any dtype's
# log-probs
MAX_MASS = 1.01


@dataclass(frozen=True)
class TopK:
    """A teacher given by its top-k log-probs: what offline distillation stores.

    ``logprobs``: float ``[..., k]``, the teacher's log-probs (natural log, already at the
    teacher's temperature) at ``index``: on each token their probabilities sum to at most 1
    (``MAX_MASS`` allows for rounding). ``index``: int ``[..., k]``, global vocabulary ids,
    distinct on each token; entries equal to ``ignore_index`` are padding (no mass, no term).
    Both are replicated on every rank of the TP group (``[...]`` is the student's token
    shape). Either may be a DTensor placed like the student's per-token values.
    """

    logprobs: Tensor
    index: Tensor


def kl(student_logits: Any, teacher: TopK, *, reverse: bool = False, tail: bool = False, **options: Any) -> Tensor:
    """KL over the teacher's top-k ids (see the module docstring), per token ``[...]`` fp32
    (fp64 for fp64 logits), or reduced. Takes the options of ``kl``: ``temperature`` (the
    student's only: the teacher's log-probs are used as given), ``mask=``/``labels=`` with
    ``ignore_index``, ``reduction``, ``normalizer``, the layout and ``backend`` (which runs the
    student's log-probs).

    A token whose ids repeat, or whose teacher probabilities sum above ``MAX_MASS``, is an
    error: outside ``torch.compile`` it raises ValueError on every rank, before any
    collective (one flag read on the host per call); inside a compiled graph or a CUDA graph
    capture, where the host cannot read it, that token's result is NaN."""
    failure = None
    group = options.get("tp_group")
    wrap = student = index = logprobs = None
    opts: dict[str, Any] = {}
    try:
        # the layout of DTensor inputs: an error it finds is raised below, on every rank
        tensors, opts, wrap, layout_error = inputs.normalize(
            "logprobs", (student_logits, getattr(teacher, "index", None)), options
        )
        group = opts.get("tp_group")
        if layout_error is not None:
            raise layout_error
        student, index = tensors
        opts = _prepare(teacher, reverse, tail, opts)
        logprobs = teacher.logprobs
        if type(logprobs) is not Tensor:  # a DTensor: this rank's part, as for the index
            parts, _, _, layout_error = inputs.normalize("logprobs", (student_logits, logprobs), {})
            if layout_error is not None:
                raise layout_error
            logprobs = parts[1]
        _check_shapes(student, index, opts)
    except Exception as exc:  # the other ranks may be in the log-probs' metadata gather already
        failure = exc
    if failure is not None:
        pipeline.fail(failure, {**options, **opts, "tp_group": group}, checks.device_of((student_logits,)))
    assert index is not None and logprobs is not None
    ii = opts["ignore_index"]
    keep = _token_mask(opts, index, ii)
    # masked tokens get an all-ignored index: the log-probs op skips their rows
    valid = index != ii
    if keep is not None:
        valid = valid & keep[..., None]
    student_index = torch.where(valid, index, torch.full_like(index, ii))
    bad = _bad_tokens(index, logprobs, ii)
    readable = not (torch.compiler.is_compiling() or (index.is_cuda and torch.cuda.is_current_stream_capturing()))
    lp_s = pipeline.run(
        "logprobs",
        (student, student_index),
        {"ignore_index": ii, **{k: opts[k] for k in _LOGPROBS_OPTIONS}},
        check=(lambda: _raise_bad(bad, index, logprobs, ii)) if readable else None,
        agree=_agreed(opts, tail),
    )
    lp_t = logprobs.to(lp_s.dtype)
    a, b = (lp_s, lp_t) if opts["reverse"] else (lp_t, lp_s)  # KL(A || B) over the k ids
    values = _kl_over_ids(a, b, valid, tail)
    if not readable:
        values = torch.where(bad, torch.full_like(values, math.nan), values)
    if keep is not None:
        values = torch.where(keep, values, torch.zeros_like(values))
    out = reduce(values, opts, None, keep, ii)
    return out if wrap is None else wrap(out)


def explain(student_logits: Any, teacher: TopK, *, gather: bool = False, **options: Any):
    """Which backend runs the student's log-probs of ``kl(student_logits, teacher)``
    (``gather`` as for ``vtp.explain``)."""
    try:
        kl_options = _prepare(teacher, options.pop("reverse", False), options.pop("tail", False), options)
    except Exception as exc:
        if gather:  # the other ranks may be in the metadata gather already
            metadata.fail(exc, options.get("tp_group"), checks.device_of((student_logits,)))
        raise
    return pipeline.explain(
        "logprobs",
        (student_logits, teacher.index),
        {"ignore_index": kl_options["ignore_index"], **{k: kl_options[k] for k in _LOGPROBS_OPTIONS}},
        gather=gather,
    )


# -- pieces --------------------------------------------------------------------------------


def _agreed(opts: dict[str, Any], tail: bool) -> str:
    """What the ranks of an sp_group must agree on beyond the student's log-probs call."""
    shown = (f"{k}={opts[k]!r}" for k in ("reverse", "reduction") if k in opts)
    kinds = (f"{k}={opts.get(k) is not None}" for k in ("mask", "labels"))
    normalizer = opts.get("normalizer")  # the student's call has none: the TopK result's
    number = "<tensor>" if isinstance(normalizer, Tensor) else repr(normalizer)
    return "|".join((f"TopK teacher, tail={tail!r}", *shown, *kinds, f"TopK normalizer={number}"))


def _prepare(teacher: TopK, reverse, tail, options: dict[str, Any]) -> dict[str, Any]:
    """This rank's checks of a TopK call; the options with their defaults and ``reverse``,
    scalar options as Python numbers (as ``vtp.loss`` takes them)."""
    if not isinstance(teacher, TopK):
        raise TypeError(f"teacher must be a vtp.TopK, got {type(teacher).__name__}")
    unknown = sorted(options.keys() - _OPTIONS.keys() - {"reverse"})
    if unknown:
        raise TypeError(
            f"kl with a TopK teacher got unknown option(s) {', '.join(unknown)}; it takes: tail, {', '.join(_OPTIONS)}"
        )
    if not isinstance(tail, bool):
        raise ValueError(f"tail must be a bool, got {tail!r}")
    kl_options = {**_OPTIONS, **options, "reverse": reverse}
    normalize_options(_KL, kl_options, [*options, "reverse"])
    check_options(_KL, kl_options)
    lp, index = teacher.logprobs, teacher.index
    if not isinstance(lp, Tensor) or not lp.is_floating_point():
        raise TypeError(
            f"TopK.logprobs must be a floating tensor, got {lp.dtype if isinstance(lp, Tensor) else type(lp).__name__}"
        )
    if not isinstance(index, Tensor) or index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise TypeError(
            f"TopK.index must be an integer tensor, got "
            f"{index.dtype if isinstance(index, Tensor) else type(index).__name__}"
        )
    if lp.shape != index.shape or index.dim() < 1 or index.shape[-1] < 1:
        raise ValueError(
            f"TopK.logprobs {tuple(lp.shape)} and TopK.index {tuple(index.shape)} must have the "
            f"same shape [..., k] with k >= 1"
        )
    if lp.device != index.device:
        raise ValueError(f"TopK.logprobs ({lp.device}) and TopK.index ({index.device}) must be on one device")
    return kl_options


def _check_shapes(student, index: Tensor, options: dict[str, Any]) -> None:
    """This rank's student, TopK index and masks agree on the token shape."""
    lead = tuple(index.shape[:-1])
    if isinstance(student, Tensor) and tuple(student.shape[:-1]) != lead:
        raise ValueError(
            f"TopK's shape {tuple(index.shape)} must be the student's token shape plus k: "
            f"{tuple(student.shape[:-1])} + (k,)"
        )
    for name in ("mask", "labels"):
        t = options[name]
        if t is not None and (not isinstance(t, Tensor) or tuple(t.shape) != lead):
            raise ValueError(
                f"{name} must be a tensor of the token shape {lead}, got "
                f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}"
            )
    if options["mask"] is not None and options["mask"].dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = keep), got {options['mask'].dtype}")
    if options["labels"] is not None and (
        options["labels"].is_floating_point() or options["labels"].dtype == torch.bool
    ):
        raise TypeError(f"labels must be an integer tensor, got {options['labels'].dtype}")


def _token_mask(options: dict[str, Any], index: Tensor, ignore_index: int) -> Tensor | None:
    """bool ``[...]``: the tokens that count (``mask`` and ``labels != ignore_index``), or None."""
    keep = options["mask"]
    if options["labels"] is not None:
        kept = options["labels"].to(index.device) != ignore_index
        keep = kept if keep is None else keep.to(index.device) & kept
    return None if keep is None else keep.to(index.device)


def _bad_tokens(index: Tensor, logprobs: Tensor, ignore_index: int) -> Tensor:
    """bool ``[...]``: tokens whose ids repeat, or whose teacher probabilities sum above
    ``MAX_MASS`` (device work only)."""
    ids = index.sort(dim=-1).values
    repeat = ((ids[..., 1:] == ids[..., :-1]) & (ids[..., 1:] != ignore_index)).any(-1)
    lp = torch.where(index != ignore_index, logprobs.float(), torch.full_like(logprobs, -math.inf, dtype=torch.float32))
    return repeat | (torch.logsumexp(lp, dim=-1) > math.log(MAX_MASS))


def _raise_bad(bad: Tensor, index: Tensor, logprobs: Tensor, ignore_index: int) -> None:
    """Raise ValueError naming the first bad token (one flag read on the host)."""
    if not bool(bad.any()):
        return
    token = tuple(bad.nonzero()[0].tolist())
    ids = [i for i in index[token].tolist() if i != ignore_index]
    if len(set(ids)) < len(ids):
        raise ValueError(
            f"TopK.index repeats an id on token {token} (ids {index[token].tolist()}); the k ids of a token "
            f"must be distinct (pad with ignore_index={ignore_index})"
        )
    mass = logprobs[token].double().exp().sum().item()
    raise ValueError(
        f"TopK.logprobs on token {token} are not log-probabilities: their probabilities sum to {mass:.4g} "
        f"(more than 1); pass log-probs (e.g. log_softmax(teacher_logits).topk(k)), not logits"
    )


def _kl_over_ids(a: Tensor, b: Tensor, valid: Tensor, tail: bool) -> Tensor:
    """``sum_k p_a (log p_a - log p_b)`` over the valid entries of ``[..., k]`` log-probs,
    plus ``r_a (log r_a - log r_b)`` with ``tail``. ``0 log 0 = 0``; NaN stays NaN."""
    neg_inf = torch.full_like(a, -math.inf)
    a = torch.where(valid, a, neg_inf)
    b = torch.where(valid, b, neg_inf)
    pa = a.exp()
    # where p_a = 0 the term is 0 whatever log p_b is (-inf included), gradients too
    values = (pa * torch.where(pa > 0, a - b, torch.zeros_like(a))).sum(-1)
    if tail:
        r_a, log_r_a = _residual(a)
        _, log_r_b = _residual(b)
        values = values + torch.where(r_a > 0, r_a * (log_r_a - log_r_b), torch.zeros_like(r_a))
    return values


def _residual(lp: Tensor) -> tuple[Tensor, Tensor]:
    """``(r, log r)`` of ``r = 1 - sum_k exp(lp_k)`` (entries of ``-inf`` add nothing), from
    ``L = logsumexp(lp)``: ``r = -expm1(L)``, exactly 0 for ``L >= 0``, and ``log r =
    log1mexp(L)`` floored at ``log(eps)``. Every branch gets inputs that keep its backward
    finite, so no NaN reaches a gradient that should be 0."""
    m = lp.detach().amax(-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # an all -inf token: L = -inf below
    s = (lp - m[..., None]).exp().sum(-1)
    nonempty = s > 0
    lse = torch.where(nonempty, m + torch.where(nonempty, s, torch.ones_like(s)).log(), torch.full_like(s, -math.inf))
    r = -torch.expm1(lse.clamp(max=0.0))
    eps = torch.finfo(lp.dtype).eps
    x = lse.clamp(max=math.log1p(-eps))  # r >= eps inside the log
    near = x > -math.log(2.0)  # log(-expm1(x)) is accurate near 0, log1p(-exp(x)) below -ln 2
    fallback = torch.full_like(x, -1.0)  # a value both branches take without trouble
    log_r = torch.where(
        near,
        torch.log(-torch.expm1(torch.where(near, x, fallback))),
        torch.log1p(-torch.exp(torch.where(near, fallback, x))),
    )
    return r, log_r
