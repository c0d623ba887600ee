"""``vtp-runtime bench --ops sample,sample_top_k,sample_top_p,argmax``: vocabulary-parallel
sampling against gathering the logits and sampling them whole.

Ops: ``sample`` (plain), ``sample_top_k`` (top_k=50), ``sample_top_p`` (top_p=0.9) and
``argmax``, at decode sizes (N = 1, 8, 64, 256) and prefill (N = 8192), V = 151936.
"TP = t" is the per-rank work of a TP group of size t on one GPU: vtp arms run on local
logits ``[N, V / t]`` (their all-gather of O(N) candidates is not timed: no group); the
peer (``torch``) gathers the t shards into ``[N, V]`` (a ``torch.cat``, standing for the
all-gather's copy) and then draws as transformers does: softmax + ``torch.multinomial``;
for top-k ``topk`` + mask first; for top-p the sort + softmax + cumsum + scatter of
``TopPLogitsWarper``; ``torch.argmax`` for argmax. Every vtp call gets a new seed.

Logits are ``randn * 4`` in the chosen dtype: peaked enough that top-p keeps tens to
hundreds of tokens, as language models' distributions do (a flatter distribution makes
vtp's top-p take more rounds: see ``vtp_runtime.sampling``). Bandwidth counts one read of
the local logits; times are CUDA events (median), and the CUDA-graph replay where the arm
can be captured. ``--device cpu`` runs the same arms at tiny sizes (perf_counter timing).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from ..cli_flags import non_negative_int, positive_int, positive_ints
from .timing import (
    copy_bandwidth,
    cuda_missing,
    no_row_ran,
    time_cpu,
    time_graph,
    time_loop,
    write_results,
)

SAMPLE_OPS = ("sample", "sample_top_k", "sample_top_p", "argmax")
HOST_READS = ("sample_top_k", "sample_top_p")  # a host read per round: no CUDA-graph timing

TOKENS = (1, 8, 64, 256, 8192)  # the defaults of --tokens and --tp
TPS = (1, 2, 4)
TOP_K, TOP_P = 50, 0.9


@dataclass
class DecodeRow:
    """One decode arm at one row count: wall µs per call back to back."""

    tokens: int
    arm: str
    us: float


@dataclass
class SampleRow:
    op: str
    arm: str
    tp: int
    tokens: int
    v_local: int
    dtype: str
    ms: float | None = None
    graph_ms: float | None = None
    gbps: float | None = None
    pct_copy: float | None = None
    vs_peer: float | None = None  # peer time / this arm's time (> 1: faster than the peer)
    error: str = ""


def _options(op: str) -> dict[str, Any]:
    if op == "sample_top_k":
        return {"top_k": TOP_K}
    return {"top_p": TOP_P} if op == "sample_top_p" else {}


def vtp_arm(backend: str, op: str, z):
    """A closure drawing once from ``z`` ``[N, V_local]`` with ``backend``, a new seed per call."""
    import itertools

    import vtp_runtime as vtp

    seeds = itertools.count()
    if op == "argmax":
        return lambda: vtp.argmax(z, backend=backend)
    options = _options(op)
    return lambda: vtp.sample(z, seed=next(seeds), backend=backend, **options)


def peer_arm(op: str, shards: list):
    """Gather the shards, then draw from the full logits as transformers' decoding loop does."""
    import torch

    def gathered():
        return shards[0] if len(shards) == 1 else torch.cat(shards, dim=-1)

    if op == "argmax":
        return lambda: gathered().argmax(-1)

    def run():
        x = gathered().float()
        if op == "sample_top_k":  # TopKLogitsWarper
            kth = torch.topk(x, TOP_K, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, -float("inf"))
        elif op == "sample_top_p":  # TopPLogitsWarper
            sorted_x, order = torch.sort(x, descending=False)
            cum = sorted_x.softmax(-1).cumsum(-1)
            drop = cum <= 1 - TOP_P
            drop[..., -1:] = False
            x = x.masked_fill(drop.scatter(1, order, drop), -float("inf"))
        return torch.multinomial(x.softmax(-1), num_samples=1).squeeze(1)

    return run


def run(args) -> int:
    import torch

    device = args.device
    if cuda_missing(device, "try the sampling ops at tiny sizes on the CPU"):
        return 2
    ops, backends = args.ops, args.backends  # checked by vtp_runtime.tools.bench
    peers = {"torch"} if args.peers is None else set(args.peers)
    dtype = getattr(torch, args.dtype)
    itemsize = torch.finfo(dtype).bits // 8
    copy_gbps = copy_bandwidth() if device == "cuda" else None
    rows: list[SampleRow] = []
    for op in ops:
        for n in args.tokens:
            for tp in args.tp:
                v_local = args.vocab // tp
                g = torch.Generator(device=device).manual_seed(n + tp)
                full = (torch.randn(n, v_local * tp, generator=g, device=device) * 4).to(dtype)
                shards = list(full.split(v_local, dim=-1))
                arms = [(b, vtp_arm(b, op, shards[0])) for b in backends]
                if "torch" in peers:
                    arms.append(("torch", peer_arm(op, shards)))
                got: list[SampleRow] = []
                for name, fn in arms:
                    row = SampleRow(op, name, tp, n, v_local, args.dtype)
                    try:
                        if device == "cuda":
                            row.ms = time_loop(fn, args.warmup, args.reps)
                            # top-k and top-p read a flag on the host each round: not capturable (a
                            # failed capture would leave the device's RNG mid-capture for the peers)
                            if not args.no_graph and op not in HOST_READS:
                                row.graph_ms = time_graph(fn, args.reps)
                        else:
                            row.ms = time_cpu(fn, args.warmup, args.reps)
                        best = min(t for t in (row.ms, row.graph_ms) if t is not None)
                        row.gbps = n * v_local * itemsize / (best * 1e-3) / 1e9
                        row.pct_copy = None if copy_gbps is None else 100 * row.gbps / copy_gbps
                    except Exception as exc:
                        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                    got.append(row)
                peer = next((r for r in got if r.arm == "torch" and r.ms is not None), None)
                for r in got:
                    if peer is not None and r.ms is not None and r is not peer:
                        r.vs_peer = min(t for t in (peer.ms, peer.graph_ms) if t) / min(
                            t for t in (r.ms, r.graph_ms) if t
                        )
                rows.extend(got)
                print(f"{op} TP{tp} N={n}", file=sys.stderr, flush=True)
    print_table(rows, copy_gbps)
    if args.json:
        write_results(args.json, device, rows, mode="sample", copy_gbps=copy_gbps, vocab=args.vocab, dtype=args.dtype)
    return no_row_ran(rows, lambda r: r.arm, backends)


def print_table(rows: list[SampleRow], copy_gbps: float | None) -> None:
    if copy_gbps is not None:
        print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")

    def fmt(x, spec):
        return "-".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)

    header = (
        f"{'op':13s} {'arm':7s} {'TP':>2s} {'N':>5s} {'V_local':>7s} {'ms':>8s} {'graph ms':>8s} "
        f"{'GB/s':>6s} {'%copy':>5s} {'x peer':>6s}  note"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.op:13s} {r.arm:7s} {r.tp:2d} {r.tokens:5d} {r.v_local:7d} {fmt(r.ms, '8.3f')} "
            f"{fmt(r.graph_ms, '8.3f')} {fmt(r.gbps, '6.0f')} {fmt(r.pct_copy, '5.0f')} {fmt(r.vs_peer, '6.2f')}  "
            f"{r.error}"
        )


# -- decode: wall time per call, back to back ------------------------------------------------
# ``python -m vtp_runtime.tools.bench_sample`` (``benchmarks/sample_tp2.py`` for TP = 2). Each
# arm runs ``reps`` calls back to back, then one synchronize: the wall time per call is what a
# decode loop pays (the larger of the host's and the device's cost per call).

DECODE_TOKENS = (1, 8, 64)
# (target arm, the peer it is held to, the bound on arm / peer)
DECODE_TARGETS = (
    ("vtp.argmax", "torch.argmax", 2.0),
    ("vtp.sample", "softmax+multinomial", 1.0),
    ("vtp.top_k", "sort top_p", 1.0),
    ("vtp.top_p", "sort top_p", 1.0),
    ("vtp.min_p", "softmax+multinomial", None),
)


def decode_arms(z, group=None, vocab=None) -> dict[str, Any]:
    """The vtp arms on this rank's logits ``z`` ``[N, V_local]`` (``group``: its TP group,
    ``vocab``: ``(vocab_start, vocab_end)`` on it), a new seed per call."""
    import itertools

    import vtp_runtime as vtp

    seeds = itertools.count()
    kw: dict[str, Any] = {"backend": "triton"}
    if group is not None:
        kw.update(tp_group=group)
    if vocab is not None:
        kw.update(vocab_start=vocab[0], vocab_end=vocab[1])
    return {
        "vtp.argmax": lambda: vtp.argmax(z, **kw),
        "vtp.sample": lambda: vtp.sample(z, seed=next(seeds), **kw),
        "vtp.top_k": lambda: vtp.sample(z, seed=next(seeds), top_k=TOP_K, **kw),
        "vtp.top_p": lambda: vtp.sample(z, seed=next(seeds), top_p=TOP_P, **kw),
        "vtp.min_p": lambda: vtp.sample(z, seed=next(seeds), min_p=0.05, **kw),
    }


def peer_decode_arms(x) -> dict[str, Any]:
    """torch's draws on the full logits ``x`` ``[N, V]``, as transformers' decoding loop does."""
    import torch

    def top_p():
        sorted_x, order = torch.sort(x.float(), descending=False)
        drop = sorted_x.softmax(-1).cumsum(-1) <= 1 - TOP_P
        drop[..., -1:] = False
        kept = x.float().masked_fill(drop.scatter(1, order, drop), -float("inf"))
        return torch.multinomial(kept.softmax(-1), 1)

    return {
        "torch.argmax": lambda: x.argmax(-1),
        "softmax+multinomial": lambda: torch.multinomial(x.float().softmax(-1), 1),
        "sort top_p": top_p,
    }


def wall_us(fn, warmup: int, reps: int) -> float:
    """Wall microseconds per call of ``reps`` calls back to back, synchronized once (CUDA), after
    ``warmup`` calls."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps * 1e6


def decode_logits(n: int, vocab: int, device: str, dtype):
    import torch

    g = torch.Generator(device=device).manual_seed(n)
    return (torch.randn(n, vocab, generator=g, device=device) * 4).to(dtype)


def decode_table(times: dict[tuple[int, str], float], tokens, label: str) -> str:
    """The table of ``times`` (µs by (N, arm)) with each target's ratio and whether it holds."""
    arms = sorted({arm for _, arm in times}, key=lambda a: (a.startswith("vtp"), a))
    lines = [f"{label}: wall µs per call, back to back"]
    lines.append(f"{'N':>4s} " + " ".join(f"{a:>20s}" for a in arms))
    for n in tokens:
        lines.append(f"{n:4d} " + " ".join(f"{times.get((n, a), float('nan')):20.1f}" for a in arms))
    lines.append("targets (arm / peer, same run):")
    for arm, peer, bound in DECODE_TARGETS:
        for n in tokens:
            if (n, arm) in times and (n, peer) in times:
                ratio = times[(n, arm)] / times[(n, peer)]
                verdict = "" if bound is None else ("  met" if ratio <= bound else f"  MISSED (bound {bound:g})")
                lines.append(f"  N={n:<3d} {arm:>11s} / {peer:<20s} {ratio:6.2f}{verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch

    parser = argparse.ArgumentParser(description="decode-time sampling: wall µs per call, TP = 1")
    parser.add_argument("--tokens", type=positive_ints, default=list(DECODE_TOKENS))
    parser.add_argument("--vocab", type=positive_int, default=151936)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--warmup", type=non_negative_int, default=50)
    parser.add_argument("--reps", type=positive_int, default=500)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if cuda_missing(args.device, "time the arms at tiny sizes on the CPU (--vocab 64 --reps 5)"):
        return 2
    tokens = args.tokens
    times: dict[tuple[int, str], float] = {}
    for n in tokens:
        x = decode_logits(n, args.vocab, args.device, getattr(torch, args.dtype))
        for name, fn in {**peer_decode_arms(x), **decode_arms(x)}.items():
            times[(n, name)] = wall_us(fn, args.warmup, args.reps)
    print(decode_table(times, tokens, f"TP=1, V={args.vocab}, {args.dtype}, {args.device}"))
    if args.json:
        rows = [DecodeRow(n, a, t) for (n, a), t in times.items()]
        write_results(args.json, args.device, rows, mode="decode", tp=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
