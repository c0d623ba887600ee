"""Where the CPU time of one call goes, at TP=1 (Python-side dispatch and launches).

    python benchmarks/profile_cpu.py [--tokens 1024] [--vocab 151936] [--device cuda|cpu]

For cross entropy and JSD, forward and forward + backward (``.sum().backward()``, the
gradient accumulated into ``.grad`` as in training), prints the CPU time per call:

- ``thread``: this thread's CPU time, with the device synchronized (untimed) before every
  call, so that no launch waits for a full queue: the cost of issuing one call;
- ``process``: the same for every thread of the process (the autograd engine runs the
  backward of CUDA tensors on its own thread);
- ``loop``: this thread's CPU time per call over calls issued back to back (what a training
  loop sees; a launch that finds the queue full waits, and on CUDA that wait may spin).

Backends: ``triton`` (on CUDA), ``eager``, and a do-nothing backend that returns
preallocated outputs and saves its input as the real ones do (the core's own share). Then
a cProfile of the triton (or eager, on CPU) cross entropy forward + backward, by own time.
On CPU without a GPU, ``--device cpu`` measures the core's share the same way.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import vtp_runtime as vtp
from vtp_runtime.backend import ALL_DTYPES, Backend, OpCapability, SavedState
from vtp_runtime.ops import dtype_name
from vtp_runtime.registry import hookimpl


@dataclass
class NoopState(SavedState):
    inputs: torch.Tensor  # saved like a real backend's input, so the core does the same work


class Noop(Backend):
    """Returns preallocated outputs: what is left is the core's dispatch."""

    values: torch.Tensor  # set once the sizes are known
    grad: torch.Tensor

    name = "noop_profile"
    priority = -100
    ops = {
        op: OpCapability(device_types=None, dtypes=ALL_DTYPES, features=frozenset({"teacher_grad"}))
        for op in ("cross_entropy", "jsd")
    }

    def forward(self, call, inputs, index, mask):
        return self.values, NoopState(inputs[0])

    def backward(self, call, state, grad):
        return (self.grad,) + ((None,) if call.op == "jsd" else ())


class _Plugin:
    @hookimpl
    def vtp_runtime_register_backends(self, register):
        register(Noop())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, reps: int, device: torch.device) -> tuple[float, float, float]:
    """(thread, process, loop) CPU µs per call of ``fn``."""
    for _ in range(20):
        fn()
    _sync(device)
    thread = process = 0.0
    for _ in range(reps):
        _sync(device)
        t0, p0 = time.thread_time(), time.process_time()
        fn()
        thread += time.thread_time() - t0
        process += time.process_time() - p0
    _sync(device)
    start = time.thread_time()
    for _ in range(reps):
        fn()
    loop = time.thread_time() - start
    _sync(device)
    return thread / reps * 1e6, process / reps * 1e6, loop / reps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args()
    dev = torch.device(args.device)
    # on CPU the eager backend at full size would time its arithmetic, not its dispatch
    vocab = args.vocab if dev.type == "cuda" else min(args.vocab, 64)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    s = torch.randn(args.tokens, vocab, device=dev, dtype=dtype, requires_grad=True)
    t = torch.randn(args.tokens, vocab, device=dev, dtype=dtype)
    y = torch.randint(0, vocab, (args.tokens,), device=dev)
    vtp.register(_Plugin(), name="profile-noop")
    noop = vtp.registry.REGISTRY.get("noop_profile")
    assert isinstance(noop, Noop)
    noop.values = torch.zeros(args.tokens, device=dev)
    noop.grad = torch.zeros_like(s)
    idx = y[:, None].expand(-1, 4).contiguous()
    # every op, as a training step calls it: a mean over the tokens, then its backward
    # (each call gives a 0-d loss tensor; logprobs' annotation also admits its entropy pair)
    calls: dict[str, Callable[[str], Callable[[], Any]]] = {
        "cross_entropy": lambda b: lambda: vtp.cross_entropy(s, y, reduction="mean", backend=b),
        "logprobs": lambda b: lambda: vtp.logprobs(s, y, reduction="mean", backend=b),
        "logprobs_entropy": lambda b: lambda: sum(vtp.logprobs(s, y, return_entropy=True, reduction="mean", backend=b)),
        "logprobs_topk": lambda b: lambda: vtp.logprobs(s, idx, reduction="mean", backend=b),
        "entropy": lambda b: lambda: vtp.entropy(s, reduction="mean", backend=b),
        "kl": lambda b: lambda: vtp.kl(s, t, reduction="mean", backend=b),
        "jsd": lambda b: lambda: vtp.jsd(s, t, beta=0.5, reduction="mean", backend=b),
    }
    noop_ops = ("cross_entropy", "jsd")  # what the do-nothing backend declares
    backends = ("triton", "eager", "noop_profile") if dev.type == "cuda" else ("eager", "noop_profile")
    print(
        f"N={args.tokens} V={vocab} {dtype_name(dtype)} on {dev.type}, TP=1; "
        f"CPU µs per call: thread (device idle at each call) / process / loop (back to back)"
    )
    peer = per_call_us(lambda: torch.nn.functional.cross_entropy(s, y).backward(), args.reps, dev)
    print(f"{'torch':13s} {'F.cross_entropy':16s} forward+backward {peer[0]:7.1f} / {peer[1]:7.1f} / {peer[2]:7.1f}")
    for backend in backends:
        for name, make in calls.items():
            if backend == "noop_profile" and name not in noop_ops:
                continue
            fwd = per_call_us(make(backend), args.reps, dev)
            call = make(backend)
            both = per_call_us(lambda call=call: call().backward(), args.reps, dev)
            print(
                f"{backend:13s} {name:16s} forward {fwd[0]:7.1f} / {fwd[1]:7.1f} / {fwd[2]:7.1f}   "
                f"forward+backward {both[0]:7.1f} / {both[1]:7.1f} / {both[2]:7.1f}   "
                f"loop x F.cross_entropy {both[2] / peer[2]:5.2f}"
            )
    base = per_call_us(lambda: s.float().sum().backward(), args.reps, dev)
    print(
        f"{'torch':13s} {'s.float().sum().backward()':29s} {base[0]:7.1f} / {base[1]:7.1f} / {base[2]:7.1f} (for scale)"
    )
    prof = cProfile.Profile()
    f = calls["cross_entropy"](backends[0])
    _sync(dev)
    prof.enable()
    for _ in range(args.reps):
        f().backward()
    prof.disable()
    _sync(dev)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    print(f"cProfile: {backends[0]} cross_entropy forward + backward, {args.reps} calls")
    print(out.getvalue())


if __name__ == "__main__":
    main()
