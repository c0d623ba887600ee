"""Where the CPU time of one call goes, at TP=1 on a GPU (Python-side dispatch and launches).

    python benchmarks/profile_cpu.py [--tokens 1024] [--vocab 151936]

Prints thread CPU time per call for forward and forward+backward of cross entropy and JSD
(triton backend), the same with a do-nothing backend (the core's own share), and a cProfile
of the JSD forward+backward sorted by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import vtp_runtime as vtp
from vtp_runtime.backend import ALL_DTYPES, Backend, OpCapability
from vtp_runtime.registry import hookimpl


class Noop(Backend):
    """Returns preallocated outputs: what is left is the core's dispatch."""

    name = "noop_profile"
    priority = -100
    ops = {op: OpCapability(device_types=None, dtypes=ALL_DTYPES, features=frozenset({"teacher_grad"}))
           for op in ("cross_entropy", "jsd")}

    def forward(self, call, inputs, index, mask):
        return self.values, None  # nothing saved

    def backward(self, call, state, grad):
        return (self.grad,) + ((None,) if call.op == "jsd" else ())


class _Plugin:
    @hookimpl
    def vtp_runtime_register_backends(self, register):
        register(Noop())


def per_call_us(fn, reps: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.thread_time()
    for _ in range(reps):
        fn()
    used = time.thread_time() - start
    torch.cuda.synchronize()
    return used / reps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    dev = torch.device("cuda")
    s = torch.randn(args.tokens, args.vocab, device=dev, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randn(args.tokens, args.vocab, device=dev, dtype=torch.bfloat16)
    y = torch.randint(0, args.vocab, (args.tokens,), device=dev)
    vtp.register(_Plugin(), name="profile-noop")
    noop = vtp.registry.REGISTRY.get("noop_profile")
    noop.values = torch.zeros(args.tokens, device=dev)
    noop.grad = torch.zeros_like(s)

    def ce(b):
        return lambda: vtp.cross_entropy(s, y, backend=b)

    def jsd(b):
        return lambda: vtp.jsd(s, t, beta=0.5, backend=b)

    for backend in ("triton", "noop_profile"):
        for name, make in (("cross_entropy", ce), ("jsd", jsd)):
            fwd = per_call_us(make(backend), args.reps)
            both = per_call_us(lambda f=make(backend): f().sum().backward(), args.reps)
            print(f"{backend:13s} {name:14s} forward {fwd:7.1f} us   forward+backward {both:7.1f} us (thread CPU)")
    base = per_call_us(lambda: s.float().sum().backward(), args.reps)
    print(f"{'torch':13s} {'s.float().sum().backward()':29s} {base:7.1f} us (for scale)")
    prof = cProfile.Profile()
    f = jsd("triton")
    prof.enable()
    for _ in range(args.reps):
        f().sum().backward()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(35)
    print(out.getvalue())


if __name__ == "__main__":
    main()
