"""Launching a ``@triton.jit`` kernel with less Python per launch.

``kernel[grid](**args)`` goes through Triton's JIT dispatch on every launch: binding the
arguments, specializing each one, building the cache key, checking the kernel's global
constants, looking the compiled kernel up, then calling its launcher. ``launch`` does that
the first time a call site meets a new specialization, keeps the compiled kernel the JIT
returns, and afterwards calls the compiled kernel's launcher directly, the way the JIT
itself calls it (``compiled.run(grid_0, grid_1, grid_2, stream, function, packed_metadata,
launch_metadata, enter_hook, exit_hook, *args)`` with every argument in signature order),
as Triton 3.6 and 3.9 do.

A kernel's arguments are sorted once per kernel and set of names passed (a ``_Form``),
from the first call's values: tensors, floats, ints the kernel declares
``do_not_specialize`` (a per-call seed), and the rest (ints, bools, constexprs, launch
options such as ``num_warps``). The key of a kept kernel is then built with C-level getters,
holding everything the JIT specializes on, conservatively: the current device, each
tensor's dtype and whether its address is a multiple of 16, every value of the rest exactly,
each float and unspecialized int by its type (the latter also by whether it fits int32), and
the type of every non-tensor value. A launch whose arguments do not fit their form (a
non-tensor where the first call had a tensor) goes through the JIT. Launch hooks (a
profiler's) or pre-run hooks send every launch through the JIT, as do objects that are not
plain JIT functions (Triton's interpreter, test doubles). Nothing here holds a tensor.
``kept_count``, ``form_count`` and ``forget`` show and drop what is kept; ``use_runtime``
puts stand-ins for Triton's runtime in its place.

A ``Bound`` launch is the leaner form for a call site that launches one kernel the same way
on every call but for a few arguments (the tensors of the call, a seed): every other
argument is fixed when it is made, so a launch builds no key and no keyword arguments. It
keeps the compiled kernel its first launch returned, with what the JIT specialized on in
the per-call arguments (each tensor's dtype and 16-byte alignment, the current device), and
launches through the JIT again where one of those differs. It holds no tensor between
launches.
"""

from __future__ import annotations

from functools import reduce
from operator import attrgetter, itemgetter, or_
from typing import Any

import torch

MAX_KEPT = 256  # per kernel and set of names; past it the kept kernels are dropped and found again
MAX_FORMS = 64  # per kernel: sets of argument names passed

_forms: dict[Any, dict[tuple[str, ...], _Form | None]] = {}  # by kernel, then by names passed
_runtime: Any = None  # (JITFunction, knobs.runtime, driver), imported on first use


def _triton() -> Any:
    global _runtime
    if _runtime is None:
        import triton
        from triton.runtime.jit import JITFunction

        knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older ones always take the JIT path
        _runtime = (JITFunction, getattr(knobs, "runtime", None), triton.runtime.driver)
    return _runtime


def use_runtime(runtime: tuple[Any, Any, Any] | None) -> None:
    """Launch through ``runtime`` (``JITFunction``, ``knobs.runtime``, the driver: stand-ins
    in tests); None: Triton's own, imported at the next launch."""
    global _runtime
    _runtime = runtime


def _hook_active(hook: Any) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))


_DATA_PTR = torch.Tensor.data_ptr
_DTYPE = attrgetter("dtype")


def _getter(names: list[str]) -> Any:
    """A C-level ``lambda d: tuple(d[n] for n in names)``."""
    if len(names) == 1:
        one = names[0]
        return lambda d: (d[one],)
    return itemgetter(*names) if names else (lambda d: ())


class _Form:
    """How one kernel's arguments, passed under one set of names, enter its key."""

    __slots__ = ("tensors", "exact", "scalars", "unspecialized", "ordered", "kept")

    def __init__(self, kernel: Any, args: dict[str, Any]) -> None:
        params = {p.name: p for p in getattr(kernel, "params", ())}
        tensors, exact, scalars, unspecialized = [], [], [], []
        for name, value in args.items():
            if isinstance(value, torch.Tensor):
                tensors.append(name)
                continue
            scalars.append(name)
            param = params.get(name)
            constexpr = param is not None and getattr(param, "is_constexpr", False)
            if type(value) is float and not constexpr:
                continue  # the JIT does not specialize on a float's value
            if type(value) is int and param is not None and getattr(param, "do_not_specialize", False):
                unspecialized.append(name)  # its type follows its range, nothing else
                continue
            exact.append(name)
        self.tensors, self.exact, self.scalars = _getter(tensors), _getter(exact), _getter(scalars)
        self.unspecialized = _getter(unspecialized) if unspecialized else None
        self.ordered = _getter(list(kernel.arg_names))  # the launcher's arguments, constexprs too
        self.kept: dict[tuple, Any] = {}  # compiled kernels by key

    def key(self, device: Any, args: dict[str, Any]) -> tuple:
        tensors = self.tensors(args)
        aligned = _aligned(tensors)
        ranges = () if self.unspecialized is None else tuple(-(2**31) <= v < 2**31 for v in self.unspecialized(args))
        types = tuple(map(type, self.scalars(args)))
        return (device, self.exact(args), types, tuple(map(_DTYPE, tensors)), aligned, ranges)


def _form(kernel: Any, args: dict[str, Any]) -> _Form | None:
    """The form of ``kernel`` for the names in ``args``, made on first use; None where the
    names leave a parameter of the kernel out (its default: let the JIT bind it)."""
    names = tuple(args)
    forms = _forms.setdefault(kernel, {})
    try:
        return forms[names]
    except KeyError:
        pass
    form = _Form(kernel, args) if set(kernel.arg_names) <= set(names) else None
    if len(forms) >= MAX_FORMS:
        forms.clear()
    forms[names] = form
    return form


def direct(kernel: Any) -> tuple[Any, Any] | None:
    """Triton's ``(knobs.runtime, driver)`` where a launch of ``kernel`` may call a compiled
    kernel's launcher directly: a plain JIT function without pre-run hooks, on a Triton with
    knobs, while no launch hook is active; None where it must go through the JIT."""
    jit_function, runtime, driver = _triton()
    if (
        runtime is None
        or type(kernel) is not jit_function
        or getattr(kernel, "pre_run_hooks", True)
        or not hasattr(kernel, "arg_names")
        or _hook_active(runtime.launch_enter_hook)
        or _hook_active(runtime.launch_exit_hook)
    ):
        return None
    return runtime, driver


def launchable(compiled: Any) -> bool:
    """Whether ``compiled``, what a JIT launch returned, can be launched by ``run_compiled``."""
    return hasattr(compiled, "packed_metadata") and hasattr(compiled, "function")


def run_compiled(compiled: Any, grid: tuple[int, ...], runtime: Any, driver: Any, device: Any, values: Any) -> None:
    """Launch ``compiled`` on ``grid`` with ``values``, every argument in signature order, as
    the JIT itself does."""
    compiled.run(
        grid[0],
        grid[1] if len(grid) > 1 else 1,
        grid[2] if len(grid) > 2 else 1,
        driver.active.get_current_stream(device),
        compiled.function,
        compiled.packed_metadata,
        None,
        runtime.launch_enter_hook,
        runtime.launch_exit_hook,
        *values,
    )


def launch(kernel: Any, grid: tuple[int, ...], fast: bool, **args: Any) -> None:
    """``kernel[grid](**args)``, through the kept compiled kernel when ``fast`` allows."""
    found = direct(kernel) if fast else None
    if found is None:
        kernel[grid](**args)
        return
    runtime, driver = found
    device = driver.active.get_current_device()  # the JIT keeps compiled kernels per device too
    form = _form(kernel, args)
    key = compiled = None
    if form is not None:
        try:
            key = form.key(device, args)
            compiled = form.kept.get(key)
        except (AttributeError, TypeError):  # a non-tensor where the form has a tensor, an unhashable value
            key = None
    if compiled is None:
        compiled = kernel[grid](**args)  # compiles on a miss; returns the compiled kernel
        if form is not None and key is not None and launchable(compiled):
            if len(form.kept) >= MAX_KEPT:
                form.kept.clear()
            form.kept[key] = compiled
        return
    assert form is not None  # a kept kernel has a form
    run_compiled(compiled, grid, runtime, driver, device, form.ordered(args))


class Bound:
    """``kernel[grid]`` with every argument fixed but ``per_call`` (passed positionally to
    ``__call__``, in that order: the tensors first, then any ints, which must be ints the
    kernel does not specialize on, ``do_not_specialize``): after its first launch, straight
    to the compiled kernel's launcher while nothing the JIT specializes on has changed (each
    tensor's dtype and 16-byte alignment, each int's range, the current device); else through
    the JIT (and always where ``fast`` is off, a launch hook is set, or ``kernel`` is not a
    plain JIT function)."""

    __slots__ = (
        "kernel",
        "grid",
        "args",
        "per_call",
        "fast",
        "compiled",
        "device",
        "dtypes",
        "aligned",
        "values",
        "slots",
    )

    def __init__(self, kernel: Any, grid: tuple[int, ...], fast: bool, per_call: tuple[str, ...], **args: Any) -> None:
        self.kernel, self.grid, self.args, self.per_call, self.fast = kernel, grid, args, per_call, fast
        self.compiled: Any = None
        self.device: Any = None
        self.dtypes: tuple = ()  # the per-call tensors' dtypes the kept kernel was compiled for
        self.aligned: Any = True  # ... their alignment: True (all 16-byte aligned), or one flag each
        self.values: list[Any] = []  # every argument in signature order, the per-call slots None
        self.slots: tuple[int, ...] = ()  # where the per-call values go in ``values``

    def __call__(self, *values: Any) -> None:
        self.launch(values, checked=False)

    def _specialized_alike(self, values: tuple) -> bool:
        """Whether ``values`` match what the kept kernel was compiled for: the tensors'
        dtypes and alignment, the ints' range."""
        count = len(self.dtypes)
        tensors = values[:count]
        return (
            tuple(map(_DTYPE, tensors)) == self.dtypes
            and _aligned(tensors) == self.aligned
            and all(-(2**31) <= v < 2**31 for v in values[count:])
        )

    def launch(self, values: tuple, checked: bool) -> None:
        """Launch with ``values`` (``per_call``'s). ``checked``: the caller's own key already
        fixes what the JIT specializes on in them (the dtypes, the alignment, the ints'
        ranges), so only the current device is compared (a decode step's plan)."""
        found = direct(self.kernel) if self.fast else None
        if found is not None and self.compiled is not None:
            runtime, driver = found
            device = driver.active.get_current_device()
            if device == self.device and (checked or self._specialized_alike(values)):
                ordered = self.values.copy()
                for slot, value in zip(self.slots, values):
                    ordered[slot] = value
                run_compiled(self.compiled, self.grid, runtime, driver, device, ordered)
                return
        given = dict(zip(self.per_call, values))
        launched = self.kernel[self.grid](**self.args, **given)
        if found is not None and launchable(launched) and set(self.kernel.arg_names) <= {*self.args, *given}:
            count = next((i for i, v in enumerate(values) if not isinstance(v, torch.Tensor)), len(values))
            tensors = values[:count]
            if not all(type(v) is int and -(2**31) <= v < 2**31 for v in values[count:]):
                return  # not in the form a kept kernel can be checked against: always the JIT
            names = list(self.kernel.arg_names)
            self.slots = tuple(names.index(name) for name in self.per_call)
            self.values = [None if name in given else self.args[name] for name in names]
            self.compiled, self.device = launched, found[1].active.get_current_device()
            self.dtypes, self.aligned = tuple(map(_DTYPE, tensors)), _aligned(tensors)


def _aligned(tensors: tuple) -> Any:
    """What the JIT specializes on in the tensors' addresses: True where every one is a
    multiple of 16 (one bitwise or of them all), else whether each one is."""
    if not reduce(or_, map(_DATA_PTR, tensors), 0) & 15:
        return True
    return tuple(t.data_ptr() % 16 == 0 for t in tensors)


def form_count(kernel: Any) -> int:
    """How many sets of argument names ``kernel`` has a form for (at most ``MAX_FORMS``)."""
    return len(_forms.get(kernel, {}))


def forget() -> None:
    """Drop every form and kept kernel: the next launch of each kernel goes through the JIT."""
    _forms.clear()


def kept_count() -> int:
    """How many compiled kernels are kept, over every kernel and form."""
    return sum(len(form.kept) for forms in _forms.values() for form in forms.values() if form is not None)
