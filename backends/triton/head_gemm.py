"""The fused head's logits GEMM on the triton backend: the persistent Triton matmul of
``head_kernels.py`` whose epilogue writes each vocabulary tile's softmax statistics (max and
sum of ``exp2``) beside the logits, so that the forward merges those ``[T, 2, rows]``
partials instead of running its statistics pass over the chunk's logits
(``benchmarks/NOTES.md``: 0-3% faster than cuBLAS chunks on the H200).

``refusal`` says why it cannot run somewhere (None: it can), checked per chunk: a CUDA
device of compute capability 9.0 or later (its operands come through TMA descriptors), or
Triton's interpreter on the CPU; ``triton.tools.tensor_descriptor`` in the installed
Triton; bf16 or fp16 (fp32 too under the interpreter); an op whose forward needs nothing of
the logits beyond each row's max and sum and the logits at its labels (cross entropy
without label smoothing, log-probs without the entropy, an interior JSD); 16-byte aligned
rows of the hidden states, the weight and the logits (H and V_local elements of 16 bytes'
multiples) and a unit-stride bias; not ``VTP_HEAD_GEMM=cublas``. Where it refuses, the
chunk driver computes the logits with ``torch.mm`` (cuBLAS chunks) and the forward runs its
statistics pass. Importing this module never imports triton.

``device_refusal`` answers for a device, from ``cuda_refusal`` (a CUDA device's capability,
cached per index) and ``descriptors_refusal`` (the installed Triton's descriptors, cached).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from vtp_runtime import env
from vtp_runtime.backend import Call
from vtp_runtime.ops import dtype_name, kl_direction

from .config import LaunchConfig
from .launch import launch

LOG2E = 1.4426950408889634
OPS = ("cross_entropy", "logprobs", "jsd")
FEATURES_REFUSED = {
    "label_smoothing": "label_smoothing needs each row's sum of logits, which the epilogue does not keep",
    "return_entropy": "return_entropy needs each row's sum of p log p, which the epilogue does not keep",
}
OPS_REFUSED = {
    "entropy": "entropy needs each row's sum of p log p, which the epilogue does not keep",
    "kl": "kl's statistics pass reads student and teacher together (the KL term)",
}
ROUTE = "triton epilogue GEMM (softmax statistics in the logits matmul's epilogue)"
FALLBACK = "cuBLAS chunks"
# On CUDA, vocabulary shards narrower than this take cuBLAS chunks, which were measured faster
# there (docs/benchmarks.md, "Sixth round")
MIN_CUDA_V_LOCAL = 100_000
STATS_MODE = 1  # head_matmul_kernel's STATS epilogue


def _head_kernels():
    from . import head_kernels  # imported on first use: importing this module never needs triton

    return head_kernels


@functools.cache
def descriptors_refusal() -> str | None:
    """Why the installed Triton has no TMA tensor descriptors (None: it has them)."""
    try:
        import triton
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"no triton.tools.tensor_descriptor in this Triton ({type(exc).__name__}: {exc})"
    del triton
    return None


@functools.cache
def cuda_refusal(index: int) -> str | None:
    """Why CUDA device ``index`` cannot run the epilogue GEMM (None: it can); cached per
    index (``cuda_refusal.cache_clear()`` forgets the answers)."""
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        return f"CUDA sm_{major}{minor}: the epilogue GEMM needs sm_90 or later (TMA)"
    return None


@functools.cache
def _programs(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_refusal(device: torch.device) -> str | None:
    """Why the epilogue GEMM cannot run on ``device`` at all (None: it can)."""
    if env.head_gemm() == "cublas":
        return "VTP_HEAD_GEMM=cublas"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device"
        why = cuda_refusal(device.index if device.index is not None else torch.cuda.current_device())
    elif device.type == "cpu":
        why = None if env.triton_interpret() else "CPU tensors outside Triton's interpreter"
    else:
        why = f"device type {device.type!r}: the epilogue GEMM runs on CUDA sm_90+"
    return why or descriptors_refusal()


def call_refusal(
    device: torch.device, dtype: torch.dtype, op: str, features: Iterable[str], options: Mapping[str, Any] | None
) -> str | None:
    """Why a call of ``op`` with these features and options cannot use the epilogue GEMM on
    ``device`` for Head inputs of ``dtype`` (None: it can, where the tensors allow)."""
    why = device_refusal(device)
    if why:
        return why
    if op not in OPS:
        return OPS_REFUSED.get(op, f"{op}: its forward does not take the epilogue's statistics")
    for feature in sorted(features):
        if feature in FEATURES_REFUSED:
            return FEATURES_REFUSED[feature]
    if options is not None and kl_direction(op, options) is not None:
        return "jsd at beta 0 or 1 runs as a KL (whose statistics pass reads both inputs together)"
    low = (torch.bfloat16, torch.float16)
    if dtype not in low and not (device.type == "cpu" and dtype == torch.float32):
        return f"dtype {dtype_name(dtype)}: the epilogue GEMM takes bf16 and fp16"
    return None


def _rows_refusal(name: str, t: torch.Tensor) -> str | None:
    """Why a 2-D operand cannot go through a TMA descriptor (None: it can)."""
    size = t.element_size()
    if t.stride(-1) != 1:
        return f"{name} is not contiguous along its last dimension"
    if (t.shape[-1] * size) % 16 or (t.dim() > 1 and (t.stride(0) * size) % 16):
        return f"{name} rows of {t.shape[-1]} {dtype_name(t.dtype)} elements are not a multiple of 16 bytes (TMA)"
    if t.data_ptr() % 16:
        return f"{name} does not start at a 16-byte aligned address (TMA)"
    return None


def tensors_refusal(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
) -> str | None:
    """Why these Head tensors (``hidden`` as ``[..., H]`` rows; ``out`` the chunk's logits
    buffer, where known) cannot go through the epilogue GEMM (None: they can)."""
    if weight.shape[0] == 0:
        return "an empty vocabulary shard (V_local = 0)"
    if weight.shape[1] == 0:
        return "a hidden size of 0"
    for name, t in (("hidden", hidden), ("weight", weight), ("the logits buffer", out)):
        why = None if t is None else _rows_refusal(name, t if t.dim() == 2 else t.reshape(-1, t.shape[-1]))
        if why:
            return why
    if (weight.shape[0] * weight.element_size()) % 16:
        v_local = f"V_local = {weight.shape[0]} {dtype_name(weight.dtype)}"
        return f"logits rows of {v_local} are not a multiple of 16 bytes (TMA)"
    if bias is not None and bias.stride(0) != 1 and bias.shape[0] > 1:
        return "the bias is not contiguous"
    if weight.is_cuda and weight.shape[0] < MIN_CUDA_V_LOCAL and env.head_gemm() != "triton":
        return (
            f"a vocabulary shard of {weight.shape[0]} rows: below {MIN_CUDA_V_LOCAL} cuBLAS chunks were "
            "measured faster (docs/benchmarks.md, Sixth round); VTP_HEAD_GEMM=triton takes the GEMM anyway"
        )
    return None


def refusal(
    device: torch.device,
    dtype: torch.dtype,
    op: str,
    features: Iterable[str] = (),
    options: Mapping[str, Any] | None = None,
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = (),
) -> str | None:
    """Why Head inputs ``parts`` ``(hidden, weight, bias)`` of a call of ``op`` cannot use
    the epilogue GEMM (None: they can)."""
    why = call_refusal(device, dtype, op, features, options)
    for hidden, weight, bias in parts:
        why = why or tensors_refusal(hidden, weight, bias)
    return why


def route(why: str | None) -> str:
    """The words ``vtp.explain`` and ``vtp-runtime info`` show for a refusal (or None)."""
    return ROUTE if why is None else f"{FALLBACK} ({why})"


# -- launches -------------------------------------------------------------------------------------


def chunk_refusal(call: Call, hidden: torch.Tensor, weight: torch.Tensor, bias, out: torch.Tensor) -> str | None:
    """``refusal`` for one chunk: ``hidden [rows, H]`` into ``out [rows, V_local]``."""
    r = call.request
    return call_refusal(out.device, out.dtype, r.op, r.features, call.options) or tensors_refusal(
        hidden, weight, bias, out
    )


def logits_with_statistics(
    cfg: LaunchConfig, call: Call, hidden: torch.Tensor, weight: torch.Tensor, bias, out: torch.Tensor
) -> torch.Tensor:
    """``out = hidden @ weight.T (+ bias)`` and each vocabulary tile's partial state per row,
    ``[T, 2, rows]`` fp32 (T = ``cdiv(V_local, head_block_n)``), returned. Only where
    ``chunk_refusal`` is None."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, k_dim = hidden.shape
    v_local = weight.shape[0]
    bm, bn, bk = cfg.head_block_m, cfg.head_block_n, cfg.head_block_k
    tiles_n = -(-v_local // bn)
    part = torch.empty((tiles_n, 2, rows), dtype=torch.float32, device=out.device)
    interpreted = out.device.type == "cpu"
    programs = cfg.head_programs or _programs(
        out.device.index if out.device.index is not None else torch.cuda.current_device()
    )
    launch(
        _head_kernels().head_matmul_kernel,
        (min(programs, -(-rows // bm) * tiles_n),),
        cfg.fast_launch,
        h=TensorDescriptor.from_tensor(hidden, [bm, bk]),
        w=TensorDescriptor.from_tensor(weight, [bn, bk]),
        out=TensorDescriptor.from_tensor(out, [bm, bn]),
        bias_ptr=bias if bias is not None else part,  # a tensor for each pointer STATS does not read
        part_ptr=part,
        label_ptr=part,
        idx_ptr=part,
        stat_ptr=part,
        grad_ptr=part,
        n_rows=rows,
        v_local=v_local,
        k_dim=k_dim,
        stride_h=hidden.stride(0),
        stride_w=weight.stride(0),
        stride_out=out.stride(0),
        vocab_start=call.vocab_start,
        vocab_size=call.vocab_size,
        ignore_index=0,
        k2=LOG2E / call.options["temperature"],
        MODE=STATS_MODE,
        HAS_BIAS=bias is not None,
        USE_TMA=True,
        GRAD_PER_ROW=False,
        IEEE=out.dtype == torch.float32 or interpreted,
        UPCAST=interpreted and out.element_size() == 2,  # the interpreter multiplies 16-bit floats as integers
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=cfg.head_group_m,
        PROGRAMS=programs,
        FLATTEN=cfg.head_flatten,
        num_warps=cfg.head_warps,
        num_stages=cfg.head_stages,
    )
    return part


def tile_partials(
    cfg: LaunchConfig,
    call: Call,
    tiles: torch.Tensor,
    part: torch.Tensor,
    z: torch.Tensor,
    *,
    kind: int = 0,
    index: torch.Tensor | None = None,
    pair_side: int | None = None,
) -> None:
    """Merge one input's ``tiles`` (``logits_with_statistics``) into ``part``, the
    ``[splits, N, F]`` partials of a one-input kind ``kind`` (``fields``: CE, LOGPROBS; the
    logits at ``index`` ``[N]`` or ``[N, k]`` read from ``z``) or, with ``pair_side`` 0 / 1,
    the student's / teacher's fields of the two-input partials."""
    splits, n, _ = part.shape
    block = cfg.block_rows
    n_idx = 0 if index is None else (1 if index.dim() == 1 else index.shape[1])
    launch(
        _head_kernels().tile_partials_kernel,
        (-(-n // block),),
        cfg.fast_launch,
        tile_ptr=tiles,
        n_tiles=tiles.shape[0],
        n_rows=n,
        z_ptr=z,
        stride_z=z.stride(0),
        idx_ptr=index if index is not None else tiles,
        n_idx=n_idx,
        v_local=z.shape[-1],
        vocab_start=call.vocab_start,
        ignore_index=int(call.options.get("ignore_index", -100)),
        part_ptr=part,
        splits=splits,
        k2=LOG2E / call.options["temperature"],
        KIND=kind,
        PAIR=pair_side is not None,
        SIDE_B=pair_side == 1,
        BLOCK_T=cfg.head_merge_tiles,
        BLOCK_N=block,
        num_warps=cfg.warps_finish,
    )
