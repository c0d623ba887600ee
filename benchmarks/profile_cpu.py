"""Where the CPU time of one call goes, at TP=1 (Python-side dispatch and launches), beside peers.

    python benchmarks/profile_cpu.py [--tokens 16,1] [--vocab 151936] [--device cuda|cpu] [--reps 60] [--rounds 5]
        [--flash-attn-ce PATH] [--graph-tokens 1024] [--json PATH]

For every op, forward and forward + backward (a mean, then ``.backward()`` into ``.grad``
as in training), at each row count of ``--tokens``, prints per call:

- ``thread``: this thread's CPU µs, with the device synchronized (untimed) before every
  call, so that no launch waits for a full queue: the cost of issuing one call;
- ``process``: the same for every thread of the process (the autograd engine runs the
  backward of CUDA tensors on its own thread);
- ``loop``: this thread's CPU µs per call over calls issued back to back (what a training
  loop sees; a launch that finds the queue full waits, and on CUDA that wait may spin);
- ``wall``: the wall-clock µs per call of the same back-to-back calls, synchronized once.

Backends: ``triton`` (on CUDA), ``eager``, and a do-nothing backend that returns
preallocated outputs and saves its input as the real ones do (the core's own share).
Peers, cross entropy only, measured in the same run where importable: ``F.cross_entropy``;
on CUDA flash-attn's Triton cross entropy (``flash_attn.ops.triton.cross_entropy``, or the
module file given by ``--flash-attn-ce``: flash-attn's ``flash_attn/ops/triton/
cross_entropy.py`` runs standalone) and Liger's (``liger_kernel.transformers.
LigerCrossEntropyLoss``). Each row gives its back-to-back CPU time over
``F.cross_entropy``'s and flash-attn's. On CUDA, at ``--graph-tokens`` rows, every op's
back-to-back time per call against the replay of the same call captured in a CUDA graph.
Then a cProfile of the triton (or eager, on CPU) cross entropy forward + backward at the
first row count, by own time. ``--json`` writes every number.
On CPU without a GPU, ``--device cpu`` measures the core's share the same way.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import importlib.util
import io
import json
import pstats
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import vtp_runtime as vtp
from vtp_runtime.backend import ALL_DTYPES, OpCapability, Reduces, SavedState
from vtp_runtime.ops import dtype_name
from vtp_runtime.registry import hookimpl


@dataclass
class NoopState(SavedState):
    inputs: torch.Tensor  # saved like a real backend's input, so the core does the same work


class Noop(Reduces):
    """Returns preallocated outputs, and reduces a sum or mean itself as the triton backend
    does (one preallocated number): what is left is the core's dispatch."""

    values: torch.Tensor  # set once the sizes are known
    reduced: torch.Tensor
    grad: torch.Tensor

    name = "noop_profile"
    priority = -100
    ops = {
        op: OpCapability(device_types=None, dtypes=ALL_DTYPES, features=frozenset({"teacher_grad"}))
        for op in ("cross_entropy", "jsd")
    }
    reduced_ops = frozenset(ops)

    def forward(self, call, inputs, index, mask):
        return self.values if call.reduction == "none" else self.reduced, NoopState(inputs[0])

    def backward(self, call, state, grad):
        return (self.grad,) + ((None,) if call.op == "jsd" else ())


class _Plugin:
    @hookimpl
    def vtp_runtime_register_backends(self, register):
        register(Noop())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, reps: int, device: torch.device) -> dict[str, float]:
    """CPU µs per call of ``fn`` (thread, process, loop) and the loop's wall µs per call."""
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
    start, wall = time.thread_time(), time.perf_counter()
    for _ in range(reps):
        fn()
    loop = time.thread_time() - start
    _sync(device)
    wall = time.perf_counter() - wall
    return {
        name: value / reps * 1e6
        for name, value in zip(("thread", "process", "loop", "wall"), (thread, process, loop, wall))
    }


def _module_from(path: str) -> Any:
    """A module loaded from a file (flash-attn's cross entropy runs standalone)."""
    spec = importlib.util.spec_from_file_location("flash_attn_cross_entropy", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peers(dev: torch.device, flash_path: str | None) -> tuple[dict[str, Callable], list[str]]:
    """Cross entropy peers importable here, each ``loss(logits, labels)`` a mean over the
    non-ignored labels, and a line for each peer that is missing."""
    found: dict[str, Callable] = {"F.cross_entropy": torch.nn.functional.cross_entropy}
    missing = []
    if dev.type != "cuda":
        return found, ["flash-attn and Liger: CUDA only"]
    try:
        flash = (
            _module_from(flash_path) if flash_path else importlib.import_module("flash_attn.ops.triton.cross_entropy")
        )

        def flash_ce(logits, labels, f=flash.cross_entropy_loss):
            losses, _ = f(logits, labels)  # per token, 0 where ignored; its module's mean:
            return losses.sum() / (labels != -100).sum()

        found["flash-attn CE"] = flash_ce
    except Exception as exc:  # not installed, or a file that does not load
        missing.append(f"flash-attn CE: {type(exc).__name__}: {exc} (pass --flash-attn-ce PATH)")
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss

        found["Liger CE"] = LigerCrossEntropyLoss()
    except Exception as exc:
        missing.append(f"Liger CE: {type(exc).__name__}: {exc}")
    return found, missing


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="16,1", help="row counts, comma-separated")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--reps", type=int, default=60, help="calls per number per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds over every call; each number is their median")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--flash-attn-ce", default=None, help="flash-attn's ops/triton/cross_entropy.py, as a file")
    p.add_argument("--graph-tokens", type=int, default=1024, help="rows of the loop vs CUDA-graph comparison; 0: none")
    p.add_argument("--no-cprofile", action="store_true")
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument(
        "--cprofile-ops", default="cross_entropy", help="ops to profile with cProfile (and their kernels on CUDA)"
    )
    args = p.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cpu":  # dispatch, not arithmetic: one thread, no pool contention in the timings
        torch.set_num_threads(1)
    # on CPU the eager backend at full size would time its arithmetic, not its dispatch
    vocab = args.vocab if dev.type == "cuda" else min(args.vocab, 64)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    vtp.register(_Plugin(), name="profile-noop")
    noop = vtp.registry.REGISTRY.get("noop_profile")
    assert isinstance(noop, Noop)
    found, missing = peers(dev, args.flash_attn_ce)
    backends = ("triton", "eager", "noop_profile") if dev.type == "cuda" else ("eager", "noop_profile")
    noop_ops = ("cross_entropy", "jsd")  # what the do-nothing backend declares
    rows: list[dict[str, Any]] = []
    print(
        f"V={vocab} {dtype_name(dtype)} on {dev.type}, TP=1, {args.reps} calls per number per round, "
        f"median of {args.rounds} rounds"
    )
    for line in missing:
        print(f"peer missing: {line}")
    print("µs per call, forward and forward + backward: thread / process / loop (CPU), wall (back to back)")
    for n in [int(x) for x in args.tokens.split(",")]:
        s, calls, peer_calls = _calls(n, vocab, dtype, dev, found)
        noop.values = torch.zeros(n, device=dev)
        noop.reduced = torch.zeros((), device=dev)
        noop.grad = torch.zeros_like(s)
        # every number is the median of --rounds rounds, each round timing every call in turn:
        # the host's drift over the run falls on all of them alike
        timed: list[tuple[tuple[str, str], str, Callable[[], Any]]] = []
        for peer, call in peer_calls.items():
            timed.append(((peer, "cross_entropy"), "forward_backward", call))
        for backend in backends:
            for name, make in calls.items():
                if backend == "noop_profile" and name not in noop_ops:
                    continue
                call = make(backend)
                timed.append(((backend, name), "forward", call))
                timed.append(((backend, name), "forward_backward", _step(call)))
        runs: dict[tuple[tuple[str, str], str], list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for key, kind, fn in timed:
                runs.setdefault((key, kind), []).append(per_call_us(fn, args.reps, dev))
        results: dict[tuple[str, str], dict[str, dict[str, float]]] = {}
        for (key, kind), measured in runs.items():
            results.setdefault(key, {})[kind] = {c: statistics.median(m[c] for m in measured) for c in measured[0]}
        torch_loop = results[("F.cross_entropy", "cross_entropy")]["forward_backward"]["loop"]
        flash = results.get(("flash-attn CE", "cross_entropy"))
        flash_loop = None if flash is None else flash["forward_backward"]["loop"]
        header = (
            f"{'N':>5s} {'backend':15s} {'op':17s} {'forward thread/proc/loop':>26s} {'wall':>7s}   "
            f"{'fwd+bwd thread/proc/loop':>26s} {'wall':>7s}   {'x torch':>7s} {'x flash':>7s}"
        )
        print(header)
        print("-" * len(header))
        for (backend, name), r in results.items():
            both = r["forward_backward"]
            fwd_text = "-".rjust(34) if "forward" not in r else f"{_cpu(r['forward'])} {r['forward']['wall']:7.1f}"
            vs_flash = "-" if flash_loop is None else f"{both['loop'] / flash_loop:7.2f}"
            print(
                f"{n:5d} {backend:15s} {name:17s} {fwd_text}   {_cpu(both)} {both['wall']:7.1f}   "
                f"{both['loop'] / torch_loop:7.2f} {vs_flash:>7s}"
            )
            rows.append({"tokens": n, "backend": backend, "op": name, **r})
        if flash_loop is not None and "triton" in backends:
            worst = max((r["forward_backward"]["loop"], name) for (b, name), r in results.items() if b == "triton")
            verdict = "met" if worst[0] <= flash_loop else "missed"
            print(
                f"target, N={n}: every triton op's fwd+bwd loop CPU <= flash-attn CE's ({flash_loop:.1f} µs): "
                f"{verdict} (worst {worst[1]} {worst[0]:.1f} µs, {worst[0] / torch_loop:.2f}x F.cross_entropy)"
            )
        print()
    graphs = _graph_rows(args, vocab, dtype, dev, found) if dev.type == "cuda" and args.graph_tokens else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "vocab": vocab,
                    "dtype": dtype_name(dtype),
                    "device": dev.type,
                    "reps": args.reps,
                    "rounds": args.rounds,
                    "per_call_us": rows,
                    "graph_ms": graphs,
                    "missing_peers": missing,
                },
                f,
                indent=1,
            )
    if not args.no_cprofile:
        ops = args.cprofile_ops.split(",")
        _cprofile(int(args.tokens.split(",")[0]), vocab, dtype, dev, found, backends[0], args.reps * args.rounds, ops)


def _cpu(r: dict[str, float]) -> str:
    return f"{r['thread']:8.1f} {r['process']:8.1f} {r['loop']:8.1f}"


def _calls(
    n: int, vocab: int, dtype: torch.dtype, dev: torch.device, found: dict[str, Callable]
) -> tuple[torch.Tensor, dict[str, Callable[[str], Callable[[], Any]]], dict[str, Callable[[], Any]]]:
    """The logits leaf, every vtp op as a training step calls it (a 0-d mean; logprobs with the
    entropy sums its pair), by backend, and each peer's forward + backward."""
    gen = torch.Generator(device=dev).manual_seed(n)
    s = torch.randn(n, vocab, device=dev, generator=gen).to(dtype).requires_grad_(True)
    t = torch.randn(n, vocab, device=dev, generator=gen).to(dtype)
    y = torch.randint(0, vocab, (n,), device=dev, generator=gen)
    idx = y[:, None].expand(-1, 4).contiguous()
    calls: dict[str, Callable[[str], Callable[[], Any]]] = {
        "cross_entropy": lambda b: lambda: vtp.cross_entropy(s, y, reduction="mean", backend=b),
        "logprobs": lambda b: lambda: vtp.logprobs(s, y, reduction="mean", backend=b),
        "logprobs_entropy": lambda b: (
            lambda: _added(vtp.logprobs(s, y, return_entropy=True, reduction="mean", backend=b))
        ),
        "logprobs_topk": lambda b: lambda: vtp.logprobs(s, idx, reduction="mean", backend=b),
        "entropy": lambda b: lambda: vtp.entropy(s, reduction="mean", backend=b),
        "kl": lambda b: lambda: vtp.kl(s, t, reduction="mean", backend=b),
        "jsd": lambda b: lambda: vtp.jsd(s, t, beta=0.5, reduction="mean", backend=b),
    }
    peer_calls: dict[str, Callable[[], Any]] = {name: _backward_of(f, s, y) for name, f in found.items()}
    return s, calls, peer_calls


def _added(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A loss of two terms, as a training step adds them (one add; ``sum`` would add 0 first)."""
    return pair[0] + pair[1]


def _step(call: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: call().backward()


def _backward_of(loss: Callable, s: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    return lambda: loss(s, y).backward()


def _graph_rows(args, vocab: int, dtype: torch.dtype, dev: torch.device, found) -> list[dict[str, Any]]:
    """At ``--graph-tokens`` rows: every triton op's (and each peer's) forward + backward
    issued back to back, ms per call, against the replay of the call captured in a CUDA graph."""
    from vtp_runtime.tools.timing import time_graph, time_stream

    n = args.graph_tokens
    _, calls, peer_calls = _calls(n, vocab, dtype, dev, found)
    out = []
    header = f"N={n}: forward + backward, ms per call {'back to back':>14s} {'graph replay':>13s} {'ratio':>7s}"
    print(header)
    print("-" * len(header))
    steps: dict[str, Callable[[], Any]] = {}
    for name, make in calls.items():
        steps[f"triton {name}"] = _step(make("triton"))
    steps.update(peer_calls)
    for name, step in steps.items():
        loop = time_stream(step, args.reps * args.rounds)
        try:
            graph = time_graph(step, args.reps * args.rounds)
        except Exception as exc:  # a peer that reads the device on the host cannot be captured
            print(f"{name:38s} {loop:14.3f} not capturable ({type(exc).__name__})")
            torch.cuda.synchronize()
            continue
        print(f"{name:38s} {loop:14.3f} {graph:13.3f} {loop / graph:7.2f}")
        out.append({"tokens": n, "call": name, "back_to_back_ms": loop, "graph_ms": graph, "ratio": loop / graph})
    worst = max(((r["ratio"], r["call"]) for r in out if r["call"].startswith("triton")), default=(0.0, "none"))
    print(
        f"target: every triton op back to back <= 1.2x its graph replay: {'met' if worst[0] <= 1.2 else 'missed'} "
        f"(worst {worst[1]} {worst[0]:.2f}x)\n"
    )
    return out


def _cprofile(
    n: int, vocab: int, dtype: torch.dtype, dev: torch.device, found, backend: str, reps: int, ops: list[str]
) -> None:
    """cProfile of each op's forward + backward, and on CUDA the kernels one call launches."""
    _, calls, _ = _calls(n, vocab, dtype, dev, found)
    for op in ops:
        f = calls[op](backend)
        f().backward()
        prof = cProfile.Profile()
        _sync(dev)
        prof.enable()
        for _ in range(reps):
            f().backward()
        prof.disable()
        _sync(dev)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(f"cProfile: {backend} {op} forward + backward, N={n}, {reps} calls")
        print(out.getvalue())
        if dev.type == "cuda":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
                f().backward()
                _sync(dev)
            kernels = [e.name for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            print(f"kernels of one {op} forward + backward: {len(kernels)}")
            for name in kernels:
                print(f"  {name[:100]}")
            print()


if __name__ == "__main__":
    main()
