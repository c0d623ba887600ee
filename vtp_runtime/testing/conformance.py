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
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..backend import Backend, HeadSupport, OpCapability, head_support
from ..errors import BackendUnavailable
from ..ops import LOSSES, OPS
from ..registry import REGISTRY, registered
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


def _base(name: str, op: str, cap: OpCapability) -> Case:
    dtype = (
        "float32"
        if "float32" in {DTYPE_NAMES.get(d) for d in cap.dtypes}
        else sorted(DTYPE_NAMES[d] for d in cap.dtypes if d in DTYPE_NAMES)[0]
    )
    two = len(OPS[op].inputs) == 2
    grads = (True, "teacher_grad" in cap.features) if two else (True, True)
    return Case(op, dtype=dtype, backend=name, grads=grads, shape=(3, 4))


def _match_cases(base: Case, cap: OpCapability, world: int) -> list[tuple[Case, str]]:
    op = base.op
    claimed = [f for f in OPS[op].features if f in cap.features]
    two = len(OPS[op].inputs) == 2
    if world == 1:
        layouts = ["even"]
    elif cap.even_shards_only:
        layouts = ["even"]
    else:
        layouts = ["uneven", "explicit"] + (["empty"] if cap.empty_shards else [])
    main = base.with_(layout=layouts[0])
    out = [(base.with_(layout=lay), f"{lay} shards") for lay in layouts]
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
    for d in sorted(DTYPE_NAMES[d] for d in cap.dtypes if d in DTYPE_NAMES and DTYPE_NAMES[d] != base.dtype):
        out.append((main.with_(dtype=d), f"claims {d}"))
    edges = ["neg_inf", "offset", "all_neg_inf"] + (["disjoint"] if two else [])
    if "mask" in claimed or OPS[op].index:
        edges.append("all_neg_inf_masked")
    out += [(main.with_(edge=e), f"edge values: {e}") for e in edges]
    out.append((main.with_(shape=(0,)), "zero tokens (the core's: no backend runs)"))
    out.append((main.with_(strided=True, shape=(2, 4)), "strided rows (a causal-shift view)"))
    out.append((main.with_(options=(("reduction", "sum"),)), "reduction=sum"))
    out.append((main.with_(shape=(2, 3), vocab=9001), "a vocabulary wider than a block"))
    if len(claimed) > 1:
        combo = main
        for f in claimed:
            combo = _feature(combo, f)
        out.append((combo, f"every claimed feature at once: {', '.join(claimed)}"))
    return out


def _layout_cases(base: Case, cap: OpCapability, world: int) -> list[tuple[Case, str]]:
    """Inputs in every memory layout users pass (whatever input_layout the backend declares,
    the core must hand them over in it), and a gradient taken with create_graph=True."""
    main = base.with_(layout="even" if world == 1 or cap.even_shards_only else "uneven")
    views = ["transposed", "every_other", "permuted"] + (["expanded_teacher"] if len(OPS[base.op].inputs) == 2 else [])
    out = [(main.with_(view=v, shape=(2, 3)), f"input layout: {VIEWS[v]}") for v in views]
    if world > 1 and cap.empty_shards and not cap.even_shards_only:
        out.append((main.with_(layout="empty", view="transposed", shape=(2, 3)), "transposed input, an empty shard"))
    out.append((main.with_(shape=(0,), view="every_other"), "zero tokens, every other column"))
    out.append((main.with_(second_order=True), "create_graph=True: right gradient, differentiating it raises"))
    return out


def _as_head(case: Case, **fields) -> HeadCase:
    return HeadCase(**{**{f.name: getattr(case, f.name) for f in dataclasses.fields(Case)}, **fields})


def _head_cases(base: Case, cap: OpCapability, head: HeadSupport, world: int) -> list[tuple[Case, str]]:
    """Match cases through ``vtp.Head``: a few per TP size, each over several token chunks."""
    op = base.op
    two = len(OPS[op].inputs) == 2
    scalar = (("reduction", "mean"),)
    per_token = (("reduction", "none"),) if head.per_token else scalar
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
        combo: Case = main
        for f in OPS[op].features:
            if f in cap.features and f != "teacher_grad":
                combo = _feature(combo, f)
        if combo != main:
            out.append((combo, "head inputs with every claimed feature"))
        return out
    layouts = ["even"] if cap.even_shards_only else ["uneven", "explicit"] + (["empty"] if cap.empty_shards else [])
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


def conformance_cases(
    backend: str | Backend, world_sizes: Sequence[int] = (1, 2), plugin: str | None = None
) -> list[ConformanceCase]:
    """Every check for ``backend`` (a registered name, or a Backend instance), derived from
    its declared capabilities. ``plugin``: ``"module"`` or ``"module:object"`` holding the
    backend's hook implementation, registered in the rank processes when the backend is not
    installed as an entry point (it must be importable there)."""
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
            add(1, Case(op, backend=name), "refused", f"does not implement {op}")
            continue
        base = _base(name, op, cap)
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
        for world in world_sizes:
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
    for world, base, cap in later:  # after the others, so that adding cases here moves no seed
        for case, why in _layout_cases(base, cap, world):
            add(world, case, "match", why)
    # head inputs last, so that adding them moves no other case's seed
    for world, base, cap in later:
        head = head_support(b, base.op)
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
    return out


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


def default_runner(world: int, fn: Callable, *args: Any, timeout: float = 120.0) -> list:
    """Run ``fn(rank, world, group, *args)`` on ``world`` gloo ranks, reusing one pool per size."""
    from .distributed import RankPool

    pool = _POOLS.get(world)
    if pool is None or not pool.alive:
        if not _POOLS:
            atexit.register(close_pools)
        pool = _POOLS[world] = RankPool(world)
    return pool.run(fn, *args, timeout=timeout)


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
    world_sizes: Sequence[int] = (1, 2),
    plugin: str | None = None,
    runner: Runner | None = None,
    timeout: float = 120.0,
) -> dict[str, str]:
    """Run every conformance case; raise one AssertionError listing every failure.
    Returns ``{case id: "ok" | "skipped: ..."}``."""
    results, failures = {}, []
    for cc in conformance_cases(backend, world_sizes, plugin):
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
    world_sizes: Sequence[int] = (1, 2),
    plugin: str | None = None,
    argname: str = "conformance_case",
):
    """``pytest.mark.parametrize`` over ``conformance_cases(...)``, with readable ids."""
    import pytest

    cases = conformance_cases(backend, world_sizes, plugin)
    return pytest.mark.parametrize(argname, cases, ids=[str(c) for c in cases])
