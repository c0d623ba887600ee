"""The ``triton`` backend: launches the kernels of ``kernels.py`` for every op.

Per call, at most three kernel launches in the forward pass and one in the backward, and no
host synchronization (capturable in a CUDA graph):

==============  =====================================================  ==========================
op              forward                                                backward
==============  =====================================================  ==========================
CE / logprobs   stats (1 read) -> gather partials -> finish             1 read, 1 write
/ entropy       (log-probs with return_entropy: the same passes)
KL              stats of both (1 read each) -> gather -> finish         1 read each, 1-2 writes
JSD             stats (1 read each) -> gather -> divergence (1 read     1 read each, 1-2 writes
                each, merges the stats itself) -> gather -> finish
==============  =====================================================  ==========================

"gather" is one ``all_gather_stack`` of the ``[splits, N, F]`` fp32 partials (skipped at
TP=1); the number of collectives never depends on V_local. At TP=1 there is nothing to
gather and no finishing launch: a row's last program to store its partials merges them (an
arrival counter per row), and a row that is not split is finished by its one program. A
``sum`` or ``mean`` (``Reduces``) is made by the last program to finish a row, and backward
reads its 0-dim upstream gradient on the device. Everything kept for backward is
the inputs plus O(N) fp32 statistics.

``TritonBackend`` takes a ``LaunchConfig`` (tile sizes, warps, programs per pass); the Intel
XPU backend subclasses it with its own name, probe, device types and configuration and
launches the very same kernels. Kernels are launched with keyword arguments, named as in
``kernels.py``; the sizes of the partials and statistics it allocates come from
``fields.py``, which the kernels read too. A loss call's forward and backward each have a
plan per signature (``call_plans``, at most ``MAX_CALL_PLANS``): what the call allocates and
its launches as ``launch.Bound``, every argument fixed but the call's tensors, made once, so
a repeated call builds no arguments. Importing this module never imports triton.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vtp_runtime import env
from vtp_runtime.backend import (
    LOW_DTYPES,
    Call,
    Compiles,
    HeadSupport,
    OpCapability,
    Reduces,
    SavedState,
    TakesHead,
    meets_layout,
)
from vtp_runtime.comm import all_gather_stack, group_size
from vtp_runtime.ops import LOSSES, OPS, kl_direction

from . import fields, head_gemm, source
from .config import CUDA_CONFIG, INTERPRETER_CONFIG, LaunchConfig, cdiv, split_chunk, vocab_splits
from .launch import Bound, launch

LOG2E = 1.4426950408889634
_ONE_INPUT_KIND = {"cross_entropy": fields.CE, "logprobs": fields.LOGPROBS, "entropy": fields.ENTROPY}


@dataclass
class OneInputState(SavedState):
    """cross_entropy, logprobs, entropy: the logits, their index and mask, O(N) statistics."""

    logits: torch.Tensor  # [N, V_local], or the [A, B, V_local] strided view the kernels read
    index: torch.Tensor | None  # int64 labels [N] or logprobs' index [N, k]; None for entropy
    stats: torch.Tensor  # fp32 [N, 2]: anchor, log2 sum (entropy, logprobs with return_entropy [N, 3]: and H)
    keep: torch.Tensor | None  # uint8 [N] (entropy with a mask), else None
    scratch: torch.Tensor | None = None  # int32, a reduced call's (fields.R_COUNT: a mean's count)

    def statistics(self) -> torch.Tensor:
        return self.stats

    @classmethod
    def from_statistics(cls, call, inputs, index, mask, statistics):
        return cls(inputs[0], _index_arg(call, index), statistics, _keep(mask))


@dataclass
class PairState(SavedState):
    """kl and jsd: both inputs, the mask, O(N) statistics."""

    student: torch.Tensor
    teacher: torch.Tensor
    stats: torch.Tensor  # fp32, KL [N, 5]: a_a, log2 s_a, a_b, log2 s_b, KL; JSD [N, 6]: ..., KL_s, KL_t
    keep: torch.Tensor | None  # uint8 [N] with a mask, else None
    scratch: torch.Tensor | None = None  # int32, a reduced call's (fields.R_COUNT: a mean's count)

    def statistics(self) -> torch.Tensor:
        return self.stats

    @classmethod
    def from_statistics(cls, call, inputs, index, mask, statistics):
        return cls(inputs[0], inputs[1], statistics, _keep(mask))


def _index_arg(call: Call, index: torch.Tensor | None) -> torch.Tensor | None:
    """The index as the kernels read it: int64 ``[N]`` labels, ``[N, k]`` log-prob entries."""
    if call.op not in ("cross_entropy", "logprobs"):
        return None
    assert index is not None  # both ops take an index
    if call.op == "cross_entropy":
        return index.contiguous()
    return (index if call.topk else index[:, None]).contiguous()


def _keep(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else mask.contiguous().view(torch.uint8)


def capabilities(device_types: frozenset[str]) -> dict[str, OpCapability]:
    """Every op with every feature that applies to it, on ``device_types``, in fp32/bf16/fp16."""
    return {
        op: OpCapability(device_types=device_types, dtypes=LOW_DTYPES, features=frozenset(spec.features))
        for op, spec in OPS.items()
    }


def geometry(z: torch.Tensor) -> tuple[int, int, int]:
    """``(rows_b, stride_a, stride_b)``: row r starts at ``(r // rows_b) * stride_a + (r % rows_b) * stride_b``.
    The kernels read columns at unit stride: anything else is refused here, never misread."""
    if not meets_layout(z, TritonBackend.input_layout):
        raise RuntimeError(
            f"triton kernels need inputs [N, V_local] or [A, B, V_local] with stride 1 on the "
            f"vocabulary dim; got shape {tuple(z.shape)} with strides {z.stride()}. The core "
            f"copies inputs into the declared input_layout; callers of forward() must too."
        )
    if z.dim() == 2:
        return max(z.shape[0], 1), 0, z.stride(0)
    a, b, _ = z.shape
    return max(b, 1), z.stride(0), z.stride(1)


def _pair_geometry(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """The row geometry of a two-input kernel's inputs, as the kernels name it (``sa_*``/``sb_*``:
    the row strides of a and b; both inputs have one shape)."""
    rows_b, sa_a, sa_b = geometry(a)
    _, sb_a, sb_b = geometry(b)
    return {"rows_b": rows_b, "sa_a": sa_a, "sa_b": sa_b, "sb_a": sb_a, "sb_b": sb_b}


def _one_input_options(call: Call, kind: int) -> dict[str, Any]:
    """The options of a one-input call as its three kernels (statistics, finish, backward) take them."""
    opts = call.options
    return {
        "vocab_size": call.vocab_size,
        "k2": LOG2E / opts["temperature"],
        "ignore_index": int(opts.get("ignore_index", -100)),
        "smoothing": float(opts.get("label_smoothing", 0.0)),
        "z_loss": float(opts.get("z_loss", 0.0)),
        "KIND": kind,
        "SMOOTH": kind == fields.CE and opts["label_smoothing"] != 0.0,
        "ZLOSS": kind == fields.CE and opts["z_loss"] != 0.0,
        "WITH_ENTROPY": kind == fields.LOGPROBS and opts["return_entropy"],
    }


_REDUCE = {"none": fields.REDUCE_NONE, "sum": fields.REDUCE_SUM, "mean": fields.REDUCE_MEAN}


def _scratch_rows(reduce: bool, merge_rows: int) -> int:
    """How many int32 counters a call needs (``fields.R_*``): a call reduced in the kernels,
    or whose ``merge_rows`` split rows are merged by their last program; else 0."""
    return fields.R_ROWS + merge_rows if reduce or merge_rows else 0


def _scratch(rows: int, dev: torch.device) -> torch.Tensor | None:
    """``rows`` zeroed int32 counters (``_scratch_rows``), or None for 0."""
    return torch.zeros(rows, dtype=torch.int32, device=dev) if rows else None


def _upstream_layout(call: Call, grad: torch.Tensor, with_column: bool) -> dict[str, Any]:
    """How the backward kernels read the upstream gradient: in its own strides (0 where
    expanded; a reduced call's is 0-dim); ``with_column``: ``[N, k]`` log-probs' column
    stride too; ``MEAN``: divided by the count a mean's scratch holds."""
    if call.reduction != "none":  # one number, or [2] (log-probs, entropy) for every row alike
        g_row, g_col = 0, grad.stride(0) if grad.dim() else 0
    else:  # [N] or [N, k]
        g_row, g_col = grad.stride(0) if grad.dim() else 0, grad.stride(1) if grad.dim() == 2 else 0
    args: dict[str, Any] = {"g_row": g_row}
    if with_column:
        args["g_col"] = g_col
    args["MEAN"] = call.reduction == "mean"
    return args


def _gather(part: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    """Every rank's ``[S, N, F]`` partials as one ``[W * S, N, F]`` tensor (one collective)."""
    if group_size(group) == 1:
        return part, part.shape[0]
    stacked = all_gather_stack(part, group)
    return stacked.view(-1, *part.shape[1:]), stacked.shape[0] * part.shape[0]


class TritonBackend(TakesHead, Compiles, Reduces):
    """Fused vocabulary-parallel kernels, from logits or ``vtp.Head`` inputs, and inside
    ``torch.compile``. Subclass with another ``name``, ``priority``, ``ops`` (device types),
    ``probe`` and ``default_config`` to launch them elsewhere."""

    name = "triton"
    priority = 20
    # a causal-shift view logits[:, :-1] reaches the kernels uncopied; a vocabulary stride
    # other than 1 is copied by the core (strided column loads would not coalesce anyway)
    input_layout = "unit_vocab_stride_3d"
    strided_upstream = True  # the backward kernels read the upstream gradient in its strides
    ops = capabilities(frozenset({"cuda", "cpu"}))
    # sample from logits only (its noise is keyed by the row of the whole call, not of a chunk)
    # argmax's Head runs chunk by chunk on this rank's hidden rows: not sequence-parallel
    head_ops = {**{op: HeadSupport(sequence_parallel=True) for op in LOSSES}, "argmax": HeadSupport()}
    compiled_ops = frozenset(LOSSES)
    reduced_ops = frozenset(LOSSES)  # the last program of the finishing pass reduces
    reduces_pairs = True

    def __init__(self, config: LaunchConfig | None = None) -> None:
        self._config = config

    # -- environment -------------------------------------------------------------------
    def probe(self, device_type: str) -> list[str]:
        try:
            import triton  # noqa: F401
        except Exception as exc:  # ImportError, or a broken install
            return [f"triton is not importable ({type(exc).__name__}: {exc}); pip install triton"]
        if device_type == "cpu":
            if not env.triton_interpret():
                return [
                    "CPU tensors run only under Triton's interpreter: set TRITON_INTERPRET=1 "
                    "before importing triton (meant for tests; it is slow)"
                ]
            return []
        if device_type == "cuda":
            if not torch.cuda.is_available():
                return ["torch.cuda.is_available() is False: no CUDA device or driver"]
            return []
        return [f"device type {device_type!r} is not handled by this backend"]

    def config_for(self, device: torch.device) -> LaunchConfig:
        if self._config is not None:
            return self._config
        if device.type == "cpu" or env.triton_interpret():
            return INTERPRETER_CONFIG
        return CUDA_CONFIG

    # -- inside torch.compile: the state as the inputs plus [N, W] statistics ------------------
    def statistics_width(self, op, options):
        """The fp32 statistics the kernels keep per token: cross_entropy and logprobs 2
        (anchor, log2-sum), entropy and logprobs with return_entropy 3 (and the entropy), kl 5
        (both anchors and log2-sums, the KL), jsd 6 (..., KL(p_s||M), KL(p_t||M)); jsd at
        beta 0 or 1 is a plain KL."""
        if kl_direction(op, options) is not None:
            return fields.KL_STATS
        if op in _ONE_INPUT_KIND:
            with_entropy = op == "entropy" or (op == "logprobs" and options["return_entropy"])
            return fields.ENTROPY_STATS if with_entropy else fields.STATS
        return fields.JSD_STATS

    def statistics(self, call, state):
        return state.statistics()

    def from_statistics(self, call, inputs, index, mask, statistics):
        kind = OneInputState if call.op in _ONE_INPUT_KIND else PairState
        return kind.from_statistics(call, inputs, index, mask, statistics)

    # -- forward -----------------------------------------------------------------------
    # Triton needs a tensor for every pointer argument: where a call has no index or no
    # mask, another tensor of the call stands in, and KIND / HAS_KEEP keep the kernel from
    # reading it.
    def forward(self, call, inputs, index, mask):
        if OPS[call.op].returns_ids:  # argmax, sample
            from . import sampling

            return sampling.forward(self.config_for(inputs[0].device), call, inputs[0]), None
        if call.op in _ONE_INPUT_KIND:
            return self._forward1(call, inputs[0], index, mask)
        return self._forward2(call, inputs, mask)

    def backward(self, call, state, grad):
        return self.head_backward(call, state, grad, (False, False))

    # -- the fused head: the logits GEMM with the statistics in its epilogue (head_gemm.py) -------
    def head_logits(self, call, hidden, weight, bias, out):
        """Where ``head_gemm.chunk_refusal`` allows: the Triton GEMM, returning its per-tile
        partials for ``head_forward``; else None (the driver's torch.mm)."""
        if head_gemm.chunk_refusal(call, hidden, weight, bias, out) is not None:
            return None
        return head_gemm.logits_with_statistics(self.config_for(out.device), call, hidden, weight, bias, out)

    def head_forward(self, call, inputs, index, mask, partials):
        """With every input's tile partials (``head_logits``), the forward merges them instead
        of running the statistics pass over the logits; else ``forward``."""
        if not partials or any(p is None for p in partials):
            return self.forward(call, inputs, index, mask)
        if call.op in _ONE_INPUT_KIND:
            return self._forward1(call, inputs[0], index, mask, tiles=partials[0])
        return self._forward2(call, inputs, mask, tiles=partials)

    def head_logits_route(self, device_type, request=None, options=None, parts=()):
        if request is None:
            types = self.ops["cross_entropy"].device_types
            if types is not None and device_type not in types:
                return head_gemm.route(f"{self.name} does not run on {device_type}")
            why = head_gemm.device_refusal(torch.device(device_type))
            if why is None:
                return (
                    f"{head_gemm.ROUTE} for {', '.join(head_gemm.OPS)} where the Head's tensors allow "
                    f"(vtp.explain says per call), else {head_gemm.FALLBACK}"
                )
            return head_gemm.route(why)
        device = parts[0][1].device if parts else torch.device(request.device_type)
        return head_gemm.route(head_gemm.refusal(device, request.dtype, request.op, request.features, options, parts))

    def head_backward(self, call, state, grad, scratch):
        """Under the fused head the kernels write each gradient over its logits buffer: every
        program reads a tile of the inputs before it writes that tile, and nothing else reads
        it later (the statistics are saved apart)."""
        if call.op in _ONE_INPUT_KIND:
            return self._backward1(call, state, grad, in_place=scratch[0])
        reverse = kl_direction(call.op, call.options)
        if reverse is not None:
            return self._backward2(call, state, grad, fields.KL, reverse, scratch)
        return self._backward2(call, state, grad, fields.JSD, False, scratch)

    def scale_gradients(self, grads, scale):
        """One launch per gradient that returns at once where ``scale`` is 1: a plain
        ``loss.backward()`` then reads and writes no gradient again."""
        if not all(g.is_contiguous() and g.dtype in LOW_DTYPES for g in grads):
            super().scale_gradients(grads, scale)
            return
        cfg = self.config_for(scale.device)
        k = source.module("kernels")
        for g in grads:
            if g.numel():
                programs = min(cfg.scale_programs, cdiv(g.numel(), cfg.block_scale))
                launch(
                    k.scale_kernel,
                    (programs,),
                    cfg.fast_launch,
                    x_ptr=g,
                    n=g.numel(),
                    scale_ptr=scale,
                    programs=programs,
                    BLOCK=cfg.block_scale,
                    num_warps=cfg.warps_scale,
                )

    def _forward1(self, call: Call, z: torch.Tensor, index, mask, tiles: torch.Tensor | None = None):
        """``tiles``: the logits GEMM's per-tile partials of ``z`` (``head_gemm``), merged in
        place of the statistics pass."""
        idx, keep, dev = _index_arg(call, index), _keep(mask), z.device
        cfg = self.config_for(dev)
        plan = _plan(
            ("forward1", cfg, *_signature(call), *_layout(z), _shape(idx), keep is None, tiles is None),
            lambda: _one_input_plan(cfg, call, z, idx, keep, tiles is not None),
        )
        n = plan.n
        values = torch.empty(plan.values_shape, dtype=torch.float32, device=dev)
        stats = torch.empty((n, plan.n_stats), dtype=torch.float32, device=dev)
        if n == 0:
            return values, OneInputState(z, idx, stats, keep)
        scratch = _scratch(plan.scratch_rows, dev)
        # reduced: one number, or two for log-probs with the entropy
        out = values if plan.out_shape is None else torch.empty(plan.out_shape, dtype=torch.float32, device=dev)
        state = OneInputState(z, idx, stats, keep, scratch)
        part = values if plan.partials_shape is None else plan.partials(dev)
        # what both passes read besides the logits and the partials (a stand-in for each absent one)
        shared = (
            values if idx is None else idx,
            values if keep is None else keep,
            values,
            stats,
            values if scratch is None else scratch,
            out,
        )
        if tiles is not None:
            head_gemm.tile_partials(cfg, call, tiles, part, z, kind=plan.kind, index=idx)
        else:
            plan.stats(z, *shared, part)
        if plan.finish is not None:
            plan.finish(*shared, _gather(part, call.group)[0])
        return out, state

    def _forward2(self, call: Call, inputs, mask, tiles: tuple | None = None):
        """kl and jsd. ``tiles``: both inputs' per-tile partials from the logits GEMM
        (``head_gemm``, JSD), merged in place of the statistics pass."""
        student, teacher = inputs
        keep, dev = _keep(mask), student.device
        cfg = self.config_for(dev)
        plan = _plan(
            ("forward2", cfg, *_signature(call), *_layout(student), *_layout(teacher), keep is None, tiles is None),
            lambda: _pair_plan(cfg, call, student, teacher, keep, tiles is not None),
        )
        n = plan.n
        values = torch.empty((n,), dtype=torch.float32, device=dev)
        state = PairState(student, teacher, torch.empty((n, plan.n_stats), dtype=torch.float32, device=dev), keep)
        if n == 0:
            return values, state
        state.scratch = _scratch(plan.scratch_rows, dev)
        out = values if plan.out_shape is None else torch.empty(plan.out_shape, dtype=torch.float32, device=dev)
        # what every pass reads besides the inputs and the partials (a stand-in for each absent one)
        shared = (
            values if keep is None else keep,
            values,
            state.stats,
            values if state.scratch is None else state.scratch,
            out,
        )
        # KL(A || B): forward A = teacher, reverse A = student; JSD: a = student, b = teacher
        a, b = (teacher, student) if plan.swapped else (student, teacher)
        if plan.whole is not None:
            plan.whole(a, b, *shared)
            return out, state
        part = values if plan.partials_shape is None else plan.partials(dev)
        if tiles is not None:
            for side, (t, z) in enumerate(zip(tiles, inputs)):
                head_gemm.tile_partials(cfg, call, t, part, z, pair_side=side)
        else:
            assert plan.stats is not None  # a plan without tiles has its statistics pass
            plan.stats(a, b, *shared, part)
        if plan.divergence is not None:
            assert plan.divergence_shape is not None
            divergence = torch.empty(plan.divergence_shape, dtype=torch.float32, device=dev)
            plan.divergence(a, b, *shared, _gather(part, call.group)[0], divergence)
            part = divergence
        if plan.finish is not None:
            plan.finish(*shared, _gather(part, call.group)[0])
        return out, state

    # -- backward ----------------------------------------------------------------------
    def _backward1(self, call: Call, state: OneInputState, grad, in_place: bool = False):
        z, idx, stats, keep = state.logits, state.index, state.stats, state.keep
        if not call.needs_grad[0]:
            return (None,)
        dz = z if in_place else torch.empty(z.shape, dtype=z.dtype, device=z.device)
        if _num_rows(z) == 0 or z.shape[-1] == 0:
            return (dz,)
        cfg = self.config_for(z.device)
        upstream = (grad.shape, grad.stride(), state.scratch is None)
        launch = _plan(
            ("backward1", cfg, *_signature(call), *_layout(z), _shape(idx), keep is None, *upstream),
            lambda: _backward1_plan(cfg, call, state, grad),
        )
        red = state.scratch if state.scratch is not None else stats
        launch(z, dz, grad, red, stats if idx is None else idx, stats if keep is None else keep, stats)
        return (dz,)

    def _backward2(
        self, call: Call, state: PairState, grad, kind: int, reverse: bool, scratch: tuple[bool, bool] = (False, False)
    ):
        student, teacher, stats, keep = state.student, state.teacher, state.stats, state.keep
        need_s, need_t = call.needs_grad
        # KL(A || B): forward A = teacher, reverse A = student; JSD: a = student, b = teacher
        if kind == fields.KL and not reverse:
            a, b, need_a, need_b = teacher, student, need_t, need_s
            in_place_a, in_place_b = scratch[1], scratch[0]
        else:
            a, b, need_a, need_b = student, teacher, need_s, need_t
            in_place_a, in_place_b = scratch
        da = (a if in_place_a else torch.empty(a.shape, dtype=a.dtype, device=a.device)) if need_a else None
        db = (b if in_place_b else torch.empty(b.shape, dtype=b.dtype, device=b.device)) if need_b else None
        if (need_a or need_b) and _num_rows(a) > 0 and a.shape[-1] > 0:
            cfg = self.config_for(a.device)
            upstream = (grad.shape, grad.stride(), state.scratch is None)
            launch = _plan(
                ("backward2", cfg, *_signature(call), *_layout(a), *_layout(b), keep is None, kind, *upstream),
                lambda: _backward2_plan(cfg, call, a, b, keep, grad, kind, (need_a, need_b)),
            )
            red = state.scratch if state.scratch is not None else stats
            keep_or = stats if keep is None else keep
            # NEED_A / NEED_B gate the writes: a gradient not asked for has the other's stand in
            launch(a, b, da if need_a else db, db if need_b else da, grad, red, keep_or, stats)
        if kind == fields.KL and not reverse:
            return db, da
        return da, db


def _num_rows(z: torch.Tensor) -> int:
    return z.shape[0] * z.shape[1] if z.dim() == 3 else z.shape[0]


# -- call plans: what every call of one signature launches ------------------------------------

MAX_CALL_PLANS = 256  # signatures kept; past it the kept plans are dropped and made again
_CALL_PLANS: dict[tuple, Any] = {}
# the per-call tensors that a one-input call's passes read besides the logits and the partials
_SHARED = ("idx_ptr", "keep_ptr", "val_ptr", "stat_ptr", "red_ptr", "out_ptr")


def _signature(call: Call) -> tuple:
    """What of ``call`` a plan's arguments follow (the request holds the op, dtype, TP size,
    V and the token count; the group is read per call)."""
    return (call.request, call.vocab_start, call.reduction, call.topk, call.needs_grad, tuple(call.options.items()))


def _layout(z: torch.Tensor) -> tuple:
    return z.shape, z.stride(), z.dtype, z.device


def _shape(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else t.shape


def _plan(key: tuple, make: Callable[[], Any]) -> Any:
    """The plan kept for ``key``, or ``make()``'s, kept."""
    plan = _CALL_PLANS.get(key)
    if plan is None:
        plan = make()
        if len(_CALL_PLANS) >= MAX_CALL_PLANS:
            _CALL_PLANS.clear()
        _CALL_PLANS[key] = plan
    return plan


def call_plans() -> list[Any]:
    """The loss calls' plans kept now (at most ``MAX_CALL_PLANS``)."""
    return list(_CALL_PLANS.values())


def clear_call_plans() -> None:
    """Drop every kept plan: the next call of each signature makes its plan again."""
    _CALL_PLANS.clear()


class _ForwardPlan:
    """What every forward plan holds: the row count, the statistics' width, the counters, a
    reduced result's shape and the partials' (each None where the values stand in), the
    statistics pass and the finishing launch (each None where the call has none)."""

    __slots__ = ("n", "n_stats", "scratch_rows", "out_shape", "partials_shape", "stats", "finish")

    def __init__(self, n: int, n_stats: int) -> None:
        self.n, self.n_stats = n, n_stats
        self.scratch_rows = 0
        self.out_shape: tuple[int, ...] | None = None
        self.partials_shape: tuple[int, ...] | None = None
        self.stats: Bound | None = None
        self.finish: Bound | None = None

    def partials(self, dev: torch.device) -> torch.Tensor:
        assert self.partials_shape is not None
        return torch.empty(self.partials_shape, dtype=torch.float32, device=dev)


class OneInputPlan(_ForwardPlan):
    """A one-input forward (cross_entropy, logprobs, entropy) of one signature: the sizes of
    what it allocates and its launches with every argument bound but the tensors (no
    tensor, no group). ``stats`` is None for a fused head's (its GEMM made the partials);
    ``finish`` is None where the statistics pass finishes the rows itself."""

    __slots__ = ("kind", "values_shape")

    def __init__(self, n: int, kind: int, values_shape: tuple[int, ...], n_stats: int) -> None:
        super().__init__(n, n_stats)
        self.kind, self.values_shape = kind, values_shape


def _one_input_plan(cfg: LaunchConfig, call: Call, z: torch.Tensor, idx, keep, tiled: bool) -> OneInputPlan:
    kind = _ONE_INPUT_KIND[call.op]
    n, v_local = _num_rows(z), z.shape[-1]
    n_idx = 0 if idx is None else 1 if kind == fields.CE else idx.shape[1]
    options = _one_input_options(call, kind)
    zloss = options.pop("ZLOSS")
    # log-probs with return_entropy: the entropy's sum rides in the same pass
    with_entropy = options["WITH_ENTROPY"]
    n_fields = {
        fields.CE: fields.CE_FIELDS,
        fields.ENTROPY: fields.ENTROPY_FIELDS,
        fields.LOGPROBS: (fields.LOGPROBS_ENTROPY_FIELDS if with_entropy else fields.LOGPROBS_FIELDS) + n_idx,
    }[kind]
    n_stats = fields.ENTROPY_STATS if kind == fields.ENTROPY or with_entropy else fields.STATS
    values_shape: tuple[int, ...]
    if with_entropy:
        values_shape = (n, n_idx + 1)  # the log-probs, then the entropy
    else:
        values_shape = (n, n_idx) if (kind == fields.LOGPROBS and call.topk) else (n,)
    plan = OneInputPlan(n, kind, values_shape, n_stats)
    if n == 0:
        return plan
    k = source.module("kernels")
    tp = call.request.tp_size
    splits = vocab_splits(n, cdiv(call.vocab_size, tp), cfg.block_stats, cfg.target_programs, cfg.max_splits)
    # a row that is neither split nor sharded is finished by the program that reads it;
    # split rows at one rank by the last program of the row (nothing to gather between)
    finish = splits == 1 and tp == 1 and not tiled
    merge = not finish and tp == 1 and cfg.merge_rows and not tiled
    reduce = _REDUCE[call.reduction]
    plan.scratch_rows = _scratch_rows(reduce != fields.REDUCE_NONE, n if merge else 0)
    if reduce:  # one number, or two for log-probs with the entropy (an [N] index: one column)
        plan.out_shape = (2,) if with_entropy else ()
    if not finish:
        plan.partials_shape = (splits, n, n_fields)
    shared = {
        "n_idx": n_idx,
        "n_rows": n,
        "HAS_KEEP": keep is not None,
        "REDUCE": reduce,
        "BLOCK_REDUCE": cfg.block_reduce,
        **options,
    }
    if not tiled:
        rows_b, stride_a, stride_b = geometry(z)
        plan.stats = Bound(
            k.stats1_kernel,
            (n * splits,),
            cfg.fast_launch,
            ("z_ptr", *_SHARED, "part_ptr"),
            rows_b=rows_b,
            stride_a=stride_a,
            stride_b=stride_b,
            **shared,
            v_local=v_local,
            vocab_start=call.vocab_start,
            splits=splits,
            chunk=split_chunk(v_local, splits, cfg.block_stats),
            # the z-loss term is added where a row is finished (here with FINISH or MERGE)
            ZLOSS=zloss and (finish or merge),
            FINISH=finish,
            MERGE=merge,
            BLOCK=cfg.block_stats,
            num_warps=cfg.warps_stats,
        )
    if not (finish or merge):
        plan.finish = Bound(
            k.finish1_kernel,
            (cdiv(n, cfg.block_rows),),
            cfg.fast_launch,
            (*_SHARED, "part_ptr"),
            **shared,
            n_parts=tp * splits,  # every rank's partials, gathered
            ZLOSS=zloss,
            BLOCK_N=cfg.block_rows,
            num_warps=cfg.warps_finish,
        )
    return plan


def _backward1_plan(cfg: LaunchConfig, call: Call, state: OneInputState, grad: torch.Tensor) -> Bound:
    """A one-input backward of one signature: its launch, bound but the tensors."""
    z, idx = state.logits, state.index
    n, v_local = _num_rows(z), z.shape[-1]
    splits, chunk = _bwd_splits(cfg, n, v_local)
    rows_b, stride_a, stride_b = geometry(z)
    return Bound(
        source.module("kernels").backward1_kernel,
        (n * splits,),
        cfg.fast_launch,
        ("z_ptr", "dz_ptr", "grad_ptr", "red_ptr", "idx_ptr", "keep_ptr", "stat_ptr"),
        rows_b=rows_b,
        stride_a=stride_a,
        stride_b=stride_b,
        **_one_input_options(call, _ONE_INPUT_KIND[call.op]),
        **_upstream_layout(call, grad, with_column=True),
        n_idx=0 if idx is None else (1 if idx.dim() == 1 else idx.shape[1]),
        v_local=v_local,
        vocab_start=call.vocab_start,
        splits=splits,
        chunk=chunk,
        inv_t=1.0 / call.options["temperature"],
        HAS_KEEP=state.keep is not None,
        BLOCK=cfg.block_bwd,
        num_warps=cfg.warps_bwd,
    )


def _bwd_splits(cfg: LaunchConfig, n: int, v_local: int) -> tuple[int, int]:
    tiles = max(1, cdiv(v_local, cfg.block_bwd))
    splits = max(1, min(cdiv(cfg.bwd_target_programs, max(n, 1)), tiles))
    return splits, split_chunk(v_local, splits, cfg.block_bwd)


# the per-call tensors that every pass of a pair call reads besides its inputs and partials
_PAIR_SHARED = ("keep_ptr", "val_ptr", "stat_ptr", "red_ptr", "out_ptr")


class PairPlan(_ForwardPlan):
    """A kl or jsd forward of one signature: the sizes of what it allocates and its launches
    bound but the tensors (no tensor, no group). ``swapped``: the kernels' A is the teacher
    (forward KL); ``whole``: JSD rows that one program reads and finishes (the only launch);
    ``stats`` is None for a fused head's (its GEMM made the partials); ``divergence``: JSD's
    second pass; ``finish``: None where a pass finishes the rows itself."""

    __slots__ = ("swapped", "divergence_shape", "whole", "divergence")

    def __init__(self, n: int, n_stats: int, swapped: bool) -> None:
        super().__init__(n, n_stats)
        self.swapped = swapped
        self.divergence_shape: tuple[int, ...] | None = None
        self.whole: Bound | None = None
        self.divergence: Bound | None = None


def _pair_plan(cfg: LaunchConfig, call: Call, student, teacher, keep, tiled: bool) -> PairPlan:
    reverse = kl_direction(call.op, call.options)
    is_kl = reverse is not None
    n, v_local = _num_rows(student), student.shape[-1]
    plan = PairPlan(n, fields.KL_STATS if is_kl else fields.JSD_STATS, swapped=is_kl and not reverse)
    if n == 0:
        return plan
    a, b = (teacher, student) if plan.swapped else (student, teacher)
    k = source.module("kernels")
    tp = call.request.tp_size
    v_per_rank = cdiv(call.vocab_size, tp)
    splits = vocab_splits(n, v_per_rank, cfg.block_stats, cfg.target_programs, cfg.max_splits)
    div_splits = 0 if is_kl else vocab_splits(n, v_per_rank, cfg.block_div, cfg.target_programs, cfg.max_splits)
    # KL: the statistics pass finishes a row that is neither split nor sharded, and merges split
    # rows at one rank (see _forward1); JSD: one launch for rows neither split nor sharded, else
    # the divergence pass merges its split rows at one rank
    if is_kl:
        whole, finish = False, splits == 1 and tp == 1
    else:
        whole, finish = splits == 1 and div_splits == 1 and tp == 1 and not tiled, False
    merge = not (whole or finish) and tp == 1 and cfg.merge_rows
    reduce = _REDUCE[call.reduction]
    plan.scratch_rows = _scratch_rows(reduce != fields.REDUCE_NONE, n if merge else 0)
    if reduce:
        plan.out_shape = ()
    k2 = LOG2E / call.options["temperature"]
    geometry_ab = _pair_geometry(a, b)
    if whole:
        plan.whole = Bound(
            k.jsd_row_kernel,
            (n,),
            cfg.fast_launch,
            ("a_ptr", "b_ptr", *_PAIR_SHARED),
            **geometry_ab,
            v_local=v_local,
            k2=k2,
            beta=call.options["beta"],
            HAS_KEEP=keep is not None,
            FAST_LOG2=cfg.fast_log2,
            REDUCE=reduce,
            BLOCK_REDUCE=cfg.block_reduce,
            n_rows=n,
            BLOCK_STATS=cfg.block_stats,
            BLOCK_DIV=cfg.block_div,
            num_warps=cfg.warps_div,
        )
        return plan
    if not finish:
        plan.partials_shape = (splits, n, fields.KL_FIELDS if is_kl else fields.PAIR_FIELDS)
    if not tiled:
        plan.stats = Bound(
            k.stats2_kernel,
            (n * splits,),
            cfg.fast_launch,
            ("a_ptr", "b_ptr", *_PAIR_SHARED, "part_ptr"),
            **geometry_ab,
            n_rows=n,
            v_local=v_local,
            splits=splits,
            chunk=split_chunk(v_local, splits, cfg.block_stats),
            k2=k2,
            WITH_KL=is_kl,
            HAS_KEEP=keep is not None,
            FINISH=finish,
            MERGE=is_kl and merge,
            REDUCE=reduce if is_kl and (finish or merge) else fields.REDUCE_NONE,
            BLOCK=cfg.block_stats,
            BLOCK_REDUCE=cfg.block_reduce,
            num_warps=cfg.warps_stats,
        )
    finish_parts = tp * splits
    if not is_kl:
        plan.divergence_shape = (div_splits, n, fields.DIV_FIELDS)
        plan.divergence = Bound(
            k.jsd_div_kernel,
            (n * div_splits,),
            cfg.fast_launch,
            ("a_ptr", "b_ptr", *_PAIR_SHARED, "stats_part_ptr", "part_ptr"),
            **geometry_ab,
            v_local=v_local,
            k2=k2,
            beta=call.options["beta"],
            HAS_KEEP=keep is not None,
            FAST_LOG2=cfg.fast_log2,
            REDUCE=reduce if merge else fields.REDUCE_NONE,
            BLOCK_REDUCE=cfg.block_reduce,
            n_stats_parts=tp * splits,
            n_rows=n,
            splits=div_splits,
            chunk=split_chunk(v_local, div_splits, cfg.block_div),
            MERGE=merge,
            BLOCK=cfg.block_div,
            num_warps=cfg.warps_div,
        )
        finish_parts = tp * div_splits
    if not (finish or merge):
        plan.finish = Bound(
            k.finish2_kernel,
            (cdiv(n, cfg.block_rows),),
            cfg.fast_launch,
            (*_PAIR_SHARED, "part_ptr"),
            n_parts=finish_parts,  # every rank's partials, gathered
            n_rows=n,
            k2=k2,
            beta=0.0 if is_kl else call.options["beta"],  # read only by the JSD kind
            KIND=fields.KL if is_kl else fields.JSD,
            HAS_KEEP=keep is not None,
            REDUCE=reduce,
            BLOCK_N=cfg.block_rows,
            BLOCK_REDUCE=cfg.block_reduce,
            num_warps=cfg.warps_finish,
        )
    return plan


def _backward2_plan(cfg: LaunchConfig, call: Call, a, b, keep, grad, kind: int, need: tuple[bool, bool]) -> Bound:
    """A kl or jsd backward of one signature: its launch, bound but the tensors; ``need``:
    whether A's and B's gradients are asked for."""
    n, v_local = _num_rows(a), a.shape[-1]
    splits, chunk = _bwd_splits(cfg, n, v_local)
    return Bound(
        source.module("kernels").backward2_kernel,
        (n * splits,),
        cfg.fast_launch,
        ("a_ptr", "b_ptr", "da_ptr", "db_ptr", "grad_ptr", "red_ptr", "keep_ptr", "stat_ptr"),
        **_pair_geometry(a, b),
        **_upstream_layout(call, grad, with_column=False),
        v_local=v_local,
        splits=splits,
        chunk=chunk,
        k2=LOG2E / call.options["temperature"],
        inv_t=1.0 / call.options["temperature"],
        beta=call.options["beta"] if kind == fields.JSD else 0.0,  # read only by the JSD kind
        KIND=kind,
        NEED_A=need[0],
        NEED_B=need[1],
        HAS_KEEP=keep is not None,
        FAST_LOG2=cfg.fast_log2 and kind == fields.JSD,
        BLOCK=cfg.block_bwd,
        num_warps=cfg.warps_bwd,
    )
