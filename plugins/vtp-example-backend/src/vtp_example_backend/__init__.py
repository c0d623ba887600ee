"""``example_blockwise``: a third-party vtp_runtime backend, and the template to copy.

It computes ``entropy`` and ``kl`` with a **one-pass streaming softmax** over blocks of
vocabulary columns, where the built-in ``eager`` backend makes two passes (first the max,
then the sums). Per token it keeps a running max ``m``, a running ``s = sum exp(x - m)``
and the op's running moment; when a block raises the max, the running sums are rescaled
by ``exp(m_old - m_new)``. Across tensor-parallel ranks the per-rank states are combined
the same way: one all-reduce MAX of the maxima, a local rescale, one all-reduce SUM. Two
collectives per call whatever the local vocabulary size, as the backend contract demands.

Moments kept, for ``x = z / T``, ``e = exp(x - m)``:

- entropy: ``t = sum e (x - m)``; rescaled to a new max ``m'`` as ``a (t + (m - m') s)``
  with ``a = exp(m - m')``. Then ``H = log S - T / S``.
- KL(A || B): ``u = sum e_a (a - b)``, which needs no additive correction (``a - b`` does
  not depend on the max), and plain ``(m_b, s_b)`` for B. Then
  ``KL = u / S_a - (M_a - M_b) - log S_a + log S_b``.

Backward recomputes probabilities block by block from the saved inputs and O(N) statistics,
which forward hands over in a small dataclass (a ``SavedState``): the core keeps its tensors
for backward the way autograd keeps saved tensors, and rebuilds it for ``backward``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vtp_runtime import Backend, OpCapability, SavedState, hookimpl
from vtp_runtime.backend import value_dtype
from vtp_runtime.comm import all_reduce

__version__ = "0.1.0"

BLOCK = 4096  # vocabulary columns per block: bounds fp32 temporaries to N x BLOCK

Tensor = torch.Tensor


# -- helpers -------------------------------------------------------------------------------


def _blocks(v: int):
    for lo in range(0, v, BLOCK):
        yield lo, min(lo + BLOCK, v)


def _x(z: Tensor, lo: int, hi: int, temperature: float) -> Tensor:
    """Columns ``[lo, hi)`` of ``z / T`` in the accumulation dtype (a copy: inputs stay intact)."""
    x = z[:, lo:hi].to(value_dtype(z.dtype), copy=True)
    return x.div_(temperature) if temperature != 1.0 else x


def _finite_or_zero(m: Tensor) -> Tensor:
    """A max of ``-inf`` (nothing seen yet, or an all ``-inf`` row) becomes 0 so that
    ``x - m`` stays ``-inf`` instead of NaN."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _p_times(p: Tensor, y: Tensor) -> Tensor:
    """``p * y`` with ``0 * anything = 0`` (``0 log 0 = 0``)."""
    return torch.where(p > 0, p * y, torch.zeros_like(p))


def _rescale(m: Tensor, m_new: Tensor) -> tuple[Tensor, Tensor]:
    """``(exp(m - m_new), m - m_new)`` for moving running sums from max ``m`` to ``m_new``;
    both 0 where nothing was accumulated yet (``m = -inf``)."""
    new = _finite_or_zero(m_new)
    seen = torch.isfinite(m)
    shift = torch.where(seen, m - new, torch.zeros_like(m))
    return torch.where(seen, shift.exp(), torch.zeros_like(m)), shift


def _masked(values: Tensor, mask: Tensor | None) -> Tensor:
    return values if mask is None else torch.where(mask, values, torch.zeros_like(values))


# -- what forward keeps for backward ---------------------------------------------------------
# Every field is a tensor (or None for an optional one): the core saves them with autograd's
# save_for_backward, which also catches an input modified in place before backward.


@dataclass
class EntropyState(SavedState):
    logits: Tensor  # [N, V_local], the input itself (no copy)
    max: Tensor  # [N] global max of x = z / T (0 for an all -inf row)
    log_sum: Tensor  # [N] log sum exp(x - max) over the global vocabulary
    entropy: Tensor  # [N] the value
    mask: Tensor | None = None  # bool [N], True = keep


@dataclass
class KLState(SavedState):
    student: Tensor  # [N, V_local]
    teacher: Tensor  # [N, V_local]
    stats: Tensor  # [5, N]: max_a, max_b, log_sum_a, log_sum_b, KL (A, B as in _kl_forward)
    mask: Tensor | None = None  # bool [N]


# -- entropy -------------------------------------------------------------------------------


def _entropy_forward(call, z: Tensor, mask):
    n, v = z.shape
    temp = call.options["temperature"]
    acc = value_dtype(z.dtype)
    m = torch.full((n,), -math.inf, dtype=acc, device=z.device)
    s = torch.zeros(n, dtype=acc, device=z.device)
    t = torch.zeros(n, dtype=acc, device=z.device)
    for lo, hi in _blocks(v):  # one pass over the local vocabulary
        x = _x(z, lo, hi, temp)
        m_new = torch.maximum(m, x.amax(dim=1))
        a, shift = _rescale(m, m_new)
        t, s = a * (t + shift * s), a * s
        xm = x.sub_(_finite_or_zero(m_new)[:, None])
        e = xm.exp()
        s += e.sum(dim=1)
        t += _p_times(e, xm).sum(dim=1)
        m = m_new
    # combine the ranks: one MAX, a local rescale, one SUM
    big_m = all_reduce(m.clone(), call.group, "max")
    a, shift = _rescale(m, big_m)
    sums = torch.stack([a * s, a * (t + shift * s)])
    all_reduce(sums, call.group, "sum")
    log_s = sums[0].log()
    h = _masked(log_s - sums[1] / sums[0], mask)
    return h, EntropyState(z, _finite_or_zero(big_m), log_s, h, mask)


def _entropy_backward(call, state: EntropyState, grad):
    z, m, log_s, h, mask = state.logits, state.max, state.log_sum, state.entropy, state.mask
    temp = call.options["temperature"]
    scale = (grad / temp)[:, None]
    out = torch.empty_like(z)
    for lo, hi in _blocks(z.shape[1]):
        logp = _x(z, lo, hi, temp).sub_(m[:, None]).sub_(log_s[:, None])
        d = -_p_times(logp.exp(), logp + h[:, None]) * scale
        out[:, lo:hi] = d if mask is None else torch.where(mask[:, None], d, torch.zeros_like(d))
    return (out,)


# -- KL ------------------------------------------------------------------------------------


def _kl_forward(call, student: Tensor, teacher: Tensor, mask, reverse: bool):
    """KL(A || B): forward A = teacher, B = student; reverse A = student, B = teacher."""
    a_in, b_in = (student, teacher) if reverse else (teacher, student)
    n, v = a_in.shape
    temp = call.options["temperature"]
    acc = value_dtype(a_in.dtype)
    m = torch.full((2, n), -math.inf, dtype=acc, device=a_in.device)  # running max of A, B
    s = torch.zeros(2, n, dtype=acc, device=a_in.device)  # running sum exp(x - m) of A, B
    u = torch.zeros(n, dtype=acc, device=a_in.device)  # running sum e_a (a - b)
    for lo, hi in _blocks(v):
        xa, xb = _x(a_in, lo, hi, temp), _x(b_in, lo, hi, temp)
        m_new = torch.maximum(m, torch.stack([xa.amax(dim=1), xb.amax(dim=1)]))
        r, _ = _rescale(m, m_new)
        s, u = r * s, r[0] * u
        ea = (xa - _finite_or_zero(m_new[0])[:, None]).exp()
        s[0] += ea.sum(dim=1)
        s[1] += (xb - _finite_or_zero(m_new[1])[:, None]).exp().sum(dim=1)
        u += _p_times(ea, xa - xb).sum(dim=1)
        m = m_new
    big_m = all_reduce(m.clone(), call.group, "max")
    r, _ = _rescale(m, big_m)
    sums = torch.cat([r * s, (r[0] * u)[None]])
    all_reduce(sums, call.group, "sum")
    big_m = _finite_or_zero(big_m)
    log_sa, log_sb = sums[0].log(), sums[1].log()
    value = _masked(sums[2] / sums[0] - (big_m[0] - big_m[1]) - log_sa + log_sb, mask)
    stats = torch.stack([big_m[0], big_m[1], log_sa, log_sb, value])
    return value, KLState(student, teacher, stats, mask)


def _kl_backward(call, state: KLState, grad, reverse: bool):
    student, teacher, stats, mask = state.student, state.teacher, state.stats, state.mask
    a_in, b_in = (student, teacher) if reverse else (teacher, student)
    need_s, need_t = call.needs_grad
    need_a, need_b = (need_s, need_t) if reverse else (need_t, need_s)
    ma, mb, log_sa, log_sb, kl = stats
    temp = call.options["temperature"]
    scale = (grad / temp)[:, None]
    grad_a = torch.empty_like(a_in) if need_a else None
    grad_b = torch.empty_like(b_in) if need_b else None
    keep = None if mask is None else mask[:, None]
    for lo, hi in _blocks(a_in.shape[1]):
        logpa = _x(a_in, lo, hi, temp).sub_(ma[:, None]).sub_(log_sa[:, None])
        logpb = _x(b_in, lo, hi, temp).sub_(mb[:, None]).sub_(log_sb[:, None])
        pa = logpa.exp()
        if grad_a is not None:
            d = _p_times(pa, logpa - logpb - kl[:, None]) * scale
            grad_a[:, lo:hi] = d if keep is None else torch.where(keep, d, torch.zeros_like(d))
        if grad_b is not None:
            d = (logpb.exp() - pa) * scale
            grad_b[:, lo:hi] = d if keep is None else torch.where(keep, d, torch.zeros_like(d))
    return (grad_a, grad_b) if reverse else (grad_b, grad_a)


# -- the backend ---------------------------------------------------------------------------


class BlockwiseBackend(Backend):
    """Entropy and KL by a one-pass streaming softmax over vocabulary blocks.

    Capabilities are a promise: everything listed here is checked by the conformance kit
    (``vtp_runtime.testing.conformance``), and everything not listed is refused by dispatch.
    fp16 is left out on purpose (not validated yet), so dispatch refuses it.
    """

    name = "example_blockwise"
    # The memory layout forward() accepts (vtp_runtime.backend.INPUT_LAYOUTS): plain torch
    # ops take any strides. A kernel that reads columns at unit stride declares
    # "unit_vocab_stride" (the default) and the core copies anything else.
    input_layout = "any"
    # Below eager (0): an example must never win auto-selection by being installed.
    # Use it with VTP_BACKEND=example_blockwise, use_backend(...) or backend=...
    priority = -10
    _DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float64})
    ops = {  # device_types=None: pure PyTorch, any device torch runs on
        "entropy": OpCapability(device_types=None, dtypes=_DTYPES, features=frozenset({"mask", "temperature"})),
        "kl": OpCapability(
            device_types=None, dtypes=_DTYPES, features=frozenset({"mask", "temperature", "reverse", "teacher_grad"})
        ),
    }

    def probe(self, device_type: str) -> list[str]:
        # Nothing to probe for pure PyTorch. A real backend returns reasons here (a missing
        # import, no device, too old a compute capability) and never raises.
        return []

    def forward(self, call, inputs, index, mask):
        if call.op == "entropy":
            return _entropy_forward(call, inputs[0], mask)
        student, teacher = inputs
        return _kl_forward(call, student, teacher, mask, reverse=call.options["reverse"])

    def backward(self, call, state, grad):
        if call.op == "entropy":
            return _entropy_backward(call, state, grad)
        return _kl_backward(call, state, grad, reverse=call.options["reverse"])


@hookimpl
def vtp_runtime_register_backends(register):
    register(BlockwiseBackend())
