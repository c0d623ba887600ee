"""backends/triton/launch.py without a GPU: a stand-in compiled kernel records what the
launcher is given. The first launch of a specialization goes through the JIT, later ones
straight to the compiled kernel's launcher with every argument in signature order; any
change the JIT specializes on (dtype, 16-byte alignment, an int, a constexpr, the names
passed) goes through the JIT again, and so does every launch while a launch hook is set.
(On a GPU every test of the triton backend runs through it.)"""

import types

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
    monkeypatch.setattr(launch_mod, "_runtime", (JITFunction, runtime, driver))
    monkeypatch.setattr(launch_mod, "_kept", {})
    return fn, log, runtime, active


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


def test_unspecialized_ints_are_keyed_by_range_only():
    """A per-call seed (``do_not_specialize``) must not make every launch a miss of the kept kernels."""
    from vtp_runtime.backends.triton import launch as L

    keys = [L._key("dev", {"x": 3, "seed": s}, frozenset({"seed"})) for s in (1, 2, -5, 2**31 - 1)]
    assert len(set(keys)) == 1
    assert L._key("dev", {"x": 3, "seed": 2**31}, frozenset({"seed"})) != keys[0]  # an int64 now
    assert L._key("dev", {"x": 3, "seed": 1}) != L._key("dev", {"x": 3, "seed": 2})  # specialized ints: exactly
    from vtp_runtime.backends.triton import sampling_kernels

    assert L._unspecialized(sampling_kernels.scan_kernel) >= {"seed_key", "seed_lo", "seed_hi"} or not hasattr(
        sampling_kernels.scan_kernel, "params"
    )  # the interpreter's function has no params
