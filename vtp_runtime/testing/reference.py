"""The float64 dense reference every backend is tested against.

It works on the **full** (unsharded) logits, straight from the definitions in
``vtp_runtime.ops`` with ``torch.log_softmax`` in float64, and gets gradients from autograd.
It shares no code with any backend, so it can disagree with them.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def _safe_mul(p: Tensor, log_ratio: Tensor) -> Tensor:
    """``p * log_ratio`` with ``0 * anything = 0``, NaN-free in backward too."""
    pos = p > 0
    return p * torch.where(pos, log_ratio, torch.zeros_like(log_ratio))


def _kl(logp_a: Tensor, logp_b: Tensor) -> Tensor:
    return _safe_mul(logp_a.exp(), logp_a - logp_b).sum(-1)


def _needed(op: str, index: Tensor | None) -> Tensor:
    if index is None:
        raise ValueError(f"the {op} reference needs index (labels / token ids)")
    return index


def values(
    op: str,
    logits: tuple[Tensor, ...],
    index: Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reverse: bool = False,
    beta: float = 0.5,
    mask: Tensor | None = None,
    labels: Tensor | None = None,
) -> Tensor:
    """Per-token float64 values of ``op`` on full logits ``[N, V]`` (differentiable)."""
    n = logits[0].shape[0]
    keep = torch.ones(n, dtype=torch.bool, device=logits[0].device)
    if mask is not None:
        keep &= mask
    if labels is not None:
        keep &= labels != ignore_index
    if op == "cross_entropy":
        keep &= _needed(op, index) != ignore_index
    if op == "logprobs":  # a token whose every index entry is ignored is masked
        idx = _needed(op, index)
        keep &= ((idx if idx.dim() == 2 else idx[:, None]) != ignore_index).any(-1)
    # masked rows get zero logits so that nothing non-finite flows through autograd there
    xs = [torch.where(keep[:, None], z.double() / temperature, torch.zeros((), dtype=torch.float64)) for z in logits]
    logps = [torch.log_softmax(x, dim=-1) for x in xs]
    big_v = logits[0].shape[-1]

    if op == "cross_entropy":
        y = _needed(op, index)
        bad = (y != ignore_index) & ((y < 0) | (y >= big_v))
        yy = torch.where(keep & ~bad, y, torch.zeros_like(y))
        nll = -logps[0].gather(-1, yy[:, None]).squeeze(-1)
        out = (1 - label_smoothing) * nll
        if label_smoothing:
            out = out - label_smoothing * logps[0].mean(-1)
        if z_loss:
            out = out + z_loss * torch.logsumexp(xs[0], -1) ** 2
        out = torch.where(bad, torch.full_like(out, math.nan), out)
    elif op == "logprobs":
        index_ids = _needed(op, index)
        idx = index_ids if index_ids.dim() == 2 else index_ids[:, None]
        valid = idx != ignore_index
        bad = valid & ((idx < 0) | (idx >= big_v))
        got = logps[0].gather(-1, torch.where(valid & ~bad, idx, torch.zeros_like(idx)))
        got = torch.where(bad, torch.full_like(got, math.nan), got)
        out = torch.where(valid & keep[:, None], got, torch.zeros_like(got))
        return out if index_ids.dim() == 2 else out[:, 0]
    elif op == "entropy":
        out = -_safe_mul(logps[0].exp(), logps[0]).sum(-1)
    elif op == "kl":
        ls, lt = logps
        out = _kl(ls, lt) if reverse else _kl(lt, ls)
    elif op == "jsd":
        ls, lt = logps
        if beta == 0.0:
            out = _kl(lt, ls)
        elif beta == 1.0:
            out = _kl(ls, lt)
        else:
            mix = beta * lt.exp() + (1 - beta) * ls.exp()
            log_mix = torch.where(mix > 0, mix, torch.ones_like(mix)).log()
            log_mix = torch.where(mix > 0, log_mix, torch.full_like(log_mix, -math.inf))
            out = beta * _kl(lt, log_mix) + (1 - beta) * _kl(ls, log_mix)
    else:
        raise ValueError(f"unknown op {op!r}")
    return torch.where(keep, out, torch.zeros_like(out))


def values_and_grads(
    op: str,
    logits: tuple[Tensor, ...],
    index: Tensor | None = None,
    grad_output: Tensor | None = None,
    *,
    needs_grad: tuple[bool, ...] | None = None,
    **options,
) -> tuple[Tensor, tuple[Tensor | None, ...]]:
    """Values and float64 gradients of ``sum(values * grad_output)`` w.r.t. each logits input
    (None where ``needs_grad`` is False). ``grad_output`` defaults to ones."""
    needs_grad = needs_grad or (True,) * len(logits)
    leaves = tuple(z.detach().double().requires_grad_(need) for z, need in zip(logits, needs_grad))
    with torch.enable_grad():
        out = values(op, leaves, index, **options)
        g = torch.ones_like(out) if grad_output is None else grad_output.double()
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        grads = torch.autograd.grad((out * g).sum(), wanted, allow_unused=True) if wanted else ()
    it = iter(grads)
    return out.detach(), tuple(next(it) if need else None for need in needs_grad)


def topk_kl(
    student: Tensor,
    teacher_logprobs: Tensor,
    index: Tensor,
    *,
    temperature: float = 1.0,
    reverse: bool = False,
    tail: bool = False,
    ignore_index: int = -100,
    mask: Tensor | None = None,
    labels: Tensor | None = None,
) -> Tensor:
    """Per-token float64 KL against a teacher given by its log-probs at ``index`` (``[N, k]``;
    ``ignore_index`` entries are padding), on full student logits ``[N, V]``, differentiable
    w.r.t. the student and the teacher's log-probs. The student's residual mass is summed over
    the ids outside the k directly (no ``1 - sum`` cancellation); the teacher's is ``1 - sum``
    of what it gives (there is nothing else to sum)."""
    n, v = student.shape
    keep = torch.ones(n, dtype=torch.bool, device=student.device)
    if mask is not None:
        keep &= mask
    if labels is not None:
        keep &= labels != ignore_index
    valid = (index != ignore_index) & keep[:, None]
    x = torch.where(keep[:, None], student.double() / temperature, torch.zeros((), dtype=torch.float64))
    logp_all = torch.log_softmax(x, dim=-1)
    ids = torch.where(valid, index, torch.zeros_like(index))
    ls = logp_all.gather(-1, ids)
    lt = torch.where(valid, teacher_logprobs.double(), torch.zeros((), dtype=torch.float64))
    in_k = torch.zeros(n, v, dtype=torch.float64, device=student.device).scatter_add(1, ids, valid.double()) > 0
    r_s = torch.where(in_k, torch.zeros_like(logp_all), logp_all.exp()).sum(-1)
    r_t = 1 - torch.where(valid, lt.exp(), torch.zeros_like(lt)).sum(-1)
    a, b, r_a, r_b = (ls, lt, r_s, r_t) if reverse else (lt, ls, r_t, r_s)
    out = _safe_mul(torch.where(valid, a.exp(), torch.zeros_like(a)), a - b).sum(-1)
    if tail:
        log_ra = torch.where(r_a > 0, r_a, torch.ones_like(r_a)).log()
        log_rb = torch.where(r_b > 0, r_b, torch.ones_like(r_b)).log()
        log_rb = torch.where(r_b > 0, log_rb, torch.full_like(log_rb, -math.inf))
        out = out + _safe_mul(r_a, log_ra - log_rb)
    return torch.where(keep, out, torch.zeros_like(out))


# -- sampling -----------------------------------------------------------------------------------


def argmax(logits: Tensor) -> Tensor:
    """The lowest id of each row's largest logit, NaN counted as ``+inf`` (int64 ``[N]``;
    ``torch.argmax`` of the full logits outside NaN)."""
    x = torch.nan_to_num(logits.double(), nan=math.inf, posinf=math.inf, neginf=-math.inf)
    ids = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    return torch.where(x == x.amax(-1, keepdim=True), ids, x.shape[-1]).amin(-1) % max(x.shape[-1], 1)


def sampling_distribution(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> Tensor:
    """The float64 distribution ``sample`` draws from, ``[N, V]`` on full logits ``[N, V]``:
    ``softmax(x / T)`` restricted in transformers' order -- top-k keeps the logits ``>=`` the
    k-th largest (ties kept), top-p keeps the tokens whose mass before them, in the order
    (logit desc, id asc) of the top-k-renormalized distribution, is below ``top_p``, min-p keeps
    ``p >= min_p * p_max`` -- then renormalized. ``temperature=0`` is a point mass at the argmax."""
    n, v = logits.shape
    x = logits.double()
    if temperature == 0:
        return torch.nn.functional.one_hot(argmax(x), v).double()
    x = x / temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if top_k is not None and top_k < v:
        kth = torch.sort(x, dim=-1, descending=True).values[:, top_k - 1 : top_k]
        keep &= x >= kth
    if top_p is not None and top_p < 1:
        p = torch.softmax(torch.where(keep, x, -math.inf), -1)
        # (logit desc, id asc): a stable sort of the ids by decreasing logit
        order = torch.sort(x, dim=-1, descending=True, stable=True).indices
        p_sorted = p.gather(-1, order)
        before = torch.cumsum(p_sorted, -1) - p_sorted
        keep_sorted = before < top_p
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    if min_p is not None and min_p > 0:
        p = torch.softmax(torch.where(keep, x, -math.inf), -1)
        keep &= p >= min_p * p.amax(-1, keepdim=True)
    return torch.softmax(torch.where(keep, x, -math.inf), -1)
