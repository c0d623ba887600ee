"""Per-kernel GPU time (torch.profiler) of log-probs, log-probs with the entropy and cross
entropy on the triton backend, for a few launch configurations: where the entropy's extra
time goes (statistics pass or backward pass).

    python benchmarks/profile_entropy.py [--tokens 8192] [--vocab 151936]

One line per configuration: each arm's mean ``stats1_kernel`` and ``backward1_kernel`` ms
over 5 calls of forward + ``.sum().backward()`` (bf16, TP=1).
"""

import argparse
import dataclasses
from typing import cast

import torch
from profile_passes import kernel_times  # this folder is on the path when run as a script

import vtp_runtime as vtp
import vtp_runtime.backends.triton.backend as tb
from vtp_runtime.registry import REGISTRY

BASE = tb.CUDA_CONFIG
VARIANTS = {
    "default": BASE,
    "s2048w4": dataclasses.replace(BASE, block_stats=2048, warps_stats=4),
    "s4096w16": dataclasses.replace(BASE, block_stats=4096, warps_stats=16),
    "s8192w16": dataclasses.replace(BASE, block_stats=8192, warps_stats=16),
    "b4096w8": dataclasses.replace(BASE, block_bwd=4096, warps_bwd=8),
    "b1024w4": dataclasses.replace(BASE, block_bwd=1024, warps_bwd=4),
    "b2048w4": dataclasses.replace(BASE, block_bwd=2048, warps_bwd=4),
}


def kernel_ms(fn) -> dict[str, float]:
    """Mean ms of the statistics and backward kernels over 5 calls of ``fn``."""
    times = kernel_times(fn, reps=5)
    return {k.split("_")[0]: us / 1e3 for k, (us, _) in times.items() if k in ("stats1_kernel", "backward1_kernel")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=151936)
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(args.tokens, args.vocab, device="cuda", generator=g) * 3).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=g)

    def with_entropy():
        lp, h = vtp.logprobs(z, y, return_entropy=True, backend="triton")
        (lp.sum() + h.sum()).backward()

    arms = {
        "lp": lambda: cast(torch.Tensor, vtp.logprobs(z, y, backend="triton")).sum().backward(),
        "lp+H": with_entropy,
        "ce": lambda: vtp.cross_entropy(z, y, backend="triton", reduction="sum").backward(),
    }
    backend = REGISTRY.backends()["triton"]
    assert isinstance(backend, tb.TritonBackend)
    try:
        for name, cfg in VARIANTS.items():
            backend._config = cfg
            cells = []
            for arm, fn in arms.items():
                ms = kernel_ms(fn)
                cells.append(f"{arm}: " + " ".join(f"{k}={v:.3f}" for k, v in sorted(ms.items())))
            print(f"{name:9s} | " + " | ".join(cells), flush=True)
    finally:
        backend._config = None


if __name__ == "__main__":
    main()
