"""The ops: their inputs, options, defaults and the exact math every backend implements.

Notation, per token: ``x = z / T`` (T = ``temperature``), ``p = softmax(x)`` over the
**global** vocabulary of size V, ``lse = logsumexp(x)``. Values are per token, in fp32
(fp64 for fp64 inputs), identical on every rank of the TP group.

==================  ===============================================  ==========================================
op                  value per token                                  gradient w.r.t. x (times upstream g; 1/T on z)
==================  ===============================================  ==========================================
cross_entropy       (1-e)(lse - x[y]) + e(lse - mean_j x_j) + l*lse^2   p - (1-e) onehot(y) - e/V + 2 l lse p
logprobs            x[i] - lse  (i is [N] or [N, k])                 sum_k g_k onehot(i_k) - (sum_k g_k) p
logprobs with       (x[i] - lse, H) from one read of the logits      the logprobs and entropy gradients, summed:
return_entropy                                                       g . (onehot - p) + g_H (-p (log p + H))
entropy             H = -sum p log p                                 -p (log p + H)
kl (A || B)         sum p_A (log p_A - log p_B)                      dA = p_A (log p_A - log p_B - KL), dB = p_B - p_A
kl with a TopK      sum_k p_t,k (log p_t,k - log p_s,k) over the     autograd through the student's top-k
teacher             teacher's k ids; tail: + r_t log(r_t / r_s),     log-probs (vtp_runtime/topk.py; backends
                    r = 1 - sum_k p_k                                run only its top-k logprobs)
jsd                 b KL(p_t || M) + (1-b) KL(p_s || M),             dz_s = (1-b) p_s (log p_s - log M - KL(p_s||M))
                    M = b p_t + (1-b) p_s                            dz_t = b p_t (log p_t - log M - KL(p_t||M))
==================  ===============================================  ==========================================

- ``kl``: forward (``reverse=False``) is KL(p_t || p_s) (A = teacher); reverse is KL(p_s || p_t).
- ``jsd``: ``beta=0`` **is** forward KL(p_t || p_s) and ``beta=1`` **is** reverse KL(p_s || p_t),
  explicit branches (the interior formula tends to 0 at both ends).
- Label smoothing averages over the global V; z-loss is ``l * lse^2``.
- Masked tokens (``ignore_index`` labels/index entries, or ``mask`` False) give exactly 0
  value and exactly 0 gradient. ``logprobs`` with ``return_entropy=True``: a token's entropy
  is masked (0) when every entry of its index is ``ignore_index`` (one entry for an ``[N]``
  index, all k for ``[N, k]``). An index outside ``[0, V)`` that is not ``ignore_index``
  gives NaN for that token (value and gradient), never a silently wrong number (the
  entropy, which does not depend on the index, stays finite; the row's gradient is NaN).
- ``0 * log 0 = 0``; KL is ``+inf`` where the weighting distribution has mass the other
  lacks; an unmasked row of all ``-inf`` gives NaN in that row only.

Two ops return token ids instead of a value (``OpSpec.returns_ids``; see
``vtp_runtime/sampling.py``): ``argmax`` (the lowest global id of each row's largest logit)
and ``sample`` (a draw from ``softmax(z / T)`` restricted by ``top_k``, then ``top_p``, then
``min_p``). They are int64 ``[N]``, not differentiable, and take no reduction, normalizer or
mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

# Features a call may use beyond the plain op, each with how a call turns it on: from its
# options, whether its index has a top-k dimension, whether its teacher requires grad. A
# backend declares the ones it supports, per op; ``OpSpec.features`` says which apply to an op.
_USES: dict[str, Callable[[Mapping[str, Any], bool, bool], bool]] = {
    "label_smoothing": lambda options, topk, teacher_grad: options["label_smoothing"] != 0.0,
    "z_loss": lambda options, topk, teacher_grad: options["z_loss"] != 0.0,
    "temperature": lambda options, topk, teacher_grad: options["temperature"] != 1.0,
    "topk": lambda options, topk, teacher_grad: topk,  # logprobs with an index [..., k]
    "mask": lambda options, topk, teacher_grad: options["mask"] is not None or options["labels"] is not None,
    "reverse": lambda options, topk, teacher_grad: bool(options["reverse"]),
    "teacher_grad": lambda options, topk, teacher_grad: teacher_grad,
    # logprobs: also the entropy of each token, from the same read of the logits
    "return_entropy": lambda options, topk, teacher_grad: bool(options["return_entropy"]),
}
FEATURES = tuple(_USES)

REDUCTIONS = ("none", "sum", "mean")


@dataclass(frozen=True)
class OpSpec:
    name: str
    inputs: tuple[str, ...]  # floating-point logits inputs, in call order
    index: str | None  # name of the integer index input, if any
    options: Mapping[str, Any]  # op-specific options and their defaults
    features: tuple[str, ...]  # the FEATURES that apply to this op
    # the op returns int64 token ids (argmax, sample): no gradient, no reduction, no mask,
    # and it runs outside the autograd Function (vtp_runtime/sampling.py)
    returns_ids: bool = False


_MASKING = {"mask": None, "labels": None, "ignore_index": -100}

OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec(
            "cross_entropy",
            ("logits",),
            "labels",
            {"ignore_index": -100, "label_smoothing": 0.0, "z_loss": 0.0},
            ("label_smoothing", "z_loss", "temperature"),
        ),
        OpSpec(
            "logprobs",
            ("logits",),
            "index",
            {"ignore_index": -100, "return_entropy": False},
            ("topk", "temperature", "return_entropy"),
        ),
        OpSpec("entropy", ("logits",), None, dict(_MASKING), ("mask", "temperature")),
        OpSpec(
            "kl",
            ("student_logits", "teacher_logits"),
            None,
            {"reverse": False, **_MASKING},
            ("mask", "temperature", "reverse", "teacher_grad"),
        ),
        OpSpec(
            "jsd",
            ("student_logits", "teacher_logits"),
            None,
            {"beta": 0.5, **_MASKING},
            ("mask", "temperature", "teacher_grad"),
        ),
        OpSpec("argmax", ("logits",), None, {}, (), returns_ids=True),
        # seed is required: None stands for "not given" and is refused by check_options
        OpSpec(
            "sample",
            ("logits",),
            None,
            {"seed": None, "top_k": None, "top_p": None, "min_p": None},
            (),
            returns_ids=True,
        ),
    )
}
# the ops whose value is a loss (everything but argmax and sample)
LOSSES = tuple(name for name, spec in OPS.items() if not spec.returns_ids)
# per op, the (feature, how a call uses it) pairs features_of tests: built once, it is on every call's path
_FEATURE_TESTS = {name: tuple((f, _USES[f]) for f in spec.features) for name, spec in OPS.items()}

# Options every op takes; handled by the core, not by backends.
COMMON_OPTIONS: dict[str, Any] = {
    "tp_group": None,
    "temperature": 1.0,
    "reduction": "none",
    "normalizer": None,
    "vocab_start": None,
    "vocab_end": None,
    "global_vocab_size": None,
    "backend": None,
}


# Scalar options are given one Python type before they are checked and compared across ranks,
# so that equal values agree: temperature=2 on one rank and 2.0, np.float32(2) or
# torch.tensor(2.) on another.
FLOAT_OPTIONS = frozenset({"temperature", "label_smoothing", "z_loss", "beta", "normalizer", "top_p", "min_p"})
SCALAR_OPTIONS = FLOAT_OPTIONS | {
    "seed",
    "top_k",
    "ignore_index",
    "vocab_start",
    "vocab_end",
    "global_vocab_size",
    "reverse",
    "return_entropy",
}


def _python_scalar(name: str, value: Any) -> Any:
    """A numpy scalar or a 0-d CPU tensor as the Python number it holds; anything else as is."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            return value
        if value.device.type != "cpu":
            raise ValueError(
                f"{name} is a tensor on {value.device}; pass a Python number (reading a "
                f"device tensor would wait for the device)"
            )
        return value.item()
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()
    return value


def normalize_options(options: dict[str, Any], given: Iterable[str]) -> None:
    """Give the scalar options among ``given`` one Python type each, in place: numpy scalars
    and 0-d CPU tensors become Python numbers, and ints of float options floats. A tensor
    ``normalizer`` stays a tensor (it is never read on the host)."""
    for name in given:
        if name not in SCALAR_OPTIONS:
            continue
        value = options[name]
        if (
            type(value) not in (int, float, bool)
            and value is not None
            and not (name == "normalizer" and isinstance(value, torch.Tensor))
        ):
            value = _python_scalar(name, value)
        if type(value) is int and name in FLOAT_OPTIONS:
            value = float(value)
        options[name] = value


def get_spec(op: str) -> OpSpec:
    try:
        return OPS[op]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; the ops are: {', '.join(OPS)}") from None


def check_options(spec: OpSpec, options: Mapping[str, Any]) -> None:
    """Validate option values (not tensors). Raises ValueError (TypeError for a value of the
    wrong kind) with what to change."""
    if spec.returns_ids:
        _check_sampling_options(spec, options)
        return
    t = options["temperature"]
    # comparisons rather than math.isfinite: under torch.compile(dynamic=True) numbers are symbols
    if not (isinstance(t, (int, float)) and 0 < t < math.inf):
        raise ValueError(f"temperature must be a finite number > 0, got {t!r}")
    if options["reduction"] not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {options['reduction']!r}")
    n = options["normalizer"]
    if isinstance(n, torch.Tensor):  # e.g. HF Trainer's num_items_in_batch; not read (no host sync):
        if n.numel() != 1 or n.is_complex():  # a value that is not finite and > 0 gives NaN instead
            raise ValueError(f"normalizer must be a number or a one-element tensor, got shape {tuple(n.shape)}")
    elif n is not None and not (isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n) and n > 0):
        raise ValueError(f"normalizer must be a finite number > 0 (e.g. num_items_in_batch), got {n!r}")
    if not isinstance(options.get("ignore_index", -100), int):
        raise ValueError(f"ignore_index must be an int, got {options['ignore_index']!r}")
    if spec.name == "cross_entropy":
        eps, lam = options["label_smoothing"], options["z_loss"]
        if not (isinstance(eps, (int, float)) and 0.0 <= eps <= 1.0):
            raise ValueError(f"label_smoothing must be in [0, 1], got {eps!r}")
        if not (isinstance(lam, (int, float)) and 0.0 <= lam < math.inf):
            raise ValueError(f"z_loss must be a finite number >= 0, got {lam!r}")
    if spec.name == "jsd":
        beta = options["beta"]
        if not (isinstance(beta, (int, float)) and 0.0 <= beta <= 1.0):
            raise ValueError(f"beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta!r}")
    if spec.name == "logprobs" and not isinstance(options["return_entropy"], bool):
        raise ValueError(f"return_entropy must be a bool, got {options['return_entropy']!r}")
    if spec.name == "kl" and not isinstance(options["reverse"], bool):
        raise ValueError(f"reverse must be a bool, got {options['reverse']!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_sampling_options(spec: OpSpec, options: Mapping[str, Any]) -> None:
    """argmax and sample: what a loss takes (reduction, normalizer) does not apply."""
    name = spec.name
    if options["reduction"] != "none":
        raise ValueError(f"{name} returns token ids: reduction does not apply (got reduction={options['reduction']!r})")
    if options["normalizer"] is not None:
        raise ValueError(f"{name} returns token ids: normalizer does not apply")
    t = options["temperature"]
    # temperature 0 is greedy decoding; argmax ignores the temperature (it moves no maximum)
    if not (_is_number(t) and 0 <= t < math.inf):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {t!r}")
    if name != "sample":
        return
    seed = options["seed"]
    if seed is None:
        raise TypeError("sample needs seed= (an int, the same on every rank; a new one per step)")
    if not _is_int(seed):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    k = options["top_k"]
    if k is not None:
        if not _is_int(k):
            raise TypeError(f"top_k must be an int or None, got {type(k).__name__} {k!r}")
        if k < 1:
            raise ValueError(f"top_k must be >= 1 (None: no top-k), got {k}")
    p = options["top_p"]
    if p is not None and not (_is_number(p) and 0 < p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (None or 1: no top-p), got {p!r}")
    mp = options["min_p"]
    if mp is not None and not (_is_number(mp) and 0 <= mp <= 1):
        raise ValueError(f"min_p must be in [0, 1] (None or 0: no min-p), got {mp!r}")


def kl_direction(op: str, options: Mapping[str, Any]) -> bool | None:
    """For a call that is a plain KL -- ``kl``, or ``jsd`` at ``beta`` 0 or 1 -- whether it
    is reverse KL(p_s || p_t); None for an interior JSD (and for the other ops)."""
    if op == "kl":
        return bool(options["reverse"])
    if op == "jsd" and options["beta"] in (0.0, 1.0):
        return options["beta"] == 1.0
    return None


def features_of(op: str, options: Mapping[str, Any], *, topk: bool, teacher_grad: bool) -> frozenset[str]:
    """The features (see FEATURES) a call uses; dispatch matches them against capabilities.
    ``options`` holds every option of ``op`` (defaults filled in)."""
    return frozenset([f for f, uses in _FEATURE_TESTS[op] if uses(options, topk, teacher_grad)])
