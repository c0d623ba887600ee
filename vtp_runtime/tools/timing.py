"""Timing and table helpers shared by ``vtp-runtime bench`` and ``bench --head``: CUDA-event
timing (per call, back to back, CUDA-graph replay), peak memory, copy bandwidth, versions and
the text tables."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from typing import Any


def cuda_missing(device: str, cpu_hint: str | None = None) -> bool:
    """Whether a bench asked for CUDA where there is none; says so on stderr (with
    ``cpu_hint``: what it can do on the CPU instead)."""
    import torch

    if device != "cuda" or torch.cuda.is_available():
        return False
    hint = f"; pass --device cpu to {cpu_hint}" if cpu_hint else ""
    print(f"vtp-runtime bench needs a CUDA GPU (torch.cuda.is_available() is False){hint}", file=sys.stderr)
    return True


def no_row_ran(rows: Sequence[Any], backend_of: Callable[[Any], str], backends: Iterable[str]) -> int:
    """The exit status of a bench whose ``rows`` (each with ``ms``, None where it failed, and
    ``error``) are printed: 1 when a backend of ``backends`` timed no row (or no row ran at
    all), saying on stderr which and why (its first row's error); else 0."""
    for backend in backends:
        mine = [r for r in rows if backend_of(r) == backend]
        if mine and not any(r.ms is not None for r in mine):
            print(
                f"vtp-runtime bench: every row of backend {backend!r} failed (first: {mine[0].error or 'no reason'})",
                file=sys.stderr,
            )
            return 1
    if not any(r.ms is not None for r in rows):
        why = f"first: {rows[0].error or 'no reason'}" if rows else "nothing to time"
        print(f"vtp-runtime bench: no row ran ({why})", file=sys.stderr)
        return 1
    return 0


def time_cpu(fn, warmup: int, reps: int) -> float:
    """Median milliseconds of one ``fn()`` on the host clock, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_loop(fn, warmup: int, reps: int) -> float:
    """Median milliseconds of one ``fn()`` on the current CUDA stream, each call timed with
    CUDA events and synchronized, after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_stream(fn, reps: int) -> float:
    """Time per call of ``reps`` calls issued back to back, synchronized once at the end: what
    a training loop sees when Python runs ahead of the GPU (max of CPU and GPU cost per call),
    where ``time_loop``'s per-call sync adds the CPU issue time to the GPU time."""
    import torch

    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def time_graph(fn, reps: int) -> float:
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream, as torch.cuda.graphs asks
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


def peak(fn) -> float:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def copy_bandwidth(reps: int = 20) -> float:
    """Device-to-device copy in GB/s, counting bytes read + written (1 GiB buffers)."""
    import torch

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_loop(lambda: dst.copy_(src), 3, reps)
    return 2 * 2**30 / (ms * 1e-3) / 1e9


def version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def fmt(x, spec):
    return "-".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)


def print_rows(header: str, lines: Iterable[str]) -> None:
    """A text table: the header, a rule as wide, then one line per row."""
    print(header)
    print("-" * len(header))
    for line in lines:
        print(line)


def write_results(path: str, device: str, rows: Iterable, **fields: Any) -> None:
    """A run's measurements as JSON: the device and versions, ``fields``, the command line
    and one object per row (a dataclass)."""
    import torch

    data = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": version("triton"),
        **fields,
        "argv": sys.argv,
        "rows": [asdict(r) for r in rows],
    }
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
