"""backends/triton/launch.py without a GPU: a stand-in compiled kernel records what the
launcher is given. The first launch of a specialization goes through the JIT, later ones
straight to the compiled kernel's launcher with every argument in signature order; any
change the JIT specializes on (dtype, 16-byte alignment, an int, a constexpr, the names
passed) goes through the JIT again, and so does every launch while a launch hook is set.
(On a GPU every test of the triton backend runs through it.)"""

import types
from collections.abc import Callable

import pytest
import torch
from triton.runtime.jit import JITFunction

from vtp_runtime.backends.triton import launch as launch_mod


def _source(x_ptr, y_ptr, n, scale, BLOCK):  # a kernel's signature; never compiled here
    pass


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("launcher", args))


@pytest.fixture
def kernel(monkeypatch):
    log = []
    fn = JITFunction(_source)
    compiled = []

    def jit_run(*args, grid, warmup, **kwargs):
        log.append(("jit", grid, kwargs))
        compiled.append(_Compiled(log))
        return compiled[-1]

    monkeypatch.setattr(fn, "run", jit_run)
    runtime = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    active = types.SimpleNamespace(device=0, get_current_stream=lambda device: 1234 + device)
    active.get_current_device = lambda: active.device
    driver = types.SimpleNamespace(active=active)
    launch_mod.use_runtime((JITFunction, runtime, driver))
    launch_mod.forget()
    yield fn, log, runtime, active
    launch_mod.use_runtime(None)
    launch_mod.forget()  # the stand-ins hold what they were given


def test_second_launch_skips_the_jit(kernel):
    fn, log, _, active = kernel
    x, y = torch.zeros(32), torch.zeros(32)
    for _ in range(3):
        launch_mod.launch(fn, (7,), True, x_ptr=x, y_ptr=y, n=100, scale=0.5, BLOCK=16, num_warps=4)
    assert [entry[0] for entry in log] == ["jit", "launcher", "launcher"]
    # the JIT's own call form: grid, stream, function, metadata, no launch metadata, hooks, then
    # every argument (constexprs too) in signature order; num_warps is an option, not an argument
    assert log[1][1] == (7, 1, 1, 1234, "function", "metadata", None, None, None, x, y, 100, 0.5, 16)


@pytest.mark.parametrize("change", ["dtype", "alignment", "int", "constexpr", "names", "num_warps", "device"])
def test_what_the_jit_specializes_on_goes_through_it_again(kernel, change):
    fn, log, _, active = kernel
    base = torch.zeros(64)
    args = dict(x_ptr=base[:32], y_ptr=base[:32], n=100, scale=0.5, BLOCK=16, num_warps=4)
    launch_mod.launch(fn, (7,), True, **args)
    other = dict(args)
    if change == "dtype":
        other["x_ptr"] = torch.zeros(32, dtype=torch.float64)
    elif change == "alignment":
        other["x_ptr"] = base[1:33]  # 4 bytes off a 16-byte boundary
    elif change == "int":
        other["n"] = 101
    elif change == "constexpr":
        other["BLOCK"] = 32
    elif change == "names":
        other = {"y_ptr": args["y_ptr"], **{k: v for k, v in args.items() if k != "y_ptr"}}
    elif change == "num_warps":
        other["num_warps"] = 8
    else:
        active.device = 1  # another GPU is current: the JIT compiles for it
    launch_mod.launch(fn, (7,), True, **other)
    launch_mod.launch(fn, (7,), True, **{**other, "scale": 0.25})  # same names, same order
    # a float is not specialized on: the third launch reuses the second's kernel
    assert [entry[0] for entry in log] == ["jit", "jit", "launcher"]


def test_hooks_and_other_objects_take_the_jit(kernel):
    fn, log, runtime, _ = kernel
    x = torch.zeros(32)
    args = dict(x_ptr=x, y_ptr=x, n=100, scale=0.5, BLOCK=16, num_warps=4)
    launch_mod.launch(fn, (7,), True, **args)
    runtime.launch_enter_hook = types.SimpleNamespace(calls=[print])  # a profiler's hook chain
    launch_mod.launch(fn, (7,), True, **args)
    runtime.launch_enter_hook = types.SimpleNamespace(calls=[])  # an empty chain: no hook
    launch_mod.launch(fn, (7,), True, **args)
    launch_mod.launch(fn, (7,), False, **args)  # fast=False: always the JIT
    assert [entry[0] for entry in log] == ["jit", "jit", "launcher", "jit"]
    seen = []

    class Double:  # not a JIT function (the interpreter's, a test's recorder)
        def __getitem__(self, grid):
            return lambda **kw: seen.append(grid)

    launch_mod.launch(Double(), (3,), True, **args)
    launch_mod.launch(Double(), (3,), True, **args)
    assert seen == [(3,), (3,)]


def _seeded(x_ptr, n, seed, BLOCK):  # a kernel taking a per-call seed; never compiled here
    pass


def test_unspecialized_ints_are_keyed_by_range_only(kernel):
    """A per-call seed (``do_not_specialize``) must not make every launch a miss of the kept kernels."""
    _, log, _, _ = kernel
    fn = JITFunction(_seeded, do_not_specialize=["seed"])
    fn.run = lambda *a, grid, warmup, **kw: log.append(("jit", grid, kw)) or _Compiled(log)
    x = torch.zeros(8)
    for seed in (1, 2, -5, 2**31 - 1, 2**31, 2**32 + 7):
        launch_mod.launch(fn, (1,), True, x_ptr=x, n=3, seed=seed, BLOCK=4)
    # int32 seeds share a kernel; past int32 the JIT compiles an int64 one, shared again
    assert [entry[0] for entry in log] == ["jit", "launcher", "launcher", "launcher", "jit", "launcher"]
    launch_mod.launch(fn, (1,), True, x_ptr=x, n=4, seed=1, BLOCK=4)  # a specialized int: exactly
    assert log[-1][0] == "jit"


def test_the_same_values_under_swapped_names_are_not_confused(kernel):
    """Two tensors of different dtypes passed in the other order are another specialization."""
    fn, log, _, _ = kernel
    a, b = torch.zeros(8), torch.zeros(8, dtype=torch.float16)
    launch_mod.launch(fn, (1,), True, x_ptr=a, y_ptr=b, n=3, scale=0.5, BLOCK=16)
    launch_mod.launch(fn, (1,), True, y_ptr=a, x_ptr=b, n=3, scale=0.5, BLOCK=16)
    launch_mod.launch(fn, (1,), True, x_ptr=b, y_ptr=a, n=3, scale=0.5, BLOCK=16)
    assert [entry[0] for entry in log] == ["jit", "jit", "jit"]


def test_arguments_that_do_not_fit_their_form_take_the_jit(kernel):
    fn, log, _, _ = kernel
    x = torch.zeros(8)
    args = dict(x_ptr=x, y_ptr=x, n=3, scale=0.5, BLOCK=16)
    launch_mod.launch(fn, (1,), True, **args)
    launch_mod.launch(fn, (1,), True, **{**args, "y_ptr": None})  # a tensor's slot without a tensor
    launch_mod.launch(fn, (1,), True, **{**args, "BLOCK": [16]})  # unhashable
    launch_mod.launch(fn, (1,), True, **{**args, "n": 3.0})  # an int's slot with a float
    launch_mod.launch(fn, (1,), True, **{**args, "BLOCK": True})  # 1 == True: told apart by type
    launch_mod.launch(fn, (1,), True, **{**args, "BLOCK": 1})
    launch_mod.launch(fn, (1,), True, x_ptr=x, y_ptr=x, n=3, scale=0.5)  # BLOCK left to its default
    assert [entry[0] for entry in log] == ["jit"] * 7


def test_the_kept_kernels_are_bounded(kernel, monkeypatch):
    fn, log, _, _ = kernel
    monkeypatch.setattr(launch_mod, "MAX_KEPT", 4)
    monkeypatch.setattr(launch_mod, "MAX_FORMS", 2)
    x = torch.zeros(8)
    for n in range(10):
        launch_mod.launch(fn, (1,), True, x_ptr=x, y_ptr=x, n=n, scale=0.5, BLOCK=16)
    assert launch_mod.kept_count() <= 4
    launch_mod.launch(fn, (1,), True, x_ptr=x, y_ptr=x, n=9, scale=0.5, BLOCK=16)
    assert log[-1][0] == "launcher"  # the latest survive
    for order in (
        ("x_ptr", "y_ptr", "n", "scale", "BLOCK"),
        ("y_ptr", "x_ptr", "n", "scale", "BLOCK"),
        ("n", "x_ptr", "y_ptr", "scale", "BLOCK"),
    ):
        values = dict(x_ptr=x, y_ptr=x, n=1, scale=0.5, BLOCK=16)
        launch_mod.launch(fn, (1,), True, **{name: values[name] for name in order})
    assert launch_mod.form_count(fn) <= 2
    assert launch_mod.kept_count() <= 2 * 4


def test_no_tensor_is_held(kernel):
    import gc
    import weakref

    fn, log, _, _ = kernel
    x = torch.zeros(8)
    ref = weakref.ref(x)
    for _ in range(2):
        launch_mod.launch(fn, (1,), True, x_ptr=x, y_ptr=x, n=3, scale=0.5, BLOCK=16)
    assert log[-1][0] == "launcher"
    log.clear()  # the stand-ins record what they were given
    del x
    gc.collect()
    assert ref() is None


def test_the_interpreter_takes_the_jit_and_keeps_nothing(monkeypatch):
    """Under TRITON_INTERPRET=1 (the test suite's mode) kernels are interpreted functions:
    every launch goes through them, fast or not, and gives the JIT's results."""
    from vtp_runtime.backends.triton import kernels

    launch_mod.forget()
    x = torch.randn(40)
    for fast in (True, False, True):
        y = x.clone()
        launch_mod.launch(
            kernels.scale_kernel, (2,), fast, x_ptr=y, n=40, scale_ptr=torch.tensor(0.5), programs=2, BLOCK=16
        )
        assert torch.equal(y, x * 0.5)
    assert launch_mod.kept_count() == 0


# -- launch.Bound: every argument fixed but the per-call ones ---------------------------------


def test_a_bound_launch_skips_the_jit_after_its_first(kernel):
    fn, log, _, _ = kernel
    bound = launch_mod.Bound(fn, (7,), True, ("y_ptr", "x_ptr"), n=100, scale=0.5, BLOCK=16, num_warps=4)
    x, y = torch.zeros(32), torch.zeros(32)
    for _ in range(3):
        bound(y, x)  # per-call values in the order named, not the signature's
    assert [entry[0] for entry in log] == ["jit", "launcher", "launcher"]
    assert log[0][2] == dict(n=100, scale=0.5, BLOCK=16, num_warps=4, y_ptr=y, x_ptr=x)
    assert log[1][1] == (7, 1, 1, 1234, "function", "metadata", None, None, None, x, y, 100, 0.5, 16)


@pytest.mark.parametrize("change", ["dtype", "alignment", "device", "hook"])
def test_a_bound_launch_takes_the_jit_where_the_specialization_differs(kernel, change):
    fn, log, runtime, active = kernel
    bound = launch_mod.Bound(fn, (7,), True, ("x_ptr", "y_ptr"), n=100, scale=0.5, BLOCK=16)
    base = torch.zeros(64)
    bound(base[:32], base[:32])
    x, y = base[:32], base[:32]
    if change == "dtype":
        x = torch.zeros(32, dtype=torch.float64)
    elif change == "alignment":
        y = base[1:33]  # 4 bytes off a 16-byte boundary
    elif change == "device":
        active.device = 1  # another GPU is current: the JIT compiles for it
    else:
        runtime.launch_enter_hook = types.SimpleNamespace(calls=[print])  # a profiler's hook chain
    bound(x, y)
    if change == "hook":
        runtime.launch_enter_hook = None
    bound(x, y)  # the new specialization is kept (or, after the hook, the kept one reused)
    assert [entry[0] for entry in log] == ["jit", "jit", "launcher"]


def test_a_checked_bound_launch_compares_the_device_only(kernel):
    """A caller whose own key fixes the per-call values' dtypes and alignment (a decode plan)
    launches with ``checked``: the kept kernel is reused without looking at them."""
    fn, log, _, active = kernel
    bound = launch_mod.Bound(fn, (7,), True, ("x_ptr", "y_ptr"), n=100, scale=0.5, BLOCK=16)
    base = torch.zeros(64)
    bound.launch((base[:32], base[:32]), checked=True)
    bound.launch((base[1:33], base[:32]), checked=True)  # the caller's key would differ here
    active.device = 1
    bound.launch((base[:32], base[:32]), checked=True)
    assert [entry[0] for entry in log] == ["jit", "launcher", "jit"]


def test_a_bound_launch_holds_no_tensor(kernel):
    import gc
    import weakref

    fn, log, _, _ = kernel
    bound = launch_mod.Bound(fn, (1,), True, ("x_ptr", "y_ptr"), n=3, scale=0.5, BLOCK=16)
    x = torch.zeros(8)
    ref = weakref.ref(x)
    for _ in range(2):
        bound(x, x)
    log.clear()  # the stand-ins record what they were given
    del x
    gc.collect()
    assert ref() is None
    assert not any(isinstance(v, torch.Tensor) for v in (*bound.args.values(), *bound.values))


def test_call_plans_are_bounded_and_hold_no_tensor(monkeypatch):
    """The triton backend keeps one plan per signature of a loss call (forward and backward),
    at most ``MAX_CALL_PLANS``, holding sizes and bound launches, never a tensor."""
    import vtp_runtime as vtp
    from vtp_runtime.backends.triton import backend as triton_backend

    monkeypatch.setattr(triton_backend, "MAX_CALL_PLANS", 6)
    triton_backend.clear_call_plans()
    for n in range(1, 12):  # a new token count: a new signature
        s = torch.randn(n, 40, requires_grad=True)
        vtp.cross_entropy(s, torch.randint(0, 40, (n,)), reduction="mean", backend="triton").backward()
        vtp.jsd(s, torch.randn(n, 40), reduction="sum", backend="triton").backward()
        assert 0 < len(triton_backend.call_plans()) <= 6

    def held(value) -> list:
        if isinstance(value, launch_mod.Bound):  # a backward's plan is its launch
            return [*value.args.values(), *value.values]
        return [value]

    for plan in triton_backend.call_plans():
        if isinstance(plan, launch_mod.Bound):
            assert not any(isinstance(v, torch.Tensor) for v in held(plan))
            continue
        for name in {name for kind in type(plan).__mro__ for name in getattr(kind, "__slots__", ())}:
            assert not any(isinstance(v, torch.Tensor) for v in held(getattr(plan, name))), name
    triton_backend.clear_call_plans()
    s = torch.randn(3, 40, requires_grad=True)
    for _ in range(3):  # one signature: one forward plan, one backward plan
        vtp.entropy(s, reduction="mean", backend="triton").backward()
        assert len(triton_backend.call_plans()) == 2


# -- on a GPU: the kept kernels give the JIT's results ---------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1, 8])  # elements: aligned, 2 bytes off, 16 bytes off
def test_kept_kernels_match_the_jit_on_cuda(offset):
    """The launcher's path and the JIT's give bit-identical results at every alignment, and
    a change of alignment between launches is a new specialization, not a reuse."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with compiled Triton: TRITON_INTERPRET=0 pytest -m gpu")
    from vtp_runtime.backends.triton import kernels

    base = torch.randn(1 << 16, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(0.37, device="cuda")
    for start in (offset, 0, offset):  # views at that offset: misaligned pointers reach the kernel
        want_buffer = base.clone()
        want = want_buffer[start : start + 50001]
        launch_mod.launch(
            kernels.scale_kernel, (64,), False, x_ptr=want, n=want.numel(), scale_ptr=scale, programs=64, BLOCK=1024
        )
        for _ in range(3):  # the first launch of a specialization compiles, the others reuse it
            got_buffer = base.clone()
            got = got_buffer[start : start + 50001]
            launch_mod.launch(
                kernels.scale_kernel, (64,), True, x_ptr=got, n=got.numel(), scale_ptr=scale, programs=64, BLOCK=1024
            )
            assert torch.equal(got_buffer, want_buffer)  # the elements outside the view untouched too
    assert launch_mod.kept_count() >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 1024])
def test_every_loss_is_the_same_through_the_launcher_on_cuda(rows):
    """Every op, forward and backward, at the decode and training sizes of the CPU-cost
    benchmark, with the launcher's path on and off: identical values and gradients."""
    import dataclasses
    import os

    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with compiled Triton: TRITON_INTERPRET=0 pytest -m gpu")
    import vtp_runtime as vtp
    from vtp_runtime.backends.triton import CUDA_CONFIG, TritonBackend
    from vtp_runtime.registry import REGISTRY, register

    class JitOnly(TritonBackend):
        name, priority = "triton_jit_only", -5

    class Plugin:
        @staticmethod
        def vtp_runtime_register_backends(register):
            register(JitOnly(dataclasses.replace(CUDA_CONFIG, fast_launch=False)))

    vtp.hookimpl(Plugin.vtp_runtime_register_backends)
    register(Plugin(), name="triton_jit_only")
    try:
        gen = torch.Generator(device="cuda").manual_seed(rows)
        v = 151936
        z = torch.randn(rows, v, device="cuda", generator=gen).to(torch.bfloat16) * 3
        t = torch.randn(rows, v, device="cuda", generator=gen).to(torch.bfloat16) * 3
        y = torch.randint(0, v, (rows,), device="cuda", generator=gen)
        idx = torch.randint(0, v, (rows, 4), device="cuda", generator=gen)
        calls: dict[str, Callable[[torch.Tensor, str], torch.Tensor]] = {
            "cross_entropy": lambda s, b: vtp.cross_entropy(s, y, reduction="mean", backend=b),
            "cross_entropy_smooth": lambda s, b: vtp.cross_entropy(
                s, y, label_smoothing=0.1, z_loss=1e-4, reduction="sum", backend=b
            ),
            "logprobs": lambda s, b: vtp.logprobs(s, y, reduction="mean", backend=b),
            "logprobs_entropy": lambda s, b: torch.stack(
                vtp.logprobs(s, y, return_entropy=True, reduction="mean", backend=b)
            ).sum(),
            "logprobs_topk": lambda s, b: vtp.logprobs(s, idx, reduction="mean", backend=b),
            "entropy": lambda s, b: vtp.entropy(s, reduction="mean", backend=b),
            "kl": lambda s, b: vtp.kl(s, t, reduction="mean", backend=b),
            "jsd": lambda s, b: vtp.jsd(s, t, beta=0.5, reduction="mean", backend=b),
        }
        for name, call in calls.items():
            results: dict[str, list[torch.Tensor | None]] = {}
            for backend in ("triton", "triton_jit_only"):
                outs: list[torch.Tensor | None] = []
                for source in (z, z[:, :]):  # twice: the second call takes the kept kernels
                    s = source.detach().clone().requires_grad_(True)
                    out = call(s, backend)
                    out.backward()
                    outs += [out.detach(), s.grad]
                results[backend] = outs
            for a, b in zip(results["triton"], results["triton_jit_only"]):
                assert a is not None and b is not None and torch.equal(a, b), name
        assert launch_mod.kept_count() >= 1
    finally:
        REGISTRY.unregister("triton_jit_only")


# what follows a call's token count, by parameter name; the fused head's matmul keeps its row
# count specialized (its tiles' masks), and is compiled per chunk size, which is bounded
TOKEN_COUNT_PARAMS = {"rows_b", "n_rows", "splits", "n_parts", "n_stats_parts", "n_tiles"}
SPECIALIZED_ROWS = {"head_matmul_kernel"}


def _kernel_definitions():
    import ast
    import pathlib

    from vtp_runtime.backends import triton as triton_package

    for path in sorted(pathlib.Path(triton_package.__path__[0]).glob("*kernels.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                yield path.name, node


def test_numbers_that_follow_the_token_count_are_not_specialized():
    """A job whose token count changes every step compiles no kernel after its first steps:
    the JIT specializes an int on being 1 or a multiple of 16, so every such number of a
    kernel is declared ``do_not_specialize``."""
    import ast

    checked = 0
    for file, node in _kernel_definitions():
        params = {a.arg for a in node.args.args}
        wanted = params & TOKEN_COUNT_PARAMS
        if node.name == "scale_kernel":
            wanted = {"n", "programs"}  # a gradient's size and the programs over it
        if not wanted or node.name in SPECIALIZED_ROWS:
            continue
        declared: set[str] = set()
        for decorator in node.decorator_list:
            if isinstance(decorator, ast.Call):
                for keyword in decorator.keywords:
                    if keyword.arg == "do_not_specialize":
                        declared |= set(ast.literal_eval(keyword.value))
        assert wanted <= declared, f"{file}: {node.name} specializes on {sorted(wanted - declared)}"
        checked += 1
    assert checked >= 12  # the loss, sampling and head kernels were found
