"""The conformance kit: what a backend must pass before anyone relies on it.

Cases are derived from what the backend **declares** (its ``ops`` and their
``OpCapability``), so a claim is a promise that is checked:

- ``match`` cases: every claimed op, feature and dtype, on 1 and 2 gloo ranks (even,
  uneven, empty and explicit shards as the capability allows), with masking, edge values
  (``-inf``, large offsets, all ``-inf`` rows), inputs in every memory layout users pass
  (a causal-shift view, a transposed-then-sliced tensor, ``x[..., ::2]``, a permuted 3-D
  tensor, a broadcast teacher; see ``cases.VIEWS``), a reduction and a vocabulary wider
  than a typical block. Each runs ``run_case`` on every rank: values and the local
  gradient of every input that requires grad against the float64 reference, a second
  backward through the retained graph, inputs left unmodified; and one case per op takes
  the gradient with ``create_graph=True`` and checks that differentiating it raises.
- ``refused`` cases: every op, feature, dtype, TP size or shard layout the backend does
  **not** claim must make a forced call raise ``BackendUnavailable`` — never run.
- Head inputs (the ``TakesHead`` protocol, ``head_ops``): where claimed, ``match`` cases through
  ``vtp.Head`` (``head_cases.run_head_case``: values and hidden/weight/bias gradients against
  float64 on ``h @ W.T + b``, several token chunks, each shard layout, Head and logits
  mixed, per-token results where ``HeadSupport.per_token``, a sequence-parallel Head where
  ``HeadSupport.sequence_parallel``); where not, a forced call with such a Head must be refused.

In a plugin's tests (pytest)::

    from vtp_runtime.testing import conformance

    @conformance.parametrize("my_backend")
    def test_conformance(conformance_case):
        conformance.check(conformance_case)

or in one go (a script, or one big test): ``conformance.check_backend("my_backend")``.
The kit runs on CPU; cases a backend cannot run on this machine (its ``probe`` fails) skip.

How many cases: ``VTP_TEST_DEPTH`` (``current_depth()``), or ``depth=`` on any of these.
``fast`` (the default, for CI) makes each check once per TP size (1 and 2), on one dtype and
shard layout; ``full`` (on demand) makes the checks of options and values again at every
claimed dtype and on every shard layout, on TP 1 to 4, with memory layouts on every shard
layout, every pair of claimed features and more through ``vtp.Head``. ``smoke``
(``smoke(...)``), for a backend slow per element such as Triton's interpreter, keeps one
case of each check per TP size.

What other tests parametrize over, from the same declarations: ``ops_with(*features,
backend=...)`` (the loss ops a feature applies to, or a backend claims), ``backends_with(op,
*features)`` (the built-in backends claiming them on a device type) and ``tp_sizes(*fast)``
(a test's TP sizes, more at full depth); ``head_cases.TOKEN_SPLITS``, the splits of a
sequence-parallel Head's tokens.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .. import env
from ..backend import Backend, HeadSupport, OpCapability, head_support
from ..errors import BackendUnavailable
from ..ops import LOSSES, OPS
from ..registry import BUILTIN_MODULES, REGISTRY, registered
from .cases import DTYPES, VIEWS, Case, run_case
from .head_cases import HeadCase, run_head_case

# How a case turns on each feature (which features apply to an op: ops.OPS[op].features).
_OPTION = {
    "label_smoothing": ("label_smoothing", 0.1),
    "z_loss": ("z_loss", 1e-3),
    "temperature": ("temperature", 0.7),
    "reverse": ("reverse", True),
    "return_entropy": ("return_entropy", True),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

Runner = Callable[..., list]  # runner(world, fn, *args, timeout=...) -> per-rank results


@dataclass(frozen=True)
class ConformanceCase:
    """One check: run ``case`` on ``world`` ranks and expect a ``match`` or ``refused``."""

    world: int
    case: Case
    expect: str  # "match" (against the float64 reference) or "refused" (by dispatch)
    why: str  # what is being checked, in words
    plugin: str | None = None  # "module" or "module:object" to register in rank processes if not installed
    skip: str = ""  # non-empty: the backend cannot run here (its probe failed)

    def __str__(self) -> str:
        c = self.case
        extra = "" if c.shape == (3, 4) else "-shape" + "x".join(map(str, c.shape))
        return f"tp{self.world}-{self.expect}-{c.id}{extra}" + ("" if c.vocab == 37 else f"-V{c.vocab}")


# -- how deep ------------------------------------------------------------------------------

DEPTHS = ("smoke", "fast", "full")


def current_depth(slow: bool = False) -> str:
    """The depth ``VTP_TEST_DEPTH`` asks for: ``"fast"`` (the default, for CI) or ``"full"``
    (on demand). ``slow=True`` is the depth for a backend that is slow per element (Triton's
    interpreter on CPU): ``"smoke"`` under fast, ``"full"`` under full."""
    value = env.text("VTP_TEST_DEPTH").lower() or "fast"
    if value not in ("fast", "full"):
        raise ValueError(f"VTP_TEST_DEPTH={value!r}: use fast (the default) or full")
    return "smoke" if slow and value == "fast" else value


def default_world_sizes(depth: str) -> tuple[int, ...]:
    """TP 1 and 2; TP 3 and 4 too at full depth."""
    return (1, 2, 3, 4) if depth == "full" else (1, 2)


def tp_sizes(*fast: int, depth: str | None = None) -> tuple[int, ...]:
    """The TP sizes of a test on gloo ranks: ``fast`` (the sizes it names, chosen cheap) at
    fast depth; at full depth also every size ``default_world_sizes`` runs from the smallest
    of ``fast`` up. ``depth``: default ``current_depth()``."""
    if (depth or current_depth()) != "full":
        return tuple(fast)
    return tuple(sorted({*fast, *(w for w in default_world_sizes("full") if w >= min(fast))}))


# -- what tests enumerate ------------------------------------------------------------------


def ops_with(*features: str, backend: str | Backend | None = None) -> tuple[str, ...]:
    """The loss ops (``LOSSES``, in its order) that every one of ``features`` applies to;
    with ``backend`` (a registered name or a Backend), those of them it claims with those
    features. A test parametrized over them runs an op added later, or one given the feature
    later, without an edit."""
    b = REGISTRY.get(backend) if isinstance(backend, str) else backend
    wanted = set(features)
    out = []
    for op in LOSSES:
        if not wanted <= set(OPS[op].features):
            continue
        cap = None if b is None else b.ops.get(op)
        if b is None or cap is not None and wanted <= cap.features:
            out.append(op)
    return tuple(out)


def backends_with(op: str | None = None, *features: str, device_type: str = "cpu") -> tuple[str, ...]:
    """The built-in backends (``registry.BUILTIN_MODULES``: a plugin runs the kit in its own
    suite) that claim ``op`` (any op when None) with every one of ``features`` on
    ``device_type``, by name."""
    out = []
    for name, b in REGISTRY.backends().items():
        owner = REGISTRY.owner(name)
        if owner is None or owner.name not in BUILTIN_MODULES:
            continue
        caps = list(b.ops.values()) if op is None else [b.ops[op]] if op in b.ops else []
        if any(
            set(features) <= cap.features and (cap.device_types is None or device_type in cap.device_types)
            for cap in caps
        ):
            out.append(name)
    return tuple(sorted(out))


# -- deriving the cases --------------------------------------------------------------------


def _feature(case: Case, feature: str) -> Case:
    if feature in _OPTION:
        key, value = _OPTION[feature]
        return case.with_(options=case.options + ((key, value),))
    if feature == "topk":
        return case.with_(topk=3)
    if feature == "mask":
        return case.with_(masked="mask")
    if feature == "teacher_grad":
        return case.with_(grads=(True, True))
    raise ValueError(f"unknown feature {feature!r}")


def _claimed(op: str, cap: OpCapability) -> list[str]:
    return [f for f in OPS[op].features if f in cap.features]


def _every_feature(case: Case, cap: OpCapability, but: tuple[str, ...] = ()) -> Case:
    """``case`` with every feature the backend claims for its op turned on (``but`` those)."""
    for f in _claimed(case.op, cap):
        if f != "teacher_grad" and f not in but:  # the base case has teacher_grad where claimed
            case = _feature(case, f)
    return case


def _dtypes(cap: OpCapability) -> list[str]:
    return sorted(DTYPE_NAMES[d] for d in cap.dtypes if d in DTYPE_NAMES)


def _layouts(cap: OpCapability, world: int) -> list[str]:
    if world == 1 or cap.even_shards_only:
        return ["even"]
    return ["uneven", "explicit"] + (["empty"] if cap.empty_shards else [])


def _edges(op: str, cap: OpCapability, dtype: str = "float32") -> list[str]:
    """The edge values for ``op``. In bfloat16, logits near 1e4 are multiples of 64: an offset
    case would hold near-uniform, equal distributions (a reference of exactly 0), so it runs
    in the other dtypes only."""
    offset = [] if dtype == "bfloat16" else ["offset"]
    edges = ["neg_inf", *offset, "all_neg_inf"] + (["disjoint"] if len(OPS[op].inputs) == 2 else [])
    if "mask" in cap.features or OPS[op].index:
        edges.append("all_neg_inf_masked")
    return edges


def _masking(op: str, cap: OpCapability) -> str:
    """How a case masks tokens for ``op``: ignored index entries, a mask, or not at all."""
    return "labels" if OPS[op].index else "mask" if "mask" in cap.features else ""


def _base(name: str, op: str, cap: OpCapability, shape: tuple[int, ...]) -> Case:
    dtypes = _dtypes(cap)
    dtype = "float32" if "float32" in dtypes else dtypes[0]
    two = len(OPS[op].inputs) == 2
    grads = (True, "teacher_grad" in cap.features) if two else (True, True)
    return Case(op, dtype=dtype, backend=name, grads=grads, shape=shape)


WIDE = "a vocabulary wider than a block"


def _match_cases(base: Case, cap: OpCapability, world: int, main: Case | None = None) -> list[tuple[Case, str]]:
    """The first checks of a TP size: each shard layout, each claimed feature, dtype and edge
    value. With ``main`` (full depth: another dtype or shard layout), only the checks of
    options and values, made on ``main``."""
    op = base.op
    claimed = _claimed(op, cap)
    two = len(OPS[op].inputs) == 2
    layouts = _layouts(cap, world)
    variant = main is not None
    main = main or base.with_(layout=layouts[0])
    out = [] if variant else [(base.with_(layout=lay), f"{lay} shards") for lay in layouts]
    out += [(_feature(main, f), f"claims {f}") for f in claimed if f != "teacher_grad"]  # base has it
    if "mask" in claimed:
        out.append((main.with_(masked="labels"), "claims mask (labels= with ignore_index)"))
        out.append((main.with_(masked="mask", options=(("reduction", "mean"),)), "mean over unmasked tokens"))
    if OPS[op].index:
        out.append((main.with_(masked="labels"), "ignore_index entries"))
        out.append((main.with_(edge="bad_index"), "out-of-range index gives NaN in its row only"))
    if two and "teacher_grad" in claimed:
        out.append((main.with_(grads=(True, False)), "detached teacher"))
        out.append((main.with_(grads=(False, True)), "gradient to the teacher only"))
    if op == "jsd":
        out += [(main.with_(options=(("beta", b),)), f"beta={b}") for b in (0.0, 1.0, 0.3)]
    if not variant:
        out += [(main.with_(dtype=d), f"claims {d}") for d in _dtypes(cap) if d != base.dtype]
    out += [(main.with_(edge=e), f"edge values: {e}") for e in _edges(op, cap, main.dtype)]
    if not variant:
        out.append((main.with_(shape=(0,)), "zero tokens (the core's: no backend runs)"))
    out.append((main.with_(strided=True, shape=(2, 4)), "strided rows (a causal-shift view)"))
    out.append((main.with_(options=(("reduction", "sum"),)), "reduction=sum"))
    if not variant:
        # wide enough that some rank's shard is wider than a block of 4096 at every TP size
        out.append((main.with_(shape=(2, 3), vocab=max(9001, 4500 * world + 1)), WIDE))
    if len(claimed) > 1:
        out.append((_every_feature(main, cap), f"every claimed feature at once: {', '.join(claimed)}"))
    return out


def _layout_cases(base: Case, cap: OpCapability, world: int) -> list[tuple[Case, str]]:
    """Inputs in every memory layout users pass (whatever input_layout the backend declares,
    the core must hand them over in it), and a gradient taken with create_graph=True."""
    main = base.with_(layout=_layouts(cap, world)[0])
    views = ["transposed", "every_other", "permuted"] + (["expanded_teacher"] if len(OPS[base.op].inputs) == 2 else [])
    out = [(main.with_(view=v, shape=(2, 3)), f"input layout: {VIEWS[v]}") for v in views]
    if world > 1 and cap.empty_shards and not cap.even_shards_only:
        out.append((main.with_(layout="empty", view="transposed", shape=(2, 3)), "transposed input, an empty shard"))
    out.append((main.with_(shape=(0,), view="every_other"), "zero tokens, every other column"))
    out.append((main.with_(second_order=True), "create_graph=True: right gradient, differentiating it raises"))
    return out


def _more_cases(base: Case, cap: OpCapability, world: int, main: Case | None = None) -> list[tuple[Case, str]]:
    """Checks of options at other values and of values with every claimed feature on (kept
    after the others, so that adding them moved no earlier case's seed). ``main`` as in
    ``_match_cases``."""
    op = base.op
    main = main or base.with_(layout=_layouts(cap, world)[0])
    combo = _every_feature(main, cap)
    masking = _masking(op, cap)
    out = []
    if masking:
        ignore = main.with_(masked="labels", options=(("ignore_index", 3),))
        out.append((ignore, "an ignore_index other than -100"))
        mean = combo.with_(masked=masking, options=(*combo.options, ("reduction", "mean")))
        out.append((mean, "every claimed feature, masked, reduction=mean"))
        strided = combo.with_(masked=masking, strided=True, shape=(2, 4))
        out.append((strided, "strided rows, masked, every claimed feature"))
    out.append((main.with_(options=(("reduction", "sum"), ("normalizer", 7))), "reduction=sum over a normalizer"))
    out.append((main.with_(grads=(False, False)), "no input requires grad (forward only)"))
    if len(OPS[op].inputs) == 2 and "teacher_grad" in cap.features:
        out.append((combo.with_(grads=(False, True)), "gradient to the teacher only, every claimed feature"))
    if combo != main:
        edges = _edges(op, cap, main.dtype) + (["bad_index"] if OPS[op].index else [])
        # logits near 1e4 divided by T lose ~1e-3 in fp32, more than the tolerance: T = 1 there
        at_one = _every_feature(main, cap, but=("temperature",))
        for e in edges:
            out.append(((at_one if e == "offset" else combo).with_(edge=e), "edge values, every claimed feature"))
        out.append((combo.with_(shape=(0,)), "zero tokens, every claimed feature"))
    if op == "jsd":  # the two ends are their own branches (plain KL)
        for e, b in itertools.product(_edges(op, cap, main.dtype), (0.0, 1.0)):
            out.append((main.with_(edge=e, options=(("beta", b),)), "edge values at beta 0 and 1"))
    return out


def _as_head(case: Case, **fields) -> HeadCase:
    return HeadCase(**{**{f.name: getattr(case, f.name) for f in dataclasses.fields(Case)}, **fields})


def _head_options(head: HeadSupport) -> tuple[tuple, tuple]:
    """(a scalar result's options, a per-token result's where the backend takes one)."""
    scalar = (("reduction", "mean"),)
    return scalar, (("reduction", "none"),) if head.per_token else scalar


def _head_cases(base: Case, cap: OpCapability, head: HeadSupport, world: int) -> list[tuple[Case, str]]:
    """Match cases through ``vtp.Head``: a few per TP size, each over several token chunks."""
    op = base.op
    two = len(OPS[op].inputs) == 2
    scalar, per_token = _head_options(head)
    main = _as_head(base, options=scalar, bias=True)
    if world == 1:
        out: list[tuple[Case, str]] = [
            (main, "head inputs (sum/mean: gradients during forward), bias"),
            (main.with_(options=per_token, bias=False), "head inputs, per-token result"),
        ]
        if two:
            out.append((main.with_(heads=(True, False)), "a Head student, teacher logits"))
            if "teacher_grad" in cap.features:
                out.append((main.with_(grads=(True, False), options=per_token), "a frozen teacher Head"))
        out.append((main.with_(shape=(0,)), "head inputs, zero tokens"))
        combo = _every_feature(main, cap)
        if combo != main:
            out.append((combo, "head inputs with every claimed feature"))
        return out
    layouts = _layouts(cap, world)
    out = [
        (main.with_(layout=lay, options=(scalar, per_token)[i % 2]), f"head inputs, {lay} shards")
        for i, lay in enumerate(layouts)
    ]
    out.append(
        (
            main.with_(layout=layouts[0], reduce_hidden_grad=False),
            "head inputs, reduce_hidden_grad=False: this rank's partial hidden gradient",
        )
    )
    return out


def _more_head_cases(base: Case, cap: OpCapability, head: HeadSupport, world: int) -> list[tuple[Case, str]]:
    """More checks through ``vtp.Head``: edge values, masking, chunk sizes, gradients to some
    of a Head's parts, every claimed dtype, mixed Head and logits inputs."""
    op = base.op
    two = len(OPS[op].inputs) == 2
    topk = 3 if "topk" in cap.features else 0
    scalar, per_token = _head_options(head)
    main = _as_head(base, options=scalar, bias=True)
    combo = _every_feature(main, cap)
    out: list[tuple[Case, str]] = []
    if world == 1:
        sums = (("reduction", "sum"),)
        out.append((combo.with_(edge="neg_inf", options=(*combo.options, *sums)), "head inputs, a -inf bias slice"))
        if OPS[op].index:
            out.append((main.with_(edge="bad_index", topk=topk), "head inputs, an out-of-range index"))
        if _masking(op, cap):
            out.append((main.with_(masked="labels", options=per_token), "head inputs, ignored tokens"))
        out.append((combo.with_(shape=(0,)), "head inputs, zero tokens, every claimed feature"))
        out.append((main.with_(chunk_rows=None, shape=(40,)), "head inputs, the default chunk size"))
        out.append((main.with_(chunk_rows=1, options=per_token), "head inputs, one token per chunk"))
        out.append((main.with_(head_grads="w"), "head inputs, a gradient to the weight only"))
        out.append((main.with_(head_grads="hb", options=per_token), "head inputs, gradients to hidden and bias"))
        out.append((main.with_(head_grads="", grads=(True, False)), "head inputs, none requiring grad"))
        out.append((main.with_(hidden=1), "head inputs, a hidden size of 1"))
        sum_over = (("reduction", "sum"), ("normalizer", 7))
        out.append((main.with_(options=sum_over, bias=False), "head inputs, reduction=sum over a normalizer"))
        if two:
            out.append((main.with_(heads=(False, True)), "student logits, a Head teacher"))
            if "teacher_grad" in cap.features:
                out.append((main.with_(grads=(False, True)), "head inputs, a gradient to the teacher only"))
        if op == "jsd":
            out += [(main.with_(options=(*scalar, ("beta", b))), "head inputs at beta 0 and 1") for b in (0.0, 1.0)]
        out += [(main.with_(dtype=d), f"head inputs in {d}") for d in _dtypes(cap) if d != base.dtype]
        return out
    layouts = _layouts(cap, world)
    if "empty" in layouts:
        out.append((main.with_(layout="empty", shape=(0,)), "head inputs, an empty shard, zero tokens"))
        partial = main.with_(layout="empty", reduce_hidden_grad=False)
        out.append((partial, "head inputs, partial hidden gradient, an empty shard"))
    chunked = main.with_(layout=layouts[min(1, len(layouts) - 1)], chunk_rows=1, options=per_token, topk=topk)
    out.append((chunked, "head inputs, one token per chunk, on shards"))
    return out


def _full_cases(base: Case, cap: OpCapability, world: int) -> list[tuple[Case, str]]:
    """Full depth: the checks of options and values at every other claimed dtype and on
    every other shard layout (even ones too at TP > 1), memory layouts on every shard layout,
    every pair of claimed features, a temperature above 1."""
    op = base.op
    layouts = _layouts(cap, world)
    every = layouts + (["even"] if world > 1 and not cap.even_shards_only else [])
    variants = [(d, layouts[0]) for d in _dtypes(cap) if d != base.dtype] + [(base.dtype, lay) for lay in every[1:]]
    out = []
    for d, lay in variants:
        main = base.with_(dtype=d, layout=lay)
        for case, why in _match_cases(base, cap, world, main) + _more_cases(base, cap, world, main):
            out.append((case, f"{why} ({d}, {lay} shards)"))
    for lay in every[1:]:
        out += [(c.with_(layout=lay), f"{why} ({lay} shards)") for c, why in _layout_cases(base, cap, world) if c.view]
    main = base.with_(layout=layouts[0])
    features = [f for f in _claimed(op, cap) if f != "teacher_grad"]
    for a, b in itertools.combinations(features, 2):
        out.append((_feature(_feature(main, a), b), f"claims {a} and {b}"))
    if "temperature" in features:
        out.append((main.with_(options=(("temperature", 2.0),)), "a temperature above 1"))
    if op == "jsd":
        inside = main.with_(options=(("beta", 0.3),))
        out += [(inside.with_(edge=e), "edge values at beta 0.3") for e in _edges(op, cap, main.dtype)]
    return out


def _full_head_cases(base: Case, cap: OpCapability, head: HeadSupport, world: int) -> list[tuple[Case, str]]:
    """Full depth through ``vtp.Head``: each claimed feature and dtype, both kinds of result
    and edge values on every shard layout."""
    op = base.op
    scalar, per_token = _head_options(head)
    main = _as_head(base, options=scalar, bias=True)
    out: list[tuple[Case, str]] = []
    every = _layouts(cap, world) + (["even"] if world > 1 and not cap.even_shards_only else [])
    for lay in every:
        at = main.with_(layout=lay)
        for options in dict.fromkeys((scalar, per_token, (("reduction", "sum"),))):
            kind = dict(options)["reduction"]
            out += [
                (_feature(at.with_(options=options), f), f"head inputs, claims {f} ({lay} shards, {kind})")
                for f in _claimed(op, cap)
                if f != "teacher_grad"
            ]
        # TP 1 and 2 only for bf16/fp16: a weight gradient sums rounded per-token terms, and on
        # a rank of 3 or 4 holding a few columns its rounding can pass the tolerance, which is
        # scaled to that rank's own (small) gradients
        low = world <= 2
        out += [
            (at.with_(dtype=d), f"head inputs in {d} ({lay} shards)")
            for d in _dtypes(cap)
            if d != base.dtype and (low or DTYPES[d].itemsize >= 4)
        ]
        out.append((at.with_(edge="neg_inf"), f"head inputs, a -inf bias slice ({lay} shards)"))
        if len(OPS[op].inputs) == 2:
            out.append((at.with_(heads=(True, False)), f"a Head student, teacher logits ({lay} shards)"))
            teacher = at.with_(heads=(False, True), options=per_token)
            out.append((teacher, f"student logits, a Head teacher ({lay} shards)"))
    return out


def conformance_cases(
    backend: str | Backend,
    world_sizes: Sequence[int] | None = None,
    plugin: str | None = None,
    *,
    depth: str | None = None,
    shape: tuple[int, ...] = (3, 4),
) -> list[ConformanceCase]:
    """Every check for ``backend`` (a registered name, or a Backend instance), derived from
    its declared capabilities. ``plugin``: ``"module"`` or ``"module:object"`` holding the
    backend's hook implementation, registered in the rank processes when the backend is not
    installed as an entry point (it must be importable there).

    ``depth``: ``"fast"``, ``"full"`` or ``"smoke"`` (``smoke(...)`` of fast's cases);
    default ``current_depth()``. ``world_sizes``: default ``default_world_sizes(depth)``.
    ``shape``: the token shape of the main cases (a backend slow per token passes a smaller
    one)."""
    depth = depth or current_depth()
    if depth not in DEPTHS:
        raise ValueError(f"unknown depth {depth!r}; known: {', '.join(DEPTHS)}")
    worlds = tuple(world_sizes) if world_sizes is not None else default_world_sizes(depth)
    b = REGISTRY.get(backend) if isinstance(backend, str) else backend
    name = b.name
    probe = "; ".join(b.probe_reasons("cpu"))
    out: list[ConformanceCase] = []
    later: list[tuple[int, Case, OpCapability]] = []
    head_refusals: list[Case] = []

    def add(world: int, case: Case, expect: str, why: str) -> None:
        case = case.with_(seed=len(out))
        out.append(ConformanceCase(world, case, expect, why, plugin, probe if expect == "match" else ""))

    for op in LOSSES:  # argmax and sample: tests/test_sampling.py
        cap = b.ops.get(op)
        if cap is None:
            add(1, Case(op, backend=name, shape=shape), "refused", f"does not implement {op}")
            continue
        base = _base(name, op, cap, shape)
        if cap.device_types is not None and "cpu" not in cap.device_types:
            add(1, base, "refused", "does not claim the cpu device (the kit runs on CPU only)")
            continue
        for f in OPS[op].features:
            if f not in cap.features:
                add(1, _feature(base, f), "refused", f"does not claim {f}")
        for d in DTYPES.values():
            if d not in cap.dtypes:
                add(1, base.with_(dtype=DTYPE_NAMES[d]), "refused", f"does not claim {DTYPE_NAMES[d]}")
        head_refusals.append(base)
        for world in worlds:
            if cap.tp_sizes is not None and world not in cap.tp_sizes:
                add(world, base.with_(layout="even"), "refused", f"does not claim TP size {world}")
                continue
            if world > 1 and cap.even_shards_only:
                add(world, base.with_(layout="uneven"), "refused", "claims even shards only")
            if world > 1 and not cap.empty_shards:
                add(world, base.with_(layout="empty"), "refused", "does not claim empty shards")
            for case, why in _match_cases(base, cap, world):
                add(world, case, "match", why)
            later.append((world, base, cap))
    # each group after the others, so that adding cases to one moves no earlier case's seed
    for world, base, cap in later:
        for case, why in _layout_cases(base, cap, world):
            add(world, case, "match", why)
    heads = [(world, base, cap, head_support(b, base.op)) for world, base, cap in later]
    for world, base, cap, head in heads:
        if head is not None:
            for case, why in _head_cases(base, cap, head, world):
                add(world, case, "match", why)
    for base in head_refusals:
        head = head_support(b, base.op)
        if head is None:
            add(1, _as_head(base), "refused", "does not claim head inputs")
        elif not head.per_token:
            add(
                1,
                _as_head(base, options=(("reduction", "none"),)),
                "refused",
                "does not claim per-token results with head inputs",
            )
    for world, base, cap in later:
        for case, why in _more_cases(base, cap, world):
            add(world, case, "match", why)
    for world, base, cap, head in heads:
        if head is not None:
            for case, why in _more_head_cases(base, cap, head, world):
                add(world, case, "match", why)
    if depth == "full":
        for world, base, cap, head in heads:
            for case, why in _full_cases(base, cap, world):
                add(world, case, "match", why)
            if head is not None:
                for case, why in _full_head_cases(base, cap, head, world):
                    add(world, case, "match", why)
    # sequence-parallel Heads last, so that adding them moves no other case's seed
    for world, base, cap in later:
        head = head_support(b, base.op)
        if world == 1 or head is None:
            continue
        layout = "even" if cap.even_shards_only else "uneven"
        options = (("reduction", "none" if head.per_token else "mean"),)
        case = _as_head(base, layout=layout, options=options, shape=(9,), sequence="empty", chunk_rows=4)
        if head.sequence_parallel:
            add(world, case, "match", "sequence-parallel head inputs, a rank holding no tokens")
        else:
            add(world, case, "refused", "does not claim sequence-parallel head inputs")
    unique: dict[str, ConformanceCase] = {}
    for cc in out:  # a case derived twice (for two reasons) runs once
        unique.setdefault(str(cc), cc)
    return smoke(list(unique.values())) if depth == "smoke" else list(unique.values())


def smoke(cases: Sequence[ConformanceCase]) -> list[ConformanceCase]:
    """A selection of ``cases`` for a backend that is slow per element (Triton's interpreter
    on CPU): every refusal; at each TP size every op's first case, and of every other check
    (one ``why``) one case, the op taking turns from one check to the next. So every op,
    claimed feature, dtype, shard layout, edge value, memory layout and Head form still runs
    at every TP size. The wide-vocabulary check is left to fast and full: its cost grows with V."""
    groups: dict[tuple[int, str], list[ConformanceCase]] = {}
    for cc in cases:
        if cc.expect == "match" and cc.why != WIDE:
            groups.setdefault((cc.world, cc.why), []).append(cc)
    keep = {id(cc) for cc in cases if cc.expect == "refused"}
    firsts: set[int] = set()
    turn: dict[int, int] = {}
    for (world, _), group in groups.items():
        if world not in firsts:  # the first check of a TP size: every op's base case
            firsts.add(world)
            keep.update(id(cc) for cc in group)
            continue
        keep.add(id(group[turn.get(world, 0) % len(group)]))
        turn[world] = turn.get(world, 0) + 1
    return [cc for cc in cases if id(cc) in keep]


# -- running -------------------------------------------------------------------------------


@contextlib.contextmanager
def _available(name: str | None, plugin: str | None) -> Iterator[None]:
    """Register ``plugin`` in this (rank) process for the block, unless ``name`` is installed."""
    if plugin is None or name in REGISTRY.backends():
        yield
        return
    module, _, attr = plugin.partition(":")
    obj = importlib.import_module(module)
    with registered(getattr(obj, attr) if attr else obj, name=plugin):
        yield


def _job(rank: int, world: int, group, cc: ConformanceCase) -> Any:
    """Runs on every rank."""

    def run(rank: int, world: int, group, case: Case) -> Any:
        if isinstance(case, HeadCase):
            return run_head_case(rank, world, group, case)
        return run_case(rank, world, group, case)

    with _available(cc.case.backend, cc.plugin):
        if cc.expect == "match":
            return run(rank, world, group, cc.case)
        try:
            run(rank, world, group, cc.case)
        except BackendUnavailable as exc:
            return str(exc)
        raise AssertionError(
            f"backend {cc.case.backend!r} {cc.why}, yet a forced call ran it instead of raising "
            f"BackendUnavailable: declare the capability (and pass its checks) or make dispatch refuse it"
        )


_POOLS: dict[int, Any] = {}


def default_runner(world: int, fn: Callable, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list:
    """Run ``fn(rank, world, group, *args, **kwargs)`` on ``world`` gloo ranks, reusing one
    pool per size (a job that times out tears its pool down; the next call starts another)."""
    from .distributed import RankPool

    pool = _POOLS.get(world)
    if pool is None or not pool.alive:
        if not _POOLS:
            atexit.register(close_pools)
        pool = _POOLS[world] = RankPool(world)
    return pool.run(fn, *args, timeout=timeout, **kwargs)


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def check(cc: ConformanceCase, runner: Runner | None = None, timeout: float = 120.0) -> list:
    """Run one conformance case on its ranks; raises (AssertionError subclasses) on failure.
    Under pytest, a case the backend cannot run on this machine is skipped."""
    if cc.skip:
        import pytest

        pytest.skip(f"{cc.case.backend} cannot run on this machine: {cc.skip}")
    return (runner or default_runner)(cc.world, _job, cc, timeout=timeout)


def check_backend(
    backend: str | Backend,
    world_sizes: Sequence[int] | None = None,
    plugin: str | None = None,
    runner: Runner | None = None,
    timeout: float = 120.0,
    *,
    depth: str | None = None,
) -> dict[str, str]:
    """Run every conformance case; raise one AssertionError listing every failure.
    Returns ``{case id: "ok" | "skipped: ..."}``."""
    results, failures = {}, []
    for cc in conformance_cases(backend, world_sizes, plugin, depth=depth):
        if cc.skip:
            results[str(cc)] = f"skipped: {cc.skip}"
            continue
        try:
            check(cc, runner, timeout)
            results[str(cc)] = "ok"
        except AssertionError as exc:
            failures.append(f"{cc} ({cc.why}):\n{exc}")
    if failures:
        raise AssertionError(f"{len(failures)} conformance case(s) failed:\n\n" + "\n\n".join(failures))
    return results


def parametrize(
    backend: str | Backend,
    world_sizes: Sequence[int] | None = None,
    plugin: str | None = None,
    argname: str = "conformance_case",
    *,
    depth: str | None = None,
    shape: tuple[int, ...] = (3, 4),
):
    """``pytest.mark.parametrize`` over ``conformance_cases(...)``, with readable ids."""
    import pytest

    cases = conformance_cases(backend, world_sizes, plugin, depth=depth, shape=shape)
    return pytest.mark.parametrize(argname, cases, ids=[str(c) for c in cases])
