"""The conformance kit: its cases follow a backend's declaration, at each depth
(``VTP_TEST_DEPTH``); it catches each kind of broken backend (wrong math, wrong gradient, a
missing cross-rank term, a second backward that differs, a dishonest capability
declaration), with its smoke selection too. Correct backends pass it in their own tests:
the eager backend in tests/test_eager.py, the example plugin in its own suite."""

import dataclasses
import math
import re
import sys
from pathlib import Path

import pytest

from vtp_runtime.backend import ALL_DTYPES, OpCapability
from vtp_runtime.backends.eager import EagerBackend
from vtp_runtime.ops import LOSSES, OPS
from vtp_runtime.registry import hookimpl
from vtp_runtime.testing import conformance as kit
from vtp_runtime.testing.cases import DTYPES, shard_sizes
from vtp_runtime.testing.head_cases import TOKEN_SPLITS, token_split

EXAMPLE_SRC = Path(__file__).resolve().parents[1] / "plugins" / "vtp-example-backend" / "src"
if str(EXAMPLE_SRC) not in sys.path:  # importable here and in the rank processes spawned later
    sys.path.append(str(EXAMPLE_SRC))

from vtp_example_backend import BlockwiseBackend  # noqa: E402

# The example plugin's conformance cases run once, in its own suite
# (plugins/vtp-example-backend/tests, also collected from the repository root); here only
# how they are derived is checked.
EXAMPLE_CASES = kit.conformance_cases(BlockwiseBackend(), plugin="vtp_example_backend", depth="fast")


# -- cases follow the declaration ----------------------------------------------------------


def test_cases_follow_the_declaration():
    ids = {str(c): c for c in EXAMPLE_CASES}
    assert len(ids) == len(EXAMPLE_CASES), "case ids must be unique"
    refused = {c.why for c in EXAMPLE_CASES if c.expect == "refused"}
    assert {
        "does not implement cross_entropy",
        "does not implement logprobs",
        "does not implement jsd",
        "does not claim float16",
    } <= refused
    matched = [c for c in EXAMPLE_CASES if c.expect == "match"]
    assert {c.world for c in matched} == {1, 2}
    assert {c.case.layout for c in matched if c.world == 2} >= {"uneven", "explicit", "empty"}
    kl = [c.case for c in matched if c.case.op == "kl"]
    assert any(c.grads == (True, True) for c in kl) and any(c.grads == (False, True) for c in kl)
    assert any(("reverse", True) in c.options for c in kl) and any(c.masked == "labels" for c in kl)
    assert {c.case.dtype for c in matched} == {"float32", "bfloat16", "float64"}

    class Narrow(EagerBackend):
        name = "narrow"
        ops = {
            "cross_entropy": OpCapability(
                device_types=None, dtypes=ALL_DTYPES, tp_sizes=frozenset({1}), even_shards_only=True, empty_shards=False
            )
        }

    whys = {(c.world, c.why) for c in kit.conformance_cases(Narrow()) if c.expect == "refused"}
    assert {(1, "does not claim label_smoothing"), (2, "does not claim TP size 2")} <= whys
    assert not any(c.world == 2 and c.expect == "match" for c in kit.conformance_cases(Narrow()))


def test_the_depth_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("VTP_TEST_DEPTH", raising=False)
    assert (kit.current_depth(), kit.current_depth(slow=True)) == ("fast", "smoke")
    monkeypatch.setenv("VTP_TEST_DEPTH", "full")
    assert (kit.current_depth(), kit.current_depth(slow=True)) == ("full", "full")
    assert {c.world for c in kit.conformance_cases(BlockwiseBackend())} == {1, 2, 3, 4}
    monkeypatch.setenv("VTP_TEST_DEPTH", "deep")
    with pytest.raises(ValueError, match="VTP_TEST_DEPTH='deep': use fast"):
        kit.current_depth()


def test_each_depth_widens_the_one_before():
    cases = {depth: kit.conformance_cases("eager", depth=depth) for depth in kit.DEPTHS}
    ids = {depth: {str(c) for c in cases[depth]} for depth in kit.DEPTHS}
    assert ids["smoke"] < ids["fast"] < ids["full"]
    assert {c.world for c in cases["fast"]} == {1, 2} and {c.world for c in cases["full"]} == {1, 2, 3, 4}

    def edges_checked(depth, world):
        """(dtype, shard layout) of the cases with edge values, at a TP size."""
        return {(c.case.dtype, c.case.layout) for c in cases[depth] if c.world == world and c.case.edge}

    assert edges_checked("fast", 2) == {("float32", "uneven")}  # other dtypes and layouts: base cases only
    for world in (2, 3, 4):  # full: every dtype, and every shard layout, meets them
        assert {d for d, _ in edges_checked("full", world)} == set(DTYPES)
        assert {lay for _, lay in edges_checked("full", world)} == {"even", "uneven", "explicit", "empty"}


def test_smoke_keeps_one_case_of_every_check():
    """Of every check but the wide vocabulary, at each TP size: one case, and every op's
    first one; the refusals all."""
    for backend in ("eager", "triton", "liger"):
        fast = kit.conformance_cases(backend, depth="fast")
        smoke = kit.conformance_cases(backend, depth="smoke")
        for world in (1, 2):
            whys = {c.why for c in fast if c.world == world and c.why != kit.WIDE}
            assert whys == {c.why for c in smoke if c.world == world}, backend
            ops = {c.case.op for c in fast if c.world == world and c.expect == "match"}
            assert ops == {c.case.op for c in smoke if c.world == world and c.expect == "match"}
        assert [c for c in fast if c.expect == "refused"] == [c for c in smoke if c.expect == "refused"]
        assert len(smoke) < len(fast)


def test_what_tests_enumerate_follows_the_declarations(monkeypatch):
    """The ops, backends and TP sizes other tests parametrize over come from the op table and
    the backends' declarations, so that a new op, feature or backend shows up in them."""
    assert kit.ops_with() == LOSSES
    assert kit.ops_with("mask") == tuple(op for op in LOSSES if "mask" in OPS[op].features) == ("entropy", "kl", "jsd")
    assert kit.ops_with(backend=BlockwiseBackend()) == ("entropy", "kl")
    assert kit.ops_with("reverse", backend=BlockwiseBackend()) == ("kl",)
    assert kit.ops_with("topk", backend="liger") == ()
    assert kit.backends_with("sample") == ("eager", "triton")  # liger has no sampling
    assert kit.backends_with("kl", "teacher_grad") == ("eager", "triton")  # liger's teacher is frozen
    assert "example_blockwise" not in kit.backends_with("entropy")  # a plugin's suite runs it
    assert kit.backends_with(device_type="xpu") == ("eager", "triton_xpu")
    monkeypatch.delenv("VTP_TEST_DEPTH", raising=False)
    assert kit.tp_sizes(2, 4) == (2, 4)
    assert kit.tp_sizes(2, 4, depth="full") == kit.tp_sizes(4, 2, depth="full") == (2, 3, 4)
    monkeypatch.setenv("VTP_TEST_DEPTH", "full")
    assert kit.tp_sizes(1, 3) == (1, 2, 3, 4)
    assert all(sum(token_split(split, 5, 2, 0)) == 5 for split in TOKEN_SPLITS)
    with pytest.raises(ValueError, match="unknown token split 'odd'; known: even, uneven, empty"):
        token_split("odd", 5, 2, 0)


# -- broken backends the kit must catch ----------------------------------------------------
# Each registers in the rank processes through plugin="tests.test_conformance:<OBJECT>".


class _Plugin:
    def __init__(self, cls):
        self.cls = cls

    @hookimpl
    def vtp_runtime_register_backends(self, register):
        register(self.cls())


def _entropy_only(name, features=("mask", "temperature")):
    return {
        "name": name,
        "priority": -50,
        "ops": {"entropy": OpCapability(device_types=None, dtypes=ALL_DTYPES, features=frozenset(features))},
    }


class WrongValue(EagerBackend):
    locals().update(_entropy_only("kit_wrong_value"))

    def forward(self, call, inputs, index, mask):
        values, state = super().forward(call, inputs, index, mask)
        return values * 1.001, state


class WrongTemperatureGrad(EagerBackend):
    """Right at T = 1; forgets the 1/T factor of the gradient."""

    locals().update(_entropy_only("kit_wrong_temperature_grad"))

    def backward(self, call, state, grad):
        (out,) = super().backward(call, state, grad)
        return (out * call.options["temperature"],)


class NoAllReduce(EagerBackend):
    """Right on one rank; forgets to combine statistics across ranks."""

    locals().update(_entropy_only("kit_no_all_reduce"))

    def forward(self, call, inputs, index, mask):
        return super().forward(dataclasses.replace(call, group=None), inputs, index, mask)


class OverwritesSaved(EagerBackend):
    """Right the first time; its backward overwrites what it saved (as Liger's kernels do)."""

    locals().update(_entropy_only("kit_overwrites_saved"))

    def backward(self, call, state, grad):
        out = super().backward(call, state, grad)
        state.max.data.add_(1.0)  # like a kernel writing through a raw pointer: autograd cannot tell
        return out


class ClaimsLess(EagerBackend):
    """Declares no mask support, but its reasons() accept anything."""

    locals().update(_entropy_only("kit_claims_less", features=("temperature",)))

    def capability_reasons(self, request):
        return []


WRONG_VALUE, WRONG_TEMPERATURE_GRAD, NO_ALL_REDUCE, OVERWRITES_SAVED, CLAIMS_LESS = map(
    _Plugin, (WrongValue, WrongTemperatureGrad, NoAllReduce, OverwritesSaved, ClaimsLess)
)


def _pick(plugin: str, cls, world: int, pred):
    cases = [
        c
        for c in kit.conformance_cases(cls(), world_sizes=(world,), plugin=f"tests.test_conformance:{plugin}")
        if pred(c)
    ]
    assert cases, "no such case"
    return cases[0]


@pytest.mark.parametrize(
    "plugin,cls,world,pred,message",
    [
        ("WRONG_VALUE", WrongValue, 1, lambda c: c.why == "even shards", "value: .* elements off"),
        (
            "WRONG_TEMPERATURE_GRAD",
            WrongTemperatureGrad,
            1,
            lambda c: c.why == "claims temperature",
            r"grad\[0\]: .* elements off",
        ),
        ("NO_ALL_REDUCE", NoAllReduce, 2, lambda c: c.why == "uneven shards", "value: .* elements off"),
        ("OVERWRITES_SAVED", OverwritesSaved, 1, lambda c: c.why == "even shards", "second backward differs"),
        (
            "CLAIMS_LESS",
            ClaimsLess,
            1,
            lambda c: c.why == "does not claim mask",
            "does not claim mask, yet a forced call ran it",
        ),
    ],
    ids=["value", "temperature-grad", "no-all-reduce", "overwrites-saved", "claims-less"],
)
def test_kit_catches(ranks, plugin, cls, world, pred, message):
    cc = _pick(plugin, cls, world, pred)
    with pytest.raises(AssertionError, match=message):
        kit.check(cc, runner=ranks, timeout=60)


def test_kit_passes_where_the_bug_does_not_show(ranks):
    """Each broken backend is right outside its bug, so the failures above are the bug's."""
    kit.check(
        _pick("WRONG_TEMPERATURE_GRAD", WrongTemperatureGrad, 1, lambda c: c.why == "even shards"),
        runner=ranks,
        timeout=60,
    )
    kit.check(_pick("NO_ALL_REDUCE", NoAllReduce, 1, lambda c: c.why == "even shards"), runner=ranks, timeout=60)
    kit.check(_pick("CLAIMS_LESS", ClaimsLess, 1, lambda c: c.why == "claims temperature"), runner=ranks, timeout=60)


BROKEN = [
    ("WRONG_VALUE", WrongValue, "value: .* elements off"),
    ("WRONG_TEMPERATURE_GRAD", WrongTemperatureGrad, r"grad\[0\]: .* elements off"),
    ("NO_ALL_REDUCE", NoAllReduce, "tp2-match-entropy.*value: .* elements off"),
    ("OVERWRITES_SAVED", OverwritesSaved, "second backward differs"),
    ("CLAIMS_LESS", ClaimsLess, "does not claim mask, yet a forced call ran it"),
]


@pytest.mark.parametrize("plugin,cls,message", BROKEN, ids=[p.lower() for p, _, _ in BROKEN])
def test_smoke_catches_every_broken_backend(ranks, plugin, cls, message):
    """The selection a slow backend runs (Triton's interpreter in CI) still fails each bug."""
    with pytest.raises(AssertionError, match=r"conformance case\(s\) failed") as info:
        kit.check_backend(cls(), plugin=f"tests.test_conformance:{plugin}", runner=ranks, timeout=60, depth="smoke")
    assert re.search(message, str(info.value), re.S), str(info.value)[:2000]


def test_check_backend_reports_every_failure(ranks):
    with pytest.raises(AssertionError, match=r"conformance case\(s\) failed") as info:
        kit.check_backend(
            NoAllReduce(), world_sizes=(1, 2), plugin="tests.test_conformance:NO_ALL_REDUCE", runner=ranks, timeout=60
        )
    text = str(info.value)
    assert "tp2-match-entropy" in text and "tp1-match" not in text


def test_probe_failure_skips(monkeypatch):
    class Absent(EagerBackend):
        locals().update(_entropy_only("kit_absent"))

        def probe(self, device_type):
            return ["needs libfoo"]

    cases = kit.conformance_cases(Absent())
    match = next(c for c in cases if c.expect == "match")
    assert match.skip == "needs libfoo"
    with pytest.raises(pytest.skip.Exception, match="needs libfoo"):
        kit.check(match)
    ran = []

    def runner(world, fn, cc, timeout):
        ran.append(cc)
        return []

    results = kit.check_backend(Absent(), runner=runner, world_sizes=(1,))
    assert results[str(match)] == "skipped: needs libfoo"
    assert ran and all(c.expect == "refused" for c in ran)  # refusals are still checked


def test_wide_case_crosses_example_blocks():
    """The kit's wide-vocabulary case spans more than one of the example's blocks on some
    rank, at every world size, with tokens to compute."""
    import vtp_example_backend

    full = kit.conformance_cases(BlockwiseBackend(), plugin="vtp_example_backend", depth="full")
    wide = [c for c in EXAMPLE_CASES + full if c.expect == "match" and c.why == kit.WIDE]
    assert {c.world for c in wide} == {1, 2, 3, 4}
    for c in wide:
        sizes, _ = shard_sizes(c.case.layout, c.case.vocab, c.world, c.case.seed)
        assert max(sizes) > vtp_example_backend.BLOCK, (str(c), sizes)
        assert math.prod(c.case.shape) > 0


def test_backend_authors_guide_runs():
    """Every Python example in docs/backend-authors.md runs, in order, in one namespace."""
    doc = Path(__file__).resolve().parents[1] / "docs" / "backend-authors.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    assert len(blocks) >= 4
    namespace = {"__name__": "__doc_example__"}
    import contextlib

    import vtp_example_backend
    from vtp_runtime.registry import registered

    # the guide assumes the example plugin is installed; here its source is on sys.path
    installed = "example_blockwise" in kit.REGISTRY.backends()
    with contextlib.nullcontext() if installed else registered(vtp_example_backend):
        for code in blocks:
            exec(compile(code, "<docs/backend-authors.md example>", "exec"), namespace)
    assert "tiny_entropy" not in kit.REGISTRY.backends()  # the guide cleans up after itself
