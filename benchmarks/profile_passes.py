"""Per-kernel GPU time of the triton backend (torch.profiler, CUPTI) for a few launch
configurations, and a CPU profile of the dispatch path. Output: one line per kernel with its
mean duration and achieved GB/s on the bytes it must move. See benchmarks/NOTES.md.
    python benchmarks/profile_passes.py [--shapes op:N:TP,...] [--variants name,...] [--no-cpu]

Every kernel the step runs is listed, torch's own small ops too; ``gaps`` is the step's GPU
time in a CUDA graph less the sum of its kernels: what running them one after another costs.
"""

import cProfile
import io
import pstats
import sys

import torch
from torch.profiler import ProfilerActivity, profile
from tune import sweep  # benchmarks/tune.py: the variants, the shapes, the command line

import vtp_runtime as vtp
import vtp_runtime.backends.triton.backend as tb
from vtp_runtime.tools.bench import make_inputs, vtp_arm
from vtp_runtime.tools.timing import time_graph

V = 151936
BASE = tb.CUDA_CONFIG
DEFAULT_VARIANTS = ["default", "stats2k_w4"]


def per_kernel(op, n, v, reps=10):
    """(kernel times as ``kernel_times`` gives them, the step's CUDA-graph replay µs)."""
    z, other = make_inputs(op, n, v, torch.bfloat16, "cuda", seed=0)
    fn = vtp_arm("triton", op, z, other, beta=0.5)
    return kernel_times(fn, reps), 1e3 * time_graph(fn, 50)


def kernel_times(step, reps=10):
    """{kernel name: (mean µs, launches per step)} over ``reps`` calls of ``step`` after 3."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        if evt.device_type.name == "CUDA" or getattr(evt, "device_time_total", 0):
            t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
            if t and evt.count:
                out[evt.key] = (t / evt.count, evt.count // reps)
    return out


def main():
    args, shapes, variants = sweep(
        __doc__.splitlines()[0], DEFAULT_VARIANTS, no_cpu="skip the CPU profile of the dispatch path"
    )
    nbytes_pass = {
        "stats2_kernel": 2,
        "jsd_div_kernel": 2,
        "backward2_kernel": 3,
        "stats1_kernel": 1,
        "backward1_kernel": 2,
    }
    for name, cfg in variants.items():
        tb.CUDA_CONFIG = cfg
        for op, n, tp in shapes:
            v = V // tp
            res, graph_us = per_kernel(op, n, v)
            total = sum(us * c for us, c in res.values())
            parts = []
            for k, (us, _) in sorted(res.items(), key=lambda kv: -kv[1][0]):
                short = k.split("(")[0][:24]
                mult = next((m for kk, m in nbytes_pass.items() if kk in k), None)
                bw = f" {mult * n * v * 2 / us / 1e3:.0f}GB/s" if mult else ""
                parts.append(f"{short}={us:.1f}us{bw}")
            launches = sum(c for _, c in res.values())
            print(
                f"{name:14s} {op:13s} N={n:5d} TP={tp} graph={graph_us:6.1f}us kernels={total:6.1f}us "
                f"({launches} launches) gaps={graph_us - total:5.1f}us | " + " ".join(parts),
                flush=True,
            )
    tb.CUDA_CONFIG = BASE
    if args.no_cpu:
        return
    # CPU profile of steady-state dispatch, tiny inputs
    z = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)

    def loop():
        for _ in range(300):
            vtp.loss("jsd", z, t, backend="triton").sum().backward()

    loop()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    loop()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(s.getvalue()[-6000:])


if __name__ == "__main__":
    sys.exit(main())
