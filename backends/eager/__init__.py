"""The ``eager`` backend: pure PyTorch, every op and option, any device and dtype.

It is the readable statement of the vocabulary-parallel algorithm every other backend
implements faster:

- Statistics are max-rescaled: per token the global max ``m`` (one all-reduce MAX over all
  inputs), then sums relative to it (one all-reduce SUM over all sums the op needs). JSD
  needs one more all-reduce for its divergence sums. The count never depends on V_local.
- Elementwise work runs over chunks of token rows so fp32 temporaries stay near
  ``CHUNK_ELEMENTS`` whatever N and V_local; collectives run once, over all tokens.
- Values are differences from the max (``x - m``, ``log s``) so a large common offset
  (1e4 and more) cancels exactly instead of rounding away.
- Backward recomputes probabilities from the saved inputs and O(N) statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vtp_runtime.backend import (
    ALL_DTYPES,
    Call,
    Compiles,
    HeadSupport,
    OpCapability,
    SavedState,
    TakesHead,
    value_dtype,
)
from vtp_runtime.comm import all_reduce
from vtp_runtime.ops import LOSSES, OPS, kl_direction
from vtp_runtime.registry import hookimpl

from . import sampling

CHUNK_ELEMENTS = 1 << 24

Tensor = torch.Tensor


def _row_chunks(n: int, v: int):
    step = max(1, CHUNK_ELEMENTS // max(v, 1))
    for lo in range(0, n, step):
        yield lo, min(lo + step, n)


def _scaled(z: Tensor, lo: int, hi: int, call: Call) -> Tensor:
    """``z[lo:hi] / T`` in the accumulation dtype (a new tensor; inputs are never modified)."""
    x = z[lo:hi].to(value_dtype(z.dtype), copy=True)
    t = call.options["temperature"]
    return x.div_(t) if t != 1.0 else x


def _global_max(call: Call, inputs: tuple[Tensor, ...]) -> Tensor:
    """``[len(inputs), N]`` global row maxima of ``x``; rows of all ``-inf`` get 0 so that
    ``x - m`` stays ``-inf`` rather than NaN."""
    n, v = inputs[0].shape
    m = torch.full((len(inputs), n), -math.inf, dtype=value_dtype(inputs[0].dtype), device=inputs[0].device)
    if v:
        for lo, hi in _row_chunks(n, v):
            for i, z in enumerate(inputs):
                m[i, lo:hi] = _scaled(z, lo, hi, call).amax(dim=1)
    all_reduce(m, call.group, "max")
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _xlogy_rel(p: Tensor, diff: Tensor) -> Tensor:
    """``p * diff`` with ``0 * anything = 0`` (the ``0 log 0 = 0`` rule); NaN stays NaN."""
    return torch.where(p == 0, torch.zeros_like(p), p * diff)


def _index_in_shard(index: Tensor, call: Call, v: int) -> tuple[Tensor, Tensor]:
    """(local column, whether the global id lies in this shard)."""
    local = index - call.vocab_start
    inside = (local >= 0) & (local < v)
    return local.clamp(0, max(v - 1, 0)), inside


def _bad_index(index: Tensor, call: Call) -> Tensor:
    ii = call.options["ignore_index"]
    return (index != ii) & ((index < 0) | (index >= call.vocab_size))


@dataclass
class IndexState(SavedState):
    """cross_entropy and logprobs: the logits, their index, and two O(N) statistics."""

    logits: Tensor  # [N, V_local]
    index: Tensor  # int64 labels [N], or logprobs' index [N] / [N, k]
    max: Tensor  # [N] global row max of x = z / T (0 for an all -inf row)
    log_sum: Tensor  # [N] log sum exp(x - max)
    entropy: Tensor | None = None  # [N] logprobs with return_entropy: the entropy (0 on masked tokens)

    def statistics(self) -> Tensor:
        columns = [self.max, self.log_sum] + ([] if self.entropy is None else [self.entropy])
        return torch.stack(columns, dim=1)

    @classmethod
    def from_statistics(cls, call, inputs, index, mask, statistics):
        entropy = statistics[:, 2] if statistics.shape[1] == 3 else None
        return cls(inputs[0], index, statistics[:, 0], statistics[:, 1], entropy)


@dataclass
class EntropyState(SavedState):
    logits: Tensor  # [N, V_local]
    max: Tensor  # [N]
    log_sum: Tensor  # [N]
    entropy: Tensor  # [N], the value (0 on masked tokens)
    mask: Tensor | None = None  # bool [N]

    def statistics(self) -> Tensor:
        return torch.stack([self.max, self.log_sum, self.entropy], dim=1)

    @classmethod
    def from_statistics(cls, call, inputs, index, mask, statistics):
        return cls(inputs[0], statistics[:, 0], statistics[:, 1], statistics[:, 2], mask)


@dataclass
class PairState(SavedState):
    """kl and jsd: both inputs and the stacked O(N) statistics."""

    student: Tensor  # [N, V_local]
    teacher: Tensor  # [N, V_local]
    # KL(A || B) [5, N]: max_a, max_b, log_sum_a, log_sum_b, KL;
    # JSD [6, N]: max_s, max_t, log_sum_s, log_sum_t, KL(p_s || M), KL(p_t || M)
    stats: Tensor
    mask: Tensor | None = None  # bool [N]

    def statistics(self) -> Tensor:
        return self.stats.t().contiguous()

    @classmethod
    def from_statistics(cls, call, inputs, index, mask, statistics):
        return cls(inputs[0], inputs[1], statistics.t(), mask)


class EagerBackend(TakesHead, Compiles):
    name = "eager"
    priority = 0
    input_layout = "any"  # torch ops take any strides: never a copy of a viewable input
    # every op with every feature that applies to it, on any device, in every dtype; the losses
    # also from vtp.Head inputs (the core's token-chunk driver computes each chunk's logits) and
    # inside torch.compile; argmax and sample (sampling.py) from logits
    ops = {
        op: OpCapability(device_types=None, dtypes=ALL_DTYPES, features=frozenset(spec.features))
        for op, spec in OPS.items()
    }
    # argmax's Head runs chunk by chunk on this rank's hidden rows: not sequence-parallel
    head_ops = {**{op: HeadSupport(sequence_parallel=True) for op in LOSSES}, "argmax": HeadSupport()}
    compiled_ops = frozenset(LOSSES)

    def forward(self, call, inputs, index, mask):
        if OPS[call.op].returns_ids:
            return sampling.forward(call, inputs[0]), None
        return _math(call)[0](call, inputs, index, mask)

    def backward(self, call, state, grad):
        return _math(call)[1](call, state, grad)

    # -- inside torch.compile: the state as the inputs plus [N, W] statistics ------------------
    def statistics_width(self, op, options):
        """cross_entropy and logprobs 2 (max, log-sum), entropy and logprobs with
        return_entropy 3 (and the entropy), kl 5 (both maxima and log-sums, the KL), jsd 6
        (both maxima and log-sums, KL(p_s||M), KL(p_t||M)); jsd at beta 0 or 1 is a plain KL."""
        if kl_direction(op, options) is not None:
            return 5
        if op == "logprobs" and options["return_entropy"]:
            return 3
        return {"cross_entropy": 2, "logprobs": 2, "entropy": 3, "jsd": 6}[op]

    def statistics(self, call, state):
        return state.statistics()

    def from_statistics(self, call, inputs, index, mask, statistics):
        kinds: dict[str, type[IndexState | EntropyState]] = {
            "cross_entropy": IndexState,
            "logprobs": IndexState,
            "entropy": EntropyState,
        }
        kind = kinds.get(call.op, PairState)
        return kind.from_statistics(call, inputs, index, mask, statistics)


def _math(call: Call):
    """(forward, backward) of ``call``: ``jsd`` at beta 0 or 1 is a plain KL."""
    if kl_direction(call.op, call.options) is not None:
        return _kl_forward, _kl_backward
    return {
        "cross_entropy": (_ce_forward, _ce_backward),
        "logprobs": (_logprobs_forward, _logprobs_backward),
        "entropy": (_entropy_forward, _entropy_backward),
        "jsd": (_jsd_forward, _jsd_backward),
    }[call.op]


# -- cross entropy -------------------------------------------------------------------------


def _ce_forward(call, inputs, labels, mask):
    (z,) = inputs
    n, v = z.shape
    eps, lam, ii = call.options["label_smoothing"], call.options["z_loss"], call.options["ignore_index"]
    m = _global_max(call, inputs)[0]
    local, inside = _index_in_shard(labels, call, v)
    sums = torch.zeros(3, n, dtype=m.dtype, device=z.device)  # sum exp(x-m), sum (x-m), (x-m)[y]
    for lo, hi in _row_chunks(n, v):
        xm = _scaled(z, lo, hi, call).sub_(m[lo:hi, None])
        sums[0, lo:hi] = xm.exp().sum(dim=1)
        if eps:
            sums[1, lo:hi] = xm.sum(dim=1)
        if v:
            picked = xm.gather(1, local[lo:hi, None]).squeeze(1)
            sums[2, lo:hi] = torch.where(inside[lo:hi], picked, torch.zeros_like(picked))
    all_reduce(sums, call.group, "sum")
    log_s = sums[0].log()
    value = (1 - eps) * (log_s - sums[2])
    if eps:
        value = value + eps * (log_s - sums[1] / call.vocab_size)
    lse = m + log_s
    if lam:
        value = value + lam * lse * lse
    value = torch.where(_bad_index(labels, call), torch.full_like(value, math.nan), value)
    value = torch.where(labels != ii, value, torch.zeros_like(value))
    return value, IndexState(z, labels, m, log_s)


def _ce_backward(call, state, grad):
    z, labels, m, log_s = state.logits, state.index, state.max, state.log_sum
    n, v = z.shape
    eps, lam, ii = call.options["label_smoothing"], call.options["z_loss"], call.options["ignore_index"]
    keep = labels != ii
    scale = torch.where(keep, grad / call.options["temperature"], torch.zeros_like(grad))
    scale = torch.where(_bad_index(labels, call), torch.full_like(scale, math.nan), scale)
    local, inside = _index_in_shard(labels, call, v)
    lse = m + log_s
    out = torch.empty_like(z)
    for lo, hi in _row_chunks(n, v):
        p = _scaled(z, lo, hi, call).sub_(m[lo:hi, None]).sub_(log_s[lo:hi, None]).exp_()
        d = p * (1 + 2 * lam * lse[lo:hi, None]) if lam else p
        if eps:
            d = d - eps / call.vocab_size
        if v:
            hit = inside[lo:hi].to(d.dtype) * (1 - eps)
            d = d.scatter_add(1, local[lo:hi, None], -hit[:, None])
        d = d * scale[lo:hi, None]
        out[lo:hi] = torch.where(keep[lo:hi, None], d, torch.zeros_like(d))
    return (out,)


# -- log-probs -----------------------------------------------------------------------------


def _logprobs_forward(call, inputs, index, mask):
    """Log-probs at the index entries and, with ``return_entropy``, the entropy: its sum
    ``sum e (x - m)`` rides in the same pass and the same all-reduce."""
    (z,) = inputs
    n, v = z.shape
    with_entropy = call.options["return_entropy"]
    idx = index if call.topk else index[:, None]
    m = _global_max(call, inputs)[0]
    local, inside = _index_in_shard(idx, call, v)
    # columns: sum exp(x - m), [sum e (x - m)], then x - m at each index entry
    first = 2 if with_entropy else 1
    sums = torch.zeros(n, first + idx.shape[1], dtype=m.dtype, device=z.device)
    for lo, hi in _row_chunks(n, v):
        xm = _scaled(z, lo, hi, call).sub_(m[lo:hi, None])
        e = xm.exp()
        sums[lo:hi, 0] = e.sum(dim=1)
        if with_entropy:
            sums[lo:hi, 1] = _xlogy_rel(e, xm).sum(dim=1)
        if v:
            got = xm.gather(1, local[lo:hi])
            sums[lo:hi, first:] = torch.where(inside[lo:hi], got, torch.zeros_like(got))
    all_reduce(sums, call.group, "sum")
    log_s = sums[:, 0].log()
    value = sums[:, first:] - log_s[:, None]
    value = torch.where(_bad_index(idx, call), torch.full_like(value, math.nan), value)
    keep = idx != call.options["ignore_index"]
    value = torch.where(keep, value, torch.zeros_like(value))
    if not with_entropy:
        return (value if call.topk else value[:, 0]), IndexState(z, index, m, log_s)
    h = log_s - sums[:, 1] / sums[:, 0]
    h = torch.where(keep.any(dim=1), h, torch.zeros_like(h))
    return torch.cat([value, h[:, None]], dim=1), IndexState(z, index, m, log_s, h)


def _logprobs_backward(call, state, grad):
    """``sum_k g_k onehot(i_k) - (sum_k g_k) p``, and with the entropy ``- g_H p (log p + H)``."""
    z, index, m, log_s, h = state.logits, state.index, state.max, state.log_sum, state.entropy
    n, v = z.shape
    idx = index if call.topk else index[:, None]
    t = call.options["temperature"]
    g_h = None
    if h is not None:
        grad, g_h = grad[:, :-1], grad[:, -1]
        g_h = torch.where((idx != call.options["ignore_index"]).any(dim=1), g_h / t, torch.zeros_like(g_h))
    g = grad if grad.dim() == 2 else grad[:, None]
    keep = idx != call.options["ignore_index"]
    g = torch.where(keep, g, torch.zeros_like(g)) / t
    g = torch.where(_bad_index(idx, call), torch.full_like(g, math.nan), g)
    local, inside = _index_in_shard(idx, call, v)
    g_total = g.sum(dim=1)
    out = torch.empty_like(z)
    for lo, hi in _row_chunks(n, v):
        logp = _scaled(z, lo, hi, call).sub_(m[lo:hi, None]).sub_(log_s[lo:hi, None])
        p = logp.exp() if g_h is not None else logp.exp_()  # log p is needed only for the entropy
        d = torch.where(g_total[lo:hi, None] != 0, -p * g_total[lo:hi, None], torch.zeros_like(p))
        if g_h is not None:
            # masked tokens have g_h = 0: their rows stay exactly 0 even where log p is NaN
            # (a masked row of all -inf)
            term = -_xlogy_rel(p, logp + h[lo:hi, None]) * g_h[lo:hi, None]
            d = d + torch.where(g_h[lo:hi, None] != 0, term, torch.zeros_like(term))
        if v:
            hit = torch.where(inside[lo:hi], g[lo:hi], torch.zeros_like(g[lo:hi]))
            d = d.scatter_add(1, local[lo:hi], hit)
        out[lo:hi] = d
    return (out,)


# -- entropy -------------------------------------------------------------------------------


def _entropy_forward(call, inputs, index, mask):
    (z,) = inputs
    n, v = z.shape
    m = _global_max(call, inputs)[0]
    sums = torch.zeros(2, n, dtype=m.dtype, device=z.device)  # sum e, sum e (x - m)
    for lo, hi in _row_chunks(n, v):
        xm = _scaled(z, lo, hi, call).sub_(m[lo:hi, None])
        e = xm.exp()
        sums[0, lo:hi] = e.sum(dim=1)
        sums[1, lo:hi] = _xlogy_rel(e, xm).sum(dim=1)
    all_reduce(sums, call.group, "sum")
    log_s = sums[0].log()
    h = log_s - sums[1] / sums[0]
    if mask is not None:
        h = torch.where(mask, h, torch.zeros_like(h))
    return h, EntropyState(z, m, log_s, h, mask)


def _entropy_backward(call, state, grad):
    z, m, log_s, h, mask = state.logits, state.max, state.log_sum, state.entropy, state.mask
    n, v = z.shape
    scale = grad / call.options["temperature"]
    out = torch.empty_like(z)
    for lo, hi in _row_chunks(n, v):
        logp = _scaled(z, lo, hi, call).sub_(m[lo:hi, None]).sub_(log_s[lo:hi, None])
        p = logp.exp()
        d = -_xlogy_rel(p, logp + h[lo:hi, None]) * scale[lo:hi, None]
        if mask is not None:
            d = torch.where(mask[lo:hi, None], d, torch.zeros_like(d))
        out[lo:hi] = d
    return (out,)


# -- KL ------------------------------------------------------------------------------------


def _kl_forward(call, inputs, index, mask):
    """KL(A || B): forward A = teacher, B = student; reverse A = student, B = teacher."""
    reverse = kl_direction(call.op, call.options)
    student, teacher = inputs
    a, b = (student, teacher) if reverse else (teacher, student)
    n, v = a.shape
    m = _global_max(call, (a, b))
    sums = torch.zeros(3, n, dtype=m.dtype, device=a.device)  # s_a, s_b, sum e_a (la - lb)
    for lo, hi in _row_chunks(n, v):
        la = _scaled(a, lo, hi, call).sub_(m[0, lo:hi, None])
        lb = _scaled(b, lo, hi, call).sub_(m[1, lo:hi, None])
        ea = la.exp()
        sums[0, lo:hi] = ea.sum(dim=1)
        sums[1, lo:hi] = lb.exp().sum(dim=1)
        sums[2, lo:hi] = _xlogy_rel(ea, la - lb).sum(dim=1)
    all_reduce(sums, call.group, "sum")
    log_sa, log_sb = sums[0].log(), sums[1].log()
    value = sums[2] / sums[0] - log_sa + log_sb
    if mask is not None:
        value = torch.where(mask, value, torch.zeros_like(value))
    stats = torch.stack([m[0], m[1], log_sa, log_sb, value])
    return value, PairState(student, teacher, stats, mask)


def _kl_backward(call, state, grad):
    reverse = kl_direction(call.op, call.options)
    student, teacher, stats, mask = state.student, state.teacher, state.stats, state.mask
    a, b = (student, teacher) if reverse else (teacher, student)
    need_s, need_t = call.needs_grad
    need_a, need_b = (need_s, need_t) if reverse else (need_t, need_s)
    n, v = a.shape
    ma, mb, log_sa, log_sb, kl = stats
    scale = grad / call.options["temperature"]
    grad_a = torch.empty_like(a) if need_a else None
    grad_b = torch.empty_like(b) if need_b else None
    for lo, hi in _row_chunks(n, v):
        logpa = _scaled(a, lo, hi, call).sub_(ma[lo:hi, None]).sub_(log_sa[lo:hi, None])
        logpb = _scaled(b, lo, hi, call).sub_(mb[lo:hi, None]).sub_(log_sb[lo:hi, None])
        pa = logpa.exp()
        g = scale[lo:hi, None]
        keep = mask[lo:hi, None] if mask is not None else None
        if grad_a is not None:
            d = _xlogy_rel(pa, logpa - logpb - kl[lo:hi, None]) * g
            grad_a[lo:hi] = d if keep is None else torch.where(keep, d, torch.zeros_like(d))
        if grad_b is not None:
            d = (logpb.exp() - pa) * g
            grad_b[lo:hi] = d if keep is None else torch.where(keep, d, torch.zeros_like(d))
    return (grad_a, grad_b) if reverse else (grad_b, grad_a)


# -- generalized JSD (interior beta) -------------------------------------------------------


def _log_mixture(logp_s: Tensor, logp_t: Tensor, beta: float) -> Tensor:
    return torch.logaddexp(logp_t + math.log(beta), logp_s + math.log1p(-beta))


def _jsd_forward(call, inputs, index, mask):
    beta = call.options["beta"]
    student, teacher = inputs
    n, v = student.shape
    m = _global_max(call, inputs)
    s = torch.zeros(2, n, dtype=m.dtype, device=student.device)
    for lo, hi in _row_chunks(n, v):
        for i, z in enumerate(inputs):
            s[i, lo:hi] = _scaled(z, lo, hi, call).sub_(m[i, lo:hi, None]).exp_().sum(dim=1)
    all_reduce(s, call.group, "sum")
    log_s = s.log()
    kls = torch.zeros(2, n, dtype=m.dtype, device=student.device)  # KL(p_s||M), KL(p_t||M)
    for lo, hi in _row_chunks(n, v):
        lps, lpt = (
            _scaled(z, lo, hi, call).sub_(m[i, lo:hi, None]).sub_(log_s[i, lo:hi, None]) for i, z in enumerate(inputs)
        )
        lm = _log_mixture(lps, lpt, beta)
        kls[0, lo:hi] = _xlogy_rel(lps.exp(), lps - lm).sum(dim=1)
        kls[1, lo:hi] = _xlogy_rel(lpt.exp(), lpt - lm).sum(dim=1)
    all_reduce(kls, call.group, "sum")
    value = (1 - beta) * kls[0] + beta * kls[1]
    if mask is not None:
        value = torch.where(mask, value, torch.zeros_like(value))
    stats = torch.cat([m, log_s, kls])
    return value, PairState(student, teacher, stats, mask)


def _jsd_backward(call, state, grad):
    beta = call.options["beta"]
    student, teacher, stats, mask = state.student, state.teacher, state.stats, state.mask
    need_s, need_t = call.needs_grad
    n, v = student.shape
    m, log_s, kls = stats[0:2], stats[2:4], stats[4:6]
    scale = grad / call.options["temperature"]
    grad_s = torch.empty_like(student) if need_s else None
    grad_t = torch.empty_like(teacher) if need_t else None
    for lo, hi in _row_chunks(n, v):
        lps, lpt = (
            _scaled(z, lo, hi, call).sub_(m[i, lo:hi, None]).sub_(log_s[i, lo:hi, None])
            for i, z in enumerate((student, teacher))
        )
        lm = _log_mixture(lps, lpt, beta)
        g = scale[lo:hi, None]
        keep = mask[lo:hi, None] if mask is not None else None
        for out, lp, kl, w in ((grad_s, lps, kls[0], 1 - beta), (grad_t, lpt, kls[1], beta)):
            if out is not None:
                d = _xlogy_rel(lp.exp(), lp - lm - kl[lo:hi, None]) * (w * g)
                out[lo:hi] = d if keep is None else torch.where(keep, d, torch.zeros_like(d))
    return grad_s, grad_t


@hookimpl
def vtp_runtime_register_backends(register):
    register(EagerBackend())
