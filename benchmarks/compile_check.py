"""Compile every kernel variant for an sm_90 (H100/H200) target without a GPU.

Catches Triton compile errors (types, loop-carried values, constexpr branches) before any
device time is spent, and prints registers/spills per kernel. Run without TRITON_INTERPRET:
    python benchmarks/compile_check.py
"""

import inspect
import itertools
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from vtp_runtime.backends.triton import kernels as K  # noqa: E402
from vtp_runtime.backends.triton import sampling_kernels as S  # noqa: E402
from vtp_runtime.backends.triton.backend import CUDA_CONFIG as C  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
INT_ARGS = {
    "rows_b",
    "stride_a",
    "stride_b",
    "n_idx",
    "n_rows",
    "v_local",
    "vocab_start",
    "splits",
    "chunk",
    "ignore_index",
    "n_parts",
    "vocab_size",
    "sa_a",
    "sa_b",
    "sb_a",
    "sb_b",
    "ss_a",
    "ss_b",
    "st_a",
    "st_b",
    "n_stats_parts",
    "g_row",
    "g_col",
    "seed_key",
    "row_offset",
    "top_k",
}
FLOAT_ARGS = {"k2", "inv_t", "smoothing", "z_loss", "beta", "scale_s", "scale_b", "top_p", "log2_min_p"}


def signature(fn, dtype: str, const: dict) -> dict:
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in const:
            sig[name] = "constexpr"
        elif name in INT_ARGS:
            sig[name] = (
                "i64" if name.startswith(("s", "stride", "g_")) and name not in ("splits", "seed_key") else "i32"
            )
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        elif name in ("z_ptr", "a_ptr", "b_ptr", "s_ptr", "t_ptr", "dz_ptr", "da_ptr", "db_ptr"):
            sig[name] = f"*{dtype}"
        elif name in ("idx_ptr", "out_ptr") and fn is S.decode_kernel:
            sig[name] = "*i64"
        elif name == "keep_ptr":
            sig[name] = "*u8"
        elif name == "red_ptr":
            sig[name] = "*i32"
        else:
            sig[name] = "*fp32"
    return sig


def compile_one(fn, dtype, const, num_warps):
    src = ASTSource(fn=fn, signature=signature(fn, dtype, const), constexprs=const)
    k = triton.compile(src, target=TARGET, options={"num_warps": num_warps})
    return k


def main() -> int:
    jobs = []
    for dt in ("bf16", "fp16", "fp32"):
        for kind, smooth, keep, ent, finish, reduce in itertools.product(
            (0, 1, 2), (False, True), (False, True), (False, True), (False, True), (0, 2)
        ):
            if ent and kind != 1:  # WITH_ENTROPY: log-probs only
                continue
            if ent and reduce:  # two outputs: the core reduces
                continue
            jobs.append(
                (
                    K.stats1_kernel,
                    dt,
                    dict(
                        KIND=kind,
                        SMOOTH=smooth,
                        ZLOSS=smooth,
                        HAS_KEEP=keep,
                        WITH_ENTROPY=ent,
                        FINISH=finish,
                        MERGE=not finish,
                        REDUCE=reduce,
                        BLOCK=C.block_stats,
                        BLOCK_REDUCE=C.block_reduce,
                    ),
                    C.warps_stats,
                )
            )
            if finish or reduce == 2 and (smooth or keep):  # the backward kernel has no FINISH
                continue
            jobs.append(
                (
                    K.backward1_kernel,
                    dt,
                    dict(
                        KIND=kind,
                        SMOOTH=smooth,
                        ZLOSS=smooth,
                        HAS_KEEP=keep,
                        WITH_ENTROPY=ent,
                        MEAN=reduce == 2,
                        BLOCK=C.block_bwd,
                    ),
                    C.warps_bwd,
                )
            )
        for with_kl, keep in itertools.product((False, True), (False, True)):
            jobs.append(
                (
                    K.stats2_kernel,
                    dt,
                    dict(
                        WITH_KL=with_kl,
                        HAS_KEEP=keep,
                        FINISH=False,
                        MERGE=with_kl,
                        REDUCE=2 if with_kl else 0,
                        BLOCK=C.block_stats,
                        BLOCK_REDUCE=C.block_reduce,
                    ),
                    C.warps_stats,
                )
            )
        jobs.append(
            (
                K.stats2_kernel,
                dt,
                dict(
                    WITH_KL=True,
                    HAS_KEEP=True,
                    FINISH=True,
                    MERGE=False,
                    REDUCE=2,
                    BLOCK=C.block_stats,
                    BLOCK_REDUCE=C.block_reduce,
                ),
                C.warps_stats,
            )
        )
        for merge in (False, True):
            const = dict(HAS_KEEP=merge, FAST_LOG2=True, MERGE=merge, REDUCE=2 if merge else 0)
            jobs.append(
                (K.jsd_div_kernel, dt, {**const, "BLOCK": C.block_div, "BLOCK_REDUCE": C.block_reduce}, C.warps_div)
            )
        for keep in (False, True):
            jobs.append(
                (
                    K.jsd_row_kernel,
                    dt,
                    dict(
                        HAS_KEEP=keep,
                        FAST_LOG2=True,
                        REDUCE=2 if keep else 1,
                        BLOCK_STATS=C.block_stats,
                        BLOCK_DIV=C.block_div,
                        BLOCK_REDUCE=C.block_reduce,
                    ),
                    C.warps_div,
                )
            )
        for kind, na, nb in itertools.product((0, 1), (True, False), (True, False)):
            if na or nb:
                jobs.append(
                    (
                        K.backward2_kernel,
                        dt,
                        dict(
                            KIND=kind,
                            NEED_A=na,
                            NEED_B=nb,
                            HAS_KEEP=True,
                            FAST_LOG2=kind == 1,
                            MEAN=na,
                            BLOCK=C.block_bwd,
                        ),
                        C.warps_bwd,
                    )
                )
    for kind, smooth, ent in itertools.product((0, 1, 2), (False, True), (False, True)):
        if ent and kind != 1:
            continue
        jobs.append(
            (
                K.finish1_kernel,
                "fp32",
                dict(
                    KIND=kind,
                    SMOOTH=smooth,
                    ZLOSS=smooth,
                    HAS_KEEP=True,
                    WITH_ENTROPY=ent,
                    REDUCE=0 if ent else 2,
                    BLOCK_N=C.block_rows,
                    BLOCK_REDUCE=C.block_reduce,
                ),
                C.warps_finish,
            )
        )
    for kind in (0, 1):
        const = dict(KIND=kind, HAS_KEEP=True, REDUCE=2, BLOCK_N=C.block_rows, BLOCK_REDUCE=C.block_reduce)
        jobs.append((K.finish2_kernel, "fp32", const, C.warps_finish))
    # the one-launch sampling kernel: argmax, the plain draw, each restriction and all at once
    grain = {"bf16": 16, "fp16": 13, "fp32": 0}
    for dt, (gumbel, k, p, mp) in itertools.product(
        ("bf16", "fp16", "fp32"),
        (
            (False, False, False, False),
            (True, False, False, False),
            (True, True, False, False),
            (True, False, True, False),
            (True, False, False, True),
            (True, True, True, True),
        ),
    ):
        const = dict(
            GUMBEL=gumbel,
            TOP_K=k,
            TOP_P=p,
            MIN_P=mp,
            GRAIN=grain[dt],
            FAST_LOG2=True,
            ROWS=C.decode_rows,
            BLOCK=C.decode_bisect_block if (k or p) else C.decode_block,
        )
        jobs.append((S.decode_kernel, dt, const, C.decode_bisect_warps if (k or p) else C.decode_warps))
    failed = 0
    for fn, dt, const, warps in jobs:
        try:
            k = compile_one(fn, dt, const, warps)
            n_regs = getattr(k, "n_regs", None)
            n_spills = getattr(k, "n_spills", None)
            meta = k.metadata
            print(
                f"ok   {fn.__name__:18s} {dt:5s} {const} regs={n_regs} spills={n_spills} "
                f"shared={getattr(meta, 'shared', '?')}"
            )
        except Exception as exc:  # report every failure, not just the first
            failed += 1
            print(f"FAIL {fn.__name__} {dt} {const}: {type(exc).__name__}: {str(exc)[:2000]}")
    print(f"{len(jobs) - failed}/{len(jobs)} compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())


def registers(fn, dtype, const, num_warps):
    """(registers per thread, spill bytes) from ptxas -v on the compiled PTX (no GPU needed)."""
    import re
    import subprocess
    import tempfile

    k = compile_one(fn, dtype, const, num_warps)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    res = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    text = res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else None
