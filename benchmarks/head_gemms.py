"""The fused head's matmuls one by one, against the materialized path's, on one GPU.

    python benchmarks/head_gemms.py [--tokens 8192] [--hidden 4096] [--vocab 151936] [--tp 1,2,4]
        [--rows 1024,1280,1536,2048] [--splits 2,4,8] [--blas cublas,cublaslt] [--reps 20]

Per TP (``V_local = V / TP``) and token-chunk rows, the median time and TFLOP/s of:

- ``logits``: ``h_c @ W.T`` into a ``[rows, V_local]`` buffer;
- ``dh``: ``dz_c @ W`` (``[rows, H]``: few output tiles, a long inner dimension);
  ``dh/splitS``: the same as ``S`` batched matmuls over vocabulary slices, summed in fp32;
- ``dw+=``: ``dW.addmm_(dz_c.T, h_c)`` (reads and writes all of dW); ``dw=``: the same
  written fresh (``beta = 0``), which isolates what the accumulation costs;
- ``chunked``: the three matmuls chunk by chunk over all N tokens as the fused head runs them,
  against ``materialized``: the three matmuls over the whole ``[N, V_local]`` logits.

No loss kernel runs there: this is what the matmuls alone cost in each arrangement. With
``--fused``, the whole ``vtp.cross_entropy(vtp.Head(h, W, chunk_rows=rows), y)`` forward +
backward (mean, upstream gradient ``--upstream``, 1 by default) per chunk size against
``h @ W.T`` + the triton CE, and at the default chunk size also with the gradients scaled by
torch's multi-tensor multiply instead of the triton backend's pass (which returns at once
where the upstream gradient is 1).
"""

from __future__ import annotations

import argparse

import torch

from vtp_runtime.tools.timing import time_loop


def tflops(flop: float, ms: float) -> float:
    return flop / ms / 1e9


def split_dh(dz: torch.Tensor, w: torch.Tensor, splits: int, out: torch.Tensor) -> None:
    """``dz @ w`` as ``splits`` batched matmuls over slices of the vocabulary, summed in fp32."""
    rows, v = dz.shape
    part = v // splits
    a = dz[:, : part * splits].view(rows, splits, part).transpose(0, 1)  # [S, rows, part], batch stride part
    b = w[: part * splits].view(splits, part, w.shape[1])
    try:
        partial = torch.bmm(a, b, out_dtype=torch.float32)
    except (TypeError, NotImplementedError, RuntimeError):  # no out_dtype here (older torch, CPU)
        partial = torch.bmm(a, b).float()
    torch.sum(partial, dim=0, out=out) if out.dtype == torch.float32 else out.copy_(partial.sum(0))


def whole(h, w, dh, dw, reps: int) -> tuple[float, float, float]:
    """The materialized path's three matmuls over the whole ``[N, V_local]`` logits."""
    z = torch.randn(h.shape[0], w.shape[0], device="cuda", dtype=h.dtype)
    return (
        time_loop(lambda: torch.mm(h, w.t(), out=z), 3, reps),
        time_loop(lambda: torch.mm(z, w, out=dh), 3, reps),
        time_loop(lambda: torch.mm(z.t(), h, out=dw), 3, reps),
    )


def gemms_at(blas: str, tp: int, args) -> None:
    n, hid, v = args.tokens, args.hidden, args.vocab // tp
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, hid, device="cuda", dtype=dt, generator=g)
    w = torch.randn(v, hid, device="cuda", dtype=dt, generator=g) * 0.02
    dw, dh = torch.empty_like(w), torch.empty_like(h)
    flop = 2.0 * n * hid * v
    t_l, t_h, t_w = whole(h, w, dh, dw, args.reps)
    mat = t_l + t_h + t_w
    print(
        f"{blas:8s} TP{tp} materialized  logits {t_l:6.2f} ms {tflops(flop, t_l):4.0f}  dh {t_h:6.2f} "
        f"{tflops(flop, t_h):4.0f}  dw {t_w:6.2f} {tflops(flop, t_w):4.0f}  sum {mat:6.2f} ms "
        f"{tflops(3 * flop, mat):4.0f} TFLOP/s",
        flush=True,
    )
    for rows in map(int, args.rows.split(",")):
        chunks_at(blas, tp, rows, h, w, dh, dw, mat, args)


def chunks_at(blas, tp, rows, h, w, dh, dw, mat, args) -> None:
    n, hid, v = h.shape[0], h.shape[1], w.shape[0]
    buf = torch.randn(rows, v, device="cuda", dtype=h.dtype)
    hc = h[:rows]
    f, flop = 2.0 * rows * hid * v, 2.0 * n * hid * v
    t_l = time_loop(lambda: torch.mm(hc, w.t(), out=buf), 3, args.reps)
    t_h = time_loop(lambda: torch.mm(buf, w, out=dh[:rows]), 3, args.reps)
    t_wa = time_loop(lambda: dw.addmm_(buf.t(), hc), 3, args.reps)
    t_w0 = time_loop(lambda: torch.mm(buf.t(), hc, out=dw), 3, args.reps)
    line = (
        f"{blas:8s} TP{tp} rows {rows:5d}  logits {tflops(f, t_l):4.0f}  dh {tflops(f, t_h):4.0f}"
        f"  dw+= {tflops(f, t_wa):4.0f} ({t_wa:.3f} ms)  dw= {tflops(f, t_w0):4.0f} ({t_w0:.3f} ms)"
    )
    acc = torch.empty(rows, hid, device="cuda", dtype=torch.float32)
    best: tuple[int, float] | None = None
    for s in map(int, args.splits.split(",")):
        if v % s:
            continue
        t_s = time_loop(lambda: split_dh(buf, w, s, acc), 3, args.reps)  # noqa: B023  (run before s changes)
        line += f"  dh/split{s} {tflops(f, t_s):4.0f}"
        if best is None or t_s < best[1]:
            best = (s, t_s)

    def chunked(split: int | None) -> None:
        for lo in range(0, n, rows):
            hi = min(lo + rows, n)
            zc, hh = buf[: hi - lo], h[lo:hi]
            torch.mm(hh, w.t(), out=zc)
            if lo == 0:
                torch.mm(zc.t(), hh, out=dw)
            else:
                dw.addmm_(zc.t(), hh)
            if split is None:
                torch.mm(zc, w, out=dh[lo:hi])
            else:
                split_dh(zc, w, split, acc[: hi - lo])

    t_c = time_loop(lambda: chunked(None), 2, max(5, args.reps // 2))
    line += f"  | chunked {t_c:6.2f} ms {tflops(3 * flop, t_c):4.0f} x{t_c / mat:.3f}"
    if best is not None:
        s = best[0]
        t_cs = time_loop(lambda: chunked(s), 2, max(5, args.reps // 2))
        line += f"  chunked/split{s} {t_cs:6.2f} ms x{t_cs / mat:.3f}"
    print(line, flush=True)


def fused_at(tp: int, args) -> None:
    import vtp_runtime as vtp
    from vtp_runtime.backend import TakesHead
    from vtp_runtime.backends.triton import TritonBackend

    n, hid, v = args.tokens, args.hidden, args.vocab // tp
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, hid, device="cuda", dtype=dt, generator=g).requires_grad_(True)
    w = (torch.randn(v, hid, device="cuda", dtype=dt, generator=g) * hid**-0.5).requires_grad_(True)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)

    upstream = torch.tensor(args.upstream, device="cuda")

    def materialized():
        loss = vtp.cross_entropy(h @ w.t(), y, reduction="mean", backend="triton")
        return torch.autograd.grad(loss, (h, w), upstream)

    def fused(rows: int | None):
        loss = vtp.cross_entropy(vtp.Head(h, w, chunk_rows=rows), y, reduction="mean", backend="triton")
        return torch.autograd.grad(loss, (h, w), upstream)

    mat = time_loop(materialized, 3, args.reps)
    line = f"TP{tp} upstream {args.upstream:g}: materialized {mat:6.2f} ms  fused (x materialized):"
    skip = TritonBackend.scale_gradients
    for rows in [None, *map(int, args.rows.split(","))]:
        for scale_pass in (False, True) if rows is None else (False,):
            # with the pass: torch's multi-tensor multiply, as before the backend skipped it
            TritonBackend.scale_gradients = TakesHead.scale_gradients if scale_pass else skip  # type: ignore[method-assign]
            try:
                t = time_loop(lambda: fused(rows), 3, args.reps)  # noqa: B023  (run before rows changes)
            finally:
                TritonBackend.scale_gradients = skip  # type: ignore[method-assign]
            name = "default rows" if rows is None else f"rows {rows}"
            line += f"  {name}{' +scale pass' if scale_pass else ''} {t:6.2f} ms x{t / mat:.3f}"
    print(line, flush=True)


def scale_at(tp: int, args) -> None:
    """The backward's scaling of a scalar call's gradients (dW ``[V_local, H]`` and dh
    ``[N, H]``, bf16) by an upstream gradient of 0.5: torch's multi-tensor multiply against
    the triton backend's pass for a few launch configurations, in TB/s of the bytes read and
    written."""
    import dataclasses

    from vtp_runtime.backends.triton import CUDA_CONFIG, TritonBackend

    v = args.vocab // tp
    grads = [
        torch.randn(v, args.hidden, device="cuda").bfloat16(),
        torch.randn(args.tokens, args.hidden, device="cuda").bfloat16(),
    ]
    scale = torch.tensor(0.5, device="cuda")
    moved = 2 * sum(g.numel() * g.element_size() for g in grads) / 1e9
    t_foreach = time_loop(lambda: torch._foreach_mul_(grads, scale), 3, args.reps)
    line = f"TP{tp} scale pass over {moved / 2:.2f} GB: foreach {moved / t_foreach:.2f} TB/s"
    for block, warps, programs in (
        (4096, 8, 1024),
        (4096, 8, 4096),
        (8192, 8, 2048),
        (2048, 4, 8192),
        (1024, 4, 1 << 20),
    ):
        cfg = dataclasses.replace(CUDA_CONFIG, block_scale=block, warps_scale=warps, scale_programs=programs)
        backend = TritonBackend(cfg)
        t = time_loop(lambda: backend.scale_gradients(grads, scale), 3, args.reps)  # noqa: B023  (run before it changes)
        line += f"  {block}/{warps}/{programs} {moved / t:.2f}"
    one = torch.tensor(1.0, device="cuda")
    t_one = time_loop(lambda: TritonBackend(CUDA_CONFIG).scale_gradients(grads, one), 3, args.reps)
    print(line + f"  | upstream 1: {t_one * 1e3:.1f} us", flush=True)


def kernels_at(tp: int, args) -> None:
    """One fused and one materialized JSD (frozen teacher head) call, forward + backward,
    under torch.profiler: each kernel's total device time, side by side."""
    import vtp_runtime as vtp

    n, hid, v = args.tokens, args.hidden, args.vocab // tp
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, hid, device="cuda", dtype=dt, generator=g).requires_grad_(True)
    w = (torch.randn(v, hid, device="cuda", dtype=dt, generator=g) * hid**-0.5).requires_grad_(True)
    ht = torch.randn(n, hid, device="cuda", dtype=dt, generator=g)
    wt = torch.randn(v, hid, device="cuda", dtype=dt, generator=g) * hid**-0.5

    def materialized():
        with torch.no_grad():
            zt = ht @ wt.t()
        return torch.autograd.grad(vtp.jsd(h @ w.t(), zt, beta=0.5, reduction="mean", backend="triton"), (h, w))

    def fused():
        loss = vtp.jsd(vtp.Head(h, w), vtp.Head(ht, wt), beta=0.5, reduction="mean", backend="triton")
        return torch.autograd.grad(loss, (h, w))

    tables, wall = {}, {}
    for name, fn in (("materialized", materialized), ("fused", fused)):
        wall[name] = time_loop(fn, 3, args.reps)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        tables[name] = {
            e.key: (e.self_device_time_total / 1e3, e.count) for e in prof.key_averages() if e.self_device_time_total
        }
    print(f"TP{tp} jsd, ms (launches) per kernel: materialized | fused")
    for key in sorted(
        set(tables["materialized"]) | set(tables["fused"]),
        key=lambda k: -max(tables["fused"].get(k, (0, 0))[0], tables["materialized"].get(k, (0, 0))[0]),
    ):
        a, b = tables["materialized"].get(key, (0.0, 0)), tables["fused"].get(key, (0.0, 0))
        print(f"  {a[0]:7.3f} ({a[1]:2d}) | {b[0]:7.3f} ({b[1]:2d})  {key[:90]}")
    totals = [sum(t for t, _ in tables[k].values()) for k in ("materialized", "fused")]
    print(
        f"  kernels {totals[0]:.2f} | {totals[1]:.2f} ms; call {wall['materialized']:.2f} | {wall['fused']:.2f} ms",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tp", default="1,2,4")
    p.add_argument("--rows", default="1024,1280,1536,2048")
    p.add_argument("--splits", default="2,4,8")
    p.add_argument("--blas", default="cublas,cublaslt")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--fused", action="store_true")
    p.add_argument("--scale", action="store_true", help="the backward's scaling pass alone")
    p.add_argument("--kernels", action="store_true", help="JSD's kernels, fused against materialized (torch.profiler)")
    p.add_argument("--upstream", type=float, default=1.0, help="--fused: the loss's upstream gradient")
    args = p.parse_args()
    print(
        f"torch {torch.__version__} {torch.cuda.get_device_name()} N={args.tokens} H={args.hidden} V={args.vocab} bf16"
    )
    for tp in map(int, args.tp.split(",")):
        if args.scale:
            scale_at(tp, args)
            continue
        if args.kernels:
            kernels_at(tp, args)
            continue
        if args.fused:
            fused_at(tp, args)
            torch.cuda.empty_cache()
            continue
        for blas in args.blas.split(","):
            torch.backends.cuda.preferred_blas_library(blas)
            gemms_at(blas, tp, args)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
