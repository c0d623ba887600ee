"""Launch-configuration sweep of the triton backend on the GPU: loop and CUDA-graph time.

Loop time by CUDA events; CUDA-graph replay time is the GPU time, which the percentages of
copy bandwidth use.

Replaces ``CUDA_CONFIG`` between runs and times JSD and cross entropy fwd+bwd at the
target shapes; prints one line per (config, shape). Used to pick the defaults in
``backends/triton/backend.py``; see benchmarks/NOTES.md.
    python benchmarks/tune.py [--shapes op:N:TP,...] [--variants name,...]
"""

import argparse
import dataclasses
import sys

import torch

import vtp_runtime.backends.triton.backend as tb
from vtp_runtime.tools.bench import make_inputs, model_bytes, vtp_arm
from vtp_runtime.tools.timing import copy_bandwidth, time_graph, time_loop

V = 151936
SHAPES = [("jsd", 1024, 2), ("jsd", 8192, 1), ("jsd", 1024, 8), ("cross_entropy", 1024, 1), ("cross_entropy", 8192, 2)]
VARIANTS = {
    "default": tb.CUDA_CONFIG,
    "stats8k_w16": dataclasses.replace(tb.CUDA_CONFIG, block_stats=8192, warps_stats=16),
    "tiles4k_w8": dataclasses.replace(tb.CUDA_CONFIG, block_div=4096, block_bwd=4096),
    "tiles1k_w4": dataclasses.replace(
        tb.CUDA_CONFIG, block_stats=2048, warps_stats=4, block_div=1024, warps_div=4, block_bwd=1024, warps_bwd=4
    ),
    "more_programs": dataclasses.replace(tb.CUDA_CONFIG, target_programs=4096, bwd_target_programs=16384),
    "programs2k": dataclasses.replace(tb.CUDA_CONFIG, target_programs=2048),
    "programs4k": dataclasses.replace(tb.CUDA_CONFIG, target_programs=4096),
    "bwd8k": dataclasses.replace(tb.CUDA_CONFIG, bwd_target_programs=8192),
    "programs4k_bwd8k": dataclasses.replace(tb.CUDA_CONFIG, target_programs=4096, bwd_target_programs=8192),
    "bwd2k": dataclasses.replace(tb.CUDA_CONFIG, bwd_target_programs=2048),
    "bwd16k": dataclasses.replace(tb.CUDA_CONFIG, bwd_target_programs=16384),
    "bwd4k_w16": dataclasses.replace(tb.CUDA_CONFIG, block_bwd=4096, warps_bwd=16),
    "stats2k_w4": dataclasses.replace(tb.CUDA_CONFIG, block_stats=2048, warps_stats=4),
    "stats4k_w16": dataclasses.replace(tb.CUDA_CONFIG, warps_stats=16),
}


def time_ms(fn, reps=20):
    return time_loop(fn, warmup=3, reps=reps)


def sweep(description: str, default_variants=None, **extra) -> tuple[argparse.Namespace, list, dict]:
    """The command line of a launch-configuration sweep (this script's, profile_passes.py's):
    ``--shapes op:N:TP,...`` and ``--variants name,...`` (default: ``default_variants``, or all
    of ``VARIANTS``), plus ``extra`` flags (name: help). Returns (args, shapes, variants)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--shapes", default=None, help="op:N:TP,... (default: the design's target shapes)")
    p.add_argument("--variants", default=None, help=f"comma-separated, from {', '.join(VARIANTS)}")
    for flag, text in extra.items():
        p.add_argument(f"--{flag.replace('_', '-')}", action="store_true", help=text)
    args = p.parse_args()
    shapes = (
        SHAPES
        if not args.shapes
        else [(o, int(n), int(t)) for o, n, t in (x.split(":") for x in args.shapes.split(","))]
    )
    names = args.variants.split(",") if args.variants else default_variants or list(VARIANTS)
    return args, shapes, {k: VARIANTS[k] for k in names}


def main():
    _, shapes, variants = sweep(__doc__.splitlines()[0])
    copy = copy_bandwidth()
    print(f"copy {copy:.0f} GB/s")
    for name, cfg in variants.items():
        tb.CUDA_CONFIG = cfg
        for op, n, tp in shapes:
            v = V // tp
            z, other = make_inputs(op, n, v, torch.bfloat16, "cuda", seed=0)
            fn = vtp_arm("triton", op, z, other, beta=0.5)
            ms = time_ms(fn)
            graph = time_graph(fn, 50)
            nbytes = model_bytes(op, n, v, 2)
            print(
                f"{name:16s} {op:14s} N={n:5d} TP={tp} loop {ms:7.3f} ms graph {graph:7.3f} ms "
                f"{nbytes / graph / 1e6:6.0f} GB/s {100 * nbytes / graph / 1e6 / copy:4.0f}%",
                flush=True,
            )
            del z, other


if __name__ == "__main__":
    sys.exit(main())
