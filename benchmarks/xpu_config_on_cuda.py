"""The ``triton_xpu`` launch configuration, run on a CUDA GPU: correctness and a rough timing.

No Intel GPU is available to this project's CI, so this checks what can be checked
elsewhere: the very kernels ``triton_xpu`` launches, with ``XPU_CONFIG`` (its tiles, warps
and vocabulary splits), compiled for and run on CUDA, against the float64 dense reference.
It says nothing about speed on XPU; the timing column only compares XPU_CONFIG with the
CUDA configuration on the same GPU (expect XPU_CONFIG to be slower there).

    python benchmarks/xpu_config_on_cuda.py                        # TP=1, one GPU
    torchrun --nproc-per-node 2 benchmarks/xpu_config_on_cuda.py   # TP=2 (NCCL), uneven shards

Exit status 1 if any case is off the reference. ``--json PATH`` also writes the results.
``--backend liger`` (or any registered name) runs the same correctness cases through that
backend instead, skipping the cases it refuses (and no timing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
import zlib
from dataclasses import asdict

import torch
import torch.distributed as dist

import vtp_runtime as vtp
from vtp_runtime.backends.triton.backend import TritonBackend, capabilities
from vtp_runtime.backends.triton_xpu import XPU_CONFIG, TritonXPUBackend
from vtp_runtime.ops import dtype_name
from vtp_runtime.registry import hookimpl, register
from vtp_runtime.testing.reference import values_and_grads
from vtp_runtime.tools.timing import time_stream

VALUE_RTOL = 2e-5
GRAD_RTOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


class XpuConfigOnCuda(TritonXPUBackend):
    """The triton_xpu class and its XPU_CONFIG, declared for CUDA tensors."""

    name = "xpu_config_on_cuda"
    priority = -100  # forced below, never auto-selected
    ops = capabilities(frozenset({"cuda"}))
    probe = TritonBackend.probe


def _register() -> None:
    register(
        types.SimpleNamespace(vtp_runtime_register_backends=hookimpl(lambda register: register(XpuConfigOnCuda()))),
        name="xpu_config_on_cuda",
    )


CASES = [  # (op, options, teacher requires grad, masked)
    ("cross_entropy", {}, False, False),
    ("cross_entropy", {"label_smoothing": 0.1, "z_loss": 1e-4, "temperature": 0.8}, False, True),
    ("logprobs", {"topk": 4}, False, False),
    ("entropy", {"temperature": 1.3}, False, True),
    ("kl", {"reverse": True}, True, False),
    ("kl", {}, False, True),
    ("jsd", {"beta": 0.5}, True, False),
    ("jsd", {"beta": 0.1, "temperature": 2.0}, False, True),
    ("jsd", {"beta": 0.0}, False, False),
    ("cross_entropy", {}, False, True),
    ("kl", {"reverse": True, "temperature": 0.7}, False, False),
    ("jsd", {"beta": 1.0}, False, True),
]


def _shards(vocab: int, world: int) -> list[tuple[int, int]]:
    """Uneven contiguous shards in rank order (the first rank one column larger)."""
    base, extra = divmod(vocab, world)
    sizes = [base + (1 if r < extra else 0) for r in range(world)]
    if world > 1 and sizes[0] == sizes[-1]:
        sizes[0], sizes[-1] = sizes[0] + 1, sizes[-1] - 1
    starts = [sum(sizes[:r]) for r in range(world)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def check(
    op, options, teacher_grad, masked, n, vocab, dtype, rank, world, group, device, backend: str = "xpu_config_on_cuda"
) -> dict | None:
    options = dict(options)
    topk = options.pop("topk", 0)
    g = torch.Generator(device=device).manual_seed(zlib.crc32(f"{op}{options}{n}{vocab}{dtype}".encode()))
    n_in = 2 if op in ("kl", "jsd") else 1
    full = [(torch.randn(n, vocab, generator=g, device=device) * 3).to(dtype) for _ in range(n_in)]
    start, end = _shards(vocab, world)[rank]
    local = [z[:, start:end].contiguous().requires_grad_(i == 0 or teacher_grad) for i, z in enumerate(full)]
    extra, index = {}, None
    if op in ("cross_entropy", "logprobs"):
        index = torch.randint(0, vocab, (n, topk) if topk else (n,), generator=g, device=device)
        if masked:
            index[torch.rand(index.shape, generator=g, device=device) < 0.25] = -100
    elif masked:
        extra["mask"] = torch.rand(n, generator=g, device=device) >= 0.25
    tensors = local + ([index] if index is not None else [])
    if vtp.explain(op, *tensors, tp_group=group, gather=True, **options, **extra).reasons.get(backend):
        return None  # the backend refuses this call (identical verdict on every rank)
    out = vtp.loss(op, *tensors, tp_group=group, backend=backend, **options, **extra)
    upstream = torch.randn(out.shape, generator=g, device=device, dtype=torch.float64)
    wanted = [t for t in local if t.requires_grad]
    grads = torch.autograd.grad((out.double() * upstream).sum(), wanted)
    ref_vals, ref_grads = values_and_grads(
        op, tuple(full), index, upstream, needs_grad=tuple(t.requires_grad for t in local), **options, **extra
    )
    result = {
        "op": op,
        "options": {**options, "topk": topk},
        "masked": masked,
        "teacher_grad": teacher_grad,
        "tokens": n,
        "vocab": vocab,
        "dtype": dtype_name(dtype),
        "ok": True,
    }
    err = (out.double() - ref_vals).abs().max().item()
    scale = ref_vals.abs().max().item()
    result["value_err"] = err
    result["ok"] &= err <= VALUE_RTOL * max(scale, 1e-3) * 2
    for i, (t, rg) in enumerate(zip(local, ref_grads)):
        if rg is None:
            continue
        got = grads[[w is t for w in wanted].index(True)].double()
        want = rg[:, start:end]
        gerr = (got - want).abs().max().item()
        result[f"grad{i}_err"] = gerr
        result["ok"] &= gerr <= GRAD_RTOL[dtype] * max(want.abs().max().item(), 1e-3) * 2
    return result


def time_fwd_bwd(backend: str, op: str, n: int, vocab: int, dtype, group, rank, world, device, reps=20) -> float:
    start, end = _shards(vocab, world)[rank]
    s = torch.randn(n, end - start, device=device, dtype=dtype, requires_grad=True)
    t = torch.randn(n, end - start, device=device, dtype=dtype)
    labels = torch.randint(0, vocab, (n,), device=device)
    args = (s, labels) if op == "cross_entropy" else (s, t)

    def step():
        vtp.loss(op, *args, tp_group=group, backend=backend, reduction="sum").backward()

    for _ in range(3):
        step()
    return time_stream(step, reps)  # back to back, one sync at the end


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[7, 256])
    ap.add_argument("--vocab", type=int, nargs="+", default=[1000, 151936])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--time-tokens", type=int, nargs="*", default=[1024, 8192])
    ap.add_argument("--backend", default="xpu_config_on_cuda")
    ap.add_argument(
        "--json",
        default=os.path.join(os.environ.get("OUT", ""), "xpu_config_on_cuda.json") if os.environ.get("OUT") else None,
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, group = 0, None
    if world > 1:
        dist.init_process_group("nccl")
        rank = dist.get_rank()
        group = dist.group.WORLD
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device())
    _register()
    if rank == 0:
        print(f"XPU_CONFIG = {XPU_CONFIG}")
    results, bad = [], 0
    for dtype_arg in args.dtypes:
        dtype = getattr(torch, dtype_arg)
        for vocab in args.vocab:
            for n in args.tokens:
                for op, options, tg, masked in CASES:
                    r = check(op, options, tg, masked, n, vocab, dtype, rank, world, group, device, args.backend)
                    if r is None:
                        if rank == 0:
                            print(f"--- {args.backend} refuses {op} {options} masked={masked} teacher_grad={tg}")
                        continue
                    results.append(r)
                    bad += not r["ok"]
                    if rank == 0:
                        errs = " ".join(f"{k}={v:.2e}" for k, v in r.items() if k.endswith("_err"))
                        print(
                            f"{'ok ' if r['ok'] else 'BAD'} {args.backend} tp={world} {op:13s} {dtype_arg:8s} "
                            f"V={vocab:<6d} N={n:<4d} {r['options']} masked={masked} {errs}"
                        )
    timings = []
    for n in args.time_tokens if args.backend == "xpu_config_on_cuda" else ():
        for op in ("cross_entropy", "jsd"):
            row = {"op": op, "tokens": n, "vocab": 151936, "tp": world}
            for backend in ("xpu_config_on_cuda", "triton"):
                row[backend] = time_fwd_bwd(backend, op, n, 151936, torch.bfloat16, group, rank, world, device)
            timings.append(row)
            if rank == 0:
                print(
                    f"time bf16 fwd+bwd {op:13s} N={n:<5d} V=151936 tp={world}: XPU_CONFIG "
                    f"{row['xpu_config_on_cuda']:.3f} ms, CUDA_CONFIG {row['triton']:.3f} ms"
                )
    if rank == 0:
        print(f"{len(results) - bad} of {len(results)} cases match the float64 reference")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {"config": asdict(XPU_CONFIG), "world": world, "cases": results, "timings": timings}, f, indent=1
                )
    if world > 1:
        dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
