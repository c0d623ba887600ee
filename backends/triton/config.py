"""How the Triton kernels are launched: tile sizes, warps, programs per pass. The CUDA and
interpreter configurations; the XPU backend has its own (``backends/triton_xpu``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property


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
    block_reduce: int = 1024  # a call reduced in the kernels: the tile of its last program
    # split rows at one rank: the last program of a row merges the row's partials (an
    # arrival counter per row) instead of a finishing launch
    merge_rows: bool = True
    decode_rows: int = 1  # a TP = 1 argmax / sample in one launch: rows per program (a power of two)
    # its tile (columns) and warps: each program walks its rows' vocabulary once per pass, so at
    # few rows a pass is bound by one program's latency per tile; a top-k / top-p draw bisects
    # (many passes) and takes the larger tile (benchmarks/decode_tiles.py)
    decode_block: int = 8192
    decode_warps: int = 16
    decode_bisect_block: int = 16384
    decode_bisect_warps: int = 32
    warps_finish: int = 4
    block_scale: int = 2048  # scaling a fused head's gradients in backward: tile, warps, programs
    warps_scale: int = 4
    scale_programs: int = 8192
    # JSD: the hardware lg2.approx through inline PTX. NVIDIA only, so off unless a config
    # asks for it (CUDA_CONFIG does); other targets get Triton's portable tl.log2.
    fast_log2: bool = False
    # launch a kernel already compiled for these arguments through its launcher, without
    # Triton's per-launch JIT dispatch (launch.py); checked on CUDA with triton 3.6 and 3.9
    fast_launch: bool = False
    # the fused head's logits GEMM with the softmax statistics in its epilogue
    # (head_gemm.py): output tile rows x columns x K step, row tiles walked together along
    # the vocabulary, software pipeline stages, warps, persistent programs (0: one per SM).
    # CUDA's are the configuration benchmarks/head_variants.py measures first on the H200.
    head_block_m: int = 128
    head_block_n: int = 256
    head_block_k: int = 64
    head_group_m: int = 16
    head_stages: int = 3
    head_warps: int = 8
    head_flatten: bool = True
    head_programs: int = 0
    head_merge_tiles: int = 16  # tile partials merged per step, per block of block_rows rows

    # every call plan's key holds the config: its hash is computed once, not per call
    @cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    def __hash__(self) -> int:
        return self._hash


CUDA_CONFIG = LaunchConfig(fast_log2=True, fast_launch=True)
# Triton's interpreter runs programs one by one in numpy: small tiles keep the tests fast
# and make the small test shapes cover several tiles and several splits per row.
INTERPRETER_CONFIG = LaunchConfig(
    block_stats=16,
    warps_stats=1,
    block_div=16,
    warps_div=1,
    block_bwd=32,
    warps_bwd=1,
    target_programs=16,
    max_splits=4,
    bwd_target_programs=16,
    block_rows=16,
    block_reduce=16,
    decode_rows=16,
    decode_block=16,
    decode_warps=1,
    decode_bisect_block=16,
    decode_bisect_warps=1,
    warps_finish=1,
    block_scale=16,
    warps_scale=1,
    scale_programs=4,
    head_block_m=16,
    head_block_n=16,
    head_block_k=16,
    head_group_m=2,
    head_stages=1,
    head_warps=1,
    head_flatten=False,
    head_programs=3,
    head_merge_tiles=4,
)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints."""
    return -(-a // b)


def vocab_splits(n: int, v_per_rank: int, block: int, target: int, max_splits: int) -> int:
    """How many chunks each of ``n`` rows' local vocabulary is cut into for a forward pass
    (see ``LaunchConfig.target_programs``): at most one per tile of the (even) shard."""
    tiles = max(1, cdiv(v_per_rank, block))
    return max(1, min(cdiv(target, max(n, 1)), tiles, max_splits))


def split_chunk(v_local: int, splits: int, block: int) -> int:
    """The columns of one of ``splits`` chunks of a local vocabulary: whole tiles."""
    return max(block, cdiv(cdiv(v_local, splits), block) * block)
