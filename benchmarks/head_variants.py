"""Candidate arrangements of the fused head's cross entropy, against the materialized path and
today's fused head: what each changes in the chunk runner, checked and timed in one run.

    python benchmarks/head_variants.py [--quick] [--shapes 8192:4096:1,...] [--variants a,b]
        [--reps 10] [--json out.json]              # on a CUDA GPU; JSON also under $OUT
    TRITON_INTERPRET=1 python benchmarks/head_variants.py --cpu   # tiny shapes, no GPU

Every variant computes the cross entropy of ``h @ W.T`` (``h [N, H]``, the weight shard
``W [V_local, H]``, int64 labels) with gradients to ``h`` and ``W``, over token chunks whose
logits live in a reused ``[rows, V_local]`` buffer, as ``vtp.Head`` does; each rank's shard
is simulated on one device (``V_local = V / TP``, as ``vtp-runtime bench --head``). A
scalar (mean/sum) variant computes the gradients in its forward pass, as the product does:

- ``chunks``: today's arrangement, re-built here (the control): per chunk the logits by the
  BLAS, a statistics pass, a finishing kernel, the gradient written over the logits, then
  ``dh = dz @ W`` and ``dW += dz.T @ h`` by the BLAS;
- ``stream`` (overlap): two buffers of half the rows; each chunk's loss kernels run on a
  second stream while the main stream computes the next chunk's logits;
- ``group`` (dW over a larger K): one buffer, its logits and loss kernels in ``group``
  sub-chunks, then ``dh`` and ``dW`` over the whole buffer at once; ``group_stream``: the
  same with the loss kernels of each sub-chunk on the second stream, overlapping the next
  sub-chunk's logits (the overlap of ``stream`` at one buffer's memory);
- ``triton_logits``: ``chunks`` with the logits from the Triton matmul of
  ``backends/triton/head_kernels.py`` (its plain epilogue): the matmul against the BLAS's;
- ``epilogue`` (statistics in the matmul): the logits from the Triton matmul whose epilogue
  writes each vocabulary tile's softmax partials: no statistics pass over the logits;
  ``epilogue_stream``, ``epilogue_group_stream``: with the overlaps above;
- ``none_epilogue``: ``reduction="none"`` (per-token upstream gradients, known only in
  backward): the forward matmul keeps only the partials and the label's logit (no logits
  buffer at all), the backward matmul writes the logits gradient from the saved statistics
  in its epilogue (no pass over the logits): four matmuls, no loss pass.

A backward over vocabulary chunks (each ``dW`` row block written once, ``dh`` the
accumulator) is not built: it needs the logits of every token before any gradient, so a
scalar loss computes them twice, four matmuls for three (``benchmarks/NOTES.md``).

On the GPU the script first picks the Triton matmul's configuration (a few tile shapes, each
against the BLAS on the chunk's shape), then checks every variant against the materialized
path at a real size (relative error of the loss and both gradients, in fp32), then times
(CUDA events, median of ``--reps`` after warm-up) the materialized path (``h @ W.T`` + the
triton backend's CE), today's fused head (``vtp.cross_entropy(vtp.Head(h, W))``, triton),
its ``reduction="none"`` and every variant, per shape ``N:H:TP``; a table last, JSON to
``--json`` and ``$OUT/head_variants.json``. A variant that fails (compilation included) is
reported with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

Tensor = torch.Tensor
LOG2E = 1.4426950408889634
IGNORE = -100
CHUNK_BYTES = 384 * 2**20  # one logits buffer, as vtp.Head's default
TWO_BUFFER_BYTES = 448 * 2**20  # both buffers of the two-buffer variants (inside the 0.5 GiB target)


# -- the Triton matmul's launch ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tiles, warps and pipelining of ``head_matmul_kernel``; ``tma``: operands through TMA
    descriptors where the device and the strides allow (else pointer loads)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 16
    stages: int = 3
    warps: int = 8
    flatten: bool = False
    tma: bool = True

    @property
    def name(self) -> str:
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k}/s{self.stages}/w{self.warps}"
            + ("/flat" if self.flatten else "")
            + ("" if self.tma else "/ptr")
        )


# the first is the one --quick takes; all compile for sm_90 with triton 3.6 (--compile-check)
GPU_CONFIGS = (
    MatmulConfig(flatten=True),
    MatmulConfig(),
    MatmulConfig(block_n=128, stages=4),
    MatmulConfig(block_m=256, block_n=128),
)
# the interpreter runs programs one by one: tiles small enough that the tests' shapes cover
# several of them, and a few persistent programs so that each walks several tiles
INTERPRETER_CONFIG = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, stages=1, warps=1)
INTERPRETER_PROGRAMS = 3


def _kernels():
    from vtp_runtime.backends.triton import head_kernels

    return head_kernels


def _interpreting(t: Tensor) -> bool:
    return t.device.type == "cpu"


def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_ok(cfg: MatmulConfig, *tensors: Tensor) -> bool:
    """TMA descriptors: asked for, on Hopper or later (or the interpreter), rows 16-byte
    aligned, the last dimension contiguous."""
    if not cfg.tma:
        return False
    dev = tensors[0].device
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] < 9:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return all(
        t.dim() == 2
        and t.stride(1) == 1
        and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0
        and t.shape[0] > 0
        and t.shape[1] > 0
        for t in tensors
    )


def matmul(
    mode: str,
    h: Tensor,
    w: Tensor,
    cfg: MatmulConfig,
    *,
    out: Tensor | None = None,
    bias: Tensor | None = None,
    part: Tensor | None = None,
    label: Tensor | None = None,
    y: Tensor | None = None,
    stats: Tensor | None = None,
    grad: Tensor | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    temperature: float = 1.0,
) -> None:
    """``head_matmul_kernel`` on rows ``h [M, H]`` and the shard ``w [V, H]``, epilogue
    ``mode`` in ``logits``, ``stats``, ``stats_only``, ``grad`` (see its docstring)."""
    k = _kernels()
    n_rows, k_dim = h.shape
    v_local = w.shape[0]
    if n_rows == 0 or v_local == 0:
        return
    if out is None:
        out = h  # STATS_ONLY stores nothing; the kernel reads only its dtype
    if _interpreting(h):
        cfg = dataclasses.replace(INTERPRETER_CONFIG, tma=cfg.tma)
    programs = _programs(h.device)
    mode_id = {"logits": 0, "stats": 1, "stats_only": 2, "grad": 3}[mode]
    stored = out if mode != "stats_only" else None
    use_tma = tma_ok(cfg, h, w, *([stored] if stored is not None else []))
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_arg = TensorDescriptor.from_tensor(h, [cfg.block_m, cfg.block_k])
        b_arg = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
        out_arg = TensorDescriptor.from_tensor(stored, [cfg.block_m, cfg.block_n]) if stored is not None else a_arg
    else:
        a_arg, b_arg, out_arg = h, w, out
    tiles = -(-n_rows // cfg.block_m) * -(-v_local // cfg.block_n)
    filler = out  # a tensor for each pointer the mode does not read
    k.head_matmul_kernel[(min(programs, tiles),)](
        a_arg,
        b_arg,
        out_arg,
        bias if bias is not None else filler,
        part if part is not None else filler,
        label if label is not None else filler,
        y if y is not None else filler,
        stats if stats is not None else filler,
        grad if grad is not None else filler,
        n_rows,
        v_local,
        k_dim,
        h.stride(0),
        w.stride(0),
        out.stride(0),
        vocab_start,
        v_local if vocab_size is None else vocab_size,
        IGNORE,
        LOG2E / temperature,
        MODE=mode_id,
        HAS_BIAS=bias is not None,
        USE_TMA=use_tma,
        GRAD_PER_ROW=grad is not None and grad.dim() == 1,
        IEEE=h.dtype == torch.float32 or _interpreting(h),
        UPCAST=_interpreting(h) and h.element_size() == 2,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        PROGRAMS=programs,
        FLATTEN=cfg.flatten,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )


def vocab_tiles(v_local: int, cfg: MatmulConfig, device: torch.device) -> int:
    """The partials' first dimension after a STATS matmul."""
    block_n = INTERPRETER_CONFIG.block_n if device.type == "cpu" else cfg.block_n
    return -(-v_local // block_n)


# -- the row kernels -------------------------------------------------------------------------------


def _ceil_to(x: int, step: int) -> int:
    return -(-x // step) * step


def _row_blocks(device: torch.device) -> tuple[int, int, int, int]:
    """(statistics tile, gradient tile, warps, programs aimed at) of the row kernels."""
    if device.type == "cpu":
        return 16, 32, 1, 16
    return 4096, 2048, 8, 4096


MAX_SPLITS = 64  # vocabulary splits of the statistics pass, at most


def stats_pass(z: Tensor, flat: Tensor) -> Tensor:
    """The statistics pass over stored logits ``z [M, V]``: its ``[splits, 2, M]`` partials,
    a view of the fp32 storage ``flat`` (``2 * MAX_SPLITS * M`` elements at least)."""
    n, v = z.shape
    block, _, warps, target = _row_blocks(z.device)
    splits = max(1, min(-(-target // max(n, 1)), -(-v // block), MAX_SPLITS))
    chunk = _ceil_to(-(-v // splits), block)
    part = flat[: splits * 2 * n].view(splits, 2, n)
    if n:
        _kernels().head_ce_stats_kernel[(n * splits,)](
            z, z.stride(0), part, n, v, splits, chunk, LOG2E, BLOCK=block, num_warps=warps
        )
    return part


def finish(
    part: Tensor,
    n_parts: int,
    y: Tensor,
    values: Tensor,
    stats: Tensor,
    *,
    z: Tensor | None = None,
    label: Tensor | None = None,
    vocab_start: int = 0,
    vocab_size: int,
    v_local: int,
) -> None:
    """Rows' statistics and cross entropy from their partials; the label's logit from the
    logits ``z`` or from ``label``."""
    n = y.shape[0]
    if n == 0:
        return
    cpu = y.device.type == "cpu"
    block = 16 if cpu else 32
    source = z if z is not None else label
    assert source is not None
    _kernels().head_ce_finish_kernel[(-(-n // block),)](
        part,
        n_parts,
        n,
        source,
        z.stride(0) if z is not None else 0,
        source,
        y,
        values,
        stats,
        v_local,
        vocab_start,
        vocab_size,
        IGNORE,
        LOG2E,
        LABEL_FROM_Z=z is not None,
        BLOCK_P=4 if cpu else 64,
        BLOCK_N=block,
        num_warps=1 if cpu else 4,
    )


def grad_pass(z: Tensor, y: Tensor, stats: Tensor, grad: Tensor, *, vocab_start: int = 0, vocab_size: int) -> None:
    """The logits gradient over ``z`` in place; ``grad``: one upstream value (0-dim) or one
    per row."""
    n, v = z.shape
    if n == 0 or v == 0:
        return
    _, block, warps, target = _row_blocks(z.device)
    splits = max(1, min(-(-target // n), -(-v // block)))
    chunk = _ceil_to(-(-v // splits), block)
    _kernels().head_ce_grad_kernel[(n * splits,)](
        z,
        z.stride(0),
        y,
        stats,
        grad,
        v,
        vocab_start,
        vocab_size,
        IGNORE,
        LOG2E,
        splits,
        chunk,
        GRAD_PER_ROW=grad.dim() == 1,
        BLOCK=block,
        num_warps=warps,
    )


# -- the variants ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """One arrangement of the chunk runner.

    ``stats``: ``pass`` (a statistics pass over the stored logits) or ``epilogue`` (the
    Triton matmul writes the partials); ``logits``: who computes them with ``pass``
    (``blas`` or ``triton``); ``buffers``: logits buffers of ``rows`` rows each, used in
    turn; ``group``: sub-chunks per buffer, each with its own logits matmul and loss
    kernels, ``dh``/``dW`` once per buffer; ``side_stream``: the loss kernels on a second
    stream; ``reduction``: ``mean`` (gradients in forward) or ``none`` (``epilogue`` only:
    the forward keeps statistics, the backward's matmul writes the gradient)."""

    name: str
    stats: str = "pass"
    logits: str = "blas"
    buffers: int = 1
    group: int = 1
    side_stream: bool = False
    reduction: str = "mean"
    note: str = ""

    @property
    def budget(self) -> int:
        return CHUNK_BYTES if self.buffers == 1 else TWO_BUFFER_BYTES


VARIANTS = {
    v.name: v
    for v in (
        Variant("chunks", note="today's arrangement re-built (control)"),
        Variant("stream", buffers=2, side_stream=True, note="(a) loss kernels on a 2nd stream, 2 buffers"),
        Variant("group", group=2, note="(b) dh/dW over 2 sub-chunks at once"),
        Variant("group_stream", group=2, side_stream=True, note="(a)+(b) at one buffer"),
        Variant("triton_logits", logits="triton", note="Triton matmul, plain epilogue, + stats pass"),
        Variant("epilogue", stats="epilogue", note="(c) softmax partials in the matmul's epilogue"),
        Variant("epilogue_stream", stats="epilogue", buffers=2, side_stream=True, note="(c)+(a)"),
        Variant("epilogue_group_stream", stats="epilogue", group=2, side_stream=True, note="(c)+(a)+(b)"),
        Variant("none_epilogue", stats="epilogue", reduction="none", note="none: stats-only fwd, grad epilogue bwd"),
    )
}


def rows_for(num_tokens: int, v_local: int, itemsize: int, budget: int, buffers: int = 1) -> int:
    """Rows per buffer: at most ``budget / buffers`` bytes of ``[rows, V_local]``, balanced
    over the chunks N needs, a multiple of 256, as ``vtp.Head`` sizes its one buffer."""
    most = budget // buffers // max(1, v_local * itemsize)
    if most < 256:
        return max(1, min(most, num_tokens))
    most -= most % 256
    chunks = -(-num_tokens // most)
    rows = -(-num_tokens // chunks)
    return max(1, min(most, -(-rows // 256) * 256, num_tokens))


def sub_rows(rows: int, group: int) -> int:
    """Rows of each of a buffer's ``group`` sub-chunks (a multiple of 128 where they can be)."""
    sub = -(-rows // group)
    return -(-sub // 128) * 128 if rows >= 128 * group else sub


class _Streams:
    """The main stream and, where asked on CUDA, a second one for the loss kernels."""

    def __init__(self, device: torch.device, side: bool) -> None:
        self.side = _side_stream(device) if side and device.type == "cuda" else None

    def to_side(self) -> None:
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream())

    def on_side(self):
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def mark(self):
        if self.side is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.side)
        return ev

    @staticmethod
    def wait(ev) -> None:
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def _upstream_of_mean(y: Tensor) -> Tensor:
    """1 / (labels not ignored), 0-dim fp32 on the device: what a plain backward of the mean
    sends each token."""
    return torch.reciprocal((y != IGNORE).sum().to(torch.float32))


def scalar_ce(
    variant: Variant, h: Tensor, w: Tensor, y: Tensor, cfg: MatmulConfig, rows: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(mean cross entropy, dh, dW)`` of ``h @ w.T`` by ``variant`` (gradients in the
    forward pass, for a plain backward of the mean)."""
    n, _ = h.shape
    v = w.shape[0]
    dev = h.device
    rows = rows or rows_for(n, v, w.element_size(), variant.budget, variant.buffers)
    sub = sub_rows(rows, variant.group)
    g = _upstream_of_mean(y)
    values = torch.empty(n, dtype=torch.float32, device=dev)
    stats = torch.empty(n, 2, dtype=torch.float32, device=dev)
    dh, dw = torch.empty_like(h), torch.empty_like(w)
    bufs = [torch.empty(rows, v, dtype=w.dtype, device=dev) for _ in range(variant.buffers)]
    epilogue = variant.stats == "epilogue"
    n_parts = vocab_tiles(v, cfg, dev) if epilogue else MAX_SPLITS
    # partials' storage per (buffer, sub-chunk): a slot is reused only after the loss kernels
    # that read it are done (the main stream waited for them before that buffer's dh/dW)
    slots = [
        [torch.empty(n_parts * 2 * sub, dtype=torch.float32, device=dev) for _ in range(variant.group)]
        for _ in range(variant.buffers)
    ]
    streams = _Streams(dev, variant.side_stream)
    units = []  # (chunk, sub-chunk, lo, hi, first row of the chunk): the logits matmuls in order
    for c, lo in enumerate(range(0, n, rows)):
        hi = min(lo + rows, n)
        for j, s_lo in enumerate(range(lo, hi, sub)):
            units.append((c, j, s_lo, min(s_lo + sub, hi), lo))
    done: list = [None] * len(units)
    issued = [False] * len(units)

    def issue(u: int) -> None:
        """The logits of unit u on the main stream, then its loss kernels (second stream)."""
        c, j, lo, hi, first = units[u]
        z = bufs[c % variant.buffers][lo - first : hi - first]
        flat = slots[c % variant.buffers][j]
        if epilogue:
            part = flat[: n_parts * 2 * (hi - lo)].view(n_parts, 2, hi - lo)
            matmul("stats", h[lo:hi], w, cfg, out=z, part=part)
        elif variant.logits == "triton":
            matmul("logits", h[lo:hi], w, cfg, out=z)
        else:
            torch.mm(h[lo:hi], w.t(), out=z)
        streams.to_side()
        with streams.on_side():
            if not epilogue:
                part = stats_pass(z, flat)
            finish(part, part.shape[0], y[lo:hi], values[lo:hi], stats[lo:hi], z=z, vocab_size=v, v_local=v)
            grad_pass(z, y[lo:hi], stats[lo:hi], g, vocab_size=v)
        done[u] = streams.mark()
        issued[u] = True

    issue(0)
    for u, (c, _, _, hi, first) in enumerate(units):
        nxt = u + 1
        last_of_chunk = nxt == len(units) or units[nxt][0] != c
        # the next unit's logits go before this one's wait where their rows are free: the
        # same buffer's next sub-chunk, or the other buffer (its dh/dW are issued already)
        if nxt < len(units) and not issued[nxt] and (not last_of_chunk or variant.buffers > 1):
            issue(nxt)
        if last_of_chunk:
            streams.wait(done[u])  # the second stream runs in order: every unit of this chunk is done
            dz = bufs[c % variant.buffers][: hi - first]
            torch.mm(dz, w, out=dh[first:hi])
            if first == 0:
                torch.mm(dz.t(), h[first:hi], out=dw)
            else:
                dw.addmm_(dz.t(), h[first:hi])
            if nxt < len(units) and not issued[nxt]:
                issue(nxt)
    return values.sum() * g, dh, dw


def none_ce(
    variant: Variant, h: Tensor, w: Tensor, y: Tensor, upstream: Tensor, cfg: MatmulConfig, rows: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(per-token cross entropy, dh, dW)`` for the per-token upstream gradient ``upstream``
    (known only in backward): the forward's matmul keeps each row's statistics and label
    logit only; the backward's matmul writes the logits gradient in its epilogue."""
    n, _ = h.shape
    v = w.shape[0]
    dev = h.device
    rows = rows or rows_for(n, v, w.element_size(), variant.budget)
    n_parts = vocab_tiles(v, cfg, dev)
    values = torch.empty(n, dtype=torch.float32, device=dev)
    stats = torch.empty(n, 2, dtype=torch.float32, device=dev)
    flat = torch.empty(n_parts * 2 * rows, dtype=torch.float32, device=dev)
    label = torch.zeros(rows, dtype=torch.float32, device=dev)
    for lo in range(0, n, rows):  # forward: no logits buffer
        hi = min(lo + rows, n)
        p = flat[: n_parts * 2 * (hi - lo)].view(n_parts, 2, hi - lo)
        lab = label[: hi - lo].zero_()
        matmul("stats_only", h[lo:hi], w, cfg, part=p, label=lab, y=y[lo:hi])
        finish(p, n_parts, y[lo:hi], values[lo:hi], stats[lo:hi], label=lab, vocab_size=v, v_local=v)
    del flat, label
    dh, dw = torch.empty_like(h), torch.empty_like(w)
    buf = torch.empty(rows, v, dtype=w.dtype, device=dev)
    grad = upstream.to(torch.float32).contiguous()
    for lo in range(0, n, rows):  # backward
        hi = min(lo + rows, n)
        dz = buf[: hi - lo]
        matmul("grad", h[lo:hi], w, cfg, out=dz, y=y[lo:hi], stats=stats[lo:hi], grad=grad[lo:hi])
        torch.mm(dz, w, out=dh[lo:hi])
        if lo == 0:
            torch.mm(dz.t(), h[lo:hi], out=dw)
        else:
            dw.addmm_(dz.t(), h[lo:hi])
    return values, dh, dw


def run_variant(
    variant: Variant,
    h: Tensor,
    w: Tensor,
    y: Tensor,
    cfg: MatmulConfig,
    upstream: Tensor | None = None,
    rows: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    if variant.reduction == "none":
        assert upstream is not None
        return none_ce(variant, h, w, y, upstream, cfg, rows)
    return scalar_ce(variant, h, w, y, cfg, rows)


# -- the product's arms ------------------------------------------------------------------------------


def product_arm(arm: str, h: Tensor, w: Tensor, y: Tensor, upstream: Tensor | None = None) -> Callable[[], tuple]:
    """``materialized``, ``fused`` (``vtp.Head``) or ``fused_none`` (``reduction="none"``,
    then ``(values * upstream).sum()``): forward + backward, returning (loss, dh, dW)."""
    import vtp_runtime as vtp

    backend = "triton"
    hg, wg = h.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def grads(loss):
        dh, dw = torch.autograd.grad(loss, (hg, wg))
        return loss.detach(), dh, dw

    if arm == "materialized":
        return lambda: grads(vtp.cross_entropy(hg @ wg.T, y, reduction="mean", backend=backend))
    if arm == "materialized_none":
        assert upstream is not None
        return lambda: grads((vtp.cross_entropy(hg @ wg.T, y, reduction="none", backend=backend) * upstream).sum())
    if arm == "fused":
        return lambda: grads(vtp.cross_entropy(vtp.Head(hg, wg), y, reduction="mean", backend=backend))
    if arm == "fused_none":
        assert upstream is not None
        return lambda: grads(
            (vtp.cross_entropy(vtp.Head(hg, wg), y, reduction="none", backend=backend) * upstream).sum()
        )
    raise ValueError(f"no arm {arm!r}")


def variant_arm(
    name: str, h: Tensor, w: Tensor, y: Tensor, cfg: MatmulConfig, upstream: Tensor, rows: int | None = None
) -> Callable:
    variant = VARIANTS[name]

    def run():
        values, dh, dw = run_variant(variant, h, w, y, cfg, upstream, rows)
        loss = (values * upstream).sum() if variant.reduction == "none" else values
        return loss, dh, dw

    return run


# -- checks, timing, memory ------------------------------------------------------------------------


def rel(a: Tensor, b: Tensor) -> float:
    """``||a - b|| / ||b||`` in fp32 (inf where a is not finite)."""
    a, b = a.float(), b.float()
    if not bool(torch.isfinite(a).all()):
        return math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def time_ms(fn: Callable, warmup: int, reps: int, device: str = "cuda") -> tuple[float, float]:
    """(median, spread) in ms: CUDA events around each call, synchronized, after ``warmup``
    calls (the wall clock on the CPU); the spread is the interquartile range."""
    for _ in range(warmup):
        fn()
    times = []
    if device != "cuda":
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        reps = 0
    else:
        torch.cuda.synchronize()
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return statistics.median(times), q[2] - q[0]


def temporaries_gib(fn: Callable, device: str = "cuda") -> float | None:
    """GiB allocated during one call beyond what was held before it and the gradients it
    returns (CUDA only)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    kept = sum(t.numel() * t.element_size() for t in out[1:])
    return (torch.cuda.max_memory_allocated() - base - kept) / 2**30


def inputs(n: int, hidden: int, v_local: int, device, dtype=torch.bfloat16, seed: int = 0):
    """As ``vtp-runtime bench --head``: ``h ~ N(0, 1)``, ``W ~ N(0, 1/H)``, uniform labels,
    and a per-token upstream gradient for ``reduction="none"`` (``U(0, 1) / N``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, device=device).to(dtype)
    w = (torch.randn(v_local, hidden, generator=g, device=device) * hidden**-0.5).to(dtype)
    y = torch.randint(0, v_local, (n,), generator=g, device=device)
    upstream = torch.rand(n, generator=g, device=device) / n
    return h, w, y, upstream


# -- the GPU run ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    shape: str
    arm: str
    ms: float | None = None
    spread_ms: float | None = None
    vs_mat: float | None = None
    tflops: float | None = None
    temp_gib: float | None = None
    err_loss: float | None = None
    err_dh: float | None = None
    err_dw: float | None = None
    error: str = ""


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def _fatal(exc: BaseException) -> bool:
    """A CUDA error poisons the context: nothing after it can be trusted."""
    text = str(exc)
    return "CUDA error" in text or "illegal" in text or "unspecified launch failure" in text


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def pick_config(configs, tp: int, args, log) -> tuple[MatmulConfig | None, list[dict]]:
    """Time each configuration's STATS matmul (and its plain one) on the TP's chunk shape
    against the BLAS; the fastest STATS configuration that compiles wins."""
    v = args.vocab // tp
    rows = args.rows or rows_for(args.tokens_for_pick, v, 2, CHUNK_BYTES)
    dev = args.device
    h, w, _, _ = inputs(rows, args.pick_hidden, v, dev, dtype=args.dtype)
    z = torch.empty(rows, v, dtype=h.dtype, device=dev)
    flop = 2.0 * rows * args.pick_hidden * v
    blas, _ = time_ms(lambda: torch.mm(h, w.t(), out=z), 3, args.reps, dev)
    results = [{"config": "blas", "logits_ms": blas, "logits_tflops": flop / blas / 1e9}]
    log(
        f"matmul configs, TP{tp} chunk {rows}x{v}x{args.pick_hidden}: "
        f"blas {blas:.3f} ms {flop / blas / 1e9:.0f} TFLOP/s"
    )
    best: tuple[float, MatmulConfig] | None = None
    ref = z.float()
    part = torch.empty(max(vocab_tiles(v, c, z.device) for c in configs), 2, rows, device=dev)
    for cfg in configs:
        entry: dict = {"config": cfg.name}
        try:
            t0 = time.perf_counter()
            zt = torch.empty_like(z)
            matmul("logits", h, w, cfg, out=zt)
            _sync(dev)
            entry["compile_s"] = time.perf_counter() - t0
            entry["err"] = rel(zt, ref)
            t_plain, _ = time_ms(lambda: matmul("logits", h, w, cfg, out=zt), 2, args.reps, dev)  # noqa: B023
            p = part[: vocab_tiles(v, cfg, z.device)]
            t_stats, _ = time_ms(lambda: matmul("stats", h, w, cfg, out=zt, part=p), 2, args.reps, dev)  # noqa: B023
            entry.update(
                logits_ms=t_plain,
                logits_tflops=flop / t_plain / 1e9,
                stats_ms=t_stats,
                stats_tflops=flop / t_stats / 1e9,
            )
            log(
                f"  {cfg.name:28s} plain {t_plain:.3f} ms {flop / t_plain / 1e9:4.0f}  stats {t_stats:.3f} ms "
                f"{flop / t_stats / 1e9:4.0f} TFLOP/s  err {entry['err']:.1e}  (compile {entry['compile_s']:.1f} s)"
            )
            if entry["err"] < 1e-2 and (best is None or t_stats < best[0]):
                best = (t_stats, cfg)
        except Exception as exc:  # a configuration that does not compile or run is reported, not fatal
            entry["error"] = _error(exc)
            log(f"  {cfg.name:28s} FAILED {entry['error']}")
            if _fatal(exc):
                raise
        results.append(entry)
    _sync(dev)
    return (best[1] if best else None), results


def check(arms: dict[str, Callable], ref_arm: str, shape: str, log, device: str) -> dict[str, tuple]:
    """Each arm's loss and gradients against the reference arm's (fp32 relative error)."""
    out: dict[str, tuple] = {}
    ref = arms[ref_arm]()
    for name, fn in arms.items():
        if name == ref_arm:
            continue
        try:
            got = fn()
            out[name] = tuple(rel(a, b) for a, b in zip(got, ref))
            log(f"  check {shape} {name:24s} loss {out[name][0]:.1e}  dh {out[name][1]:.1e}  dW {out[name][2]:.1e}")
        except Exception as exc:
            out[name] = (_error(exc),)
            log(f"  check {shape} {name:24s} FAILED {out[name][0]}")
            if _fatal(exc):
                raise
        _sync(device)
    del ref
    return out


def run_shape(n: int, hidden: int, tp: int, args, cfg: MatmulConfig | None, log) -> list[Row]:
    v = args.vocab // tp
    shape = f"N={n} H={hidden} TP{tp}"
    dev = args.device
    h, w, y, upstream = inputs(n, hidden, v, dev, dtype=args.dtype, seed=n + tp)
    mean_up = torch.full_like(upstream, 1.0 / n)
    arms: dict[str, Callable] = {}
    for name in ("materialized", "fused"):
        arms[name] = product_arm(name, h, w, y)
    if "none" in args.product:
        arms["fused_none"] = product_arm("fused_none", h, w, y, upstream)
    names = [x for x in args.variants if cfg is not None or _blas_only(VARIANTS[x])]
    for name in names:
        up = upstream if VARIANTS[name].reduction == "none" else mean_up
        arms[name] = variant_arm(name, h, w, y, cfg or MatmulConfig(), up, args.rows or None)
    rows: dict[str, Row] = {name: Row(shape, name) for name in arms}
    for name in args.variants:
        if name not in arms:
            rows[name] = Row(shape, name, error="no Triton matmul configuration compiled")
    if args.check:
        mean_arms = {k: f for k, f in arms.items() if not k.endswith("none") and not k.startswith("none")}
        for name, err in check(mean_arms, "materialized", shape, log, dev).items():
            _put_errors(rows[name], err)
        none_arms = {k: f for k, f in arms.items() if k.endswith("none") or k.startswith("none")}
        if none_arms:
            none_arms = {"materialized_none": product_arm("materialized_none", h, w, y, upstream), **none_arms}
            for name, err in check(none_arms, "materialized_none", shape, log, dev).items():
                _put_errors(rows[name], err)
    flop = 6.0 * n * hidden * v
    for name, fn in arms.items():
        row = rows[name]
        try:
            row.ms, row.spread_ms = time_ms(fn, args.warmup, args.reps, dev)
            row.tflops = flop / row.ms / 1e9
            row.temp_gib = temporaries_gib(fn, dev)
        except Exception as exc:
            row.error = row.error or _error(exc)
            if _fatal(exc):
                raise
        _sync(dev)
        log(f"  time  {shape} {name:24s} {_fmt(row.ms, '8.3f')} ms  {_fmt(row.tflops, '4.0f')} TFLOP/s {row.error}")
    mat = rows["materialized"].ms
    for row in rows.values():
        if row.ms and mat:
            row.vs_mat = row.ms / mat
    return list(rows.values())


def _blas_only(variant: Variant) -> bool:
    return variant.logits == "blas" and variant.stats == "pass"


def _put_errors(row: Row, err: tuple) -> None:
    if len(err) == 1:
        row.error = str(err[0])
    else:
        row.err_loss, row.err_dh, row.err_dw = err


def _fmt(x, spec: str) -> str:
    return "-".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)


def table(rows: list[Row]) -> str:
    head = (
        f"{'shape':18s} {'arm':22s} {'ms':>8s} {'iqr':>5s} {'x mat':>6s} {'TFLOP/s':>7s} {'temp GiB':>8s} "
        f"{'err dh':>7s} {'err dW':>7s}  note"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.shape:18s} {r.arm:22s} {_fmt(r.ms, '8.2f')} {_fmt(r.spread_ms, '5.2f')} {_fmt(r.vs_mat, '6.3f')} "
            f"{_fmt(r.tflops, '7.0f')} {_fmt(r.temp_gib, '8.3f')} {_fmt(r.err_dh, '7.1e')} {_fmt(r.err_dw, '7.1e')}"
            f"  {r.error}"
        )
    return "\n".join(lines)


def run_main(args) -> int:
    import triton

    start = time.perf_counter()
    log_lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        log_lines.append(line)

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton's interpreter)"
    log(
        f"torch {torch.__version__} triton {triton.__version__} {device} V={args.vocab} {args.dtype}; "
        f"variants {','.join(args.variants)}"
    )
    configs = [c for c in GPU_CONFIGS if c.name in args.configs] if args.configs else list(GPU_CONFIGS)
    if args.quick or args.device != "cuda":
        configs = configs[:1]
    report: dict = {"argv": sys.argv, "device": device, "torch": torch.__version__, "triton": triton.__version__}
    rows: list[Row] = []
    paths = [args.json, os.path.join(os.environ["OUT"], "head_variants.json") if os.environ.get("OUT") else ""]

    def save() -> None:  # after every shape: a run cut short keeps what it measured
        report["rows"] = [dataclasses.asdict(r) for r in rows]
        report["log"] = log_lines
        report["wall_s"] = time.perf_counter() - start
        for path in paths:
            if path:
                Path(path).write_text(json.dumps(report, indent=1))

    try:
        needs_triton = not all(_blas_only(VARIANTS[v]) for v in args.variants)
        cfg, report["configs"] = pick_config(configs, 1, args, log) if needs_triton else (None, [])
        report["config"] = cfg.name if cfg else None
        log(f"matmul configuration: {cfg.name if cfg else 'none'} ({time.perf_counter() - start:.0f} s)")
        for n, hidden, tp in args.shapes:
            if time.perf_counter() - start > args.budget_s:
                log(f"skipped N={n} H={hidden} TP{tp}: past --budget-s {args.budget_s:.0f}")
                continue
            rows += run_shape(n, hidden, tp, args, cfg, log)
            log(f"  ({time.perf_counter() - start:.0f} s)")
            save()
    except Exception as exc:  # a CUDA error: report what was measured
        log(f"stopped: {_error(exc)}")
        report["stopped"] = _error(exc)
    save()
    print()
    print(table(rows))
    print(f"config {report.get('config')}; wall {report['wall_s']:.0f} s")
    return 1 if "stopped" in report else 0


def compile_main(args) -> int:
    """Compile every kernel and matmul configuration for sm_90 without a GPU (run without
    TRITON_INTERPRET): failures, registers and spills (ptxas), shared memory, and whether the
    matmul's PTX has the Hopper instructions it is meant to use (wgmma; TMA loads)."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = _kernels()
    target = GPUTarget("cuda", 90, 32)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    ints = {"n_rows", "v_local", "k_dim", "stride_h", "stride_w", "stride_out", "vocab_start", "vocab_size"}
    ints |= {"ignore_index", "stride_z", "splits", "chunk", "n_parts"}
    pointers = {"idx_ptr": "*i64", "bias_ptr": "*bf16", "z_ptr": "*bf16"}

    def signature(fn, const, descs):
        sig = {}
        for name in fn.arg_names:
            if name in const:
                sig[name] = "constexpr"
            elif name in descs:
                sig[name] = descs[name]
            elif name in ints:
                sig[name] = "i32"
            elif name == "k2":
                sig[name] = "fp32"
            else:
                sig[name] = pointers.get(name, "*fp32")
        return sig

    jobs = []
    for cfg in GPU_CONFIGS:
        for mode in (0, 1, 2, 3):
            for tma in (True, False):
                const = dict(
                    MODE=mode,
                    HAS_BIAS=False,
                    USE_TMA=tma,
                    GRAD_PER_ROW=True,
                    IEEE=False,
                    UPCAST=False,
                    BLOCK_M=cfg.block_m,
                    BLOCK_N=cfg.block_n,
                    BLOCK_K=cfg.block_k,
                    GROUP_M=cfg.group_m,
                    PROGRAMS=132,
                    FLATTEN=cfg.flatten,
                )
                if tma:
                    descs = {
                        "h": f"tensordesc<bf16[{cfg.block_m},{cfg.block_k}]>",
                        "w": f"tensordesc<bf16[{cfg.block_n},{cfg.block_k}]>",
                        "out": f"tensordesc<bf16[{cfg.block_m},{cfg.block_n}]>",
                    }
                else:
                    descs = {"h": "*bf16", "w": "*bf16", "out": "*bf16"}
                label = f"matmul {cfg.name} mode {mode} {'tma' if tma else 'ptr'}"
                jobs.append((label, k.head_matmul_kernel, const, descs, cfg.warps, cfg.stages))
    jobs.append(("stats pass", k.head_ce_stats_kernel, dict(BLOCK=4096), {}, 8, 3))
    jobs.append(("finish", k.head_ce_finish_kernel, dict(LABEL_FROM_Z=True, BLOCK_P=64, BLOCK_N=32), {}, 4, 3))
    jobs.append(("grad pass", k.head_ce_grad_kernel, dict(GRAD_PER_ROW=False, BLOCK=2048), {}, 8, 3))
    failed = 0
    for label, fn, const, descs, warps, stages in jobs:
        try:
            src = ASTSource(fn=fn, signature=signature(fn, const, descs), constexprs=const)
            compiled = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
            ptx = compiled.asm["ptx"]
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(ptx)
            res = subprocess.run(
                [ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"], capture_output=True, text=True
            )
            regs = re.search(r"Used (\d+) registers", res.stderr)
            spills = re.search(r"(\d+) bytes spill stores", res.stderr)
            print(
                f"ok   {label:44s} regs {regs.group(1) if regs else '?':>3s} spills "
                f"{spills.group(1) if spills else '?':>4s} shared {compiled.metadata.shared:6d}"
                f"  wgmma {'wgmma' in ptx}  tma {'cp.async.bulk.tensor' in ptx}"
            )
        except Exception as exc:  # every failure, not just the first
            failed += 1
            print(f"FAIL {label}: {_error(exc)}")
    print(f"{len(jobs) - failed}/{len(jobs)} compiled")
    return 1 if failed else 0


QUICK_VARIANTS = ("chunks", "stream", "group_stream", "epilogue", "epilogue_stream", "none_epilogue")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one shape (N=8192, TP1), one config, fewer reps (~1 min)")
    p.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--compile-check", action="store_true", help="compile every kernel for sm_90, no GPU needed")
    p.add_argument("--shapes", default="8192:4096:1,8192:4096:2,8192:4096:4,2048:4096:1,32768:4096:1,8192:1024:1")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--product", default="none", help="'none' to time today's fused head with reduction='none' too")
    p.add_argument("--configs", default="", help="matmul configurations by name (default: all)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", type=int, default=0, help="rows per logits buffer (default: the budget's)")
    p.add_argument("--no-check", dest="check", action="store_false")
    p.add_argument("--json", default="")
    p.add_argument("--budget-s", type=float, default=240.0, help="start no new shape past this many seconds")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if args.compile_check:
        return compile_main(args)
    args.device, args.dtype = "cuda", torch.bfloat16
    args.tokens_for_pick, args.pick_hidden = 8192, 4096
    if args.cpu:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--cpu runs the kernels under Triton's interpreter: set TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        # tiny shapes, fp32: several chunks, tiles and persistent rounds each
        args.device, args.dtype = "cpu", torch.float32
        args.shapes, args.vocab = "40:32:1,40:32:2", 208
        args.tokens_for_pick, args.pick_hidden = 40, 32
        args.reps, args.warmup = 1, 0
        args.rows = args.rows or 16
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    if args.quick:
        args.shapes = "8192:4096:1" if args.device == "cuda" else args.shapes
        args.reps = min(args.reps, 5)
        args.variants = [v for v in args.variants if v in QUICK_VARIANTS]
    args.shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",") if s]
    args.configs = [c for c in args.configs.split(",") if c]
    return run_main(args)


if __name__ == "__main__":
    sys.exit(main())
