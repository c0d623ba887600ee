"""Launching a ``@triton.jit`` kernel with less Python per launch.

``kernel[grid](**args)`` goes through Triton's JIT dispatch on every launch: binding the
arguments, specializing each one, building the cache key, looking the compiled kernel up,
then calling its launcher. ``launch`` does that the first time a call site meets a new
specialization, keeps the compiled kernel the JIT returns, and afterwards calls the
compiled kernel's launcher directly, the way the JIT itself calls it
(``compiled.run(grid_0, grid_1, grid_2, stream, function, packed_metadata, metadata,
enter_hook, exit_hook, *args)`` with every argument in signature order), as Triton 3.6
and 3.9 do.

The key of a kept kernel holds everything the JIT specializes on, conservatively: the
current device, the argument names in call order, each tensor's dtype and whether its
address is a multiple of 16, each int and constexpr exactly (an int the kernel declares
``do_not_specialize``, such as a per-call seed, only by whether it fits int32), each float
as a float. Launch hooks (a profiler's) or
pre-run hooks send every launch through the JIT, as do objects that are not plain JIT
functions (Triton's interpreter, test doubles).
"""

from __future__ import annotations

from typing import Any

import torch

MAX_KEPT = 256  # per kernel; past it the kept kernels are dropped and found again

_kept: dict[Any, dict[tuple, Any]] = {}
_runtime: Any = None  # (JITFunction, knobs.runtime, driver), imported on first use


def _triton() -> Any:
    global _runtime
    if _runtime is None:
        import triton
        from triton.runtime.jit import JITFunction

        knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older ones always take the JIT path
        _runtime = (JITFunction, getattr(knobs, "runtime", None), triton.runtime.driver)
    return _runtime


def _hook_active(hook: Any) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel: Any, grid: tuple[int, ...], fast: bool, **args: Any) -> None:
    """``kernel[grid](**args)``, through the kept compiled kernel when ``fast`` allows."""
    if not fast:
        kernel[grid](**args)
        return
    jit_function, runtime, driver = _triton()
    if (
        runtime is None
        or type(kernel) is not jit_function
        or getattr(kernel, "pre_run_hooks", True)
        or not hasattr(kernel, "arg_names")
        or _hook_active(runtime.launch_enter_hook)
        or _hook_active(runtime.launch_exit_hook)
    ):
        kernel[grid](**args)
        return
    device = driver.active.get_current_device()  # the JIT keeps compiled kernels per device too
    key = _key(device, args, _unspecialized(kernel))
    kept = _kept.setdefault(kernel, {})
    compiled = kept.get(key) if key is not None else None
    if compiled is None:
        compiled = kernel[grid](**args)  # compiles on a miss; returns the compiled kernel
        if key is not None and hasattr(compiled, "packed_metadata") and hasattr(compiled, "function"):
            if len(kept) >= MAX_KEPT:
                kept.clear()
            kept[key] = compiled
        return
    stream = driver.active.get_current_stream(device)
    values = [args[name] for name in kernel.arg_names]
    compiled.run(
        grid[0],
        grid[1] if len(grid) > 1 else 1,
        grid[2] if len(grid) > 2 else 1,
        stream,
        compiled.function,
        compiled.packed_metadata,
        None,
        runtime.launch_enter_hook,
        runtime.launch_exit_hook,
        *values,
    )


_UNSPECIALIZED: dict[Any, frozenset[str]] = {}


def _unspecialized(kernel: Any) -> frozenset[str]:
    """The names of the kernel's ``do_not_specialize`` parameters."""
    names = _UNSPECIALIZED.get(kernel)
    if names is None:
        params = getattr(kernel, "params", ())
        names = _UNSPECIALIZED[kernel] = frozenset(p.name for p in params if getattr(p, "do_not_specialize", False))
    return names


def _key(device: Any, args: dict[str, Any], unspecialized: frozenset[str] = frozenset()) -> tuple | None:
    key: list[Any] = [device, tuple(args)]
    for name, value in args.items():
        kind = type(value)
        if kind is torch.Tensor:
            key.append((value.dtype, value.data_ptr() % 16 == 0))
        elif kind is int and name in unspecialized:  # its type follows its range, nothing else
            key.append((int, -(2**31) <= value < 2**31))
        elif kind is int or kind is bool:
            key.append(value)
        elif kind is float:
            key.append(float)
        else:  # anything else: let the JIT decide every time
            return None
    return tuple(key)
