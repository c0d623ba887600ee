"""The ``liger`` backend: liger-kernel's vocabulary-parallel cross entropy and JSD.

What it runs, and what it refuses (dispatch never selects it for a refused call; forcing it
raises with the reasons):

``cross_entropy`` — ``LigerVocabParallelCEFunction`` (liger-kernel >= 0.8.1), any TP size.

- Even shards in rank order only: Liger computes ``vocab_start = rank * V_local`` itself
  and is silently wrong for any other layout (uneven, empty or permuted shards).
- No ``z_loss``, no ``temperature`` (Liger has neither; emulating them would copy the
  logits). No ``label_smoothing``: Liger's "global" smoothing mode has the right formula,
  but computes ``mean log p`` as ``log(exp(x - max))`` in fp32, which is ``-inf`` for any
  logit more than ~104 nats below the row max (a vocabulary padded with -1e4, say), so the
  loss is ``inf`` where the true value is finite. Refused rather than silently wrong.
- Liger's own ``forward``/``backward`` are called with a context object we own, so we know
  exactly what it saves: an fp32 ``[N, V_local]`` buffer of ``exp(x - max)``, which its
  backward kernel **overwrites with the gradient**. A second backward through a retained
  graph therefore raises a clear error (a CPU flag in the saved state, no device sync).
- Labels outside ``[0, V)`` (other than ``ignore_index``): Liger treats them as "owned by
  no rank" and returns ``lse`` — silently wrong. Here the value and the gradient row are NaN
  (the NaN goes in through the upstream gradient Liger multiplies by).

``cross_entropy`` with ``vtp.Head`` inputs (the fused head; sum/mean results only, since
Liger computes the head's gradients in its forward pass for an upstream gradient of ones):

- TP = 1: Liger's fused linear cross entropy (``fused_linear_cross_entropy_forward``, the
  function behind ``LigerFusedLinearCrossEntropyFunction``) with ``reduction="none"``, which
  returns per-token losses and, in the same pass, the gradients of hidden, weight and bias;
  backward scales them by the upstream gradient. Labels outside ``[0, V)`` are passed to
  Liger as ``ignore_index`` (it would read out of bounds) and their values and gradients
  set to NaN here.
- TP > 1 (even shards): the generic token-chunk driver of ``vtp_runtime.head_chunks`` with the
  vocabulary-parallel CE above on each chunk (its fp32 softmax buffer is per chunk); a
  sequence-parallel Head too (the driver gathers each chunk's hidden rows).
- ``reduction="none"`` with a Head is refused (``HeadSupport(per_token=False)``).

``kl`` and ``jsd`` — Liger's JSD primitive (``jsd_loss_and_grad``, the kernel behind
``LigerJSDFunction``) at TP = 1 only (it has no cross-rank statistics).

- ``LigerJSDFunction`` itself returns only the mean over tokens; the primitive returns the
  per-element loss tile and the gradient w.r.t. the student log-probs, so the per-token
  values our contract needs come from the same kernel. Liger's beta convention is ours
  (input = student log Q, target = teacher log P; beta=0 forward KL(P||Q), beta=1 reverse
  KL(Q||P), explicit branches). ``kl`` maps to beta=0 (forward) / beta=1 (reverse).
- It needs log-probs: computed here in fp32 from ``z / T`` (so ``temperature`` is exact).
  Liger's kernel gives NaN where both inputs are ``-inf`` at the same vocabulary entry
  (``-inf - -inf``); -inf log-probs are therefore floored to -1e30 (``exp`` of it is exactly
  0), and rows where the KL's weighting distribution has mass the other lacks are set to
  ``+inf`` explicitly (the floor would make them huge but finite).
- Student gradients only (Liger gives no teacher gradient): ``teacher_grad`` is refused.
  The saved Liger gradient is only read in backward, so a second backward is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch

from vtp_runtime import env
from vtp_runtime.backend import LOW_DTYPES, Call, HeadDriver, HeadSupport, OpCapability, SavedState, TakesHead
from vtp_runtime.head_chunks import TokenChunks
from vtp_runtime.registry import hookimpl

MIN_VERSION = (0, 8, 1)
DEVICE_TYPES = frozenset({"cuda", "cpu"})  # cpu only under TRITON_INTERPRET=1 (tests)
LOGP_FLOOR = -1e30  # stands in for -inf log-probs inside Liger's JSD kernel

Tensor = torch.Tensor


class SecondBackwardError(RuntimeError):
    """A second backward through a Liger cross entropy whose saved buffer was consumed."""


def _version_tuple(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def liger_version() -> str | None:
    for dist in ("liger-kernel", "liger_kernel", "liger-kernel-nightly"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


class _Ctx:
    """Stands in for an autograd context when calling Liger's Function methods directly."""

    def save_for_backward(self, *tensors: Tensor) -> None:
        self.saved_tensors = tensors


def _ce_module():
    from liger_kernel.ops import vocab_parallel_cross_entropy as mod

    return mod


def _jsd_primitive():
    import liger_kernel.ops.jsd  # noqa: F401  (declares the jsd_loss_and_grad op)
    from liger_kernel.backends import dispatch

    return dispatch


_CAP: dict[str, Any] = dict(device_types=DEVICE_TYPES, dtypes=LOW_DTYPES, empty_shards=False)


class LigerBackend(TakesHead):
    name = "liger"
    priority = 10
    # Liger's kernels step through rows by their stride and read columns at stride 1; the
    # log-probs handed to its JSD kernel are computed from the input and keep its memory
    # layout (a transposed input gives transposed log-probs), so inputs come contiguous
    input_layout = "contiguous"
    ops = {
        "cross_entropy": OpCapability(**_CAP, even_shards_only=True),
        "kl": OpCapability(**_CAP, tp_sizes=frozenset({1}), features=frozenset({"mask", "reverse", "temperature"})),
        "jsd": OpCapability(**_CAP, tp_sizes=frozenset({1}), features=frozenset({"mask", "temperature"})),
    }
    # Liger computes the head's gradients in its forward pass: sum/mean results only. A
    # sequence-parallel Head at TP > 1 runs through the core's token-chunk driver (which
    # gathers its chunks), as every TP > 1 Head call here does
    head_ops = {"cross_entropy": HeadSupport(per_token=False, sequence_parallel=True)}

    def probe(self, device_type: str) -> list[str]:
        version = liger_version()
        if version is None:
            return ["liger-kernel is not installed (pip install 'vtp-runtime[liger]')"]
        if _version_tuple(version) < MIN_VERSION:
            return [
                f"liger-kernel {version} is too old (needs >= {'.'.join(map(str, MIN_VERSION))}; "
                f"it lacks LigerVocabParallelCEFunction)"
            ]
        reasons = []
        try:
            import triton  # noqa: F401
        except Exception as exc:
            reasons.append(f"triton cannot be imported ({type(exc).__name__}: {exc})")
        if device_type == "cuda":
            if not torch.cuda.is_available():
                reasons.append("no CUDA device (torch.cuda.is_available() is False)")
            elif torch.version.hip is not None:
                reasons.append("ROCm build of torch: the liger backend is validated on NVIDIA CUDA only")
        elif device_type == "cpu":
            if not env.triton_interpret():
                reasons.append("cpu tensors need TRITON_INTERPRET=1 (Triton's interpreter; for tests)")
        else:  # refused by the declared device types, with their own line
            return []
        if reasons:
            return reasons
        try:
            mod = _ce_module()
            mod.LigerVocabParallelCEFunction  # noqa: B018
        except Exception as exc:
            return [
                f"liger-kernel {version}: LigerVocabParallelCEFunction cannot be imported ({type(exc).__name__}: {exc})"
            ]
        return []

    def head_driver(self, call):
        if call.op == "cross_entropy" and call.request.tp_size == 1:
            return FUSED_LINEAR_CE
        return None  # the generic token-chunk driver, with the vocabulary-parallel CE per chunk

    def head_logits_route(self, device_type, request=None, options=None, parts=()):
        chunks = super().head_logits_route(device_type, request, options, parts)
        if request is None:
            return f"Liger's fused linear cross entropy at TP 1, else {chunks}"
        if request.op == "cross_entropy" and request.tp_size == 1:
            return "Liger's fused linear cross entropy (its own chunks)"
        return chunks

    def forward(self, call, inputs, index, mask):
        for t in inputs:
            if not t.is_contiguous():
                raise RuntimeError(
                    f"liger: inputs must be contiguous [N, V_local] (input_layout = "
                    f"'contiguous'); got strides {t.stride()} for shape {tuple(t.shape)}"
                )
        if call.op == "cross_entropy":
            return _ce_forward(call, inputs[0], index)
        return _div_forward(call, inputs, mask)

    def backward(self, call, state, grad):
        if call.op == "cross_entropy":
            return _ce_backward(call, state, grad)
        return _div_backward(call, state, grad)


# -- cross entropy -------------------------------------------------------------------------


@dataclass
class CrossEntropyState(SavedState):
    """What Liger's forward saved, and the flag that guards its one backward."""

    exp_buf: Tensor  # fp32 [N, V_local] exp(x - max); Liger's backward overwrites it
    sum_exp: Tensor  # [N]
    target: Tensor  # int64 [N] labels
    consumed: Tensor  # uint8 [1] on the CPU: 1 once backward has run


def _bad_labels(labels: Tensor, call: Call) -> Tensor:
    ii = call.options["ignore_index"]
    return (labels != ii) & ((labels < 0) | (labels >= call.vocab_size))


def _expected_ctx(call: Call, n: int, v: int, dtype: torch.dtype) -> dict:
    """The attributes Liger's backward reads, rebuilt from the call (verified in forward)."""
    mod = _ce_module()
    return dict(
        alpha_eff=0.0,
        eps_eff=0.0,
        has_smoothing=False,
        vocab_start=call.vocab_start,
        v_local=v,
        ignore_index=call.options["ignore_index"],
        orig_dtype=dtype,
        orig_shape=(n, 1),
        block_size=mod._select_block_size(v),
    )


def _ce_forward(call: Call, z: Tensor, labels: Tensor):
    n, v = z.shape
    # Liger derives vocab_start = rank * V_local; dispatch only selects it for even shards in
    # rank order, and this re-check costs nothing (host ints).
    if call.vocab_start != call.rank * v:
        raise RuntimeError(
            f"liger cross_entropy: rank {call.rank} holds [{call.vocab_start}, {call.vocab_end}) "
            f"but Liger would assume [{call.rank * v}, {(call.rank + 1) * v}); "
            f"dispatch should have refused this uneven layout"
        )
    mod = _ce_module()
    group = call.group if call.request.tp_size > 1 else None
    ctx = _Ctx()
    # [N, V] -> [N, 1, V]: Liger's [S, B, V] layout, a view (no copy for contiguous rows)
    loss = mod.LigerVocabParallelCEFunction.forward(
        ctx, z.unsqueeze(1), labels, group, call.options["ignore_index"], 0.0, "pytorch", "global"
    )
    state = {k: val for k, val in vars(ctx).items() if k != "saved_tensors"}
    expected = _expected_ctx(call, n, v, z.dtype)
    if state != expected:
        raise RuntimeError(
            f"liger-kernel {liger_version()}: LigerVocabParallelCEFunction saved {state}, "
            f"expected {expected}; this liger-kernel version is not supported by the liger "
            f"backend (force another backend, e.g. VTP_BACKEND=eager)"
        )
    exp_buf, sum_exp, target = ctx.saved_tensors
    value = loss.view(n)
    value = torch.where(_bad_labels(labels, call), torch.full_like(value, math.nan), value)
    consumed = torch.zeros(1, dtype=torch.uint8)  # CPU: checking it never syncs the device
    return value, CrossEntropyState(exp_buf, sum_exp, target, consumed)


def _ce_backward(call: Call, state: CrossEntropyState, grad):
    exp_buf, sum_exp, target, consumed = state.exp_buf, state.sum_exp, state.target, state.consumed
    if consumed[0]:
        raise SecondBackwardError(
            "liger cross_entropy: backward already ran once for this graph. Liger's kernel writes the "
            "gradient into the softmax buffer it saved, so a second backward (retain_graph=True, or "
            "create_graph=True followed by another backward) cannot be computed from it. Run backward "
            "once, or use a backend without this limit for this call, e.g. backend='eager' / "
            "VTP_BACKEND_CROSS_ENTROPY=eager."
        )
    n, v = exp_buf.shape
    ctx = _Ctx()
    ctx.saved_tensors = (exp_buf, sum_exp, target)
    for key, val in _expected_ctx(call, n, v, call.request.dtype).items():
        setattr(ctx, key, val)
    consumed.data.fill_(1)  # .data: no version bump, so the next backward reaches this check
    # NaN upstream gradient on out-of-range labels: Liger multiplies every column by it
    grad = torch.where(_bad_labels(target, call), torch.full_like(grad, math.nan), grad)
    grad_input = _ce_module().LigerVocabParallelCEFunction.backward(ctx, grad.view(n, 1))[0]
    return (grad_input.view(n, v),)


# -- cross entropy from a Head at TP = 1: Liger's fused linear cross entropy ----------------


def _flce_module():
    from liger_kernel.ops import fused_linear_cross_entropy as mod

    return mod


class FusedLinearCrossEntropy(HeadDriver):
    """Liger's fused linear cross entropy as the driver of a TP = 1 ``cross_entropy`` call
    whose input is a Head: per-token losses and the gradients for an upstream gradient of
    ones in one pass (``run.scalar`` only; dispatch refuses per-token results)."""

    def forward(self, run: TokenChunks) -> Tensor:
        (x,) = run.inputs
        call, labels = run.call, run.index
        run.upstream = None  # Liger computes the gradients for an upstream gradient of ones
        # dispatch hands this driver cross_entropy calls whose one input is a Head
        assert labels is not None and x.hidden is not None and x.weight is not None
        ii = call.options["ignore_index"]
        bad = _bad_labels(labels, call)
        nh, nw, nb, _ = x.needs
        grads = run.needs_grad
        # aliases that say which gradients Liger should compute (this runs under no_grad)
        hidden = x.hidden.detach().requires_grad_(grads)
        weight = x.weight.detach().requires_grad_(grads and nw)
        bias = None if x.bias is None else x.bias.detach()
        out = _flce_module().fused_linear_cross_entropy_forward(
            _input=hidden,
            weight=weight,
            target=torch.where(bad, torch.full_like(labels, ii), labels),
            bias=bias,
            ignore_index=ii,
            reduction="none",
        )
        loss = out[0]
        if loss.dim() != 1:
            raise RuntimeError(
                f"liger-kernel {liger_version()}: fused_linear_cross_entropy_forward did not return "
                f"per-token losses for reduction='none'; this version is not supported by the liger "
                f"backend's fused head (force another backend, e.g. backend='triton')"
            )
        value = torch.where(bad, torch.full_like(loss, math.nan), loss.float())
        if grads:
            d_hidden, d_weight, d_bias = out[-3:]  # the last three in every version
            if bool(bad.any()):  # Liger syncs on the label count anyway; a NaN row poisons every sum
                d_hidden[bad] = math.nan
                for d in (d_weight, d_bias):
                    if d is not None:
                        d.fill_(math.nan)
            x.grads = [d_hidden if nh else None, d_weight if nw else None, d_bias if nb else None, None]
        return value

    def backward(self, run: TokenChunks, grad: Tensor) -> None:
        raise RuntimeError(
            "the liger backend's fused linear cross entropy has no per-token backward; "
            "dispatch refuses reduction='none' with Head inputs for it"
        )


FUSED_LINEAR_CE = FusedLinearCrossEntropy()


# -- KL and JSD (TP = 1) -------------------------------------------------------------------


@dataclass
class DivergenceState(SavedState):
    student: Tensor  # [N, V]
    max: Tensor  # fp32 [N] row max of z / T (0 for an all -inf row)
    log_sum: Tensor  # fp32 [N] log sum exp(z / T - max)
    dlogq: Tensor  # fp32 [N, V] Liger's gradient w.r.t. the student log-probs
    total: Tensor  # fp32 [N] its row sums
    mask: Tensor | None = None  # bool [N]


def _beta(call: Call) -> float:
    if call.op == "kl":
        return 1.0 if call.options["reverse"] else 0.0
    return float(call.options["beta"])


def _log_probs(z: Tensor, t: float) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 ``log softmax(z / t)`` with its max anchor ``m`` and ``log s`` (so ``x - m`` is
    exact for a large common offset). An all ``-inf`` row gives NaN log-probs."""
    x = z.float()
    if t != 1.0:
        x = x / t
    m = x.amax(dim=1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    xm = x - m[:, None]
    log_s = torch.logsumexp(xm, dim=1)
    return xm - log_s[:, None], m, log_s


def _div_forward(call: Call, inputs, mask):
    student, teacher = inputs
    n, v = student.shape
    beta = _beta(call)
    t = call.options["temperature"]
    lps, m, log_s = _log_probs(student, t)
    lpt, _, _ = _log_probs(teacher, t)
    neg_s, neg_t = lps == -math.inf, lpt == -math.inf
    uncovered = None
    if beta == 0.0:  # KL(p_t || p_s) is +inf where the teacher has mass the student lacks
        uncovered = (neg_s & ~neg_t).any(dim=1)
    elif beta == 1.0:
        uncovered = (neg_t & ~neg_s).any(dim=1)
    lps.masked_fill_(neg_s, LOGP_FLOOR)
    lpt.masked_fill_(neg_t, LOGP_FLOOR)
    del neg_s, neg_t
    labels = None if mask is None else mask.to(torch.int64) - 1  # kept -> 0, masked -> -1
    dispatch = _jsd_primitive()
    # writes d loss / d log q into lps (its first argument) and returns the per-element loss
    tile, dlogq = dispatch("jsd_loss_and_grad", lps, lpt, labels, beta, -1, 1.0)
    del lpt
    value = tile.sum(dim=1)
    del tile
    if uncovered is not None:
        value = torch.where(uncovered, torch.full_like(value, math.inf), value)
    if mask is not None:
        value = torch.where(mask, value, torch.zeros_like(value))
    if not call.needs_grad[0]:
        return value, None
    return value, DivergenceState(student, m, log_s, dlogq, dlogq.sum(dim=1), mask)


def _div_backward(call: Call, state: DivergenceState | None, grad):
    if not call.needs_grad[0]:
        return (None, None)
    assert state is not None  # forward saves a state whenever the student needs a gradient
    student, m, log_s, dlogq, total, mask = (
        state.student,
        state.max,
        state.log_sum,
        state.dlogq,
        state.total,
        state.mask,
    )
    t = call.options["temperature"]
    x = student.float()
    if t != 1.0:
        x = x / t
    p = (x - m[:, None] - log_s[:, None]).exp_()
    # chain rule through log_softmax: dz = (dlogq - p * sum(dlogq)) * g / T
    d = (dlogq - p * total[:, None]).mul_((grad / t)[:, None])
    if mask is not None:
        d = torch.where(mask[:, None], d, torch.zeros_like(d))
    return (d.to(student.dtype), None)


@hookimpl
def vtp_runtime_register_backends(register):
    register(LigerBackend())
