"""``vtp-runtime bench``: ops x backends x TP shard sizes x token counts, against peers.

Single device: "TP = t" means the per-rank work of a TP group of size t, i.e. local logits
``[N, V / t]`` on one GPU (the cross-rank all-gather of O(N) partials is not timed). Each arm
is forward + backward with an upstream gradient of ones; for divergences the teacher is
frozen (no teacher gradient), as in distillation.

Timing: CUDA events around each call, median of ``--reps`` calls after ``--warmup``; and,
where the arm can be captured, the median replay time of a CUDA graph of the same call (GPU
time without the CPU launch cost). Bandwidth counts the bytes of the passes the design's
performance model allows (see ``model_bytes``) and is compared against a device-to-device
copy measured in the same run. Peak memory is ``torch.cuda.max_memory_allocated`` during one
call, inputs included.

Peers: dense PyTorch (``torch``: TRL-style materialized log-softmax JSD/KL, ``F.cross_entropy``,
log_softmax entropy / log-probs) and liger-kernel (``liger``: LigerJSD incl. the log_softmax
it needs, LigerCrossEntropyLoss, LigerVocabParallelCEFunction at world 1) when installed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from vtp_runtime.cli_flags import names, non_negative_int, positive_int, positive_ints, unit_float

from .bench_head import HEAD_OPS, HEAD_PEERS
from .bench_sample import SAMPLE_OPS
from .bench_sample import TOKENS as SAMPLE_TOKENS
from .bench_sample import TPS as SAMPLE_TPS
from .timing import (
    copy_bandwidth,
    cuda_missing,
    fmt,
    no_row_ran,
    peak,
    print_rows,
    time_graph,
    time_loop,
    time_stream,
    version,
    write_results,
)

# logprobs_entropy: logprobs(..., return_entropy=True), both outputs and both gradients
OPS = ("jsd", "cross_entropy", "kl", "entropy", "logprobs", "logprobs_entropy")
# the sampling ops (SAMPLE_OPS) are forward only, timed by bench_sample.py against gathering
# the logits and sampling them whole
PEERS = ("torch", "liger")
TOKENS, TPS = (1024, 8192), (1, 2, 4, 8)  # the defaults of --tokens and --tp


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ops",
        type=names((*OPS, *SAMPLE_OPS), "op"),
        default=None,
        help="comma-separated ops (default: all losses; with --head: cross_entropy,jsd); the sampling ops "
        "sample,sample_top_k,sample_top_p,argmax run on their own (vtp_runtime/tools/bench_sample.py)",
    )
    parser.add_argument(
        "--backends",
        type=names(_registered_backends, "backend"),
        default="triton",
        help="comma-separated vtp_runtime backends to time (default: triton; eager is slow)",
    )
    parser.add_argument(
        "--peers",
        type=names(HEAD_PEERS, "peer", empty=True),
        default=None,
        help="comma-separated peers: torch (dense PyTorch), liger, and with --head cce "
        "(cut-cross-entropy); '' for none (default: all of them that are installed)",
    )
    parser.add_argument("--vocab", type=positive_int, default=151936, help="global vocabulary size V")
    parser.add_argument(
        "--tp",
        type=positive_ints,
        default=None,
        help="TP sizes: per-rank shard V/TP on one GPU (default 1,2,4,8; sampling ops 1,2,4)",
    )
    parser.add_argument(
        "--tokens",
        type=positive_ints,
        default=None,
        help="token counts N (default 1024,8192; sampling ops 1,8,64,256,8192)",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="logits dtype (default: bfloat16)",
    )
    parser.add_argument("--beta", type=unit_float, default=0.5, help="JSD beta, in [0, 1]")
    parser.add_argument("--warmup", type=non_negative_int, default=5, help="untimed calls before timing (default 5)")
    parser.add_argument(
        "--reps", type=positive_int, default=30, help="timed calls; the median is reported (default 30)"
    )
    parser.add_argument("--no-graph", action="store_true", help="skip CUDA-graph replay timing")
    parser.add_argument("--overhead", action="store_true", help="also measure CPU dispatch overhead per call")
    parser.add_argument("--json", metavar="PATH", help="write every measurement as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of time against shard size (matplotlib)")
    parser.add_argument(
        "--head",
        type=positive_int,
        metavar="H",
        default=None,
        help="time the fused linear head at hidden size H instead: vtp ops on vtp.Head(h, W) "
        "against h @ W.T then the op, and fused-linear peers (see vtp_runtime/tools/bench_head.py)",
    )
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="with --head or the sampling ops: cpu tries them at tiny sizes (no memory figures); default cuda",
    )


def _registered_backends() -> list[str]:
    from vtp_runtime.registry import REGISTRY

    return sorted(REGISTRY.backends())


@dataclass
class Row:
    op: str
    arm: str  # backend or peer name
    tp: int
    tokens: int
    v_local: int
    dtype: str
    ms: float | None = None  # median event time per call (loop)
    graph_ms: float | None = None  # median CUDA-graph replay time
    stream_ms: float | None = None  # back-to-back calls with no sync between: CPU runs ahead
    gbps: float | None = None  # model bytes / best of (ms, graph_ms)
    pct_copy: float | None = None
    peak_gib: float | None = None
    error: str = ""


def model_bytes(op: str, n: int, v: int, itemsize: int) -> int:
    """Bytes of the minimal passes, forward + backward, frozen teacher (DESIGN's model):
    JSD 3 reads of both inputs + 1 gradient write; KL 2 reads of both + 1 write;
    CE / log-probs (with or without the entropy) / entropy 2 reads + 1 write."""
    passes = {"jsd": 7, "kl": 5}.get(op, 3)
    return passes * n * v * itemsize


# -- arms: each returns a closure running forward + backward once ------------------------------
# make_inputs, vtp_arm, time_loop and time_stream are public: benchmarks/*.py build on them.


def make_inputs(op: str, n: int, v: int, dtype, device, seed: int):
    """``(logits, other)`` for ``op``: logits ``[n, v]`` of ``dtype`` requiring grad, and a
    frozen teacher ``[n, v]`` (kl, jsd), int64 labels ``[n]`` (cross_entropy, logprobs,
    logprobs_entropy) or None."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    z = (torch.randn(n, v, generator=g, device=device, dtype=torch.float32) * 2).to(dtype).requires_grad_(True)
    other = None
    if op in ("kl", "jsd"):
        other = (torch.randn(n, v, generator=g, device=device, dtype=torch.float32) * 2).to(dtype)
    elif op in ("cross_entropy", "logprobs", "logprobs_entropy"):
        other = torch.randint(0, v, (n,), generator=g, device=device)
    return z, other


def vtp_arm(backend: str, op: str, z, other, beta: float):
    """A closure running ``op`` forward + backward once on ``backend`` (an upstream gradient
    of ones; the gradient w.r.t. ``z`` only)."""
    import torch

    import vtp_runtime as vtp

    args = (z, other) if other is not None else (z,)
    opts = {"beta": beta} if op == "jsd" else {}
    if op == "logprobs_entropy":

        def run_pair():  # both outputs, a gradient of ones through each
            lp, h = vtp.logprobs(z, other, return_entropy=True, backend=backend)
            return torch.autograd.grad((lp, h), (z,), (torch.ones_like(lp), torch.ones_like(h)))

        return run_pair

    def run():
        out = vtp.loss(op, *args, backend=backend, **opts)
        return torch.autograd.grad(out, (z,), torch.ones_like(out))

    return run


def torch_arm(op, z, other, beta):
    """The dense PyTorch arm of ``op``: a closure running forward + backward once."""
    import torch
    import torch.nn.functional as F

    def run():
        if op == "cross_entropy":
            out = F.cross_entropy(z, other, reduction="none")
        elif op == "logprobs":
            out = F.log_softmax(z.float(), -1).gather(1, other[:, None]).squeeze(1)
        elif op == "entropy":
            lp = F.log_softmax(z.float(), -1)
            out = -(lp.exp() * lp).sum(-1)
        elif op == "logprobs_entropy":  # both from one log_softmax; the gradient of their sum
            lp = F.log_softmax(z.float(), -1)
            out = lp.gather(1, other[:, None]).squeeze(1) - (lp.exp() * lp).sum(-1)
        elif op == "kl":  # KL(p_t || p_s), materialized fp32 log-probs
            ls, lt = F.log_softmax(z.float(), -1), F.log_softmax(other.float(), -1)
            out = F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1)
        else:  # TRL GKD's generalized JSD: materialized log-probs and log-mixture
            ls, lt = F.log_softmax(z.float(), -1), F.log_softmax(other.float(), -1)
            lm = torch.logsumexp(torch.stack([ls + math.log1p(-beta), lt + math.log(beta)]), dim=0)
            out = (
                beta * F.kl_div(lm, lt, reduction="none", log_target=True)
                + (1 - beta) * F.kl_div(lm, ls, reduction="none", log_target=True)
            ).sum(-1)
        return torch.autograd.grad(out, (z,), torch.ones_like(out))

    return run


def _liger_arm(op, z, other, beta):
    import torch
    import torch.nn.functional as F

    if op == "jsd":
        from liger_kernel.transformers import LigerJSD

        jsd = LigerJSD(beta=beta)

        def run():  # Liger takes log-probs: the log_softmax is part of the arm
            loss = jsd(F.log_softmax(z, -1), F.log_softmax(other, -1))
            return torch.autograd.grad(loss, (z,))

        return run
    if op == "cross_entropy":
        from liger_kernel.transformers import LigerCrossEntropyLoss

        ce = LigerCrossEntropyLoss(reduction="sum")

        def run():
            return torch.autograd.grad(ce(z, other), (z,))

        return run
    return None


def _liger_vp_arm(op, z, other):
    import torch

    if op != "cross_entropy":
        return None
    from liger_kernel.ops.vocab_parallel_cross_entropy import LigerVocabParallelCEFunction

    def run():  # world 1: no group; Liger's [S, B, V] layout as a view
        loss = LigerVocabParallelCEFunction.apply(z.unsqueeze(1), other, None, -100, 0.0, "pytorch", "global")
        return torch.autograd.grad(loss, (z,), torch.ones_like(loss))

    return run


# -- timing -------------------------------------------------------------------------------------


def dispatch_overhead(calls: int = 2000) -> dict:
    """CPU microseconds per call at TP=1 in steady state, tiny inputs (so the GPU keeps up):
    the full ``vtp.loss`` forward, forward + backward, and the bare kernel launches."""
    import torch

    import vtp_runtime as vtp

    z = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    y = torch.randint(0, 256, (4,), device="cuda")
    out = {}
    for name, fn in [
        ("cross_entropy_forward", lambda: vtp.loss("cross_entropy", z.detach(), y, backend="triton")),
        ("jsd_forward", lambda: vtp.loss("jsd", z.detach(), t, backend="triton")),
        ("cross_entropy_fwd_bwd", lambda: vtp.loss("cross_entropy", z, y, backend="triton").sum().backward()),
        ("jsd_fwd_bwd", lambda: vtp.loss("jsd", z, t, backend="triton").sum().backward()),
    ]:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            c0 = time.perf_counter()
            for _ in range(calls // 5):
                fn()
            samples.append((time.perf_counter() - c0) / (calls // 5) * 1e6)
            torch.cuda.synchronize()
        out[name] = statistics.median(samples)
    return out


# -- driver -------------------------------------------------------------------------------------


class _Progress:
    """rich's progress bar when rich is installed, else one plain line per step."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self._rich: Any = None  # rich.progress.Progress, an optional dependency
        try:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            # on stderr, so that stdout holds only the table
            self._rich = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )
            self._rich.start()
            self._task = self._rich.add_task("bench", total=total)
        except ImportError:
            self._rich = None

    def step(self, label: str) -> None:
        self.done += 1
        if self._rich is not None:
            self._rich.update(self._task, advance=1, description=label)
        else:
            print(f"[{self.done}/{self.total}] {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()


def _arms(op, backends, peers, tp):
    arms = [(b, "vtp") for b in backends]
    if tp == 1:  # peers run on the full vocabulary on one device
        if "torch" in peers:
            arms.append(("torch", "torch"))
        if "liger" in peers and op in ("jsd", "cross_entropy"):
            arms.append(("liger", "liger"))
    if "liger" in peers and op == "cross_entropy":
        arms.append(("liger_vp", "liger_vp"))  # per-rank work of Liger's vocab-parallel CE
    return arms


def refusal(args) -> str | None:
    """Why flags that each parsed are wrong together (an op or peer of another mode, a shard
    with no token id), naming the flags; None when they fit."""
    ops: tuple[str, ...]
    peers: tuple[str, ...]
    if args.head is not None:
        mode, ops, peers = "--head", HEAD_OPS, HEAD_PEERS
    elif _sampling(args):
        mode, ops, peers = "the sampling bench", SAMPLE_OPS, ("torch",)
    else:
        mode, ops, peers = "the loss bench", OPS, PEERS
    wrong = [op for op in args.ops or () if op not in ops]
    if wrong:
        return f"--ops {','.join(wrong)}: {mode} times {', '.join(ops)}"
    wrong = [peer for peer in args.peers or () if peer not in peers]
    if wrong:
        return f"--peers {','.join(wrong)}: the peers of {mode} are {', '.join(peers)}"
    if args.vocab < max(args.tp):
        return f"--vocab {args.vocab} is smaller than --tp {max(args.tp)}: each shard needs a token id"
    return None


def _sampling(args) -> bool:
    return args.head is None and any(op in SAMPLE_OPS for op in args.ops or ())


def run(args) -> int:
    import torch

    sampling = _sampling(args)
    args.tokens = args.tokens or list(SAMPLE_TOKENS if sampling else TOKENS)
    args.tp = args.tp or list(SAMPLE_TPS if sampling else TPS)
    refused = refusal(args)
    if refused:  # before anything is timed, on every device
        print(f"vtp-runtime bench: {refused}", file=sys.stderr)
        return 2
    if sampling:
        from . import bench_sample

        return bench_sample.run(args)
    if args.head is not None:
        from . import bench_head

        return bench_head.run(args)
    ops = args.ops or list(OPS)
    if cuda_missing("cuda"):
        return 2
    backends = args.backends
    peers = set(PEERS if args.peers is None else args.peers)
    if "liger" in peers:
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            print("liger-kernel is not installed: skipping the liger peers", file=sys.stderr)
            peers.discard("liger")
    tps, tokens = args.tp, args.tokens
    dtype = getattr(torch, args.dtype)
    itemsize = torch.finfo(dtype).bits // 8

    copy_gbps = copy_bandwidth()
    plan = [
        (op, tp, n, arm, kind)
        for op in ops
        for n in tokens
        for tp in tps
        for arm, kind in _arms(op, backends, peers, tp)
    ]
    progress = _Progress(len(plan))
    rows: list[Row] = []
    seed = 0
    try:
        for op, tp, n, arm, kind in plan:
            v_local = args.vocab // tp
            row = Row(op, arm, tp, n, v_local, args.dtype)
            seed += 1
            try:
                z, other = make_inputs(op, n, v_local, dtype, "cuda", seed)
                fn = (
                    vtp_arm(arm, op, z, other, args.beta)
                    if kind == "vtp"
                    else torch_arm(op, z, other, args.beta)
                    if kind == "torch"
                    else _liger_arm(op, z, other, args.beta)
                    if kind == "liger"
                    else _liger_vp_arm(op, z, other)
                )
                row.peak_gib = peak(fn)
                row.ms = time_loop(fn, args.warmup, args.reps)
                row.stream_ms = time_stream(fn, args.reps)
                if not args.no_graph:
                    try:
                        row.graph_ms = time_graph(fn, args.reps)
                    except Exception as exc:  # not capturable: report the loop time only
                        row.error = f"graph: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                        torch.cuda.synchronize()
                best = min(t for t in (row.ms, row.graph_ms) if t is not None)
                row.gbps = model_bytes(op, n, v_local, itemsize) / (best * 1e-3) / 1e9
                row.pct_copy = 100 * row.gbps / copy_gbps
            except Exception as exc:
                row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            finally:
                z = other = fn = None  # noqa: F841
                torch.cuda.empty_cache()
            rows.append(row)
            progress.step(f"{op} {arm} TP{tp} N={n}")
    finally:
        progress.close()

    overhead = dispatch_overhead() if args.overhead else None
    print_table(rows, copy_gbps, overhead)
    if args.json:
        write_results(
            args.json,
            "cuda",
            rows,
            liger_kernel=version("liger-kernel"),
            copy_gbps=copy_gbps,
            vocab=args.vocab,
            dtype=args.dtype,
            beta=args.beta,
            dispatch_overhead_us=overhead,
        )
    if args.plot:
        _plot(rows, args.plot, args.vocab)
    return no_row_ran(rows, lambda r: r.arm, backends)


def replot(json_path: str, png_path: str) -> None:
    """Redraw the PNG from a ``--json`` file (no GPU needed)."""
    with open(json_path) as f:
        data = json.load(f)
    _plot([Row(**r) for r in data["rows"]], png_path, data["vocab"])


def print_table(rows: list[Row], copy_gbps: float, overhead: dict | None) -> None:
    """The measurements as the text table ``vtp-runtime bench`` prints."""
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")
    print_rows(
        f"{'op':16s} {'arm':9s} {'TP':>2s} {'N':>6s} {'V_local':>7s} {'ms':>8s} {'stream ms':>9s} "
        f"{'graph ms':>8s} {'GB/s':>6s} {'%copy':>5s} {'peak GiB':>8s}  note",
        (
            f"{r.op:16s} {r.arm:9s} {r.tp:2d} {r.tokens:6d} {r.v_local:7d} {fmt(r.ms, '8.3f')} "
            f"{fmt(r.stream_ms, '9.3f')} "
            f"{fmt(r.graph_ms, '8.3f')} {fmt(r.gbps, '6.0f')} {fmt(r.pct_copy, '5.0f')} "
            f"{fmt(r.peak_gib, '8.2f')}  {r.error}"
            for r in rows
        ),
    )
    ratios = entropy_overhead(rows)
    if ratios:
        print(
            "logprobs_entropy / logprobs time (best of loop and graph; target <= 1.1): "
            + ", ".join(f"{arm} TP{tp} N={n} {x:.2f}" for (arm, tp, n), x in ratios.items())
        )
    if overhead:
        print("CPU time per call at TP=1, steady state (us): " + ", ".join(f"{k} {v:.1f}" for k, v in overhead.items()))


def entropy_overhead(rows: list[Row]) -> dict[tuple[str, int, int], float]:
    """``{(arm, tp, tokens): time of logprobs_entropy / time of logprobs}`` where both ran."""
    best = {
        (r.op, r.arm, r.tp, r.tokens): min(t for t in (r.ms, r.graph_ms) if t is not None)
        for r in rows
        if r.ms is not None
    }
    return {
        key[1:]: t / best[("logprobs",) + key[1:]]
        for key, t in best.items()
        if key[0] == "logprobs_entropy" and ("logprobs",) + key[1:] in best
    }


def _plot(rows, path: str, vocab: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r.op for r in rows}, key=lambda o: OPS.index(o) if o in OPS else 99)
    tokens = sorted({r.tokens for r in rows})
    arms = sorted({r.arm for r in rows})
    colors = {arm: plt.get_cmap("tab10")(i % 10) for i, arm in enumerate(arms)}  # one color per arm
    fig, axes = plt.subplots(len(tokens), len(ops), figsize=(4 * len(ops), 3.4 * len(tokens)), squeeze=False)
    for i, n in enumerate(tokens):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            for arm in sorted({r.arm for r in rows if r.op == op}):
                pts = sorted(
                    (r.v_local, min(t for t in (r.ms, r.graph_ms) if t is not None))
                    for r in rows
                    if r.op == op and r.arm == arm and r.tokens == n and r.ms is not None
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=arm, color=colors[arm])
            ax.set_title(f"{op}, N={n}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("V_local (= V / TP)")
            ax.set_ylabel("ms, fwd+bwd")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"vtp-runtime bench, V={vocab}: best of loop / CUDA-graph time per call")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
