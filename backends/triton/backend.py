"""The ``triton`` backend: launches the kernels of ``kernels.py`` for every op.

Per call, at most three kernel launches in the forward pass and one in the backward, and no
host synchronization (capturable in a CUDA graph):

==============  =====================================================  ==========================
op              forward                                                backward
==============  =====================================================  ==========================
CE / logprobs   stats (1 read) -> gather partials -> finish             1 read, 1 write
/ entropy
KL              stats of both (1 read each) -> gather -> finish         1 read each, 1-2 writes
JSD             stats (1 read each) -> gather -> divergence (1 read     1 read each, 1-2 writes
                each, merges the stats itself) -> gather -> finish
==============  =====================================================  ==========================

"gather" is one ``all_gather_stack`` of the ``[splits, N, F]`` fp32 partials (skipped at
TP=1); the number of collectives never depends on V_local. Everything kept for backward is
the inputs plus O(N) fp32 statistics.

``TritonBackend`` takes a ``LaunchConfig`` (tile sizes, warps, programs per pass); the Intel
XPU backend subclasses it with its own name, probe, device types and configuration and
launches the very same kernels. Importing this module never imports triton.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from vtp_runtime.backend import LOW_DTYPES, Backend, Call, OpCapability, meets_layout
from vtp_runtime.comm import all_gather_stack, group_size
from vtp_runtime.ops import kl_direction

LOG2E = 1.4426950408889634

# op kinds, as the kernels number them (kernels.CE, ... are the constexpr twins)
_CE, _LOGPROBS, _ENTROPY = 0, 1, 2
_KL, _JSD = 0, 1


@dataclass(frozen=True)
class LaunchConfig:
    """How the kernels are launched. Tile sizes are powers of two.

    ``target_programs`` sets the vocabulary splits of the forward passes: each row's local
    vocabulary is cut into ``ceil(target_programs / N)`` chunks (at most ``max_splits``, at
    most one per tile), so few tokens on a small shard still fill the device. It must be the
    same on every rank (the partials of all ranks are gathered into one tensor), which is why
    it is a fixed number and not derived from the local device.
    """

    block_stats: int = 4096  # statistics pass tile (columns)
    warps_stats: int = 8
    block_div: int = 2048  # JSD divergence pass tile
    warps_div: int = 8
    block_bwd: int = 2048  # backward tile
    warps_bwd: int = 8
    target_programs: int = 1024  # forward passes: aim for about this many (row, split) programs
    max_splits: int = 64
    bwd_target_programs: int = 4096  # backward: same idea, local (no collective depends on it)
    block_rows: int = 128  # finishing kernels: rows per program
    warps_finish: int = 4
    # JSD: the hardware lg2.approx through inline PTX. NVIDIA only, so off unless a config
    # asks for it (CUDA_CONFIG does); other targets get Triton's portable tl.log2.
    fast_log2: bool = False
    # statistics passes: issue tile i+1's load before reducing tile i. Measured 3-8% slower on
    # the H200 (benchmarks/NOTES.md): occupancy already hides the latency. Off by default.
    prefetch: bool = False


CUDA_CONFIG = LaunchConfig(fast_log2=True)
# Triton's interpreter runs programs one by one in numpy: small tiles keep the tests fast
# and make the small test shapes cover several tiles and several splits per row.
INTERPRETER_CONFIG = LaunchConfig(block_stats=16, warps_stats=1, block_div=16, warps_div=1, block_bwd=32,
                                  warps_bwd=1, target_programs=16, max_splits=4, bwd_target_programs=16,
                                  block_rows=16, warps_finish=1)


def capabilities(device_types: frozenset[str]) -> dict[str, OpCapability]:
    """Every op with every feature it has, on ``device_types``, in fp32/bf16/fp16."""
    def cap(*features: str) -> OpCapability:
        return OpCapability(device_types=device_types, dtypes=LOW_DTYPES, features=frozenset(features))

    return {
        "cross_entropy": cap("label_smoothing", "z_loss", "temperature"),
        "logprobs": cap("topk", "temperature"),
        "entropy": cap("mask", "temperature"),
        "kl": cap("mask", "temperature", "reverse", "teacher_grad"),
        "jsd": cap("mask", "temperature", "teacher_grad"),
    }


def _kernels():
    from . import kernels  # imported on first use: importing this module never needs triton
    return kernels


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _geometry(z: torch.Tensor) -> tuple[int, int, int]:
    """``(rows_b, stride_a, stride_b)``: row r starts at ``(r // rows_b) * stride_a + (r % rows_b) * stride_b``.
    The kernels read columns at unit stride: anything else is refused here, never misread."""
    if not meets_layout(z, TritonBackend.input_layout):
        raise RuntimeError(f"triton kernels need inputs [N, V_local] or [A, B, V_local] with stride 1 on the "
                           f"vocabulary dim; got shape {tuple(z.shape)} with strides {z.stride()}. The core "
                           f"copies inputs into the declared input_layout; callers of forward() must too.")
    if z.dim() == 2:
        return max(z.shape[0], 1), 0, z.stride(0)
    a, b, _ = z.shape
    return max(b, 1), z.stride(0), z.stride(1)


def _splits(n: int, v_per_rank: int, block: int, target: int, max_splits: int) -> int:
    tiles = max(1, _cdiv(v_per_rank, block))
    return max(1, min(_cdiv(target, max(n, 1)), tiles, max_splits))


def _chunk(v_local: int, splits: int, block: int) -> int:
    return max(block, _cdiv(_cdiv(v_local, splits), block) * block)


def _gather(part: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    """Every rank's ``[S, N, F]`` partials as one ``[W * S, N, F]`` tensor (one collective)."""
    if group_size(group) == 1:
        return part, part.shape[0]
    stacked = all_gather_stack(part, group)
    return stacked.view(-1, *part.shape[1:]), stacked.shape[0] * part.shape[0]


class TritonBackend(Backend):
    """Fused vocabulary-parallel kernels. Subclass with another ``name``, ``priority``,
    ``ops`` (device types), ``probe`` and ``default_config`` to launch them elsewhere."""

    name = "triton"
    priority = 20
    # a causal-shift view logits[:, :-1] reaches the kernels uncopied; a vocabulary stride
    # other than 1 is copied by the core (strided column loads would not coalesce anyway)
    input_layout = "unit_vocab_stride_3d"
    ops = capabilities(frozenset({"cuda", "cpu"}))

    def __init__(self, config: LaunchConfig | None = None) -> None:
        self._config = config

    # -- environment -------------------------------------------------------------------
    def probe(self, device_type: str) -> list[str]:
        try:
            import triton  # noqa: F401
        except Exception as exc:  # ImportError, or a broken install
            return [f"triton is not importable ({type(exc).__name__}: {exc}); pip install triton"]
        if device_type == "cpu":
            if os.environ.get("TRITON_INTERPRET") != "1":
                return ["CPU tensors run only under Triton's interpreter: set TRITON_INTERPRET=1 "
                        "before importing triton (meant for tests; it is slow)"]
            return []
        if device_type == "cuda":
            if not torch.cuda.is_available():
                return ["torch.cuda.is_available() is False: no CUDA device or driver"]
            return []
        return [f"device type {device_type!r} is not handled by this backend"]

    def config_for(self, device: torch.device) -> LaunchConfig:
        if self._config is not None:
            return self._config
        if device.type == "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
            return INTERPRETER_CONFIG
        return CUDA_CONFIG

    # -- forward -----------------------------------------------------------------------
    def forward(self, call, inputs, index, mask):
        if call.op in ("cross_entropy", "logprobs", "entropy"):
            return self._forward1(call, inputs[0], index, mask)
        reverse = kl_direction(call.op, call.options)
        if reverse is not None:
            return self._forward_kl(call, inputs, mask, reverse)
        return self._forward_jsd(call, inputs, mask, call.options["beta"])

    def backward(self, call, saved, grad):
        if call.op in ("cross_entropy", "logprobs", "entropy"):
            return self._backward1(call, saved, grad)
        reverse = kl_direction(call.op, call.options)
        if reverse is not None:
            return self._backward2(call, saved, grad, _KL, reverse, 0.5)
        return self._backward2(call, saved, grad, _JSD, False, call.options["beta"])

    def _forward1(self, call: Call, z: torch.Tensor, index, mask):
        op, opts = call.op, call.options
        kind = {"cross_entropy": _CE, "logprobs": _LOGPROBS, "entropy": _ENTROPY}[op]
        n, v_local = _num_rows(z), z.shape[-1]
        dev = z.device
        n_idx = 0
        if kind == _CE:
            idx = index.contiguous()
            n_idx = 1
        elif kind == _LOGPROBS:
            idx = (index if call.topk else index[:, None]).contiguous()
            n_idx = idx.shape[1]
        else:
            idx = None
        keep = mask.contiguous().view(torch.uint8) if mask is not None else None
        n_fields = {_CE: 5, _LOGPROBS: 2 + n_idx, _ENTROPY: 3}[kind]
        n_stats = 3 if kind == _ENTROPY else 2  # anchor, log2 s (, H)
        val_shape = (n, n_idx) if (kind == _LOGPROBS and call.topk) else (n,)
        values = torch.empty(val_shape, dtype=torch.float32, device=dev)
        stats = torch.empty((n, n_stats), dtype=torch.float32, device=dev)
        saved = (z,) + ((idx,) if idx is not None else ()) + (stats,) + ((keep,) if keep is not None else ())
        if n == 0:
            return values, saved
        k = _kernels()
        cfg = self.config_for(dev)
        tp = call.request.tp_size
        splits = _splits(n, _cdiv(call.vocab_size, tp), cfg.block_stats, cfg.target_programs, cfg.max_splits)
        chunk = _chunk(v_local, splits, cfg.block_stats)
        part = torch.empty((splits, n, n_fields), dtype=torch.float32, device=dev)
        smooth = kind == _CE and opts["label_smoothing"] != 0.0
        zloss = kind == _CE and opts["z_loss"] != 0.0
        ignore = int(opts.get("ignore_index", -100))
        k2 = LOG2E / opts["temperature"]
        dummy = values
        rows_b, s_a, s_b = _geometry(z)
        k.stats1_kernel[(n * splits,)](
            z, rows_b, s_a, s_b, idx if idx is not None else dummy, n_idx, keep if keep is not None else dummy,
            part, n, v_local, call.vocab_start, splits, chunk, k2, ignore,
            KIND=kind, SMOOTH=smooth, HAS_KEEP=keep is not None, PREFETCH=cfg.prefetch, BLOCK=cfg.block_stats,
            num_warps=cfg.warps_stats)
        part, n_parts = _gather(part, call.group)
        k.finish1_kernel[(_cdiv(n, cfg.block_rows),)](
            part, n_parts, n, idx if idx is not None else dummy, n_idx, keep if keep is not None else dummy,
            values, stats, call.vocab_size, k2, ignore, float(opts.get("label_smoothing", 0.0)),
            float(opts.get("z_loss", 0.0)),
            KIND=kind, SMOOTH=smooth, ZLOSS=zloss, HAS_KEEP=keep is not None, BLOCK_N=cfg.block_rows,
            num_warps=cfg.warps_finish)
        return values, saved

    def _forward_kl(self, call: Call, inputs, mask, reverse: bool):
        student, teacher = inputs
        a, b = (student, teacher) if reverse else (teacher, student)
        n, v_local = _num_rows(a), a.shape[-1]
        dev = a.device
        keep = mask.contiguous().view(torch.uint8) if mask is not None else None
        values = torch.empty((n,), dtype=torch.float32, device=dev)
        stats = torch.empty((n, 5), dtype=torch.float32, device=dev)  # a_a, log2 s_a, a_b, log2 s_b, KL
        saved = (student, teacher, stats) + ((keep,) if keep is not None else ())
        if n == 0:
            return values, saved
        k = _kernels()
        cfg = self.config_for(dev)
        splits = _splits(n, _cdiv(call.vocab_size, call.request.tp_size), cfg.block_stats,
                         cfg.target_programs, cfg.max_splits)
        chunk = _chunk(v_local, splits, cfg.block_stats)
        part = torch.empty((splits, n, 5), dtype=torch.float32, device=dev)
        rows_b, a_a, a_b = _geometry(a)
        _, b_a, b_b = _geometry(b)
        k.stats2_kernel[(n * splits,)](
            a, b, rows_b, a_a, a_b, b_a, b_b, keep if keep is not None else values, part,
            n, v_local, splits, chunk, LOG2E / call.options["temperature"],
            WITH_KL=True, HAS_KEEP=keep is not None, PREFETCH=cfg.prefetch, BLOCK=cfg.block_stats,
            num_warps=cfg.warps_stats)
        part, n_parts = _gather(part, call.group)
        k.finish2_kernel[(_cdiv(n, cfg.block_rows),)](
            part, n_parts, n, keep if keep is not None else values, values, stats,
            LOG2E / call.options["temperature"], 0.0,
            KIND=_KL, HAS_KEEP=keep is not None, BLOCK_N=cfg.block_rows, num_warps=cfg.warps_finish)
        return values, saved

    def _forward_jsd(self, call: Call, inputs, mask, beta: float):
        student, teacher = inputs
        n, v_local = _num_rows(student), student.shape[-1]
        dev = student.device
        keep = mask.contiguous().view(torch.uint8) if mask is not None else None
        values = torch.empty((n,), dtype=torch.float32, device=dev)
        stats = torch.empty((n, 6), dtype=torch.float32, device=dev)  # a_s, log2 s_s, a_t, log2 s_t, KL_s, KL_t
        saved = (student, teacher, stats) + ((keep,) if keep is not None else ())
        if n == 0:
            return values, saved
        k = _kernels()
        cfg = self.config_for(dev)
        v_per_rank = _cdiv(call.vocab_size, call.request.tp_size)
        k2 = LOG2E / call.options["temperature"]
        keep_arg = keep if keep is not None else values
        rows_b, s_a, s_b = _geometry(student)
        _, t_a, t_b = _geometry(teacher)
        splits = _splits(n, v_per_rank, cfg.block_stats, cfg.target_programs, cfg.max_splits)
        part = torch.empty((splits, n, 4), dtype=torch.float32, device=dev)
        k.stats2_kernel[(n * splits,)](
            student, teacher, rows_b, s_a, s_b, t_a, t_b, keep_arg, part,
            n, v_local, splits, _chunk(v_local, splits, cfg.block_stats), k2,
            WITH_KL=False, HAS_KEEP=keep is not None, PREFETCH=cfg.prefetch, BLOCK=cfg.block_stats,
            num_warps=cfg.warps_stats)
        part, n_parts = _gather(part, call.group)
        div_splits = _splits(n, v_per_rank, cfg.block_div, cfg.target_programs, cfg.max_splits)
        part2 = torch.empty((div_splits, n, 2), dtype=torch.float32, device=dev)
        k.jsd_div_kernel[(n * div_splits,)](
            student, teacher, rows_b, s_a, s_b, t_a, t_b, keep_arg, part, n_parts, part2, stats,
            n, v_local, div_splits, _chunk(v_local, div_splits, cfg.block_div), k2,
            beta,
            HAS_KEEP=keep is not None, FAST_LOG2=cfg.fast_log2, BLOCK=cfg.block_div, num_warps=cfg.warps_div)
        part2, n_parts2 = _gather(part2, call.group)
        k.finish2_kernel[(_cdiv(n, cfg.block_rows),)](
            part2, n_parts2, n, keep_arg, values, stats, k2, beta,
            KIND=_JSD, HAS_KEEP=keep is not None, BLOCK_N=cfg.block_rows, num_warps=cfg.warps_finish)
        return values, saved

    # -- backward ----------------------------------------------------------------------
    def _bwd_splits(self, cfg: LaunchConfig, n: int, v_local: int) -> tuple[int, int]:
        tiles = max(1, _cdiv(v_local, cfg.block_bwd))
        splits = max(1, min(_cdiv(cfg.bwd_target_programs, max(n, 1)), tiles))
        return splits, _chunk(v_local, splits, cfg.block_bwd)

    def _backward1(self, call: Call, saved, grad):
        op, opts = call.op, call.options
        kind = {"cross_entropy": _CE, "logprobs": _LOGPROBS, "entropy": _ENTROPY}[op]
        z = saved[0]
        if kind == _ENTROPY:
            idx, stats = None, saved[1]
            keep = saved[2] if len(saved) > 2 else None
        else:
            idx, stats, keep = saved[1], saved[2], None
        if not call.needs_grad[0]:
            return (None,)
        n, v_local = _num_rows(z), z.shape[-1]
        dz = torch.empty(z.shape, dtype=z.dtype, device=z.device)
        if n == 0 or v_local == 0:
            return (dz,)
        k = _kernels()
        cfg = self.config_for(z.device)
        splits, chunk = self._bwd_splits(cfg, n, v_local)
        rows_b, s_a, s_b = _geometry(z)
        grad = grad.contiguous()
        k.backward1_kernel[(n * splits,)](
            z, rows_b, s_a, s_b, dz, grad, idx if idx is not None else stats, 0 if idx is None else (1 if idx.dim() == 1 else idx.shape[1]),
            keep if keep is not None else stats, stats, v_local, call.vocab_start, call.vocab_size,
            splits, chunk, LOG2E / opts["temperature"], 1.0 / opts["temperature"],
            int(opts.get("ignore_index", -100)), float(opts.get("label_smoothing", 0.0)),
            float(opts.get("z_loss", 0.0)),
            KIND=kind, SMOOTH=kind == _CE and opts["label_smoothing"] != 0.0,
            ZLOSS=kind == _CE and opts["z_loss"] != 0.0, HAS_KEEP=keep is not None, BLOCK=cfg.block_bwd,
            num_warps=cfg.warps_bwd)
        return (dz,)

    def _backward2(self, call: Call, saved, grad, kind: int, reverse: bool, beta: float):
        student, teacher, stats = saved[:3]
        keep = saved[3] if len(saved) > 3 else None
        need_s, need_t = call.needs_grad
        # KL(A || B): forward A = teacher, reverse A = student; JSD: a = student, b = teacher
        if kind == _KL and not reverse:
            a, b, need_a, need_b = teacher, student, need_t, need_s
        else:
            a, b, need_a, need_b = student, teacher, need_s, need_t
        da = torch.empty(a.shape, dtype=a.dtype, device=a.device) if need_a else None
        db = torch.empty(b.shape, dtype=b.dtype, device=b.device) if need_b else None
        n, v_local = _num_rows(a), a.shape[-1]
        if (need_a or need_b) and n > 0 and v_local > 0:
            k = _kernels()
            cfg = self.config_for(a.device)
            splits, chunk = self._bwd_splits(cfg, n, v_local)
            rows_b, a_a, a_b = _geometry(a)
            _, b_a, b_b = _geometry(b)
            k.backward2_kernel[(n * splits,)](
                a, b, rows_b, a_a, a_b, b_a, b_b, da if need_a else db, db if need_b else da,
                grad.contiguous(), keep if keep is not None else stats, stats, v_local, splits, chunk,
                LOG2E / call.options["temperature"], 1.0 / call.options["temperature"], beta,
                1.0 - beta, beta,
                KIND=kind, NEED_A=need_a, NEED_B=need_b, HAS_KEEP=keep is not None,
                FAST_LOG2=cfg.fast_log2 and kind == _JSD, BLOCK=cfg.block_bwd,
                num_warps=cfg.warps_bwd)
        if kind == _KL and not reverse:
            return db, da
        return da, db


def _num_rows(z: torch.Tensor) -> int:
    return z.shape[0] * z.shape[1] if z.dim() == 3 else z.shape[0]
