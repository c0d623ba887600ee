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
``fields.py``, which the kernels read too. Importing this module never imports triton.
"""

from __future__ import annotations

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
from .launch import launch

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


def _row_args(z: torch.Tensor) -> dict[str, Any]:
    """The logits of a one-input kernel and their row geometry, as the kernels name them."""
    rows_b, stride_a, stride_b = geometry(z)
    return {"z_ptr": z, "rows_b": rows_b, "stride_a": stride_a, "stride_b": stride_b}


def _pair_args(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """The two inputs of a two-input kernel and their row geometry, as the kernels name them
    (``sa_*``/``sb_*``: the row strides of a and b; both inputs have one shape)."""
    rows_b, sa_a, sa_b = geometry(a)
    _, sb_a, sb_b = geometry(b)
    return {"a_ptr": a, "b_ptr": b, "rows_b": rows_b, "sa_a": sa_a, "sa_b": sa_b, "sb_a": sb_a, "sb_b": sb_b}


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


def _scratch(reduce: bool, merge_rows: int, dev: torch.device) -> torch.Tensor | None:
    """The zeroed int32 counters of a call reduced in the kernels or whose ``merge_rows``
    split rows are merged by their last program (``fields.R_*``), else None."""
    if not reduce and not merge_rows:
        return None
    return torch.zeros(fields.R_ROWS + merge_rows, dtype=torch.int32, device=dev)


def _upstream_args(call: Call, state: OneInputState | PairState, grad: torch.Tensor) -> dict[str, Any]:
    """The upstream gradient as the backward kernels read it: in its own strides (0 where
    expanded; a reduced call's is 0-dim), and the scratch holding a mean's count."""
    red = state.scratch if state.scratch is not None else state.stats
    if call.reduction != "none":  # one number, or [2] (log-probs, entropy) for every row alike
        g_row, g_col = 0, grad.stride(0) if grad.dim() else 0
    else:  # [N] or [N, k]
        g_row, g_col = grad.stride(0) if grad.dim() else 0, grad.stride(1) if grad.dim() == 2 else 0
    args = {"grad_ptr": grad, "g_row": g_row, "red_ptr": red}
    if isinstance(state, OneInputState):  # [N, k] log-probs: a column stride too
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
        reverse = kl_direction(call.op, call.options)
        if reverse is not None:
            return self._forward_kl(call, inputs, mask, reverse)
        return self._forward_jsd(call, inputs, mask, call.options["beta"])

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
        return self._forward_jsd(call, inputs, mask, call.options["beta"], tiles=partials)

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
        kind = _ONE_INPUT_KIND[call.op]
        n, v_local = _num_rows(z), z.shape[-1]
        dev = z.device
        idx = _index_arg(call, index)
        n_idx = 0 if idx is None else 1 if kind == fields.CE else idx.shape[1]
        keep = _keep(mask)
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
        val_shape: tuple[int, ...]
        if with_entropy:
            val_shape = (n, n_idx + 1)  # the log-probs, then the entropy
        else:
            val_shape = (n, n_idx) if (kind == fields.LOGPROBS and call.topk) else (n,)
        values = torch.empty(val_shape, dtype=torch.float32, device=dev)
        stats = torch.empty((n, n_stats), dtype=torch.float32, device=dev)
        if n == 0:
            return values, OneInputState(z, idx, stats, keep)
        k = source.module("kernels")
        cfg = self.config_for(dev)
        tp = call.request.tp_size
        splits = vocab_splits(n, cdiv(call.vocab_size, tp), cfg.block_stats, cfg.target_programs, cfg.max_splits)
        # a row that is neither split nor sharded is finished by the program that reads it;
        # split rows at one rank by the last program of the row (nothing to gather between)
        finish = splits == 1 and tp == 1 and tiles is None
        merge = not finish and tp == 1 and cfg.merge_rows and tiles is None
        reduce = _REDUCE[call.reduction]
        scratch = _scratch(reduce != fields.REDUCE_NONE, n if merge else 0, dev)
        # reduced: one number, or two for log-probs with the entropy (an [N] index: one column)
        out = torch.empty((2,) if with_entropy else (), dtype=torch.float32, device=dev) if reduce else values
        state = OneInputState(z, idx, stats, keep, scratch)
        part = values if finish else torch.empty((splits, n, n_fields), dtype=torch.float32, device=dev)
        # what both passes read besides the logits and the partials
        shared = {
            "idx_ptr": idx if idx is not None else values,
            "n_idx": n_idx,
            "keep_ptr": keep if keep is not None else values,
            "val_ptr": values,
            "stat_ptr": stats,
            "n_rows": n,
            "red_ptr": scratch if scratch is not None else values,
            "out_ptr": out,
            "HAS_KEEP": keep is not None,
            "REDUCE": reduce,
            "BLOCK_REDUCE": cfg.block_reduce,
            **options,
        }
        if tiles is not None:
            head_gemm.tile_partials(cfg, call, tiles, part, z, kind=kind, index=idx)
        else:
            launch(
                k.stats1_kernel,
                (n * splits,),
                cfg.fast_launch,
                **_row_args(z),
                **shared,
                part_ptr=part,
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
        if finish or merge:
            return out, state
        part, n_parts = _gather(part, call.group)
        launch(
            k.finish1_kernel,
            (cdiv(n, cfg.block_rows),),
            cfg.fast_launch,
            **shared,
            part_ptr=part,
            n_parts=n_parts,
            ZLOSS=zloss,
            BLOCK_N=cfg.block_rows,
            num_warps=cfg.warps_finish,
        )
        return out, state

    def _forward_kl(self, call: Call, inputs, mask, reverse: bool):
        student, teacher = inputs
        a, b = (student, teacher) if reverse else (teacher, student)
        values, state = _pair_outputs(student, teacher, mask, fields.KL_STATS)
        n = values.shape[0]
        if n == 0:
            return values, state
        cfg = self.config_for(a.device)
        tp = call.request.tp_size
        splits = vocab_splits(n, cdiv(call.vocab_size, tp), cfg.block_stats, cfg.target_programs, cfg.max_splits)
        finish = splits == 1 and tp == 1  # see _forward1
        merge = not finish and tp == 1 and cfg.merge_rows
        out = _reduced(call, state, n if merge else 0, values)
        part = self._stats2(call, cfg, a, b, values, out, state, splits, with_kl=True, finish=finish, merge=merge)
        if not (finish or merge):
            self._finish2(call, cfg, part, values, out, state, fields.KL, beta=0.0)  # beta: read only by the JSD kind
        return out, state

    def _forward_jsd(self, call: Call, inputs, mask, beta: float, tiles: tuple | None = None):
        """``tiles``: both inputs' per-tile partials from the logits GEMM (``head_gemm``),
        merged in place of the statistics pass."""
        student, teacher = inputs
        values, state = _pair_outputs(student, teacher, mask, fields.JSD_STATS)
        n, v_local, keep, stats, dev = values.shape[0], student.shape[-1], state.keep, state.stats, student.device
        if n == 0:
            return values, state
        k = source.module("kernels")
        cfg = self.config_for(dev)
        tp = call.request.tp_size
        v_per_rank = cdiv(call.vocab_size, tp)
        splits = vocab_splits(n, v_per_rank, cfg.block_stats, cfg.target_programs, cfg.max_splits)
        div_splits = vocab_splits(n, v_per_rank, cfg.block_div, cfg.target_programs, cfg.max_splits)
        whole = splits == 1 and div_splits == 1 and tp == 1 and tiles is None  # one launch, see _forward1
        merge = not whole and tp == 1 and cfg.merge_rows  # the divergence pass's rows, see _forward1
        out = _reduced(call, state, n if merge else 0, values)
        reduce = {
            "red_ptr": state.scratch if state.scratch is not None else values,
            "out_ptr": out,
            "REDUCE": _REDUCE[call.reduction],
            "BLOCK_REDUCE": cfg.block_reduce,
        }
        # what both JSD passes read (a = student, b = teacher) besides their partials
        shared = {
            **_pair_args(student, teacher),
            "keep_ptr": keep if keep is not None else values,
            "stat_ptr": stats,
            "v_local": v_local,
            "k2": LOG2E / call.options["temperature"],
            "beta": beta,
            "HAS_KEEP": keep is not None,
            "FAST_LOG2": cfg.fast_log2,
        }
        if tiles is not None:
            part = torch.empty((splits, n, fields.PAIR_FIELDS), dtype=torch.float32, device=dev)
            for side, (t, z) in enumerate(zip(tiles, inputs)):
                head_gemm.tile_partials(cfg, call, t, part, z, pair_side=side)
        elif whole:
            launch(
                k.jsd_row_kernel,
                (n,),
                cfg.fast_launch,
                **shared,
                **reduce,
                val_ptr=values,
                n_rows=n,
                BLOCK_STATS=cfg.block_stats,
                BLOCK_DIV=cfg.block_div,
                num_warps=cfg.warps_div,
            )
            return out, state
        else:
            part = self._stats2(call, cfg, student, teacher, values, out, state, splits, with_kl=False)
        part, n_parts = _gather(part, call.group)
        part2 = torch.empty((div_splits, n, fields.DIV_FIELDS), dtype=torch.float32, device=dev)
        launch(
            k.jsd_div_kernel,
            (n * div_splits,),
            cfg.fast_launch,
            **shared,
            **(reduce if merge else {**reduce, "REDUCE": fields.REDUCE_NONE}),
            stats_part_ptr=part,
            n_stats_parts=n_parts,
            part_ptr=part2,
            val_ptr=values,
            n_rows=n,
            splits=div_splits,
            chunk=split_chunk(v_local, div_splits, cfg.block_div),
            MERGE=merge,
            BLOCK=cfg.block_div,
            num_warps=cfg.warps_div,
        )
        if not merge:
            self._finish2(call, cfg, part2, values, out, state, fields.JSD, beta)
        return out, state

    def _stats2(
        self,
        call: Call,
        cfg: LaunchConfig,
        a: torch.Tensor,
        b: torch.Tensor,
        values: torch.Tensor,
        out: torch.Tensor,
        state: PairState,
        splits: int,
        with_kl: bool,
        finish: bool = False,
        merge: bool = False,
    ) -> torch.Tensor:
        """The statistics pass over both inputs (``with_kl``: and the KL(A || B) term): the
        ``[splits, N, F]`` partials it fills, or with ``finish`` (KL, one split at TP 1) the
        values, filled with the statistics as ``finish2_kernel`` would; ``merge`` (KL, split
        rows at TP 1): the partials, and the values merged from them by each row's last
        program. ``out``: a reduced call's result (with ``finish`` or ``merge``)."""
        n, v_local, keep = values.shape[0], a.shape[-1], state.keep
        n_fields = fields.KL_FIELDS if with_kl else fields.PAIR_FIELDS
        part = values if finish else torch.empty((splits, n, n_fields), dtype=torch.float32, device=a.device)
        launch(
            source.module("kernels").stats2_kernel,
            (n * splits,),
            cfg.fast_launch,
            **_pair_args(a, b),
            keep_ptr=keep if keep is not None else values,
            part_ptr=part,
            val_ptr=values,
            stat_ptr=state.stats,
            red_ptr=state.scratch if state.scratch is not None else values,
            out_ptr=out,
            n_rows=n,
            v_local=v_local,
            splits=splits,
            chunk=split_chunk(v_local, splits, cfg.block_stats),
            k2=LOG2E / call.options["temperature"],
            WITH_KL=with_kl,
            HAS_KEEP=keep is not None,
            FINISH=finish,
            MERGE=merge,
            REDUCE=_REDUCE[call.reduction] if finish or merge else fields.REDUCE_NONE,
            BLOCK=cfg.block_stats,
            BLOCK_REDUCE=cfg.block_reduce,
            num_warps=cfg.warps_stats,
        )
        return part

    def _finish2(
        self, call: Call, cfg: LaunchConfig, part: torch.Tensor, values, out, state: PairState, kind: int, beta: float
    ) -> None:
        """Gather every rank's ``[S, N, F]`` partials and merge them into the values and the
        statistics (``kind``: KL or JSD)."""
        part, n_parts = _gather(part, call.group)
        n, keep = values.shape[0], state.keep
        launch(
            source.module("kernels").finish2_kernel,
            (cdiv(n, cfg.block_rows),),
            cfg.fast_launch,
            part_ptr=part,
            n_parts=n_parts,
            n_rows=n,
            keep_ptr=keep if keep is not None else values,
            val_ptr=values,
            stat_ptr=state.stats,
            red_ptr=state.scratch if state.scratch is not None else values,
            out_ptr=out,
            k2=LOG2E / call.options["temperature"],
            beta=beta,
            KIND=kind,
            HAS_KEEP=keep is not None,
            REDUCE=_REDUCE[call.reduction],
            BLOCK_N=cfg.block_rows,
            BLOCK_REDUCE=cfg.block_reduce,
            num_warps=cfg.warps_finish,
        )

    # -- backward ----------------------------------------------------------------------
    def _bwd_splits(self, cfg: LaunchConfig, n: int, v_local: int) -> tuple[int, int]:
        tiles = max(1, cdiv(v_local, cfg.block_bwd))
        splits = max(1, min(cdiv(cfg.bwd_target_programs, max(n, 1)), tiles))
        return splits, split_chunk(v_local, splits, cfg.block_bwd)

    def _backward1(self, call: Call, state: OneInputState, grad, in_place: bool = False):
        kind = _ONE_INPUT_KIND[call.op]
        z, idx, stats, keep = state.logits, state.index, state.stats, state.keep
        if not call.needs_grad[0]:
            return (None,)
        n, v_local = _num_rows(z), z.shape[-1]
        dz = z if in_place else torch.empty(z.shape, dtype=z.dtype, device=z.device)
        if n == 0 or v_local == 0:
            return (dz,)
        k = source.module("kernels")
        cfg = self.config_for(z.device)
        splits, chunk = self._bwd_splits(cfg, n, v_local)
        launch(
            k.backward1_kernel,
            (n * splits,),
            cfg.fast_launch,
            **_row_args(z),
            **_one_input_options(call, kind),
            dz_ptr=dz,
            **_upstream_args(call, state, grad),
            idx_ptr=idx if idx is not None else stats,
            n_idx=0 if idx is None else (1 if idx.dim() == 1 else idx.shape[1]),
            keep_ptr=keep if keep is not None else stats,
            stat_ptr=stats,
            v_local=v_local,
            vocab_start=call.vocab_start,
            splits=splits,
            chunk=chunk,
            inv_t=1.0 / call.options["temperature"],
            HAS_KEEP=keep is not None,
            BLOCK=cfg.block_bwd,
            num_warps=cfg.warps_bwd,
        )
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
        n, v_local = _num_rows(a), a.shape[-1]
        if (need_a or need_b) and n > 0 and v_local > 0:
            k = source.module("kernels")
            cfg = self.config_for(a.device)
            splits, chunk = self._bwd_splits(cfg, n, v_local)
            launch(
                k.backward2_kernel,
                (n * splits,),
                cfg.fast_launch,
                **_pair_args(a, b),
                da_ptr=da if need_a else db,
                db_ptr=db if need_b else da,  # NEED_A / NEED_B gate the writes
                **_upstream_args(call, state, grad),
                keep_ptr=keep if keep is not None else stats,
                stat_ptr=stats,
                v_local=v_local,
                splits=splits,
                chunk=chunk,
                k2=LOG2E / call.options["temperature"],
                inv_t=1.0 / call.options["temperature"],
                beta=call.options["beta"] if kind == fields.JSD else 0.0,  # read only by the JSD kind
                KIND=kind,
                NEED_A=need_a,
                NEED_B=need_b,
                HAS_KEEP=keep is not None,
                FAST_LOG2=cfg.fast_log2 and kind == fields.JSD,
                BLOCK=cfg.block_bwd,
                num_warps=cfg.warps_bwd,
            )
        if kind == fields.KL and not reverse:
            return db, da
        return da, db


def _pair_outputs(student: torch.Tensor, teacher: torch.Tensor, mask, n_stats: int) -> tuple[torch.Tensor, PairState]:
    """kl/jsd: the values ``[N]`` to fill, and the state holding the ``[N, n_stats]`` statistics
    to fill and the mask as uint8 (what the kernels read)."""
    n, dev = _num_rows(student), student.device
    keep = _keep(mask)
    values = torch.empty((n,), dtype=torch.float32, device=dev)
    stats = torch.empty((n, n_stats), dtype=torch.float32, device=dev)
    return values, PairState(student, teacher, stats, keep)


def _reduced(call: Call, state: PairState, merge_rows: int, values: torch.Tensor) -> torch.Tensor:
    """kl/jsd: the 0-dim result of a call the kernels reduce (its scratch set in ``state``),
    else the values."""
    reduce = call.reduction != "none"
    state.scratch = _scratch(reduce, merge_rows, values.device)
    return torch.empty((), dtype=torch.float32, device=values.device) if reduce else values


def _num_rows(z: torch.Tensor) -> int:
    return z.shape[0] * z.shape[1] if z.dim() == 3 else z.shape[0]
