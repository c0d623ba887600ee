"""Triton kernels of the vocabulary-parallel ops. No torch, no launch logic: ``backend.py``
launches these with a ``LaunchConfig`` (the XPU backend launches the same kernels).

Units. Maxima and anchors stay in raw logit units and every exponent is
``(z - a) * k2`` with ``k2 = log2(e) / T``: the subtraction of two nearby fp32 numbers is
exact, so a large common offset (1e4) cancels before any rounding, and temperature and
log2(e) fold into one multiply. Sums are in base 2 (``p = exp2((z - a) * k2 - log2 s)``);
values turn into nats (``* LN2``) at the very end. exp2/log2 are single instructions.

Max-rescaled partial sums. A partial state over some columns of a row is ``(m, s, ...)``:
``m`` the true max of ``z`` (``-inf`` when there was nothing finite),
``s = sum exp2((z - a) * k2)`` with the finite *anchor* ``a = m if m > -inf else 0``, and
extra sums relative to the same anchor. Two states merge exactly by moving both to the larger anchor; tiles, vocabulary
splits and ranks all merge with the same rule, so a row is read once and the per-rank
partials combine after one collective. The anchor is never -inf, so no ``-inf - -inf`` NaN
appears unless the row really is all ``-inf`` (where NaN is the contract).

Layouts. Logits rows may be strided: row ``r`` starts at
``(r // rows_b) * stride_a + (r % rows_b) * stride_b`` (a 3-D ``[A, B, V]`` view such as
``logits[:, :-1]`` has ``rows_b = B``; a 2-D tensor has ``rows_b = N, stride_a = 0``).
Partials are ``[P, N, F]`` fp32 (P = splits x ranks) and saved statistics ``[N, S]`` fp32;
``fields.py`` gives F and S, the offsets of the fields are named below. Gradients are
written contiguous.
Each stats/divergence/backward program handles one row and one contiguous chunk of its
local vocabulary (``pid = row * splits + split``), so few rows still fill the GPU.

Numbers that follow a call's token count (``n_rows``, ``rows_b``, ``splits``, ``n_parts``,
a gradient's size) are ``do_not_specialize``: the JIT would otherwise compile a kernel for
each of their classes (1, multiples of 16, the rest), so that a job whose token count
changes every step would compile new kernels, and keep them in host memory, long after
its first steps.
"""

import triton
import triton.language as tl

from . import fields

# Kernels read only constexpr globals. The field counts shared with backend.py, from fields.py:
CE = tl.constexpr(fields.CE)
LOGPROBS = tl.constexpr(fields.LOGPROBS)
ENTROPY = tl.constexpr(fields.ENTROPY)
KL = tl.constexpr(fields.KL)
JSD = tl.constexpr(fields.JSD)
CE_FIELDS = tl.constexpr(fields.CE_FIELDS)
LOGPROBS_FIELDS = tl.constexpr(fields.LOGPROBS_FIELDS)
LOGPROBS_ENTROPY_FIELDS = tl.constexpr(fields.LOGPROBS_ENTROPY_FIELDS)
ENTROPY_FIELDS = tl.constexpr(fields.ENTROPY_FIELDS)
PAIR_FIELDS = tl.constexpr(fields.PAIR_FIELDS)
KL_FIELDS = tl.constexpr(fields.KL_FIELDS)
DIV_FIELDS = tl.constexpr(fields.DIV_FIELDS)
STATS = tl.constexpr(fields.STATS)
ENTROPY_STATS = tl.constexpr(fields.ENTROPY_STATS)
KL_STATS = tl.constexpr(fields.KL_STATS)
JSD_STATS = tl.constexpr(fields.JSD_STATS)

# Where each field sits in a row of partials (P_) or of saved statistics (S_).
P_MAX = tl.constexpr(0)  # every partial state starts with (max, sum)
P_SUM = tl.constexpr(1)
P_MOMENT = tl.constexpr(2)  # CE: sum (z - a) k2 (label smoothing); entropy: sum e (z - a) k2
P_COUNT = tl.constexpr(3)  # CE: columns counted in that sum
P_LABEL = tl.constexpr(4)  # CE: the label's raw logit (0 where this chunk does not own it)
P_INDEX = tl.constexpr(2)  # logprobs: raw logits at index entries 0 .. k-1 (0 where not owned)
P_INDEX_AFTER_MOMENT = tl.constexpr(3)  # logprobs with the entropy: the same after [max, sum, moment]
P_MAX_A = tl.constexpr(0)  # two inputs
P_SUM_A = tl.constexpr(1)
P_MAX_B = tl.constexpr(2)
P_SUM_B = tl.constexpr(3)
P_KL = tl.constexpr(4)  # KL: sum e_a ((z_a - a_a) - (z_b - a_b)) k2
P_KL_S = tl.constexpr(0)  # JSD divergence pass
P_KL_T = tl.constexpr(1)
S_ANCHOR = tl.constexpr(0)  # one input
S_LOG2_SUM = tl.constexpr(1)
S_ENTROPY = tl.constexpr(2)
S_ANCHOR_A = tl.constexpr(0)  # two inputs (JSD: a = student, b = teacher)
S_LOG2_SUM_A = tl.constexpr(1)
S_ANCHOR_B = tl.constexpr(2)
S_LOG2_SUM_B = tl.constexpr(3)
S_KL_A = tl.constexpr(4)  # KL: KL(A || B); JSD: KL(p_s || M)
S_KL_B = tl.constexpr(5)  # JSD: KL(p_t || M)

REDUCE_NONE = tl.constexpr(fields.REDUCE_NONE)
REDUCE_SUM = tl.constexpr(fields.REDUCE_SUM)
REDUCE_MEAN = tl.constexpr(fields.REDUCE_MEAN)
R_DONE = tl.constexpr(fields.R_DONE)
R_COUNT = tl.constexpr(fields.R_COUNT)
R_ROWS = tl.constexpr(fields.R_ROWS)

LN2 = tl.constexpr(0.6931471805599453)
# The smallest normal fp32: the JSD mixture is clamped to it before its log2, so that the
# fast .ftz log2 never sees a denormal and a mixture that flushed to 0 stays finite.
MIN_NORMAL = tl.constexpr(1.1754944e-38)
# A finite floor for log-probs in bits (exp2 of it is exactly 0): p * (max(lp, floor) - lm)
# is then 0 where p = 0 (the 0 log 0 = 0 rule) in one op, where lp = -inf would give NaN.
LOGP_FLOOR = tl.constexpr(-1e30)


@triton.jit
def _anchor(m):
    # finite reference point of a partial state (0 when the state saw nothing finite)
    return tl.where(m > float("-inf"), m, 0.0)


@triton.jit
def _log2(x, FAST: tl.constexpr):
    # tl.log2 lowers to an accurate libdevice polynomial (~20 FMAs per element on sm_90),
    # which made the JSD divergence and backward passes ALU-bound. On NVIDIA, FAST uses the
    # hardware lg2.approx (one MUFU op, rel. error ~2^-22); other targets keep tl.log2.
    if FAST:
        # .ftz: callers clamp x to the smallest normal float, so no denormal ever reaches it
        return tl.inline_asm_elementwise(
            "lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.log2(x)


@triton.jit
def _entropy_moment(t, s, shift, alpha, e, x):
    # sum e (z - a) k2: the running state (t, s) moved to the tile's new anchor, plus the
    # tile's terms. The floor makes e x exactly 0 where e = 0 (x = -inf: the 0 log 0 = 0
    # rule) in the multiply itself. One block sum per tile measured faster than per-lane
    # terms with one reduction per row (docs/benchmarks.md, "Log-probs with the entropy").
    return alpha * (t + s * shift) + tl.sum(e * tl.maximum(x, LOGP_FLOOR), 0)


@triton.jit
def _row_start(base, row, rows_b, stride_a, stride_b):
    r = row.to(tl.int64)
    return base + (r // rows_b) * stride_a + (r % rows_b) * stride_b


@triton.jit
def _chunk(pid, splits, chunk, v_local):
    row = pid // splits
    lo = (pid % splits) * chunk
    hi = tl.minimum(lo + chunk, v_local)
    return row, lo, hi


# -- one-input ops: cross entropy, log-probs, entropy -------------------------------------------


@triton.jit
def _ce_value(
    log_s,
    picked,
    a,
    t,
    y,
    vocab_size,
    k2,
    ignore_index,
    smoothing,
    z_loss,
    empty,
    SMOOTH: tl.constexpr,
    ZLOSS: tl.constexpr,
):
    """Cross entropy in nats from a row's merged state (``picked``: the label's raw logit);
    NaN for a bad label or an all -inf row, 0 for an ignored one. Rows or scalars."""
    keep = y != ignore_index
    bad = keep & ((y < 0) | (y >= vocab_size))
    val = (1.0 - smoothing) * (log_s - (picked - a) * k2)
    if SMOOTH:
        val += smoothing * (log_s - t / vocab_size)
    val = val * LN2
    if ZLOSS:
        lse = (a * k2 + log_s) * LN2
        val += z_loss * lse * lse
    val = tl.where(bad | empty, float("nan"), val)
    return tl.where(keep, val, 0.0)


@triton.jit
def _logprob_value(log_s, picked, a, i, vocab_size, k2, ignore_index, empty):
    """log p at index entry ``i`` in nats (``picked``: its raw logit); NaN for a bad index or
    an all -inf row, 0 for an ignored entry."""
    keep = i != ignore_index
    bad = keep & ((i < 0) | (i >= vocab_size))
    val = ((picked - a) * k2 - log_s) * LN2
    val = tl.where(bad | empty, float("nan"), val)
    return tl.where(keep, val, 0.0)


@triton.jit
def _entropy_value(log_s, t, s, empty):
    """Entropy in nats from ``log2 s`` and ``t = sum e (z - a) k2``; NaN for an all -inf row."""
    h = (log_s - t / s) * LN2
    return tl.where(empty, float("nan"), h)


@triton.jit
def _parts_max(part_ptr, n_parts, n_rows, rows, rmask, n_fields, field, BLOCK_N: tl.constexpr):
    """Per row of a block of rows: the largest value of ``field`` over the ``[P, N, F]``
    partials of every split and rank (-inf for rows past the end)."""
    big = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for p in range(n_parts):
        value = tl.load(part_ptr + (p * n_rows + rows) * n_fields + field, mask=rmask, other=float("-inf"))
        big = tl.maximum(big, value)
    return big


@triton.jit
def _arrive(counter_ptr, total):
    """Count this program in at ``counter_ptr``: whether it is the last of ``total``. Every
    lane's stores before it are visible to the last one (a barrier, then a release; the
    last one acquires)."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == total - 1


@triton.jit
def _reduce_if_last(
    red_ptr,
    n_done,
    out_ptr,
    val_ptr,
    n_vals,
    idx_ptr,
    keep_ptr,
    ignore_index,
    BY_INDEX: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    REDUCE: tl.constexpr,
    BLOCK: tl.constexpr,
    PAIR: tl.constexpr = False,
):
    """With REDUCE, the last of the ``n_done`` programs that write values reduces all
    ``n_vals`` of them into ``out``: their sum, or for a mean that sum over the count of what
    counts (index entries that are not ``ignore_index`` with BY_INDEX, kept tokens with
    HAS_KEEP, else every value), at least 1, the count kept at ``R_COUNT`` for backward. The
    last program reads every value in one fixed order, whichever program it is: the result
    does not depend on the order the programs ran in. PAIR: the values are ``n_vals`` rows of
    two columns (log-probs of an ``[N]`` index, then the entropy), reduced column by column
    into ``out[0]``, ``out[1]``, over one count."""
    if REDUCE != REDUCE_NONE:
        if _arrive(red_ptr + R_DONE, n_done):
            acc = tl.zeros([BLOCK], tl.float32)
            acc_h = tl.zeros([BLOCK], tl.float32)
            for start in range(0, n_vals, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                if PAIR:
                    acc += tl.load(val_ptr + 2 * offs, mask=offs < n_vals, other=0.0, cache_modifier=".cg")
                    acc_h += tl.load(val_ptr + 2 * offs + 1, mask=offs < n_vals, other=0.0, cache_modifier=".cg")
                else:
                    acc += tl.load(val_ptr + offs, mask=offs < n_vals, other=0.0, cache_modifier=".cg")
            total = tl.sum(acc, 0)
            total_h = tl.sum(acc_h, 0)
            if REDUCE == REDUCE_MEAN:
                if BY_INDEX:
                    kept = tl.zeros([BLOCK], tl.int32)
                    for start in range(0, n_vals, BLOCK):
                        offs = start + tl.arange(0, BLOCK)
                        i = tl.load(idx_ptr + offs, mask=offs < n_vals, other=ignore_index)
                        kept += (i != ignore_index).to(tl.int32)
                    count = tl.sum(kept, 0)
                elif HAS_KEEP:
                    kept = tl.zeros([BLOCK], tl.int32)
                    for start in range(0, n_vals, BLOCK):
                        offs = start + tl.arange(0, BLOCK)
                        kept += (tl.load(keep_ptr + offs, mask=offs < n_vals, other=0) != 0).to(tl.int32)
                    count = tl.sum(kept, 0)
                else:
                    count = n_vals + tl.zeros([], tl.int32)
                tl.store(red_ptr + R_COUNT, count)
                total = tl.math.div_rn(total, tl.maximum(count, 1).to(tl.float32))
                total_h = tl.math.div_rn(total_h, tl.maximum(count, 1).to(tl.float32))
            tl.store(out_ptr, total)
            if PAIR:
                tl.store(out_ptr + 1, total_h)


@triton.jit
def _reduce1_if_last(
    red_ptr,
    n_done,
    out_ptr,
    val_ptr,
    n_rows,
    idx_ptr,
    n_idx,
    keep_ptr,
    ignore_index,
    KIND: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    REDUCE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``_reduce_if_last`` of a one-input op: cross entropy and log-probs count their index
    entries (one value each), entropy its kept tokens; log-probs WITH_ENTROPY (an ``[N]``
    index) reduce both columns over the index's count."""
    if KIND == LOGPROBS and WITH_ENTROPY:
        _reduce_if_last(
            red_ptr, n_done, out_ptr, val_ptr, n_rows, idx_ptr, keep_ptr, ignore_index, True, False, REDUCE, BLOCK, True
        )
    elif KIND == ENTROPY:
        _reduce_if_last(
            red_ptr, n_done, out_ptr, val_ptr, n_rows, idx_ptr, keep_ptr, ignore_index, False, HAS_KEEP, REDUCE, BLOCK
        )
    else:
        _reduce_if_last(
            red_ptr,
            n_done,
            out_ptr,
            val_ptr,
            n_rows * n_idx,
            idx_ptr,
            keep_ptr,
            ignore_index,
            True,
            False,
            REDUCE,
            BLOCK,
        )


@triton.jit
def _upstream(grad_ptr, offset, red_ptr, MEAN: tl.constexpr):
    """The upstream gradient of one value at ``grad_ptr + offset`` (any strides: 0 for an
    expanded or a reduced call's 0-dim gradient); with MEAN, the reduced call's ``g`` over
    the count its forward kept, one correctly rounded division as torch's backward of a
    mean makes it."""
    g = tl.load(grad_ptr + offset)
    if MEAN:
        g = tl.math.div_rn(g, tl.maximum(tl.load(red_ptr + R_COUNT), 1).to(tl.float32))
    return g


@triton.jit(do_not_specialize=["rows_b", "n_rows", "splits"])
def stats1_kernel(
    z_ptr,
    rows_b,
    stride_a,
    stride_b,
    idx_ptr,
    n_idx,
    keep_ptr,
    part_ptr,
    val_ptr,
    stat_ptr,
    red_ptr,
    out_ptr,
    n_rows,
    v_local,
    vocab_start,
    vocab_size,
    splits,
    chunk,
    k2,
    ignore_index,
    smoothing,
    z_loss,
    KIND: tl.constexpr,
    SMOOTH: tl.constexpr,
    ZLOSS: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    FINISH: tl.constexpr,
    MERGE: tl.constexpr,
    REDUCE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_REDUCE: tl.constexpr,
):
    """Partial statistics of one row over one vocabulary chunk, one read of the logits.

    Fields (F): CE ``[m, s, sum (z - a) k2, count, z_label]`` (sum/count only with SMOOTH);
    logprobs ``[m, s, z_index_0 .. z_index_{k-1}]``, with WITH_ENTROPY (logprobs only)
    ``[m, s, sum e (z - a) k2, z_index_0 .. z_index_{k-1}]``; entropy ``[m, s, sum e (z - a) k2]``.
    Picked logits are raw and 0 in every partial but the owner's, so they add up.
    Rows that are masked out read nothing and leave an empty state.

    FINISH: the chunk is the whole row of the whole vocabulary (one split, one rank), so
    there is nothing to merge: the program writes the values and statistics itself, as
    ``finish1_kernel`` would, and no partials (one launch instead of two). MERGE (split rows
    at one rank): the last program of a row to store its partials (an arrival counter per
    row) merges them as ``finish1_kernel`` would, in the same order, to the same bits. With
    REDUCE, the last row finished reduces the values (``_reduce_if_last``).
    """
    pid = tl.program_id(0)
    row, lo, hi = _chunk(pid, splits, chunk, v_local)
    if KIND == CE:
        n_fields = CE_FIELDS
        active = tl.load(idx_ptr + row) != ignore_index
    elif KIND == LOGPROBS:
        if WITH_ENTROPY:
            n_fields = LOGPROBS_ENTROPY_FIELDS + n_idx
            first = P_INDEX_AFTER_MOMENT
        else:
            n_fields = LOGPROBS_FIELDS + n_idx
            first = P_INDEX
        active = row < 0  # false; true below when any index entry is not ignored
        for j in range(n_idx):
            active = active | (tl.load(idx_ptr + row * n_idx + j) != ignore_index)
    else:
        n_fields = ENTROPY_FIELDS
        if HAS_KEEP:
            active = tl.load(keep_ptr + row) != 0
        else:
            active = row >= 0
    hi = tl.where(active, hi, lo)
    src = _row_start(z_ptr, row, rows_b, stride_a, stride_b)

    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    t = tl.zeros([], tl.float32)  # CE: sum (z - a) k2; entropy: sum e (z - a) k2
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inb = cols < hi
        z = tl.load(src + cols, mask=inb, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        a_new = _anchor(m_new)
        shift = (_anchor(m) - a_new) * k2  # old anchor -> new anchor, in bits (<= 0)
        alpha = tl.exp2((m - a_new) * k2)  # 0 when the old state was empty
        x = (z - a_new) * k2
        e = tl.exp2(x)  # one exp per element; 0 outside the chunk
        if KIND == CE:
            if SMOOTH:
                t = t + (start - lo) * shift + tl.sum(tl.where(inb, x, 0.0), 0)
        elif KIND == ENTROPY:
            t = _entropy_moment(t, s, shift, alpha, e, x)
        elif WITH_ENTROPY:  # log-probs and the entropy
            t = _entropy_moment(t, s, shift, alpha, e, x)
        s = s * alpha + tl.sum(e, 0)
        m = m_new

    if FINISH:
        a = _anchor(m)
        log_s = tl.log2(s)
        empty = s == 0
        n_stats = STATS
        if KIND == CE:
            y = tl.load(idx_ptr + row)
            zy = tl.load(src + (y - vocab_start), mask=(y - vocab_start >= lo) & (y - vocab_start < hi), other=0.0).to(
                tl.float32
            )
            val = _ce_value(log_s, zy, a, t, y, vocab_size, k2, ignore_index, smoothing, z_loss, empty, SMOOTH, ZLOSS)
            tl.store(val_ptr + row, val)
        elif KIND == LOGPROBS:
            n_vals = n_idx + 1 if WITH_ENTROPY else n_idx
            for j in range(n_idx):
                ij = tl.load(idx_ptr + row * n_idx + j)
                zj = tl.load(
                    src + (ij - vocab_start), mask=(ij - vocab_start >= lo) & (ij - vocab_start < hi), other=0.0
                ).to(tl.float32)
                tl.store(
                    val_ptr + row * n_vals + j, _logprob_value(log_s, zj, a, ij, vocab_size, k2, ignore_index, empty)
                )
            if WITH_ENTROPY:
                h = tl.where(active, _entropy_value(log_s, t, s, empty), 0.0)
                tl.store(val_ptr + row * n_vals + n_idx, h)
                tl.store(stat_ptr + row * ENTROPY_STATS + S_ENTROPY, h)
                n_stats = ENTROPY_STATS
        else:
            h = _entropy_value(log_s, t, s, empty)
            if HAS_KEEP:
                h = tl.where(active, h, 0.0)
            tl.store(val_ptr + row, h)
            tl.store(stat_ptr + row * ENTROPY_STATS + S_ENTROPY, h)
            n_stats = ENTROPY_STATS
        tl.store(stat_ptr + row * n_stats + S_ANCHOR, a)
        tl.store(stat_ptr + row * n_stats + S_LOG2_SUM, log_s)
        _reduce1_if_last(
            red_ptr,
            n_rows,
            out_ptr,
            val_ptr,
            n_rows,
            idx_ptr,
            n_idx,
            keep_ptr,
            ignore_index,
            KIND,
            HAS_KEEP,
            WITH_ENTROPY,
            REDUCE,
            BLOCK_REDUCE,
        )
    else:
        out = part_ptr + ((pid % splits) * n_rows + row) * n_fields
        tl.store(out + P_MAX, m)
        tl.store(out + P_SUM, s)
        if KIND == CE:
            tl.store(out + P_MOMENT, t)
            tl.store(out + P_COUNT, tl.maximum(hi - lo, 0).to(tl.float32))
            local = tl.load(idx_ptr + row) - vocab_start
            mine = (local >= lo) & (local < hi)
            zy = tl.load(src + local, mask=mine, other=0.0).to(tl.float32)
            tl.store(out + P_LABEL, tl.where(mine, zy, 0.0))
        elif KIND == LOGPROBS:
            if WITH_ENTROPY:
                tl.store(out + P_MOMENT, t)
            for j in range(n_idx):
                local = tl.load(idx_ptr + row * n_idx + j) - vocab_start
                mine = (local >= lo) & (local < hi)
                zj = tl.load(src + local, mask=mine, other=0.0).to(tl.float32)
                tl.store(out + first + j, tl.where(mine, zj, 0.0))
        else:
            tl.store(out + P_MOMENT, t)
        if MERGE:
            if _arrive(red_ptr + R_ROWS + row, splits):
                rows = row + tl.arange(0, 1)
                _finish1_rows(
                    rows,
                    rows < n_rows,
                    part_ptr,
                    splits,
                    n_rows,
                    idx_ptr,
                    n_idx,
                    keep_ptr,
                    val_ptr,
                    stat_ptr,
                    vocab_size,
                    k2,
                    ignore_index,
                    smoothing,
                    z_loss,
                    KIND,
                    SMOOTH,
                    ZLOSS,
                    HAS_KEEP,
                    WITH_ENTROPY,
                    1,
                )
                _reduce1_if_last(
                    red_ptr,
                    n_rows,
                    out_ptr,
                    val_ptr,
                    n_rows,
                    idx_ptr,
                    n_idx,
                    keep_ptr,
                    ignore_index,
                    KIND,
                    HAS_KEEP,
                    WITH_ENTROPY,
                    REDUCE,
                    BLOCK_REDUCE,
                )


@triton.jit
def _finish1_rows(
    rows,
    rmask,
    part_ptr,
    n_parts,
    n_rows,
    idx_ptr,
    n_idx,
    keep_ptr,
    val_ptr,
    stat_ptr,
    vocab_size,
    k2,
    ignore_index,
    smoothing,
    z_loss,
    KIND: tl.constexpr,
    SMOOTH: tl.constexpr,
    ZLOSS: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Merge the ``[P, N, F]`` partials of every split and rank of ``rows`` into per-token
    values (nats) and the O(N) statistics the backward pass needs: ``[a, log2 s]`` (+ H for
    entropy and for log-probs WITH_ENTROPY), so that ``log p = (z - a) k2 - log2 s`` in bits.
    Log-probs WITH_ENTROPY write ``[N, k + 1]`` values: the k log-probs, then the entropy (0
    where every index entry is ignored). The partials merge in the order of ``p``, one row
    per lane: a block of rows (``finish1_kernel``) or one row (``stats1_kernel``'s last
    program of a row) give the same bits, and every rank merging the same gathered partials
    the same values."""
    if KIND == CE:
        n_fields = CE_FIELDS
        n_stats = STATS
    elif KIND == LOGPROBS:
        if WITH_ENTROPY:
            n_fields = LOGPROBS_ENTROPY_FIELDS + n_idx
            first = P_INDEX_AFTER_MOMENT
            n_vals = n_idx + 1
            n_stats = ENTROPY_STATS
        else:
            n_fields = LOGPROBS_FIELDS + n_idx
            first = P_INDEX
            n_vals = n_idx
            n_stats = STATS
    else:
        n_fields = ENTROPY_FIELDS
        n_stats = ENTROPY_STATS
    a = _anchor(_parts_max(part_ptr, n_parts, n_rows, rows, rmask, n_fields, P_MAX, BLOCK_N))
    s = tl.zeros([BLOCK_N], tl.float32)
    t = tl.zeros([BLOCK_N], tl.float32)
    picked = tl.zeros([BLOCK_N], tl.float32)
    for p in range(n_parts):
        base = part_ptr + (p * n_rows + rows) * n_fields
        mp = tl.load(base + P_MAX, mask=rmask, other=float("-inf"))
        sp = tl.load(base + P_SUM, mask=rmask, other=0.0)
        w = tl.exp2((mp - a) * k2)
        shift = (_anchor(mp) - a) * k2
        s += sp * w
        if KIND == CE:
            if SMOOTH:
                cnt = tl.load(base + P_COUNT, mask=rmask, other=0.0)
                tp = tl.load(base + P_MOMENT, mask=rmask, other=0.0)
                t += tl.where(cnt > 0, tp + cnt * shift, 0.0)
            picked += tl.load(base + P_LABEL, mask=rmask, other=0.0)
        elif KIND == ENTROPY:
            tp = tl.load(base + P_MOMENT, mask=rmask, other=0.0)
            t += w * (tp + sp * shift)
        elif WITH_ENTROPY:  # log-probs and the entropy
            tp = tl.load(base + P_MOMENT, mask=rmask, other=0.0)
            t += w * (tp + sp * shift)
    log_s = tl.log2(s)
    empty = s == 0  # all -inf row: NaN by contract
    if KIND == CE:
        y = tl.load(idx_ptr + rows, mask=rmask, other=ignore_index)
        val = _ce_value(log_s, picked, a, t, y, vocab_size, k2, ignore_index, smoothing, z_loss, empty, SMOOTH, ZLOSS)
        tl.store(val_ptr + rows, val, mask=rmask)
    elif KIND == LOGPROBS:
        any_kept = rows < 0
        for j in range(n_idx):
            got = tl.zeros([BLOCK_N], tl.float32)
            for p in range(n_parts):
                got += tl.load(part_ptr + (p * n_rows + rows) * n_fields + first + j, mask=rmask, other=0.0)
            ij = tl.load(idx_ptr + rows * n_idx + j, mask=rmask, other=ignore_index)
            any_kept = any_kept | (ij != ignore_index)
            tl.store(
                val_ptr + rows * n_vals + j,
                _logprob_value(log_s, got, a, ij, vocab_size, k2, ignore_index, empty),
                mask=rmask,
            )
        if WITH_ENTROPY:
            h = tl.where(any_kept, _entropy_value(log_s, t, s, empty), 0.0)
            tl.store(val_ptr + rows * n_vals + n_idx, h, mask=rmask)
            tl.store(stat_ptr + rows * ENTROPY_STATS + S_ENTROPY, h, mask=rmask)
    else:
        h = _entropy_value(log_s, t, s, empty)
        if HAS_KEEP:
            h = tl.where(tl.load(keep_ptr + rows, mask=rmask, other=0) != 0, h, 0.0)
        tl.store(val_ptr + rows, h, mask=rmask)
        tl.store(stat_ptr + rows * ENTROPY_STATS + S_ENTROPY, h, mask=rmask)
    tl.store(stat_ptr + rows * n_stats + S_ANCHOR, a, mask=rmask)
    tl.store(stat_ptr + rows * n_stats + S_LOG2_SUM, log_s, mask=rmask)


@triton.jit(do_not_specialize=["n_parts", "n_rows"])
def finish1_kernel(
    part_ptr,
    n_parts,
    n_rows,
    idx_ptr,
    n_idx,
    keep_ptr,
    val_ptr,
    stat_ptr,
    red_ptr,
    out_ptr,
    vocab_size,
    k2,
    ignore_index,
    smoothing,
    z_loss,
    KIND: tl.constexpr,
    SMOOTH: tl.constexpr,
    ZLOSS: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    REDUCE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_REDUCE: tl.constexpr,
):
    """``_finish1_rows`` of a block of rows; with REDUCE the last program reduces the values
    (``_reduce_if_last``)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    _finish1_rows(
        rows,
        rows < n_rows,
        part_ptr,
        n_parts,
        n_rows,
        idx_ptr,
        n_idx,
        keep_ptr,
        val_ptr,
        stat_ptr,
        vocab_size,
        k2,
        ignore_index,
        smoothing,
        z_loss,
        KIND,
        SMOOTH,
        ZLOSS,
        HAS_KEEP,
        WITH_ENTROPY,
        BLOCK_N,
    )
    _reduce1_if_last(
        red_ptr,
        tl.num_programs(0),
        out_ptr,
        val_ptr,
        n_rows,
        idx_ptr,
        n_idx,
        keep_ptr,
        ignore_index,
        KIND,
        HAS_KEEP,
        WITH_ENTROPY,
        REDUCE,
        BLOCK_REDUCE,
    )


@triton.jit(do_not_specialize=["rows_b", "splits"])
def backward1_kernel(
    z_ptr,
    rows_b,
    stride_a,
    stride_b,
    dz_ptr,
    grad_ptr,
    g_row,
    g_col,
    red_ptr,
    idx_ptr,
    n_idx,
    keep_ptr,
    stat_ptr,
    v_local,
    vocab_start,
    vocab_size,
    splits,
    chunk,
    k2,
    inv_t,
    ignore_index,
    smoothing,
    z_loss,
    KIND: tl.constexpr,
    SMOOTH: tl.constexpr,
    ZLOSS: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    MEAN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Gradient w.r.t. the logits from the saved O(N) statistics: probabilities recomputed
    in registers (one exp per element), one read of the logits, one write of the gradient
    in the input dtype. Log-probs WITH_ENTROPY take ``[N, k + 1]`` upstream gradients (the
    entropy's last) and write both gradients' sum in the same pass. The upstream gradients
    are read at ``row * g_row + j * g_col`` (strides 0 for one number: ``_upstream``). Masked rows read nothing
    and write exact zeros; a row whose logits were all -inf gets NaN (its value is NaN),
    every other row is unaffected."""
    pid = tl.program_id(0)
    row, lo, hi = _chunk(pid, splits, chunk, v_local)
    src = _row_start(z_ptr, row, rows_b, stride_a, stride_b)
    dst = dz_ptr + row.to(tl.int64) * v_local
    nan = float("nan")
    if KIND == ENTROPY:
        n_stats = ENTROPY_STATS
    elif WITH_ENTROPY:
        n_stats = ENTROPY_STATS
    else:
        n_stats = STATS
    a = tl.load(stat_ptr + row * n_stats + S_ANCHOR)
    log_s = tl.load(stat_ptr + row * n_stats + S_LOG2_SUM)
    alive = log_s > float("-inf")
    if KIND == ENTROPY:
        h = tl.load(stat_ptr + row * ENTROPY_STATS + S_ENTROPY)
        coef = tl.where(alive, _upstream(grad_ptr, row * g_row, red_ptr, MEAN) * inv_t, nan)
        if HAS_KEEP:
            keep = tl.load(keep_ptr + row) != 0
        else:
            keep = row >= 0
    elif KIND == CE:
        y = tl.load(idx_ptr + row)
        keep = y != ignore_index
        bad = keep & ((y < 0) | (y >= vocab_size))
        coef = tl.where(bad | (alive == 0), nan, _upstream(grad_ptr, row * g_row, red_ptr, MEAN) * inv_t)
        y_local = y - vocab_start
        p_coef = 1.0
        if ZLOSS:
            p_coef = 1.0 + 2.0 * z_loss * ((a * k2 + log_s) * LN2)
    else:
        # log-probs: d = sum_j g_j onehot(i_j) - (sum_j g_j) p (- g_H p (log p + H) WITH_ENTROPY)
        total = tl.zeros([], tl.float32)
        keep = row < 0  # false; true below when any index entry is not ignored
        for j in range(n_idx):
            ij = tl.load(idx_ptr + row * n_idx + j)
            gj = _upstream(grad_ptr, row * g_row + j * g_col, red_ptr, MEAN) * inv_t
            gj = tl.where(ij != ignore_index, gj, 0.0)
            gj = tl.where((ij != ignore_index) & ((ij < 0) | (ij >= vocab_size)), nan, gj)
            total += gj
            keep = keep | (ij != ignore_index)
        # a token whose entries are all ignored read nothing in the forward: it stays 0
        total = tl.where(alive | (total == 0), total, nan)
        if WITH_ENTROPY:
            h = tl.load(stat_ptr + row * ENTROPY_STATS + S_ENTROPY)
            coef_h = tl.where(alive, _upstream(grad_ptr, row * g_row + n_idx * g_col, red_ptr, MEAN) * inv_t, nan)
    hi_read = tl.where(keep, hi, lo)  # masked rows read nothing
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inb = cols < hi
        z = tl.load(src + cols, mask=cols < hi_read, other=0.0).to(tl.float32)
        lp = (z - a) * k2 - log_s
        p = tl.exp2(lp)
        if KIND == CE:
            d = p * p_coef
            if SMOOTH:
                d -= smoothing / vocab_size
            d = tl.where(cols == y_local, d - (1.0 - smoothing), d) * coef
        elif KIND == LOGPROBS:
            if WITH_ENTROPY:
                # one product; the floor makes p (lp ln2 + H) exactly 0 where p = 0
                d = -p * (total + coef_h * (tl.maximum(lp, LOGP_FLOOR) * LN2 + h))
            else:
                d = tl.where(total != 0, -p * total, 0.0)
            for j in range(n_idx):
                ij = tl.load(idx_ptr + row * n_idx + j)
                gj = _upstream(grad_ptr, row * g_row + j * g_col, red_ptr, MEAN) * inv_t
                d += tl.where((cols == ij - vocab_start) & (ij != ignore_index), gj, 0.0)
        else:  # entropy: as the log-probs' entropy term above
            d = -p * (tl.maximum(lp, LOGP_FLOOR) * LN2 + h) * coef
        d = tl.where(keep, d, 0.0)
        tl.store(dst + cols, d.to(dz_ptr.dtype.element_ty), mask=inb)


# -- two-input ops: KL, JSD ---------------------------------------------------------------------


@triton.jit
def _pair_stats(src_a, src_b, lo, hi, k2, WITH_KL: tl.constexpr, BLOCK: tl.constexpr):
    """Max-rescaled state of two inputs over columns ``[lo, hi)`` of one row, one read of each:
    ``(m_a, s_a, m_b, s_b, kl)``, ``kl`` the unnormalized KL(A || B) term (0 without WITH_KL)."""
    ma = tl.full([], float("-inf"), tl.float32)
    mb = tl.full([], float("-inf"), tl.float32)
    sa = tl.zeros([], tl.float32)
    sb = tl.zeros([], tl.float32)
    kl = tl.zeros([], tl.float32)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inb = cols < hi
        za = tl.load(src_a + cols, mask=inb, other=float("-inf")).to(tl.float32)
        zb = tl.load(src_b + cols, mask=inb, other=float("-inf")).to(tl.float32)
        ma_new = tl.maximum(ma, tl.max(za, 0))
        mb_new = tl.maximum(mb, tl.max(zb, 0))
        aa_new = _anchor(ma_new)
        ab_new = _anchor(mb_new)
        alpha_a = tl.exp2((ma - aa_new) * k2)
        xa = (za - aa_new) * k2
        xb = (zb - ab_new) * k2
        ea = tl.exp2(xa)
        eb = tl.exp2(xb)
        if WITH_KL:
            shift = ((_anchor(ma) - aa_new) - (_anchor(mb) - ab_new)) * k2
            term = tl.where(ea == 0, 0.0, ea * (xa - xb))
            kl = alpha_a * (kl + sa * shift) + tl.sum(term, 0)
        sa = sa * alpha_a + tl.sum(ea, 0)
        sb = sb * tl.exp2((mb - ab_new) * k2) + tl.sum(eb, 0)
        ma = ma_new
        mb = mb_new
    return ma, sa, mb, sb, kl


@triton.jit
def _kl_value(kl, s_a, s_b, log_sa, log_sb):
    """KL(A || B) in nats from a row's merged state; NaN where either row is all -inf."""
    val = (kl / s_a - log_sa + log_sb) * LN2
    return tl.where((s_a == 0) | (s_b == 0), float("nan"), val)


@triton.jit
def _jsd_value(kl_s, kl_t, ls_s, ls_t, beta):
    """The JSD in nats from KL(p_s || M), KL(p_t || M) (nats); NaN where either row is all -inf."""
    val = (1.0 - beta) * kl_s + beta * kl_t
    return tl.where((ls_s > float("-inf")) & (ls_t > float("-inf")), val, float("nan"))


@triton.jit(do_not_specialize=["rows_b", "n_rows", "splits"])
def stats2_kernel(
    a_ptr,
    b_ptr,
    rows_b,
    sa_a,
    sa_b,
    sb_a,
    sb_b,
    keep_ptr,
    part_ptr,
    val_ptr,
    stat_ptr,
    red_ptr,
    out_ptr,
    n_rows,
    v_local,
    splits,
    chunk,
    k2,
    WITH_KL: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    FINISH: tl.constexpr,
    MERGE: tl.constexpr,
    REDUCE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_REDUCE: tl.constexpr,
):
    """Partial statistics of two inputs over one chunk, one read of each.

    Fields ``[m_a, s_a, m_b, s_b]`` and with WITH_KL ``sum e_a ((z_a - a_a) - (z_b - a_b)) k2``,
    the unnormalized KL(A || B) term. (``sa_*``/``sb_*`` are the row strides of a and b.)
    FINISH (KL only): the chunk is the whole row of the whole vocabulary, so the program
    writes the value and statistics as ``finish2_kernel`` would, and no partials. MERGE
    (KL, split rows at one rank): the last program of a row merges its partials as
    ``finish2_kernel`` would (see ``stats1_kernel``). With REDUCE, the last row finished
    reduces the values."""
    pid = tl.program_id(0)
    row, lo, hi = _chunk(pid, splits, chunk, v_local)
    if HAS_KEEP:
        keep = tl.load(keep_ptr + row) != 0
        hi = tl.where(keep, hi, lo)
    src_a = _row_start(a_ptr, row, rows_b, sa_a, sa_b)
    src_b = _row_start(b_ptr, row, rows_b, sb_a, sb_b)
    ma, sa, mb, sb, kl = _pair_stats(src_a, src_b, lo, hi, k2, WITH_KL, BLOCK)
    if FINISH:
        log_sa = tl.log2(sa)
        log_sb = tl.log2(sb)
        val = _kl_value(kl, sa, sb, log_sa, log_sb)
        tl.store(stat_ptr + row * KL_STATS + S_ANCHOR_A, _anchor(ma))
        tl.store(stat_ptr + row * KL_STATS + S_LOG2_SUM_A, log_sa)
        tl.store(stat_ptr + row * KL_STATS + S_ANCHOR_B, _anchor(mb))
        tl.store(stat_ptr + row * KL_STATS + S_LOG2_SUM_B, log_sb)
        tl.store(stat_ptr + row * KL_STATS + S_KL_A, val)
        if HAS_KEEP:
            val = tl.where(keep, val, 0.0)
        tl.store(val_ptr + row, val)
        _reduce2_if_last(red_ptr, n_rows, out_ptr, val_ptr, n_rows, keep_ptr, HAS_KEEP, REDUCE, BLOCK_REDUCE)
    else:
        n_fields = KL_FIELDS if WITH_KL else PAIR_FIELDS
        out = part_ptr + ((pid % splits) * n_rows + row) * n_fields
        tl.store(out + P_MAX_A, ma)
        tl.store(out + P_SUM_A, sa)
        tl.store(out + P_MAX_B, mb)
        tl.store(out + P_SUM_B, sb)
        if WITH_KL:
            tl.store(out + P_KL, kl)
        if MERGE:
            if _arrive(red_ptr + R_ROWS + row, splits):
                rows = row + tl.arange(0, 1)
                _finish2_rows(
                    rows, rows < n_rows, part_ptr, splits, n_rows, keep_ptr, val_ptr, stat_ptr, k2, 0.0, KL, HAS_KEEP, 1
                )
                _reduce2_if_last(red_ptr, n_rows, out_ptr, val_ptr, n_rows, keep_ptr, HAS_KEEP, REDUCE, BLOCK_REDUCE)


@triton.jit
def _merge_row_stats(part_ptr, n_parts, n_rows, row, k2, N_FIELDS: tl.constexpr):
    """Scalar merge of one row's ``[m_a, s_a, m_b, s_b]`` partials: ``(a_a, log2 s_a, a_b, log2 s_b)``."""
    big_a = tl.full([], float("-inf"), tl.float32)
    big_b = tl.full([], float("-inf"), tl.float32)
    for p in range(n_parts):
        base = part_ptr + (p * n_rows + row) * N_FIELDS
        big_a = tl.maximum(big_a, tl.load(base + P_MAX_A))
        big_b = tl.maximum(big_b, tl.load(base + P_MAX_B))
    aa = _anchor(big_a)
    ab = _anchor(big_b)
    s_a = tl.zeros([], tl.float32)
    s_b = tl.zeros([], tl.float32)
    for p in range(n_parts):
        base = part_ptr + (p * n_rows + row) * N_FIELDS
        s_a += tl.load(base + P_SUM_A) * tl.exp2((tl.load(base + P_MAX_A) - aa) * k2)
        s_b += tl.load(base + P_SUM_B) * tl.exp2((tl.load(base + P_MAX_B) - ab) * k2)
    return aa, tl.log2(s_a), ab, tl.log2(s_b)


@triton.jit
def _jsd_div_sums(src_s, src_t, lo, hi, a_s, ls_s, a_t, ls_t, k2, beta, FAST_LOG2: tl.constexpr, BLOCK: tl.constexpr):
    """``(sum p_s (lp_s - lm), sum p_t (lp_t - lm))`` in bits over columns ``[lo, hi)`` of one
    row, with ``M = beta p_t + (1-beta) p_s``: one more read of both inputs, three
    transcendentals per element (exp2 of each log-prob, one log2 of the mixture)."""
    acc_s = tl.zeros([BLOCK], tl.float32)
    acc_t = tl.zeros([BLOCK], tl.float32)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inb = cols < hi
        lps = (tl.load(src_s + cols, mask=inb, other=float("-inf")).to(tl.float32) - a_s) * k2 - ls_s
        lpt = (tl.load(src_t + cols, mask=inb, other=float("-inf")).to(tl.float32) - a_t) * k2 - ls_t
        ps = tl.exp2(lps)
        pt = tl.exp2(lpt)
        # clamped: under flush-to-zero a mixture of two tiny p can round to 0 (p itself ~1e-38)
        lm = _log2(tl.maximum(beta * pt + (1.0 - beta) * ps, MIN_NORMAL), FAST_LOG2)
        # lm is finite (clamped), so clamping lp to a finite floor gives 0 * finite = 0 where
        # p = 0 (the 0 log 0 = 0 rule) in one op instead of a compare and a select; a NaN p
        # (NaN logits) still propagates through the product
        acc_s += ps * (tl.maximum(lps, LOGP_FLOOR) - lm)
        acc_t += pt * (tl.maximum(lpt, LOGP_FLOOR) - lm)
    return tl.sum(acc_s, 0), tl.sum(acc_t, 0)


@triton.jit(do_not_specialize=["rows_b", "n_stats_parts", "n_rows", "splits"])
def jsd_div_kernel(
    a_ptr,
    b_ptr,
    rows_b,
    sa_a,
    sa_b,
    sb_a,
    sb_b,
    keep_ptr,
    stats_part_ptr,
    n_stats_parts,
    part_ptr,
    stat_ptr,
    val_ptr,
    red_ptr,
    out_ptr,
    n_rows,
    v_local,
    splits,
    chunk,
    k2,
    beta,
    HAS_KEEP: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    MERGE: tl.constexpr,
    REDUCE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_REDUCE: tl.constexpr,
):
    """JSD divergence pass (a = student, b = teacher, as in every two-input kernel): merges the
    row's gathered statistics itself (a few scalars, no separate launch), then one more read
    of both inputs accumulating ``sum p_s (lp_s - lm)`` and ``sum p_t (lp_t - lm)`` (bits)
    into ``[P, N, 2]`` partials. MERGE (at one rank): the last program of a row merges its
    partials as ``finish2_kernel`` would (see ``stats1_kernel``); with REDUCE, the last row
    finished reduces the values."""
    pid = tl.program_id(0)
    row, lo, hi = _chunk(pid, splits, chunk, v_local)
    if HAS_KEEP:
        hi = tl.where(tl.load(keep_ptr + row) != 0, hi, lo)
    a_s, ls_s, a_t, ls_t = _merge_row_stats(stats_part_ptr, n_stats_parts, n_rows, row, k2, PAIR_FIELDS)
    if pid % splits == 0:
        tl.store(stat_ptr + row * JSD_STATS + S_ANCHOR_A, a_s)
        tl.store(stat_ptr + row * JSD_STATS + S_LOG2_SUM_A, ls_s)
        tl.store(stat_ptr + row * JSD_STATS + S_ANCHOR_B, a_t)
        tl.store(stat_ptr + row * JSD_STATS + S_LOG2_SUM_B, ls_t)
    src_s = _row_start(a_ptr, row, rows_b, sa_a, sa_b)
    src_t = _row_start(b_ptr, row, rows_b, sb_a, sb_b)
    kl_s, kl_t = _jsd_div_sums(src_s, src_t, lo, hi, a_s, ls_s, a_t, ls_t, k2, beta, FAST_LOG2, BLOCK)
    out = part_ptr + ((pid % splits) * n_rows + row) * DIV_FIELDS
    tl.store(out + P_KL_S, kl_s)
    tl.store(out + P_KL_T, kl_t)
    if MERGE:
        if _arrive(red_ptr + R_ROWS + row, splits):
            rows = row + tl.arange(0, 1)
            _finish2_rows(
                rows, rows < n_rows, part_ptr, splits, n_rows, keep_ptr, val_ptr, stat_ptr, k2, beta, JSD, HAS_KEEP, 1
            )
            _reduce2_if_last(red_ptr, n_rows, out_ptr, val_ptr, n_rows, keep_ptr, HAS_KEEP, REDUCE, BLOCK_REDUCE)


@triton.jit(do_not_specialize=["rows_b", "n_rows"])
def jsd_row_kernel(
    a_ptr,
    b_ptr,
    rows_b,
    sa_a,
    sa_b,
    sb_a,
    sb_b,
    keep_ptr,
    val_ptr,
    stat_ptr,
    red_ptr,
    out_ptr,
    n_rows,
    v_local,
    k2,
    beta,
    HAS_KEEP: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    REDUCE: tl.constexpr,
    BLOCK_STATS: tl.constexpr,
    BLOCK_DIV: tl.constexpr,
    BLOCK_REDUCE: tl.constexpr,
):
    """The whole JSD forward of one row (a = student, b = teacher) when it is neither split nor
    sharded (one program per row, one launch): the statistics pass, the divergence pass, the value. The same reads
    and arithmetic as ``stats2_kernel`` -> ``jsd_div_kernel`` -> ``finish2_kernel``."""
    row = tl.program_id(0)
    hi = v_local
    if HAS_KEEP:
        keep = tl.load(keep_ptr + row) != 0
        hi = tl.where(keep, hi, 0)
    src_s = _row_start(a_ptr, row, rows_b, sa_a, sa_b)
    src_t = _row_start(b_ptr, row, rows_b, sb_a, sb_b)
    ms, ss, mt, st, _ = _pair_stats(src_s, src_t, 0, hi, k2, False, BLOCK_STATS)
    a_s = _anchor(ms)
    a_t = _anchor(mt)
    ls_s = tl.log2(ss)
    ls_t = tl.log2(st)
    kl_s, kl_t = _jsd_div_sums(src_s, src_t, 0, hi, a_s, ls_s, a_t, ls_t, k2, beta, FAST_LOG2, BLOCK_DIV)
    kl_s *= LN2
    kl_t *= LN2
    val = _jsd_value(kl_s, kl_t, ls_s, ls_t, beta)
    if HAS_KEEP:
        val = tl.where(keep, val, 0.0)
    base = stat_ptr + row * JSD_STATS
    tl.store(base + S_ANCHOR_A, a_s)
    tl.store(base + S_LOG2_SUM_A, ls_s)
    tl.store(base + S_ANCHOR_B, a_t)
    tl.store(base + S_LOG2_SUM_B, ls_t)
    tl.store(base + S_KL_A, kl_s)
    tl.store(base + S_KL_B, kl_t)
    tl.store(val_ptr + row, val)
    _reduce2_if_last(red_ptr, n_rows, out_ptr, val_ptr, n_rows, keep_ptr, HAS_KEEP, REDUCE, BLOCK_REDUCE)


@triton.jit
def _finish2_rows(
    rows,
    rmask,
    part_ptr,
    n_parts,
    n_rows,
    keep_ptr,
    val_ptr,
    stat_ptr,
    k2,
    beta,
    KIND: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """KL: merge ``[m_a, s_a, m_b, s_b, kl]`` partials of ``rows`` into KL(A||B) and the stats
    ``[a_a, log2 s_a, a_b, log2 s_b, KL]``. JSD: add the ``[kl_s, kl_t]`` divergence partials
    into the value and stats columns 4, 5 (columns 0-3 were written by the divergence pass).
    ``beta`` is the JSD's; the KL kind never reads it (one kernel serves both kinds). As
    ``_finish1_rows``: one row per lane, the partials in the order of ``p``."""
    if KIND == KL:
        aa = _anchor(_parts_max(part_ptr, n_parts, n_rows, rows, rmask, KL_FIELDS, P_MAX_A, BLOCK_N))
        ab = _anchor(_parts_max(part_ptr, n_parts, n_rows, rows, rmask, KL_FIELDS, P_MAX_B, BLOCK_N))
        s_a = tl.zeros([BLOCK_N], tl.float32)
        s_b = tl.zeros([BLOCK_N], tl.float32)
        kl = tl.zeros([BLOCK_N], tl.float32)
        for p in range(n_parts):
            base = part_ptr + (p * n_rows + rows) * KL_FIELDS
            mpa = tl.load(base + P_MAX_A, mask=rmask, other=float("-inf"))
            spa = tl.load(base + P_SUM_A, mask=rmask, other=0.0)
            mpb = tl.load(base + P_MAX_B, mask=rmask, other=float("-inf"))
            wa = tl.exp2((mpa - aa) * k2)
            s_a += spa * wa
            s_b += tl.load(base + P_SUM_B, mask=rmask, other=0.0) * tl.exp2((mpb - ab) * k2)
            shift = ((_anchor(mpa) - aa) - (_anchor(mpb) - ab)) * k2
            kl += wa * (tl.load(base + P_KL, mask=rmask, other=0.0) + spa * shift)
        log_sa = tl.log2(s_a)
        log_sb = tl.log2(s_b)
        val = _kl_value(kl, s_a, s_b, log_sa, log_sb)
        tl.store(stat_ptr + rows * KL_STATS + S_ANCHOR_A, aa, mask=rmask)
        tl.store(stat_ptr + rows * KL_STATS + S_LOG2_SUM_A, log_sa, mask=rmask)
        tl.store(stat_ptr + rows * KL_STATS + S_ANCHOR_B, ab, mask=rmask)
        tl.store(stat_ptr + rows * KL_STATS + S_LOG2_SUM_B, log_sb, mask=rmask)
        tl.store(stat_ptr + rows * KL_STATS + S_KL_A, val, mask=rmask)
    else:
        kl_s = tl.zeros([BLOCK_N], tl.float32)
        kl_t = tl.zeros([BLOCK_N], tl.float32)
        for p in range(n_parts):
            base = part_ptr + (p * n_rows + rows) * DIV_FIELDS
            kl_s += tl.load(base + P_KL_S, mask=rmask, other=0.0)
            kl_t += tl.load(base + P_KL_T, mask=rmask, other=0.0)
        kl_s *= LN2
        kl_t *= LN2
        ls_s = tl.load(stat_ptr + rows * JSD_STATS + S_LOG2_SUM_A, mask=rmask, other=0.0)
        ls_t = tl.load(stat_ptr + rows * JSD_STATS + S_LOG2_SUM_B, mask=rmask, other=0.0)
        val = _jsd_value(kl_s, kl_t, ls_s, ls_t, beta)
        tl.store(stat_ptr + rows * JSD_STATS + S_KL_A, kl_s, mask=rmask)
        tl.store(stat_ptr + rows * JSD_STATS + S_KL_B, kl_t, mask=rmask)
    if HAS_KEEP:
        val = tl.where(tl.load(keep_ptr + rows, mask=rmask, other=0) != 0, val, 0.0)
    tl.store(val_ptr + rows, val, mask=rmask)


@triton.jit
def _reduce2_if_last(
    red_ptr,
    n_done,
    out_ptr,
    val_ptr,
    n_rows,
    keep_ptr,
    HAS_KEEP: tl.constexpr,
    REDUCE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``_reduce_if_last`` of a two-input op: a mean counts the kept tokens."""
    _reduce_if_last(red_ptr, n_done, out_ptr, val_ptr, n_rows, keep_ptr, keep_ptr, 0, False, HAS_KEEP, REDUCE, BLOCK)


@triton.jit(do_not_specialize=["n_parts", "n_rows"])
def finish2_kernel(
    part_ptr,
    n_parts,
    n_rows,
    keep_ptr,
    val_ptr,
    stat_ptr,
    red_ptr,
    out_ptr,
    k2,
    beta,
    KIND: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    REDUCE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_REDUCE: tl.constexpr,
):
    """``_finish2_rows`` of a block of rows; with REDUCE the last program reduces the values."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    _finish2_rows(
        rows, rows < n_rows, part_ptr, n_parts, n_rows, keep_ptr, val_ptr, stat_ptr, k2, beta, KIND, HAS_KEEP, BLOCK_N
    )
    _reduce2_if_last(red_ptr, tl.num_programs(0), out_ptr, val_ptr, n_rows, keep_ptr, HAS_KEEP, REDUCE, BLOCK_REDUCE)


@triton.jit(do_not_specialize=["rows_b", "splits"])
def backward2_kernel(
    a_ptr,
    b_ptr,
    rows_b,
    sa_a,
    sa_b,
    sb_a,
    sb_b,
    da_ptr,
    db_ptr,
    grad_ptr,
    g_row,
    red_ptr,
    keep_ptr,
    stat_ptr,
    v_local,
    splits,
    chunk,
    k2,
    inv_t,
    beta,
    KIND: tl.constexpr,
    NEED_A: tl.constexpr,
    NEED_B: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    MEAN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Gradients of KL(A||B) (``dA = p_a (lp_a - lp_b - KL)``, ``dB = p_b - p_a``) or of the
    JSD (a = student, b = teacher: ``d_s = (1-beta) p_s (lp_s - lm - KL_s)``, and the same for
    the teacher with beta), from saved statistics; only requested gradients are computed and
    written, in the input dtype. The KL kind never reads ``beta``. The upstream gradient is
    read at ``row * g_row`` (``_upstream``)."""
    pid = tl.program_id(0)
    row, lo, hi = _chunk(pid, splits, chunk, v_local)
    src_a = _row_start(a_ptr, row, rows_b, sa_a, sa_b)
    src_b = _row_start(b_ptr, row, rows_b, sb_a, sb_b)
    out_off = row.to(tl.int64) * v_local
    n_stats = KL_STATS if KIND == KL else JSD_STATS
    base = stat_ptr + row * n_stats
    anc_a = tl.load(base + S_ANCHOR_A)
    ls_a = tl.load(base + S_LOG2_SUM_A)
    anc_b = tl.load(base + S_ANCHOR_B)
    ls_b = tl.load(base + S_LOG2_SUM_B)
    kl_a = tl.load(base + S_KL_A)
    if KIND == JSD:
        kl_b = tl.load(base + S_KL_B)
    coef = _upstream(grad_ptr, row * g_row, red_ptr, MEAN) * inv_t
    coef = tl.where((ls_a > float("-inf")) & (ls_b > float("-inf")), coef, float("nan"))
    if HAS_KEEP:
        keep = tl.load(keep_ptr + row) != 0
    else:
        keep = row >= 0
    hi_read = tl.where(keep, hi, lo)  # masked rows read nothing
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inb = cols < hi
        lpa = (tl.load(src_a + cols, mask=cols < hi_read, other=0.0).to(tl.float32) - anc_a) * k2 - ls_a
        lpb = (tl.load(src_b + cols, mask=cols < hi_read, other=0.0).to(tl.float32) - anc_b) * k2 - ls_b
        pa = tl.exp2(lpa)
        if KIND == KL:
            if NEED_A:
                da = tl.where(pa == 0, 0.0, pa * ((lpa - lpb) * LN2 - kl_a)) * coef
                tl.store(da_ptr + out_off + cols, tl.where(keep, da, 0.0).to(da_ptr.dtype.element_ty), mask=inb)
            if NEED_B:
                db = (tl.exp2(lpb) - pa) * coef
                tl.store(db_ptr + out_off + cols, tl.where(keep, db, 0.0).to(db_ptr.dtype.element_ty), mask=inb)
        else:
            pb = tl.exp2(lpb)
            lm = _log2(tl.maximum(beta * pb + (1.0 - beta) * pa, MIN_NORMAL), FAST_LOG2)
            if NEED_A:  # finite floor on lp: 0 * finite = 0 where p = 0 (see jsd_div_kernel)
                da = pa * ((tl.maximum(lpa, LOGP_FLOOR) - lm) * LN2 - kl_a) * ((1.0 - beta) * coef)
                tl.store(da_ptr + out_off + cols, tl.where(keep, da, 0.0).to(da_ptr.dtype.element_ty), mask=inb)
            if NEED_B:
                db = pb * ((tl.maximum(lpb, LOGP_FLOOR) - lm) * LN2 - kl_b) * (beta * coef)
                tl.store(db_ptr + out_off + cols, tl.where(keep, db, 0.0).to(db_ptr.dtype.element_ty), mask=inb)


@triton.jit(do_not_specialize=["n", "programs"])
def scale_kernel(x_ptr, n, scale_ptr, programs, BLOCK: tl.constexpr):
    """``x *= scale`` in fp32 math, in place, over a contiguous ``x`` of ``n`` elements, each
    of ``programs`` programs striding over the tiles. Where the 0-dim ``scale`` is 1 (the
    upstream gradient of a plain ``loss.backward()``) every program returns having read it
    alone."""
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, programs * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            keep = offs < n
            x = tl.load(x_ptr + offs, mask=keep)
            tl.store(x_ptr + offs, (x.to(tl.float32) * scale).to(x.dtype), mask=keep)
