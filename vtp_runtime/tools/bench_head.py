"""``vtp-runtime bench --head H``: the fused linear head against the materialized path and peers.

Each arm is one forward + backward with gradients to the hidden states ``h [N, H]`` and the
weight shard ``W [V_local, H]`` (reduction "mean"), at per-rank work ``V_local = V / TP`` on one
device (so "TP = t" times one rank's share; the O(N) cross-rank statistics are not timed):

- ``cross_entropy``: ``materialized`` (``h @ W.T`` then ``vtp.cross_entropy`` on the logits),
  ``fused`` (``vtp.cross_entropy(vtp.Head(h, W))``), ``fused_none`` (the same with
  ``reduction="none"``, then ``(values * g).sum() / N`` for a fixed random ``g``: the logits
  recomputed in backward), on the triton backend ``fused_cublas`` (``fused`` with
  ``VTP_HEAD_GEMM=cublas``: the logits by cuBLAS chunks where ``fused`` takes the epilogue
  GEMM, to compare both in one run), ``torch`` (``F.cross_entropy`` on
  ``h @ W.T``), ``liger`` (Liger's fused linear CE), ``liger_tp`` (Liger's tensor-parallel
  fused linear CE, ``LigerFusedLinearScaledCrossEntropyTPFunction`` on a group of one:
  labelled ``native`` where its CUTLASS + NVSHMEM kernel loads, else ``fallback``, its
  chunked path) and ``cce`` (cut-cross-entropy's ``linear_cross_entropy``) when installed.
- ``jsd``: a frozen teacher head (``h_t``, ``W_t`` without gradients): ``materialized``
  (``h @ W.T`` and, without grad, ``h_t @ W_t.T``, then ``vtp.jsd``) against ``fused`` (both
  Heads) and, on triton, ``fused_cublas``.

Reported per arm: the median time of ``--reps`` calls (CUDA events; wall clock on CPU), and
the temporaries beyond the inputs and their gradients: peak allocated memory during the call
minus the memory held before it (the inputs) minus the bytes of the returned gradients
(CUDA only). ``vs_mat`` is the time relative to the ``materialized`` arm of the same backend;
``TFLOP/s`` counts the GEMMs of a forward + backward with gradients to ``h`` and ``W``:
``6 N H V_local`` (``8`` with the frozen teacher head of ``jsd``).
On CPU (``--device cpu``, for trying it out at tiny sizes) memory is not measured.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from .timing import cuda_missing, fmt, no_row_ran, print_rows, time_cpu, time_loop, version, write_results

HEAD_OPS = ("cross_entropy", "jsd")
HEAD_PEERS = ("torch", "liger", "cce")
VTP_ARMS = ("materialized", "fused", "fused_cublas", "fused_none")  # the arms run once per vtp backend
# backends with a logits GEMM of their own, which VTP_HEAD_GEMM=cublas turns off (fused_cublas)
OWN_HEAD_GEMM = ("triton",)


@dataclass
class HeadRow:
    op: str
    arm: str
    tp: int
    tokens: int
    hidden: int
    v_local: int
    dtype: str
    ms: float | None = None  # median time per forward + backward
    temp_gib: float | None = None  # temporaries beyond inputs and their gradients
    vs_mat: float | None = None  # time / time of the materialized arm (same backend)
    tflops: float | None = None  # by the GEMM count: 6 N H V_local (8 with a frozen teacher head)
    error: str = ""


def head_arm(op: str, arm: str, backend: str, h, w, y, ht, wt, beta: float):
    """A closure running forward + backward once and returning the gradients of (h, w)."""
    if arm == "fused_cublas":
        return _forcing_cublas(head_arm(op, "fused", backend, h, w, y, ht, wt, beta))
    import torch
    import torch.nn.functional as F

    import vtp_runtime as vtp

    def grads(loss):
        return torch.autograd.grad(loss, (h, w))

    if op == "cross_entropy":
        if arm == "materialized":
            return lambda: grads(vtp.cross_entropy(h @ w.T, y, reduction="mean", backend=backend))
        if arm == "fused":
            return lambda: grads(vtp.cross_entropy(vtp.Head(h, w), y, reduction="mean", backend=backend))
        if arm == "fused_none":
            # per-token values: the recompute-in-backward path; a fixed random upstream gradient
            # (scaled as "mean" would) so the tokens' gradients differ
            g = torch.rand(y.shape, generator=torch.Generator(device=y.device).manual_seed(0), device=y.device)

            def per_token():
                values = vtp.cross_entropy(vtp.Head(h, w), y, reduction="none", backend=backend)
                return grads((values * g).sum() / y.numel())

            return per_token
        if arm == "torch":
            return lambda: grads(F.cross_entropy(h @ w.T, y))
        if arm == "liger":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            loss = LigerFusedLinearCrossEntropyLoss()
            return lambda: grads(loss(w, h, y))
        if arm == "cce":
            from cut_cross_entropy import linear_cross_entropy

            return lambda: grads(linear_cross_entropy(h, w, y))
        if arm.startswith("liger_tp"):
            # Liger's tensor-parallel fused linear CE on a group of one: this rank's work at
            # TP = t, the shard taken as the vocabulary (its collectives are then no-ops)
            from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyTPFunction as TP

            group = _world_of_one()
            return lambda: grads(TP.apply(h, w, y, group).mean())
    if op == "jsd":
        if arm == "materialized":

            def run():
                with torch.no_grad():
                    zt = ht @ wt.T
                return grads(vtp.jsd(h @ w.T, zt, beta=beta, reduction="mean", backend=backend))

            return run
        if arm == "fused":
            return lambda: grads(
                vtp.jsd(vtp.Head(h, w), vtp.Head(ht, wt), beta=beta, reduction="mean", backend=backend)
            )
    raise ValueError(f"no arm {arm!r} for {op}")


def _forcing_cublas(fn):
    """``fn`` run with ``VTP_HEAD_GEMM=cublas`` (the variable restored after each call)."""
    import os

    def run():
        before = os.environ.get("VTP_HEAD_GEMM")
        os.environ["VTP_HEAD_GEMM"] = "cublas"
        try:
            return fn()
        finally:
            if before is None:
                del os.environ["VTP_HEAD_GEMM"]
            else:
                os.environ["VTP_HEAD_GEMM"] = before

    return run


def _arms(op: str, peers: set[str]) -> list[str]:
    arms = ["materialized", "fused", "fused_cublas"]
    if op == "cross_entropy":
        arms += ["fused_none"] + [p for p in ("torch", "liger", "cce") if p in peers]
        if "liger" in peers:
            arms.append(_liger_tp_arm())
    return arms


def _liger_tp_arm() -> str:
    """``liger_tp(native)`` where liger's CUTLASS + NVSHMEM kernel loads, else
    ``liger_tp(fallback)``: its chunked fallback."""
    try:
        from liger_kernel.ops.fused_linear_scaled_cross_entropy import _load_native_tp_function

        native = _load_native_tp_function() is not None
    except Exception:  # an import failure of the native path is the fallback
        native = False
    return "liger_tp(native)" if native else "liger_tp(fallback)"


def _world_of_one():
    """A gloo process group of this process alone (Liger's TP function needs one)."""
    import os
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
    return dist.group.WORLD


def _available(peer: str) -> bool:
    import importlib.util

    module = {"liger": "liger_kernel", "cce": "cut_cross_entropy", "torch": "torch"}[peer]
    return importlib.util.find_spec(module) is not None


def _time(fn, device: str, warmup: int, reps: int) -> float:
    if device != "cuda":
        return time_cpu(fn, warmup, reps)
    for _ in range(warmup):
        fn()

    return time_loop(fn, 0, reps)


def temporaries(fn) -> float:
    """GiB allocated during one call beyond what was held before it and the gradients it returns."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    kept = sum(g.numel() * g.element_size() for g in out)
    return (torch.cuda.max_memory_allocated() - base - kept) / 2**30


def run(args) -> int:
    import torch

    device = args.device
    if cuda_missing(device, "try --head at tiny sizes on the CPU"):
        return 2
    ops = args.ops or list(HEAD_OPS)  # the flags were checked by vtp_runtime.tools.bench
    backends = args.backends
    peers = set(HEAD_PEERS if args.peers is None else args.peers)
    for p in sorted(peers):
        if not _available(p):
            print(f"{p} is not installed: skipping that peer", file=sys.stderr)
            peers.discard(p)
        elif p != "torch" and device != "cuda":
            print(f"{p} runs on CUDA only: skipping that peer on {device}", file=sys.stderr)
            peers.discard(p)
    dtype = getattr(torch, args.dtype)
    hidden = args.head
    rows: list[HeadRow] = []
    plan = [
        (op, tp, n, backend, arm)
        for op in ops
        for tp in args.tp
        for n in args.tokens
        for backend in backends
        for arm in _arms(op, peers)
        if (arm in VTP_ARMS or backend == backends[0]) and (arm != "fused_cublas" or backend in OWN_HEAD_GEMM)
    ]
    for i, (op, tp, n, backend, arm) in enumerate(plan):
        v_local = args.vocab // tp
        name = arm if arm not in VTP_ARMS else f"{arm}:{backend}"
        row = HeadRow(op, name, tp, n, hidden, v_local, args.dtype)
        try:
            g = torch.Generator(device=device).manual_seed(i)
            h = torch.randn(n, hidden, generator=g, device=device, dtype=torch.float32).to(dtype).requires_grad_(True)
            w = (
                (torch.randn(v_local, hidden, generator=g, device=device, dtype=torch.float32) * hidden**-0.5)
                .to(dtype)
                .requires_grad_(True)
            )
            y = torch.randint(0, v_local, (n,), generator=g, device=device)
            ht = wt = None
            if op == "jsd":
                ht = torch.randn(n, hidden, generator=g, device=device, dtype=torch.float32).to(dtype)
                wt = (torch.randn(v_local, hidden, generator=g, device=device, dtype=torch.float32) * hidden**-0.5).to(
                    dtype
                )
            fn = head_arm(op, arm, backend, h, w, y, ht, wt, args.beta)
            row.ms = _time(fn, device, args.warmup, args.reps)  # warm first: no compilation in the peak
            gemms = 8 if op == "jsd" else 6
            row.tflops = gemms * n * hidden * v_local / (row.ms * 1e-3) / 1e12
            if device == "cuda":
                row.temp_gib = temporaries(fn)
        except Exception as exc:
            row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        finally:
            # frees this size's tensors before the next one is allocated
            h = w = y = ht = wt = fn = None  # type: ignore[assignment]  # noqa: F841
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print(f"[{i + 1}/{len(plan)}] {op} {name} TP{tp} N={n}", file=sys.stderr, flush=True)
    for r in rows:
        # the materialized arm of the same backend, else any materialized arm of the same size
        timed = [m for m in rows if (m.op, m.tp, m.tokens) == (r.op, r.tp, r.tokens) and m.ms]
        same = [m for m in timed if m.arm == "materialized:" + r.arm.split(":")[-1]]
        ref = next(iter(same or [m for m in timed if m.arm.startswith("materialized")]), None)
        if r.ms is not None and ref is not None and ref.ms:
            r.vs_mat = r.ms / ref.ms
    print_table(rows)
    if args.json:
        write_results(
            args.json,
            device,
            rows,
            mode="head",
            liger_kernel=version("liger-kernel"),
            cut_cross_entropy=version("cut-cross-entropy"),
            vocab=args.vocab,
            hidden=hidden,
            dtype=args.dtype,
            beta=args.beta,
        )
    if args.plot:
        plot(rows, args.plot, args.vocab, hidden)
    return no_row_ran(rows, lambda r: r.arm.partition(":")[2] or r.arm, backends)


def print_table(rows) -> None:

    print_rows(
        f"{'op':14s} {'arm':20s} {'TP':>2s} {'N':>6s} {'H':>5s} {'V_local':>7s} {'ms':>9s} {'TFLOP/s':>7s} "
        f"{'vs_mat':>6s} {'temp GiB':>8s}  note",
        (
            f"{r.op:14s} {r.arm:20s} {r.tp:2d} {r.tokens:6d} {r.hidden:5d} {r.v_local:7d} {fmt(r.ms, '9.3f')} "
            f"{fmt(r.tflops, '7.0f')} {fmt(r.vs_mat, '6.3f')} {fmt(r.temp_gib, '8.3f')}  {r.error}"
            for r in rows
        ),
    )


def replot(json_path: str, png_path: str) -> None:
    """Redraw the PNG from a ``--head ... --json`` file (no GPU needed)."""
    with open(json_path) as f:
        data = json.load(f)
    plot([HeadRow(**r) for r in data["rows"]], png_path, data["vocab"], data["hidden"])


def plot(rows, path: str, vocab: int, hidden: int) -> None:
    """Time and temporaries against N, one column per (op, TP)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.op, r.tp) for r in rows}, key=lambda p: (HEAD_OPS.index(p[0]), p[1]))
    arms = sorted({r.arm for r in rows})
    colors = {arm: plt.get_cmap("tab10")(i % 10) for i, arm in enumerate(arms)}
    fig, axes = plt.subplots(2, len(panels), figsize=(4 * len(panels), 6.5), squeeze=False)
    for j, (op, tp) in enumerate(panels):
        for arm in arms:
            mine = sorted((r for r in rows if (r.op, r.tp, r.arm) == (op, tp, arm)), key=lambda r: r.tokens)
            for i, key in enumerate(("ms", "temp_gib")):
                pts = [(r.tokens, getattr(r, key)) for r in mine if getattr(r, key) is not None]
                if pts:
                    axes[i][j].plot(*zip(*pts), marker="o", label=arm, color=colors[arm])
        for i, label in enumerate(("ms, fwd+bwd", "GiB of temporaries")):
            ax = axes[i][j]
            ax.set_title(f"{op}, TP={tp}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens N")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    fig.suptitle(f"vtp-runtime bench --head {hidden}: V={vocab}, per-rank work V/TP")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
