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

Two ops return token ids instead of a value (``OpSpec.returns_ids``; the shared math is in
``vtp_runtime/sampling.py``): ``argmax`` (the lowest global id of each row's largest logit)
and ``sample`` (a draw from ``softmax(z / T)`` restricted by ``top_k``, then ``top_p``, then
``min_p``). They are int64 ``[N]``, not differentiable, and take no reduction, normalizer or
mask.

Every option of every op is declared once, as an ``Option`` of its ``OpSpec``: its default,
its type, the rule its value must meet, whether backends receive it, and the feature it
turns on. Defaults, the canonical form of a value (``Option.canonical``), the checks, the
cross-rank fingerprint, the plan signature, the custom ops' schema (``vtp_runtime.library``)
and the feature test all derive from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: how every message names a dtype."""
    return str(dtype).replace("torch.", "")


def _finite_positive(v: Any) -> bool:
    # comparisons rather than math.isfinite: under torch.compile(dynamic=True) numbers are symbols
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf


def _unit(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0


def _finite_non_negative(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v < math.inf


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _group_or_none(v: Any) -> bool:
    if v is None:
        return True
    dist = torch.distributed
    return dist.is_available() and isinstance(v, dist.ProcessGroup)


def _normalizer(v: Any) -> bool:
    if isinstance(v, torch.Tensor):  # e.g. HF Trainer's num_items_in_batch; never read on the host
        return v.numel() == 1 and not v.is_complex()
    return v is None or _finite_positive(v)


@dataclass(frozen=True)
class Option:
    """One option of an op.

    - ``kind``: the Python type a scalar value is given before it is checked and compared
      across ranks (``float``: ints, numpy scalars and 0-d CPU tensors become floats, so
      ``2``, ``2.0`` and ``np.float32(2)`` agree); None for options that are not scalars
      (tensors, groups, names).
    - ``rule``: what a valid value is, in words; ``valid`` tests it (None: anything).
    - ``backend``: handed to backends in ``Call.options`` (else the core consumes it).
    - ``per_call``: data of each call (a number ``normalizer``): its value is not part of a
      plan's signature and is checked on every call.
    - ``feature``: the feature (``FEATURES``) a value other than the default turns on.
    - ``compared``: part of the options fingerprint the ranks compare in the metadata
      gather (False: compared another way -- the layout, the forced backend -- or per rank
      by nature, like tensors).
    - ``tensor``: a tensor value is data of each call, never read on the host (``mask``,
      ``labels``, a tensor ``normalizer``): its shape, dtype and device are part of a plan's
      signature, its values are compared across ranks only under ``VTP_CHECK=1``.

    ``canonical`` gives every value the one form that checks, the cross-rank fingerprint and
    plan signatures compare, so that equal values spelled differently are one value.
    """

    name: str
    default: Any
    kind: type | None = None
    rule: str = ""
    valid: Callable[[Any], bool] | None = None
    backend: bool = False
    per_call: bool = False
    feature: str | None = None
    error: type[Exception] = ValueError  # raised when the value breaks the rule
    compared: bool = True
    type_error: bool = False  # a value not of ``kind`` (None aside) raises TypeError instead
    tensor: bool = False

    def canonical(self, value: Any) -> Any:
        """``value`` in its one canonical form: for a scalar option (``kind`` int, float,
        bool or str) a numpy scalar or a 0-d CPU tensor becomes the Python value it holds,
        an int of a float option a float, ``-0.0`` becomes ``0.0`` and a ``str`` subclass a
        ``str``; so ``2``, ``2.0``, ``np.float32(2)`` and ``torch.tensor(2.0)`` are one value.
        Anything else -- a value of another kind (a bool of a number option, a float of an int
        option), a device tensor, a tensor of an option that takes one as data -- is returned
        as it is, for the checks to judge. Never reads a device."""
        kind = self.kind
        if kind not in (int, float, bool, str) or value is None:
            return value
        if isinstance(value, torch.Tensor):
            if self.tensor or value.dim() != 0 or value.device.type != "cpu":
                return value
            value = value.item()
        elif type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
            value = value.item()
        if isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)):
            return float(value) + 0.0  # + 0.0: -0.0 is 0.0 (repr would tell them apart)
        if kind is int and isinstance(value, int):
            return int(value)
        if kind is str and isinstance(value, str):
            return str(value)
        return value

    def is_default(self, value: Any) -> bool:
        """Whether a canonical ``value`` is the default: then the call is the call without it."""
        if self.default is None:
            return value is None
        return type(value) is type(self.default) and value == self.default


# Options every op takes; the core handles them, backends see the layout they lead to.
COMMON = (
    Option("tp_group", None, compared=False),
    # the ranks holding other tokens of the batch (Ulysses, context parallel): sum/mean reduce
    # over them. Not part of the TP fingerprint or a plan's signature, like tp_group: its
    # ranks sit in other TP groups, whose plan caches are their own, so they agree through
    # a check of their own (vtp_runtime.sequence)
    Option(
        "sp_group",
        None,
        rule="a torch.distributed ProcessGroup or None",
        valid=_group_or_none,
        error=TypeError,
        compared=False,
    ),
    Option("temperature", 1.0, float, "a finite number > 0", _finite_positive, backend=True, feature="temperature"),
    Option("reduction", "none", str, "one of 'none', 'sum', 'mean'", lambda v: v in ("none", "sum", "mean")),
    Option(
        "normalizer",
        None,
        float,
        "a finite number > 0 (e.g. num_items_in_batch) or a one-element tensor",
        _normalizer,
        per_call=True,
        tensor=True,
    ),
    Option("vocab_start", None, int, compared=False),
    Option("vocab_end", None, int, compared=False),
    Option(
        "global_vocab_size",
        None,
        int,
        "a positive int",
        lambda v: v is None or (_is_int(v) and v > 0),
        compared=False,
    ),
    Option(
        "backend",
        None,
        None,
        "a backend name (str)",
        lambda v: v is None or isinstance(v, str),
        error=TypeError,
        compared=False,
    ),
)
_IGNORE_INDEX = Option("ignore_index", -100, int, "an int", _is_int, backend=True)
_MASKING = (
    Option("mask", None, feature="mask", compared=False, tensor=True),
    Option("labels", None, feature="mask", compared=False, tensor=True),
    _IGNORE_INDEX,
)

# Features a call may use beyond the plain op. Most are turned on by an option's value (its
# ``Option.feature``); ``topk`` by an index with a trailing k dimension, ``teacher_grad`` by
# a teacher that requires grad. A backend declares the ones it supports, per op.
FEATURES = (
    "label_smoothing",
    "z_loss",
    "temperature",
    "topk",
    "mask",
    "reverse",
    "teacher_grad",
    "return_entropy",
    "row_offset",
)


@dataclass(frozen=True)
class OpSpec:
    name: str
    inputs: tuple[str, ...]  # floating-point logits inputs, in call order
    index: str | None  # name of the integer index input, if any
    own: tuple[Option, ...]  # the options of this op beyond (or in place of) the common ones
    # the FEATURES a call of this op turns on other than by an option's value (topk, teacher_grad)
    call_features: tuple[str, ...] = ()
    # the op returns int64 token ids (argmax, sample): no gradient, no reduction, no mask
    returns_ids: bool = False
    options: Mapping[str, Option] = field(init=False)  # every option, common ones first, by name
    defaults: Mapping[str, Any] = field(init=False)  # every option's default, by name
    # the FEATURES that apply to this op: its options' (Option.feature) and call_features
    features: tuple[str, ...] = field(init=False)
    per_call: tuple[str, ...] = field(init=False)  # the per-call options
    per_call_backend: tuple[str, ...] = field(init=False)  # ... and those backends get
    # the tensors beside the logits that VTP_CHECK=1 compares across ranks: the index, then
    # the options taking tensors (Option.tensor), in schema order
    checked: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        options = {o.name: o for o in (*COMMON, *self.own)}
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "defaults", {name: o.default for name, o in options.items()})
        object.__setattr__(self, "per_call", tuple(n for n, o in options.items() if o.per_call))
        object.__setattr__(self, "per_call_backend", tuple(n for n in self.per_call if options[n].backend))
        tensors = tuple(n for n, o in options.items() if o.tensor)
        object.__setattr__(self, "checked", ((self.index,) if self.index else ()) + tensors)
        on = {o.feature for o in options.values() if o.feature} | set(self.call_features)
        object.__setattr__(self, "features", tuple(f for f in FEATURES if f in on))
        unknown = on - set(FEATURES)
        assert not unknown, f"{self.name}: unknown features {unknown}"

    @property
    def n_tensors(self) -> int:
        """How many tensor arguments the op takes: its logits inputs and its index."""
        return len(self.inputs) + (1 if self.index else 0)


# argmax and sample return token ids: what only a loss takes is refused, and temperature 0 is
# greedy decoding (argmax ignores the temperature: it moves no maximum)
_IDS = (
    Option("temperature", 1.0, float, "a finite number >= 0 (0: greedy)", _finite_non_negative, backend=True),
    Option(
        "reduction",
        "none",
        str,
        "'none' (argmax and sample return token ids: reduction does not apply)",
        lambda v: v == "none",
    ),
    Option(
        "normalizer",
        None,
        None,
        "None (argmax and sample return token ids: normalizer does not apply)",
        lambda v: v is None,
    ),
)

OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec(
            "cross_entropy",
            ("logits",),
            "labels",
            (
                _IGNORE_INDEX,
                Option("label_smoothing", 0.0, float, "in [0, 1]", _unit, backend=True, feature="label_smoothing"),
                Option(
                    "z_loss", 0.0, float, "a finite number >= 0", _finite_non_negative, backend=True, feature="z_loss"
                ),
            ),
        ),
        OpSpec(
            "logprobs",
            ("logits",),
            "index",
            (
                _IGNORE_INDEX,
                Option("return_entropy", False, bool, "a bool", _is_bool, backend=True, feature="return_entropy"),
            ),
            ("topk",),
        ),
        OpSpec("entropy", ("logits",), None, _MASKING),
        OpSpec(
            "kl",
            ("student_logits", "teacher_logits"),
            None,
            (Option("reverse", False, bool, "a bool", _is_bool, backend=True, feature="reverse"), *_MASKING),
            ("teacher_grad",),
        ),
        OpSpec(
            "jsd",
            ("student_logits", "teacher_logits"),
            None,
            (
                Option(
                    "beta",
                    0.5,
                    float,
                    "in [0, 1] (0 = forward KL, 1 = reverse KL)",
                    _unit,
                    backend=True,
                ),
                *_MASKING,
            ),
            ("teacher_grad",),
        ),
        OpSpec("argmax", ("logits",), None, _IDS, returns_ids=True),
        OpSpec(
            "sample",
            ("logits",),
            None,
            (
                *_IDS,
                # per-call data: a generation loop passes a new seed every step; the ranks'
                # seeds are compared by the op itself (they ride in its all-gather)
                Option(
                    "seed",
                    None,
                    int,
                    "an int, the same on every rank (a new one per step)",
                    _is_int,
                    backend=True,
                    per_call=True,
                    error=TypeError,
                    compared=False,
                ),
                Option(
                    "top_k",
                    None,
                    int,
                    "an int >= 1 (None: no top-k)",
                    lambda v: v is None or (_is_int(v) and v >= 1),
                    backend=True,
                    type_error=True,
                ),
                Option(
                    "top_p",
                    None,
                    float,
                    "in (0, 1] (None or 1: no top-p)",
                    lambda v: v is None or (_unit(v) and v > 0),
                    backend=True,
                ),
                Option(
                    "min_p",
                    None,
                    float,
                    "in [0, 1] (None or 0: no min-p)",
                    lambda v: v is None or _unit(v),
                    backend=True,
                ),
                # the number of the call's first row: the noise is keyed by the global row, so
                # that ranks holding other rows of one batch (data parallel) draw as one call
                # would; a DTensor sharding its batch adds its shard's offset (inputs.py)
                Option(
                    "row_offset",
                    0,
                    int,
                    "an int >= 0 (the number of the call's first row)",
                    lambda v: _is_int(v) and v >= 0,
                    backend=True,
                    feature="row_offset",
                    type_error=True,
                ),
            ),
            returns_ids=True,
        ),
    )
}
# the ops whose value is a loss (everything but argmax and sample)
LOSSES = tuple(name for name, spec in OPS.items() if not spec.returns_ids)
# the options whose tensor values are data of each call (mask, labels, a tensor normalizer)
TENSOR_OPTIONS = tuple(sorted({o.name for spec in OPS.values() for o in spec.options.values() if o.tensor}))


def get_spec(op: str) -> OpSpec:
    try:
        return OPS[op]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; the ops are: {', '.join(OPS)}") from None


def normalize_options(spec: OpSpec, options: dict[str, Any], given: Iterable[str]) -> None:
    """Give the options among ``given`` their canonical form (``Option.canonical``), in
    place. A 0-d tensor on a device given for a scalar option raises ValueError (reading it
    would wait for the device); a tensor ``normalizer`` stays a tensor (never read on the host)."""
    for name in given:
        option = spec.options[name]
        value = option.canonical(options[name])
        if (
            option.kind in (int, float, bool)
            and not option.tensor
            and isinstance(value, torch.Tensor)
            and value.dim() == 0
            and value.device.type != "cpu"
        ):
            raise ValueError(
                f"{name} is a tensor on {value.device}; pass a Python number (reading a "
                f"device tensor would wait for the device)"
            )
        options[name] = value


def check_options(spec: OpSpec, options: Mapping[str, Any]) -> None:
    """Validate option values (not tensors) against their rules. Raises ValueError saying
    what to change."""
    for name, option in spec.options.items():
        if option.valid is not None and not option.valid(options[name]):
            value = options[name]
            error = option.error
            if (
                option.type_error
                and value is not None
                and not (option.kind is not None and _is_kind(value, option.kind))
            ):
                error = TypeError
            if isinstance(value, torch.Tensor):
                got = f"a tensor of shape {tuple(value.shape)}"
            elif error is TypeError:
                got = f"{type(value).__name__} {value!r}"
            else:
                got = repr(value)
            raise error(f"{name} must be {option.rule}, got {got}")


def _is_kind(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def backend_options(spec: OpSpec, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options backends receive (``Call.options``), from a call's full options."""
    return {name: options[name] for name, o in spec.options.items() if o.backend}


def kl_direction(op: str, options: Mapping[str, Any]) -> bool | None:
    """For a call that is a plain KL -- ``kl``, or ``jsd`` at ``beta`` 0 or 1 -- whether it
    is reverse KL(p_s || p_t); None for an interior JSD (and for the other ops)."""
    if op == "kl":
        return bool(options["reverse"])
    if op == "jsd" and options["beta"] in (0.0, 1.0):
        return options["beta"] == 1.0
    return None


def features_of(spec: OpSpec, options: Mapping[str, Any], *, topk: bool, teacher_grad: bool) -> frozenset[str]:
    """The features (see FEATURES) a call uses; dispatch matches them against capabilities.
    ``options`` holds every option of the op (defaults filled in)."""
    on = {o.feature for name, o in spec.options.items() if o.feature and _differs(options[name], o.default)}
    if topk:
        on.add("topk")
    if teacher_grad:
        on.add("teacher_grad")
    return frozenset(on & set(spec.features))


def _differs(value: Any, default: Any) -> bool:
    return value is not default if default is None else value != default
