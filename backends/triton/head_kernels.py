"""Triton kernels of a fused head whose loss work rides in the logits matmul: a persistent
matmul ``z = h @ W.T (+ bias)`` over one token chunk and this rank's vocabulary shard, whose
epilogue works on the tile it holds in registers, and the two row kernels around it
(cross entropy), and ``tile_partials_kernel``, which hands the matmul's partials to the
backend's finishing kernels. No torch, no launch logic (``head_gemm.py`` launches the matmul
and ``tile_partials_kernel`` for the backend, ``benchmarks/head_variants.py`` all of them).

Units and partial states are those of ``kernels.py``: exponents ``(z - a) * k2`` with
``k2 = log2(e) / T``, sums in base 2, a partial state ``(m, s)`` with ``m`` the true max and
``s = sum exp2((z - anchor(m)) * k2)``. Statistics are computed from the logits as stored
(rounded to the output dtype), so that they agree exactly with what the gradient pass reads,
as on materialized logits.

Partials are ``[T, 2, M]`` fp32 (T vocabulary tiles or splits; field 0 the max, 1 the sum;
rows contiguous, so that the matmul's epilogue and the finishing kernel both touch them
coalesced). Row statistics are ``[M, 2]`` fp32 (anchor, log2 sum), as ``kernels.py`` saves.

The matmul (``head_matmul_kernel``) walks the ``BLOCK_M x BLOCK_N`` output tiles with
``PROGRAMS`` persistent programs, ``GROUP_M`` row tiles at a time along the vocabulary (a
chunk has few row tiles and the weight many: each weight tile is then read from memory once
and the chunk's hidden rows stay in L2). Operands come through TMA descriptors
(``USE_TMA``, Hopper and later, 16-byte aligned rows) or plain pointer loads (any GPU, any
stride, Triton's interpreter). One of four epilogues (``MODE``):

- ``LOGITS``: store z (a plain matmul, to compare with the BLAS);
- ``STATS``: store z and each tile's partial state per row: the statistics pass over the
  logits is done where they are computed;
- ``STATS_ONLY``: the partial states and the label's logit, nothing stored (the forward of
  per-token results, whose backward computes the logits again);
- ``GRAD``: the logits gradient ``(p - onehot(y)) * g`` from the saved row statistics,
  stored instead of z (that backward: no pass over the logits at all).
"""

import triton
import triton.language as tl

from .kernels import CE, CE_FIELDS, LN2, LOGPROBS_FIELDS, P_INDEX, P_LABEL, P_MAX, P_MAX_A, P_MAX_B, PAIR_FIELDS

LOGITS = tl.constexpr(0)
STATS = tl.constexpr(1)
STATS_ONLY = tl.constexpr(2)
GRAD = tl.constexpr(3)


@triton.jit
def _anchor(m):
    # finite reference point of a partial state (0 when it saw nothing finite)
    return tl.where(m > float("-inf"), m, 0.0)


@triton.jit
def _merge_partials(part_ptr, n_parts, rows, rmask, n_rows, k2, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each row's ``(max, sum)`` merged from ``[P, 2, M]`` partials, ``BLOCK_P`` at a time."""
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        mask = (ps < n_parts)[:, None] & rmask[None, :]
        src = part_ptr + ps[:, None] * 2 * n_rows + rows[None, :]
        mp = tl.load(src, mask=mask, other=float("-inf"))
        sp = tl.load(src + n_rows, mask=mask, other=0.0)
        m_new = tl.maximum(m, tl.max(mp, 0))
        a_new = _anchor(m_new)
        # exp2((m - a) k2) is 0 for an empty state (m = -inf), whatever a is
        s = s * tl.exp2((m - a_new) * k2) + tl.sum(sp * tl.exp2((mp - a_new[None, :]) * k2), 0)
        m = m_new
    return m, s


@triton.jit
def _tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row tile, vocabulary tile) of the ``tile``-th output tile: row tiles vary fastest
    within a group of ``GROUP_M`` of them, so that consecutive programs share a weight tile."""
    per_group = GROUP_M * tiles_n
    group = tile // per_group
    first = group * GROUP_M
    size = tl.minimum(tiles_m - first, GROUP_M)
    pid_m = first + (tile % per_group) % size
    pid_n = (tile % per_group) // size
    return pid_m, pid_n


@triton.jit
def _coefficient(y, grad, log_s, vocab_size, ignore_index):
    """Per row: the upstream gradient where the label counts, NaN for a bad label or an all
    -inf row (whose value is NaN), 0 for an ignored label."""
    keep = y != ignore_index
    bad = keep & ((y < 0) | (y >= vocab_size))
    coef = tl.where(bad | (log_s == float("-inf")), float("nan"), grad)
    return keep, coef


@triton.jit
def head_matmul_kernel(
    h,
    w,
    out,
    bias_ptr,
    part_ptr,
    label_ptr,
    idx_ptr,
    stat_ptr,
    grad_ptr,
    n_rows,
    v_local,
    k_dim,
    stride_h,
    stride_w,
    stride_out,
    vocab_start,
    vocab_size,
    ignore_index,
    k2,
    MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_TMA: tl.constexpr,
    GRAD_PER_ROW: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """``h [M, K] @ w[V, K].T`` tile by tile, with the epilogue ``MODE`` (module docstring).
    With ``USE_TMA`` ``h``, ``w`` and ``out`` are tensor descriptors of blocks
    ``[BLOCK_M, BLOCK_K]``, ``[BLOCK_N, BLOCK_K]``, ``[BLOCK_M, BLOCK_N]``; else pointers
    with row strides ``stride_*``. ``out`` ``[M, V]`` is z (LOGITS, STATS) or dz (GRAD).
    ``part_ptr``: ``[cdiv(V, BLOCK_N), 2, M]`` partials (STATS, STATS_ONLY);
    ``label_ptr``: ``[M]`` fp32, zeroed, the label's logit where this shard owns it
    (STATS_ONLY); ``idx_ptr``: int64 labels ``[M]`` (STATS_ONLY, GRAD); ``stat_ptr``:
    ``[M, 2]`` row statistics and ``grad_ptr`` the upstream gradient, ``[M]`` or one value
    (GRAD). ``IEEE``: full fp32 products for fp32 inputs; ``UPCAST``: 16-bit operands
    converted to fp32 before the product (for Triton's interpreter only)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(n_rows, BLOCK_M)
    tiles_n = tl.cdiv(v_local, BLOCK_N)
    k_tiles = tl.cdiv(k_dim, BLOCK_K)
    if USE_TMA:
        dtype = out.dtype
    else:
        dtype = out.dtype.element_ty
    for tile in tl.range(pid, tiles_m * tiles_n, PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = _tile(tile, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(k_tiles):
            off_k = kt * BLOCK_K
            if USE_TMA:
                a = h.load([off_m, off_k])
                b = w.load([off_n, off_k])
            else:
                ks = off_k + tl.arange(0, BLOCK_K)
                a = tl.load(
                    h + rows[:, None].to(tl.int64) * stride_h + ks[None, :],
                    mask=(rows[:, None] < n_rows) & (ks[None, :] < k_dim),
                    other=0.0,
                )
                b = tl.load(
                    w + cols[:, None].to(tl.int64) * stride_w + ks[None, :],
                    mask=(cols[:, None] < v_local) & (ks[None, :] < k_dim),
                    other=0.0,
                )
            if UPCAST:  # Triton's interpreter multiplies 16-bit floats as integers
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        col_ok = cols < v_local
        row_ok = rows < n_rows
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        zq = acc.to(dtype)  # the logits as stored: the statistics and the gradient read these
        if MODE == GRAD:
            a_row = tl.load(stat_ptr + rows * 2, mask=row_ok, other=0.0)
            log_s = tl.load(stat_ptr + rows * 2 + 1, mask=row_ok, other=0.0)
            y = tl.load(idx_ptr + rows, mask=row_ok, other=ignore_index)
            if GRAD_PER_ROW:
                g = tl.load(grad_ptr + rows, mask=row_ok, other=0.0)
            else:
                g = tl.load(grad_ptr)
            keep, coef = _coefficient(y, g, log_s, vocab_size, ignore_index)
            p = tl.exp2((zq.to(tl.float32) - a_row[:, None]) * k2 - log_s[:, None])
            d = tl.where(cols[None, :] == (y - vocab_start)[:, None], p - 1.0, p) * coef[:, None]
            result = tl.where(keep[:, None], d, 0.0).to(dtype)
        else:
            result = zq
        if MODE != STATS_ONLY:
            if USE_TMA:
                out.store([off_m, off_n], result)
            else:
                tl.store(
                    out + rows[:, None].to(tl.int64) * stride_out + cols[None, :],
                    result,
                    mask=row_ok[:, None] & col_ok[None, :],
                )
        if MODE == STATS or MODE == STATS_ONLY:
            zf = tl.where(col_ok[None, :], zq.to(tl.float32), float("-inf"))
            m = tl.max(zf, 1)
            s = tl.sum(tl.exp2((zf - _anchor(m)[:, None]) * k2), 1)
            base = part_ptr + pid_n * 2 * n_rows
            tl.store(base + rows, m, mask=row_ok)
            tl.store(base + n_rows + rows, s, mask=row_ok)
            if MODE == STATS_ONLY:
                y_local = tl.load(idx_ptr + rows, mask=row_ok, other=-1) - vocab_start
                hit = cols[None, :] == y_local[:, None]
                picked = tl.sum(tl.where(hit, zf, 0.0), 1)
                mine = row_ok & (y_local >= off_n) & (y_local < off_n + BLOCK_N) & (y_local < v_local)
                tl.store(label_ptr + rows, picked, mask=mine)


@triton.jit(do_not_specialize=["n_rows", "splits"])
def head_ce_stats_kernel(
    z_ptr,
    stride_z,
    part_ptr,
    n_rows,
    v_local,
    splits,
    chunk,
    k2,
    BLOCK: tl.constexpr,
):
    """The statistics pass over stored logits ``[M, V]`` (a matmul without the STATS
    epilogue): one program per (row, vocabulary split), its partial state into
    ``[splits, 2, M]``."""
    pid = tl.program_id(0)
    row = pid // splits
    split = pid % splits
    lo = split * chunk
    hi = tl.minimum(lo + chunk, v_local)
    src = z_ptr + row.to(tl.int64) * stride_z
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(src + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        a_new = _anchor(m_new)
        s = s * tl.exp2((m - a_new) * k2) + tl.sum(tl.exp2((z - a_new) * k2), 0)
        m = m_new
    base = part_ptr + split * 2 * n_rows
    tl.store(base + row, m)
    tl.store(base + n_rows + row, s)


@triton.jit(do_not_specialize=["n_parts", "n_rows"])
def head_ce_finish_kernel(
    part_ptr,
    n_parts,
    n_rows,
    z_ptr,
    stride_z,
    label_ptr,
    idx_ptr,
    val_ptr,
    stat_ptr,
    v_local,
    vocab_start,
    vocab_size,
    ignore_index,
    k2,
    LABEL_FROM_Z: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Merge the ``[P, 2, M]`` partials into each row's statistics ``[M, 2]`` and its cross
    entropy (nats; 0 for an ignored label, NaN for a bad one or an all -inf row), ``BLOCK_P``
    partials of ``BLOCK_N`` rows at a time (a matmul leaves hundreds of partials per row). The
    label's logit is read from the stored logits (``LABEL_FROM_Z``) or from ``label_ptr``."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    m, s = _merge_partials(part_ptr, n_parts, rows, rmask, n_rows, k2, BLOCK_P, BLOCK_N)
    a = _anchor(m)
    log_s = tl.log2(s)
    y = tl.load(idx_ptr + rows, mask=rmask, other=ignore_index)
    y_local = y - vocab_start
    if LABEL_FROM_Z:
        mine = rmask & (y_local >= 0) & (y_local < v_local)
        picked = tl.load(z_ptr + rows.to(tl.int64) * stride_z + y_local, mask=mine, other=0.0).to(tl.float32)
    else:
        picked = tl.load(label_ptr + rows, mask=rmask, other=0.0)
    keep = y != ignore_index
    bad = keep & ((y < 0) | (y >= vocab_size))
    val = (log_s - (picked - a) * k2) * LN2
    val = tl.where(bad | (s == 0), float("nan"), val)
    tl.store(val_ptr + rows, tl.where(keep, val, 0.0), mask=rmask)
    tl.store(stat_ptr + rows * 2, a, mask=rmask)
    tl.store(stat_ptr + rows * 2 + 1, log_s, mask=rmask)


@triton.jit(do_not_specialize=["splits"])
def head_ce_grad_kernel(
    z_ptr,
    stride_z,
    idx_ptr,
    stat_ptr,
    grad_ptr,
    v_local,
    vocab_start,
    vocab_size,
    ignore_index,
    k2,
    splits,
    chunk,
    GRAD_PER_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The logits gradient ``(p - onehot(y)) * g`` written over the logits ``[M, V]`` in
    place (each program reads a tile before it writes it; nothing else reads it after): one
    program per (row, vocabulary split). Ignored rows read nothing and write zeros."""
    pid = tl.program_id(0)
    row = pid // splits
    lo = (pid % splits) * chunk
    hi = tl.minimum(lo + chunk, v_local)
    src = z_ptr + row.to(tl.int64) * stride_z
    a = tl.load(stat_ptr + row * 2)
    log_s = tl.load(stat_ptr + row * 2 + 1)
    y = tl.load(idx_ptr + row)
    if GRAD_PER_ROW:
        g = tl.load(grad_ptr + row)
    else:
        g = tl.load(grad_ptr)
    keep, coef = _coefficient(y, g, log_s, vocab_size, ignore_index)
    y_local = y - vocab_start
    hi_read = tl.where(keep, hi, lo)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(src + cols, mask=cols < hi_read, other=0.0).to(tl.float32)
        p = tl.exp2((z - a) * k2 - log_s)
        d = tl.where(cols == y_local, p - 1.0, p) * coef
        d = tl.where(keep, d, 0.0)
        tl.store(src + cols, d.to(z_ptr.dtype.element_ty), mask=cols < hi)


@triton.jit(do_not_specialize=["n_tiles", "n_rows", "splits"])
def tile_partials_kernel(
    tile_ptr,
    n_tiles,
    n_rows,
    z_ptr,
    stride_z,
    idx_ptr,
    n_idx,
    v_local,
    vocab_start,
    ignore_index,
    part_ptr,
    splits,
    k2,
    KIND: tl.constexpr,
    PAIR: tl.constexpr,
    SIDE_B: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One input's ``[T, 2, M]`` tile partials (a STATS matmul's) merged into one partial
    state per row, written as split 0 of the ``[splits, M, F]`` partials of ``kernels.py``
    that ``stats1_kernel`` / ``stats2_kernel`` would have written, splits 1 .. S-1 left
    empty (max -inf, sums 0): the partials have the statistics pass's shape, so ranks that
    computed their logits either way gather and merge them together.

    One input (``KIND`` CE or LOGPROBS, not ``PAIR``): the fields ``[m, s, ...]`` and the
    logits at the row's ``n_idx`` index entries read from the stored logits ``z`` (0 where
    this shard does not own the entry or it is ``ignore_index``; CE's moment and count, read
    only with label smoothing, 0). ``PAIR`` (JSD): ``[m, s]`` of input a (student) or, with
    ``SIDE_B``, of input b (teacher); the other input's fields are left alone."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    m, s = _merge_partials(tile_ptr, n_tiles, rows, rmask, n_rows, k2, BLOCK_T, BLOCK_N)
    if PAIR:
        n_fields = PAIR_FIELDS
        first = P_MAX_B if SIDE_B else P_MAX_A
    elif KIND == CE:
        n_fields = CE_FIELDS
        first = P_MAX
    else:
        n_fields = LOGPROBS_FIELDS + n_idx
        first = P_MAX
    for split in range(splits):
        out = part_ptr + (split * n_rows + rows) * n_fields
        tl.store(out + first, tl.where(split == 0, m, float("-inf")), mask=rmask)
        tl.store(out + first + 1, tl.where(split == 0, s, 0.0), mask=rmask)
        if not PAIR:
            if KIND == CE:
                tl.store(out + first + 2, tl.zeros([BLOCK_N], tl.float32), mask=rmask)  # moment, count
                tl.store(out + first + 3, tl.zeros([BLOCK_N], tl.float32), mask=rmask)
                pick = P_LABEL
            else:
                pick = P_INDEX
            for j in range(n_idx):
                i = tl.load(idx_ptr + rows * n_idx + j, mask=rmask, other=ignore_index)
                local = i - vocab_start
                mine = rmask & (split == 0) & (i != ignore_index) & (local >= 0) & (local < v_local)
                zj = tl.load(z_ptr + rows.to(tl.int64) * stride_z + local, mask=mine, other=0.0).to(tl.float32)
                tl.store(out + pick + j, zj, mask=rmask)
