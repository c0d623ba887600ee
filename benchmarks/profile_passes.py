"""Per-kernel GPU time of the triton backend (torch.profiler, CUPTI) for a few launch
configurations, and a CPU profile of the dispatch path. Output: one line per kernel with its
mean duration and achieved GB/s on the bytes it must move. See benchmarks/NOTES.md.
    python benchmarks/profile_passes.py
"""

import cProfile
import dataclasses
import io
import pstats
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import vtp_runtime as vtp
import vtp_runtime.backends.triton.backend as tb
from vtp_runtime.tools.bench import make_inputs, vtp_arm

V = 151936
BASE = tb.CUDA_CONFIG
VARIANTS = {
    "default": BASE,
    "stats2k_w4": dataclasses.replace(BASE, block_stats=2048, warps_stats=4),
}
SHAPES = [("jsd", 1024, 2), ("jsd", 8192, 1), ("jsd", 1024, 8), ("cross_entropy", 1024, 1), ("cross_entropy", 8192, 2)]


def per_kernel(op, n, v, reps=10):
    z, other = make_inputs(op, n, v, torch.bfloat16, "cuda", seed=0)
    return kernel_times(vtp_arm("triton", op, z, other, beta=0.5), reps)


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
    nbytes_pass = {
        "stats2_kernel": 2,
        "jsd_div_kernel": 2,
        "backward2_kernel": 3,
        "stats1_kernel": 1,
        "backward1_kernel": 2,
    }
    for name, cfg in VARIANTS.items():
        tb.CUDA_CONFIG = cfg
        for op, n, tp in SHAPES:
            v = V // tp
            res = per_kernel(op, n, v)
            total = sum(us * c for us, c in res.values())
            parts = []
            for k, (us, _) in sorted(res.items(), key=lambda kv: -kv[1][0]):
                short = k.split("(")[0][:24]
                mult = next((m for kk, m in nbytes_pass.items() if kk in k), None)
                bw = f" {mult * n * v * 2 / us / 1e3:.0f}GB/s" if mult else ""
                parts.append(f"{short}={us:.1f}us{bw}")
            print(f"{name:14s} {op:13s} N={n:5d} TP={tp} sum={total:7.1f}us | " + " ".join(parts), flush=True)
    tb.CUDA_CONFIG = BASE
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
