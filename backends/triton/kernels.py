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
Partials are ``[P, N, F]`` fp32 (P = splits x ranks). Gradients are written contiguous.
Each stats/divergence/backward program handles one row and one contiguous chunk of its
local vocabulary (``pid = row * splits + split``), so few rows still fill the GPU.
"""

import triton
import triton.language as tl

# Kernels may only read globals that are constexpr; backend.py passes the plain ints.
LN2 = tl.constexpr(0.6931471805599453)
# op kinds of the one-input kernels
CE = tl.constexpr(0)
LOGPROBS = tl.constexpr(1)
ENTROPY = tl.constexpr(2)
# op kinds of the two-input kernels
KL = tl.constexpr(0)
JSD = tl.constexpr(1)


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
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.log2(x)


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
def stats1_kernel(z_ptr, rows_b, stride_a, stride_b, idx_ptr, n_idx, keep_ptr, part_ptr,
                  n_rows, v_local, vocab_start, splits, chunk, k2, ignore_index,
                  KIND: tl.constexpr, SMOOTH: tl.constexpr, HAS_KEEP: tl.constexpr,
                  PREFETCH: tl.constexpr, BLOCK: tl.constexpr):
    """Partial statistics of one row over one vocabulary chunk, one read of the logits.

    Fields (F): CE ``[m, s, sum (z - a) k2, count, z_label]`` (sum/count only with SMOOTH);
    logprobs ``[m, s, z_index_0 .. z_index_{k-1}]``; entropy ``[m, s, sum e (z - a) k2]``.
    Picked logits are raw and 0 in every partial but the owner's, so they add up.
    Rows that are masked out read nothing and leave an empty state.
    """
    pid = tl.program_id(0)
    row, lo, hi = _chunk(pid, splits, chunk, v_local)
    if KIND == CE:
        n_fields = 5
        active = tl.load(idx_ptr + row) != ignore_index
    elif KIND == LOGPROBS:
        n_fields = 2 + n_idx
        active = row < 0  # false; true below when any index entry is not ignored
        for j in range(n_idx):
            active = active | (tl.load(idx_ptr + row * n_idx + j) != ignore_index)
    else:
        n_fields = 3
        if HAS_KEEP:
            active = tl.load(keep_ptr + row) != 0
        else:
            active = row >= 0
    hi = tl.where(active, hi, lo)
    src = _row_start(z_ptr, row, rows_b, stride_a, stride_b)

    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    t = tl.zeros([], tl.float32)  # CE: sum (z - a) k2; entropy: sum e (z - a) k2
    if PREFETCH:  # the next tile's load is issued before this tile's reductions wait on it
        z_next = tl.load(src + lo + tl.arange(0, BLOCK), mask=lo + tl.arange(0, BLOCK) < hi, other=float("-inf"))
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inb = cols < hi
        if PREFETCH:
            z = z_next.to(tl.float32)
            z_next = tl.load(src + cols + BLOCK, mask=cols + BLOCK < hi, other=float("-inf"))
        else:
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
            t = alpha * (t + s * shift) + tl.sum(tl.where(e > 0, e * x, 0.0), 0)
        s = s * alpha + tl.sum(e, 0)
        m = m_new

    out = part_ptr + ((pid % splits) * n_rows + row) * n_fields
    tl.store(out, m)
    tl.store(out + 1, s)
    if KIND == CE:
        tl.store(out + 2, t)
        tl.store(out + 3, tl.maximum(hi - lo, 0).to(tl.float32))
        local = tl.load(idx_ptr + row) - vocab_start
        mine = (local >= lo) & (local < hi)
        zy = tl.load(src + local, mask=mine, other=0.0).to(tl.float32)
        tl.store(out + 4, tl.where(mine, zy, 0.0))
    elif KIND == LOGPROBS:
        for j in range(n_idx):
            local = tl.load(idx_ptr + row * n_idx + j) - vocab_start
            mine = (local >= lo) & (local < hi)
            zj = tl.load(src + local, mask=mine, other=0.0).to(tl.float32)
            tl.store(out + 2 + j, tl.where(mine, zj, 0.0))
    else:
        tl.store(out + 2, t)


@triton.jit
def finish1_kernel(part_ptr, n_parts, n_rows, idx_ptr, n_idx, keep_ptr, val_ptr, stat_ptr,
                   vocab_size, k2, ignore_index, smoothing, z_loss,
                   KIND: tl.constexpr, SMOOTH: tl.constexpr, ZLOSS: tl.constexpr,
                   HAS_KEEP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Merge the ``[P, N, F]`` partials of every split and rank into per-token values (nats)
    and the O(N) statistics the backward pass needs: ``[a, log2 s]`` (+ H for entropy), so
    that ``log p = (z - a) k2 - log2 s`` in bits. Every rank merges the same gathered
    partials in the same order, so the values are identical on every rank."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    if KIND == CE:
        n_fields = 5
    elif KIND == LOGPROBS:
        n_fields = 2 + n_idx
    else:
        n_fields = 3
    big_m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for p in range(n_parts):
        mp = tl.load(part_ptr + (p * n_rows + rows) * n_fields, mask=rmask, other=float("-inf"))
        big_m = tl.maximum(big_m, mp)
    a = _anchor(big_m)
    s = tl.zeros([BLOCK_N], tl.float32)
    t = tl.zeros([BLOCK_N], tl.float32)
    picked = tl.zeros([BLOCK_N], tl.float32)
    for p in range(n_parts):
        base = part_ptr + (p * n_rows + rows) * n_fields
        mp = tl.load(base, mask=rmask, other=float("-inf"))
        sp = tl.load(base + 1, mask=rmask, other=0.0)
        w = tl.exp2((mp - a) * k2)
        shift = (_anchor(mp) - a) * k2
        s += sp * w
        if KIND == CE:
            if SMOOTH:
                cnt = tl.load(base + 3, mask=rmask, other=0.0)
                tp = tl.load(base + 2, mask=rmask, other=0.0)
                t += tl.where(cnt > 0, tp + cnt * shift, 0.0)
            picked += tl.load(base + 4, mask=rmask, other=0.0)
        elif KIND == ENTROPY:
            tp = tl.load(base + 2, mask=rmask, other=0.0)
            t += w * (tp + sp * shift)
    log_s = tl.log2(s)
    empty = s == 0  # all -inf row: NaN by contract
    nan = float("nan")
    if KIND == CE:
        y = tl.load(idx_ptr + rows, mask=rmask, other=ignore_index)
        keep = y != ignore_index
        bad = keep & ((y < 0) | (y >= vocab_size))
        val = (1.0 - smoothing) * (log_s - (picked - a) * k2)
        if SMOOTH:
            val += smoothing * (log_s - t / vocab_size)
        val = val * LN2
        if ZLOSS:
            lse = (a * k2 + log_s) * LN2
            val += z_loss * lse * lse
        val = tl.where(bad | empty, nan, val)
        tl.store(val_ptr + rows, tl.where(keep, val, 0.0), mask=rmask)
    elif KIND == LOGPROBS:
        any_kept = rows < 0
        for j in range(n_idx):
            got = tl.zeros([BLOCK_N], tl.float32)
            for p in range(n_parts):
                got += tl.load(part_ptr + (p * n_rows + rows) * n_fields + 2 + j, mask=rmask, other=0.0)
            ij = tl.load(idx_ptr + rows * n_idx + j, mask=rmask, other=ignore_index)
            keep = ij != ignore_index
            any_kept = any_kept | keep
            bad = keep & ((ij < 0) | (ij >= vocab_size))
            val = ((got - a) * k2 - log_s) * LN2
            val = tl.where(bad | empty, nan, val)
            tl.store(val_ptr + rows * n_idx + j, tl.where(keep, val, 0.0), mask=rmask)
    else:
        h = (log_s - t / s) * LN2
        h = tl.where(empty, nan, h)
        if HAS_KEEP:
            h = tl.where(tl.load(keep_ptr + rows, mask=rmask, other=0) != 0, h, 0.0)
        tl.store(val_ptr + rows, h, mask=rmask)
        tl.store(stat_ptr + rows * 3 + 2, h, mask=rmask)
    n_stats = 3 if KIND == ENTROPY else 2
    tl.store(stat_ptr + rows * n_stats, a, mask=rmask)
    tl.store(stat_ptr + rows * n_stats + 1, log_s, mask=rmask)


@triton.jit
def backward1_kernel(z_ptr, rows_b, stride_a, stride_b, dz_ptr, grad_ptr, idx_ptr, n_idx, keep_ptr,
                     stat_ptr, v_local, vocab_start, vocab_size, splits, chunk, k2, inv_t,
                     ignore_index, smoothing, z_loss,
                     KIND: tl.constexpr, SMOOTH: tl.constexpr, ZLOSS: tl.constexpr,
                     HAS_KEEP: tl.constexpr, BLOCK: tl.constexpr):
    """Gradient w.r.t. the logits from the saved O(N) statistics: probabilities recomputed
    in registers (one exp per element), one read of the logits, one write of the gradient
    in the input dtype. Masked rows read nothing and write exact zeros; a row whose logits
    were all -inf gets NaN (its value is NaN), every other row is unaffected."""
    pid = tl.program_id(0)
    row, lo, hi = _chunk(pid, splits, chunk, v_local)
    src = _row_start(z_ptr, row, rows_b, stride_a, stride_b)
    dst = dz_ptr + row.to(tl.int64) * v_local
    nan = float("nan")
    n_stats = 3 if KIND == ENTROPY else 2
    a = tl.load(stat_ptr + row * n_stats)
    log_s = tl.load(stat_ptr + row * n_stats + 1)
    alive = log_s > float("-inf")
    if KIND == ENTROPY:
        h = tl.load(stat_ptr + row * 3 + 2)
        coef = tl.where(alive, tl.load(grad_ptr + row) * inv_t, nan)
        if HAS_KEEP:
            keep = tl.load(keep_ptr + row) != 0
        else:
            keep = row >= 0
    elif KIND == CE:
        y = tl.load(idx_ptr + row)
        keep = y != ignore_index
        bad = keep & ((y < 0) | (y >= vocab_size))
        coef = tl.where(bad | (alive == 0), nan, tl.load(grad_ptr + row) * inv_t)
        y_local = y - vocab_start
        p_coef = 1.0
        if ZLOSS:
            p_coef = 1.0 + 2.0 * z_loss * ((a * k2 + log_s) * LN2)
    else:
        # log-probs: d = sum_j g_j onehot(i_j) - (sum_j g_j) p
        total = tl.zeros([], tl.float32)
        for j in range(n_idx):
            ij = tl.load(idx_ptr + row * n_idx + j)
            gj = tl.load(grad_ptr + row * n_idx + j) * inv_t
            gj = tl.where(ij != ignore_index, gj, 0.0)
            gj = tl.where((ij != ignore_index) & ((ij < 0) | (ij >= vocab_size)), nan, gj)
            total += gj
        # a token whose entries are all ignored read nothing in the forward: leave it 0
        total = tl.where(alive | (total == 0), total, nan)
        keep = row >= 0
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
            d = tl.where(total != 0, -p * total, 0.0)
            for j in range(n_idx):
                ij = tl.load(idx_ptr + row * n_idx + j)
                gj = tl.load(grad_ptr + row * n_idx + j) * inv_t
                d += tl.where((cols == ij - vocab_start) & (ij != ignore_index), gj, 0.0)
        else:
            d = tl.where(p == 0, 0.0, -p * (lp * LN2 + h)) * coef
        d = tl.where(keep, d, 0.0)
        tl.store(dst + cols, d.to(dz_ptr.dtype.element_ty), mask=inb)


# -- two-input ops: KL, JSD ---------------------------------------------------------------------

@triton.jit
def stats2_kernel(a_ptr, b_ptr, rows_b, sa_a, sa_b, sb_a, sb_b, keep_ptr, part_ptr,
                  n_rows, v_local, splits, chunk, k2,
                  WITH_KL: tl.constexpr, HAS_KEEP: tl.constexpr, PREFETCH: tl.constexpr, BLOCK: tl.constexpr):
    """Partial statistics of two inputs over one chunk, one read of each.

    Fields ``[m_a, s_a, m_b, s_b]`` and with WITH_KL ``sum e_a ((z_a - a_a) - (z_b - a_b)) k2``,
    the unnormalized KL(A || B) term. (``sa_*``/``sb_*`` are the row strides of a and b.)"""
    pid = tl.program_id(0)
    row, lo, hi = _chunk(pid, splits, chunk, v_local)
    if HAS_KEEP:
        hi = tl.where(tl.load(keep_ptr + row) != 0, hi, lo)
    src_a = _row_start(a_ptr, row, rows_b, sa_a, sa_b)
    src_b = _row_start(b_ptr, row, rows_b, sb_a, sb_b)
    ma = tl.full([], float("-inf"), tl.float32)
    mb = tl.full([], float("-inf"), tl.float32)
    sa = tl.zeros([], tl.float32)
    sb = tl.zeros([], tl.float32)
    kl = tl.zeros([], tl.float32)
    if PREFETCH:  # the next tile's loads are issued before this tile's reductions wait on them
        first = lo + tl.arange(0, BLOCK)
        za_next = tl.load(src_a + first, mask=first < hi, other=float("-inf"))
        zb_next = tl.load(src_b + first, mask=first < hi, other=float("-inf"))
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inb = cols < hi
        if PREFETCH:
            za = za_next.to(tl.float32)
            zb = zb_next.to(tl.float32)
            za_next = tl.load(src_a + cols + BLOCK, mask=cols + BLOCK < hi, other=float("-inf"))
            zb_next = tl.load(src_b + cols + BLOCK, mask=cols + BLOCK < hi, other=float("-inf"))
        else:
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
    n_fields = 5 if WITH_KL else 4
    out = part_ptr + ((pid % splits) * n_rows + row) * n_fields
    tl.store(out, ma)
    tl.store(out + 1, sa)
    tl.store(out + 2, mb)
    tl.store(out + 3, sb)
    if WITH_KL:
        tl.store(out + 4, kl)


@triton.jit
def _merge_row_stats(part_ptr, n_parts, n_rows, row, k2, N_FIELDS: tl.constexpr):
    """Scalar merge of one row's ``[m_a, s_a, m_b, s_b]`` partials: ``(a_a, log2 s_a, a_b, log2 s_b)``."""
    big_a = tl.full([], float("-inf"), tl.float32)
    big_b = tl.full([], float("-inf"), tl.float32)
    for p in range(n_parts):
        base = part_ptr + (p * n_rows + row) * N_FIELDS
        big_a = tl.maximum(big_a, tl.load(base))
        big_b = tl.maximum(big_b, tl.load(base + 2))
    aa = _anchor(big_a)
    ab = _anchor(big_b)
    s_a = tl.zeros([], tl.float32)
    s_b = tl.zeros([], tl.float32)
    for p in range(n_parts):
        base = part_ptr + (p * n_rows + row) * N_FIELDS
        s_a += tl.load(base + 1) * tl.exp2((tl.load(base) - aa) * k2)
        s_b += tl.load(base + 3) * tl.exp2((tl.load(base + 2) - ab) * k2)
    return aa, tl.log2(s_a), ab, tl.log2(s_b)


@triton.jit
def jsd_div_kernel(s_ptr, t_ptr, rows_b, ss_a, ss_b, st_a, st_b, keep_ptr, stats_part_ptr, n_stats_parts,
                   part_ptr, stat_ptr, n_rows, v_local, splits, chunk, k2, beta,
                   HAS_KEEP: tl.constexpr, FAST_LOG2: tl.constexpr, BLOCK: tl.constexpr):
    """JSD divergence pass: merges the row's gathered statistics itself (a few scalars, no
    separate launch), then one more read of both inputs accumulating ``sum p_s (lp_s - lm)``
    and ``sum p_t (lp_t - lm)`` (bits), with ``M = beta p_t + (1-beta) p_s``. Three
    transcendentals per element: exp2 of each log-prob and one log2 of the mixture."""
    pid = tl.program_id(0)
    row, lo, hi = _chunk(pid, splits, chunk, v_local)
    if HAS_KEEP:
        hi = tl.where(tl.load(keep_ptr + row) != 0, hi, lo)
    a_s, ls_s, a_t, ls_t = _merge_row_stats(stats_part_ptr, n_stats_parts, n_rows, row, k2, 4)
    if pid % splits == 0:
        tl.store(stat_ptr + row * 6, a_s)
        tl.store(stat_ptr + row * 6 + 1, ls_s)
        tl.store(stat_ptr + row * 6 + 2, a_t)
        tl.store(stat_ptr + row * 6 + 3, ls_t)
    src_s = _row_start(s_ptr, row, rows_b, ss_a, ss_b)
    src_t = _row_start(t_ptr, row, rows_b, st_a, st_b)
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
        lm = _log2(tl.maximum(beta * pt + (1.0 - beta) * ps, 1.1754944e-38), FAST_LOG2)
        # lm is finite (clamped), so clamping lp to a finite floor gives 0 * finite = 0 where
        # p = 0 (the 0 log 0 = 0 rule) in one op instead of a compare and a select; a NaN p
        # (NaN logits) still propagates through the product
        acc_s += ps * (tl.maximum(lps, -1e30) - lm)
        acc_t += pt * (tl.maximum(lpt, -1e30) - lm)
    out = part_ptr + ((pid % splits) * n_rows + row) * 2
    tl.store(out, tl.sum(acc_s, 0))
    tl.store(out + 1, tl.sum(acc_t, 0))


@triton.jit
def finish2_kernel(part_ptr, n_parts, n_rows, keep_ptr, val_ptr, stat_ptr, k2, beta,
                   KIND: tl.constexpr, HAS_KEEP: tl.constexpr, BLOCK_N: tl.constexpr):
    """KL: merge ``[m_a, s_a, m_b, s_b, kl]`` partials into KL(A||B) and the stats
    ``[a_a, log2 s_a, a_b, log2 s_b, KL]``. JSD: add the ``[kl_s, kl_t]`` divergence partials
    into the value and stats columns 4, 5 (columns 0-3 were written by the divergence pass)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    nan = float("nan")
    if KIND == KL:
        big_a = tl.full([BLOCK_N], float("-inf"), tl.float32)
        big_b = tl.full([BLOCK_N], float("-inf"), tl.float32)
        for p in range(n_parts):
            base = part_ptr + (p * n_rows + rows) * 5
            big_a = tl.maximum(big_a, tl.load(base, mask=rmask, other=float("-inf")))
            big_b = tl.maximum(big_b, tl.load(base + 2, mask=rmask, other=float("-inf")))
        aa = _anchor(big_a)
        ab = _anchor(big_b)
        s_a = tl.zeros([BLOCK_N], tl.float32)
        s_b = tl.zeros([BLOCK_N], tl.float32)
        kl = tl.zeros([BLOCK_N], tl.float32)
        for p in range(n_parts):
            base = part_ptr + (p * n_rows + rows) * 5
            mpa = tl.load(base, mask=rmask, other=float("-inf"))
            spa = tl.load(base + 1, mask=rmask, other=0.0)
            mpb = tl.load(base + 2, mask=rmask, other=float("-inf"))
            wa = tl.exp2((mpa - aa) * k2)
            s_a += spa * wa
            s_b += tl.load(base + 3, mask=rmask, other=0.0) * tl.exp2((mpb - ab) * k2)
            shift = ((_anchor(mpa) - aa) - (_anchor(mpb) - ab)) * k2
            kl += wa * (tl.load(base + 4, mask=rmask, other=0.0) + spa * shift)
        log_sa = tl.log2(s_a)
        log_sb = tl.log2(s_b)
        val = (kl / s_a - log_sa + log_sb) * LN2
        val = tl.where((s_a == 0) | (s_b == 0), nan, val)
        tl.store(stat_ptr + rows * 5, aa, mask=rmask)
        tl.store(stat_ptr + rows * 5 + 1, log_sa, mask=rmask)
        tl.store(stat_ptr + rows * 5 + 2, ab, mask=rmask)
        tl.store(stat_ptr + rows * 5 + 3, log_sb, mask=rmask)
        tl.store(stat_ptr + rows * 5 + 4, val, mask=rmask)
    else:
        kl_s = tl.zeros([BLOCK_N], tl.float32)
        kl_t = tl.zeros([BLOCK_N], tl.float32)
        for p in range(n_parts):
            base = part_ptr + (p * n_rows + rows) * 2
            kl_s += tl.load(base, mask=rmask, other=0.0)
            kl_t += tl.load(base + 1, mask=rmask, other=0.0)
        kl_s *= LN2
        kl_t *= LN2
        ls_s = tl.load(stat_ptr + rows * 6 + 1, mask=rmask, other=0.0)
        ls_t = tl.load(stat_ptr + rows * 6 + 3, mask=rmask, other=0.0)
        val = (1.0 - beta) * kl_s + beta * kl_t
        val = tl.where((ls_s > float("-inf")) & (ls_t > float("-inf")), val, nan)
        tl.store(stat_ptr + rows * 6 + 4, kl_s, mask=rmask)
        tl.store(stat_ptr + rows * 6 + 5, kl_t, mask=rmask)
    if HAS_KEEP:
        val = tl.where(tl.load(keep_ptr + rows, mask=rmask, other=0) != 0, val, 0.0)
    tl.store(val_ptr + rows, val, mask=rmask)


@triton.jit
def backward2_kernel(a_ptr, b_ptr, rows_b, sa_a, sa_b, sb_a, sb_b, da_ptr, db_ptr, grad_ptr, keep_ptr,
                     stat_ptr, v_local, splits, chunk, k2, inv_t, beta, w_a, w_b,
                     KIND: tl.constexpr, NEED_A: tl.constexpr, NEED_B: tl.constexpr,
                     HAS_KEEP: tl.constexpr, FAST_LOG2: tl.constexpr, BLOCK: tl.constexpr):
    """Gradients of KL(A||B) (``dA = p_a (lp_a - lp_b - KL)``, ``dB = p_b - p_a``) or of the
    JSD (a = student, b = teacher: ``d_s = (1-beta) p_s (lp_s - lm - KL_s)``, and the same for
    the teacher with beta), from saved statistics; only requested gradients are computed and
    written, in the input dtype."""
    pid = tl.program_id(0)
    row, lo, hi = _chunk(pid, splits, chunk, v_local)
    src_a = _row_start(a_ptr, row, rows_b, sa_a, sa_b)
    src_b = _row_start(b_ptr, row, rows_b, sb_a, sb_b)
    out_off = row.to(tl.int64) * v_local
    n_stats = 5 if KIND == KL else 6
    base = stat_ptr + row * n_stats
    anc_a = tl.load(base)
    ls_a = tl.load(base + 1)
    anc_b = tl.load(base + 2)
    ls_b = tl.load(base + 3)
    kl_a = tl.load(base + 4)
    if KIND == JSD:
        kl_b = tl.load(base + 5)
    coef = tl.load(grad_ptr + row) * inv_t
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
            lm = _log2(tl.maximum(beta * pb + (1.0 - beta) * pa, 1.1754944e-38), FAST_LOG2)
            if NEED_A:  # finite floor on lp: 0 * finite = 0 where p = 0 (see jsd_div_kernel)
                da = pa * ((tl.maximum(lpa, -1e30) - lm) * LN2 - kl_a) * (w_a * coef)
                tl.store(da_ptr + out_off + cols, tl.where(keep, da, 0.0).to(da_ptr.dtype.element_ty), mask=inb)
            if NEED_B:
                db = pb * ((tl.maximum(lpb, -1e30) - lm) * LN2 - kl_b) * (w_b * coef)
                tl.store(db_ptr + out_off + cols, tl.where(keep, db, 0.0).to(db_ptr.dtype.element_ty), mask=inb)
