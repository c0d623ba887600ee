"""What each piece of a small loss call costs this host, in CPU µs: the floor under any call.

    python benchmarks/cost_parts.py [--device cuda|cpu] [--tokens 16] [--vocab 151936] [--reps 2000] [--rounds 5]

Each row times one piece alone, back to back (this thread's and the process's CPU µs per
call, the median of ``--rounds`` rounds): a tensor allocation (``torch.empty``,
``torch.zeros``), a view; the autograd floor: a Python ``autograd.Function`` that returns a
preallocated value and gradient, forward alone and forward + ``.backward()``, against
``F.cross_entropy``'s; on CUDA, one launch of a compiled Triton kernel (the scale kernel,
which returns at once) through the JIT, ``launch.launch`` and a ``launch.Bound``; how much of
work done in a backward (on autograd's device thread) the caller's thread pays for; and the
triton backend's cross entropy forward and backward alone, without the core. Comparing a
call's profile with these rows says which pieces a faster call could drop.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def loop_us(fn: Callable[[], Any], reps: int, rounds: int, device: torch.device) -> tuple[float, float]:
    """The median over ``rounds`` of this thread's and the process's CPU µs per call of
    ``reps`` calls back to back."""
    for _ in range(50):
        fn()
    thread, process = [], []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, start_process = time.thread_time(), time.process_time()
        for _ in range(reps):
            fn()
        thread.append((time.thread_time() - start) / reps * 1e6)
        process.append((time.process_time() - start_process) / reps * 1e6)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(thread), statistics.median(process)


def busy(us: float) -> None:
    """Hold this thread's CPU for ``us`` µs."""
    end = time.thread_time() + us * 1e-6
    while time.thread_time() < end:
        pass


class Worked(torch.autograd.Function):
    """The autograd floor: a 0-dim value out, a preallocated gradient back, and ``work()`` in
    backward (on CUDA, on autograd's device thread)."""

    work: Callable[[], Any] = staticmethod(lambda: None)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, value: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.grad = grad
        return value

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        Worked.work()
        return ctx.grad, None, None


def _times(count: int, fn: Callable[[], Any]) -> None:
    for _ in range(count):
        fn()


def worked(work: Callable[[], Any], s: torch.Tensor, value: torch.Tensor, grad: torch.Tensor) -> Callable[[], Any]:
    def step() -> None:
        Worked.work = work
        Worked.apply(s, value, grad).backward()

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    dev = torch.device(args.device)
    n, v = args.tokens, args.vocab
    s = torch.randn(n, v, device=dev).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, v, (n,), device=dev)
    value = torch.zeros((), device=dev, requires_grad=False)
    grad = torch.zeros_like(s)
    small = torch.zeros(n, 2, device=dev)
    pieces: dict[str, Callable[[], Any]] = {
        "torch.empty [16, 2] fp32": lambda: torch.empty((n, 2), dtype=torch.float32, device=dev),
        "torch.zeros [17] int32": lambda: torch.zeros(n + 1, dtype=torch.int32, device=dev),
        "tensor.view": lambda: small.view(-1),
        "tensor.contiguous (already)": lambda: y.contiguous(),
        "autograd.Function forward": lambda: Worked.apply(s, value, grad),
        "autograd.Function forward + backward": worked(lambda: None, s, value, grad),
        "autograd.Function + backward, 100 µs of Python in it": worked(lambda: busy(100.0), s, value, grad),
        "F.cross_entropy forward": lambda: torch.nn.functional.cross_entropy(s, y),
        "F.cross_entropy forward + backward": lambda: torch.nn.functional.cross_entropy(s, y).backward(),
    }
    if dev.type == "cuda":
        from vtp_runtime.backends.triton import source
        from vtp_runtime.backends.triton.launch import Bound, launch

        k = source.module("kernels")
        one = torch.ones((), device=dev)

        def scale_launch() -> None:
            launch(k.scale_kernel, (1,), True, x_ptr=grad, n=grad.numel(), scale_ptr=one, programs=1, BLOCK=1024)

        bound = Bound(k.scale_kernel, (1,), True, ("x_ptr", "scale_ptr"), n=grad.numel(), programs=1, BLOCK=1024)

        def bound_launch() -> None:
            bound(grad, one)

        pieces["triton launch, kept kernel (launch.launch)"] = scale_launch
        pieces["triton launch, launch.Bound"] = bound_launch
        pieces["backward: 10 launches in it"] = worked(lambda: _times(10, scale_launch), s, value, grad)
        pieces["backward: 10 torch.empty in it"] = worked(
            lambda: _times(10, lambda: torch.empty((n, 2), device=dev)), s, value, grad
        )
        pieces["backward: 10 small adds in it"] = worked(lambda: _times(10, lambda: small.add_(0)), s, value, grad)
        pieces["backward: 10 x 10 µs of Python in it"] = worked(lambda: _times(10, lambda: busy(10.0)), s, value, grad)
        pieces["triton launch through the JIT (kernel[grid])"] = lambda: k.scale_kernel[(1,)](
            x_ptr=grad, n=grad.numel(), scale_ptr=one, programs=1, BLOCK=1024
        )
    if dev.type == "cuda":
        pieces.update(_backend_pieces(s, y))
    print(f"{dev.type}, N={n}, V={v} bf16: CPU µs per call, back to back, median of {args.rounds} rounds")
    print(f"{'':52s} {'thread':>8s} {'process':>8s}")
    for name, fn in pieces.items():
        thread, process = loop_us(fn, args.reps, args.rounds, dev)
        print(f"{name:52s} {thread:8.2f} {process:8.2f}")


def _backend_pieces(s: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """The triton backend's forward and backward of a cross entropy mean alone (no core), with
    the ``Call`` the core passed it."""
    import vtp_runtime as vtp

    be: Any = vtp.registry.REGISTRY.get("triton")
    seen: list[tuple] = []
    real_forward = be.forward

    def forward(call, inputs, index, mask):  # keeps what the core passed
        seen.append((call, inputs, index, mask))
        return real_forward(call, inputs, index, mask)

    be.forward = forward
    try:
        vtp.cross_entropy(s, y, reduction="mean", backend="triton")
    finally:
        del be.forward
    call, inputs, index, mask = seen[0]
    _, state = be.forward(call, inputs, index, mask)
    one = torch.ones((), device=s.device)
    return {
        "triton backend forward alone (CE mean)": lambda: be.forward(call, inputs, index, mask),
        "triton backend backward alone (CE mean)": lambda: be.backward(call, state, one),
    }


if __name__ == "__main__":
    main()
