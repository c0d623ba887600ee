"""Triton kernels of ``argmax`` and ``sample`` (``sampling.py`` launches them; the XPU
backend launches the same ones).

Noise. The counter-based generator of ``vtp_runtime.sampling`` in uint32 arithmetic, bit for
bit: lowbias32 over the seed's key (mixed once per call on the host), the row (once per
program) and the global id (per element). From its bits, ``w`` in (0, 1) through the
mantissa of a float in [1, 2) (no int-to-float conversion), then Gumbel noise in bits,
``-log2(-ln(1 - w))``, with the series of ``-ln(1 - w)`` where ``w`` is small (the
logarithm near 1 is inexact, more so the hardware one). Two logarithms per element.

Scan. One program per (row, vocabulary split), as in ``kernels.py``; each lane keeps the best
(key, id, logit) of the columns it saw (a strict ``>``, so the earliest column wins a tie
within a lane) and the lanes are reduced once at the end: the lowest id among the lanes
holding the largest key. A row of partials is ``[key, id, x, max, max id, sum]`` fp32, ids
as int32 bits (``vtp_runtime.sampling.FIELDS``).
"""

import triton
import triton.language as tl

NONE_ID = tl.constexpr(2**31 - 1)
MIX_A = tl.constexpr(0x7FEB352D)
MIX_B = tl.constexpr(0x846CA68B)
ROW_SALT = tl.constexpr(0x68E31DA4)
ID_MUL = tl.constexpr(0x9E3779B1)
MANTISSA_ONE = tl.constexpr(0x3F800000)  # the bits of 1.0f
HALF_LO = tl.constexpr(0.5 * 2**-24)
HALF_HI = tl.constexpr(1.5 * 2**-24)
W_MAX = tl.constexpr(1.0 - 2**-24)
SERIES_BELOW = tl.constexpr(1.0 / 16)
THIRD = tl.constexpr(1.0 / 3)
SIXTH = tl.constexpr(1.0 / 6)
LN2 = tl.constexpr(0.6931471805599453)
KEY_BOUND = tl.constexpr(2.0**126)  # vtp_runtime.sampling.KEY_BOUND
RAW_BITS = tl.constexpr(2.0**8)  # vtp_runtime.sampling.RAW_BITS

# fields of a row of partials (vtp_runtime.sampling: KEY, ID, X, MAX, MAX_ID, SUM)
F_KEY = tl.constexpr(0)
F_ID = tl.constexpr(1)
F_X = tl.constexpr(2)
F_MAX = tl.constexpr(3)
F_MAX_ID = tl.constexpr(4)
F_SUM = tl.constexpr(5)
FIELDS = tl.constexpr(6)


@triton.jit
def _mix32(h):
    # lowbias32 on uint32
    h = h ^ (h >> 16)
    h = h * MIX_A
    h = h ^ (h >> 15)
    h = h * MIX_B
    return h ^ (h >> 16)


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:  # NVIDIA's lg2.approx: one MUFU op; arguments here are never denormal
        return tl.inline_asm_elementwise(
            "lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.log2(x)


@triton.jit
def _row_key(seed_key, row, row_offset):
    # the row's number: (row + row_offset) mod 2**32, row_offset given as int32 bits
    r = row.to(tl.uint32) + row_offset.to(tl.uint32, bitcast=True)
    return _mix32(seed_key.to(tl.uint32, bitcast=True) ^ _mix32(r ^ ROW_SALT))


@triton.jit
def _gumbel(row_key, ids, FAST: tl.constexpr):
    """Gumbel noise in bits for global ``ids`` (int32) of the row whose key is ``row_key``."""
    h = _mix32(row_key ^ (ids.to(tl.uint32) * ID_MUL))
    f = ((h >> 9) | MANTISSA_ONE).to(tl.float32, bitcast=True)
    w = tl.minimum((f - 1.0) + tl.where((h & 0x100) != 0, HALF_HI, HALF_LO), W_MAX)
    series = w * (1.0 + w * (0.5 + w * (THIRD + w * (0.25 + w * (0.2 + w * SIXTH)))))
    e = tl.where(w < SERIES_BELOW, series, -_log2(1.0 - w, FAST) * LN2)
    return -_log2(e, FAST)


@triton.jit
def _key(x, x_rel, scale_b, noise):
    """``keys`` of ``vtp_runtime.sampling``: the gap ``x_rel b`` (``x_rel = x s - anchor s``)
    clamped to ``KEY_BOUND``, plus the noise; an infinite ``x`` as it is."""
    key = tl.minimum(tl.maximum(x_rel * scale_b, -KEY_BOUND), KEY_BOUND) + noise
    return tl.where(tl.abs(x) == float("inf"), x, key)


@triton.jit(do_not_specialize=["seed_key", "seed_lo", "seed_hi", "row_offset", "rows_b", "n_rows", "splits"])
def scan_kernel(
    z_ptr,
    rows_b,
    stride_a,
    stride_b,
    out_ptr,
    tail_ptr,
    bx_ptr,
    bid_ptr,
    anchor_ptr,
    active_ptr,
    key_anchor_ptr,
    n_rows,
    v_local,
    vocab_start,
    splits,
    chunk,
    scale_s,
    scale_b,
    log2_min_p,
    seed_key,
    seed_lo,
    seed_hi,
    row_offset,
    GUMBEL: tl.constexpr,
    STATS: tl.constexpr,
    BOUND: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    KEY_ANCHOR: tl.constexpr,
    WRITE_SEED: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row's partials over one vocabulary chunk, one read of the logits.

    Gaps are in bits, ``gap(x, a) = (x s - a s) b`` (``vtp_runtime.sampling.Scale``). The
    eligible columns are all of the chunk, or with BOUND those strictly before the row's
    bound ``(bx, bid)`` in the order (logit desc, id asc) and kept by min-p
    (``gap(x, anchor) >= log2_min_p``). Keys are ``gap(x, c) + noise`` floored
    (GUMBEL; ``c`` the row's key anchor with KEY_ANCHOR, else 0) or ``x``; the noise's row
    is ``row + row_offset``. Every scan gives the chunk's max logit; STATS adds its lowest id
    and ``sum 2**gap(x, a)`` with ``a`` that max; BOUND puts the eligible
    ``sum 2**gap(x, anchor)`` in the sum. Inactive rows (HAS_ACTIVE) read nothing. NaN
    reads as ``+inf``. WRITE_SEED: program 0 writes the seed's words into the payload's
    tail (the cross-rank check)."""
    pid = tl.program_id(0)
    row = pid // splits
    lo = (pid % splits) * chunk
    hi = tl.minimum(lo + chunk, v_local)
    if HAS_ACTIVE:
        hi = tl.where(tl.load(active_ptr + row) != 0, hi, lo)
    r64 = row.to(tl.int64)
    src = z_ptr + (r64 // rows_b) * stride_a + (r64 % rows_b) * stride_b
    if GUMBEL:
        rk = _row_key(seed_key, row, row_offset)
        if KEY_ANCHOR:
            key_from = tl.load(key_anchor_ptr + row) * scale_s
        else:
            key_from = 0.0
    if BOUND:
        bx = tl.load(bx_ptr + row)
        bid = tl.load(bid_ptr + row)
        anchor = tl.load(anchor_ptr + row) * scale_s
    best_k = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], NONE_ID, tl.int32)
    best_x = tl.full([BLOCK], float("-inf"), tl.float32)
    max_x = tl.full([BLOCK], float("-inf"), tl.float32)
    max_i = tl.full([BLOCK], NONE_ID, tl.int32)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inb = cols < hi
        x = tl.load(src + cols, mask=inb, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)
        ids = vocab_start + cols
        xs = x * scale_s
        ok = inb
        if BOUND:
            ok = ok & ((x > bx) | ((x == bx) & (ids < bid))) & ((xs - anchor) * scale_b >= log2_min_p)
        if GUMBEL:
            key = _key(x, xs - key_from, scale_b, _gumbel(rk, ids, FAST_LOG2))
        else:
            key = x
        key = tl.where(ok, key, float("-inf"))
        better = key > best_k
        best_k = tl.where(better, key, best_k)
        best_i = tl.where(better, ids, best_i)
        best_x = tl.where(better, x, best_x)
        if STATS:
            up = x > max_x
            max_x = tl.where(up, x, max_x)
            max_i = tl.where(up, ids, max_i)
            m_new = tl.maximum(m, tl.max(x, 0))
            a_new = tl.where((m_new > float("-inf")) & (m_new < float("inf")), m_new, 0.0) * scale_s
            s = s * tl.exp2((m * scale_s - a_new) * scale_b) + tl.sum(tl.exp2((xs - a_new) * scale_b), 0)
            m = m_new
        else:
            max_x = tl.maximum(max_x, x)  # the max alone: its id only with STATS
        if BOUND:
            s += tl.sum(tl.where(ok, tl.exp2((xs - anchor) * scale_b), 0.0), 0)
    top = tl.max(best_k, 0)
    top_i = tl.min(tl.where(best_k == top, best_i, NONE_ID), 0)
    top_x = tl.max(tl.where(best_i == top_i, best_x, float("-inf")), 0)
    out = out_ptr + ((pid % splits) * n_rows + row) * FIELDS
    tl.store(out + F_KEY, top)
    tl.store(out + F_ID, top_i.to(tl.float32, bitcast=True))
    tl.store(out + F_X, top_x)
    mx = tl.max(max_x, 0)
    if STATS:
        mx_i = tl.min(tl.where(max_x == mx, max_i, NONE_ID), 0)
    else:
        mx_i = tl.full([], NONE_ID, tl.int32)
    tl.store(out + F_MAX, mx)
    tl.store(out + F_MAX_ID, mx_i.to(tl.float32, bitcast=True))
    tl.store(out + F_SUM, s)
    if WRITE_SEED:
        if pid == 0:
            tl.store(tail_ptr, seed_lo)
            tl.store(tail_ptr + 1, seed_hi)


@triton.jit(do_not_specialize=["seed_key", "row_offset"])
def candidate_keys_kernel(
    x_ptr,
    id_ptr,
    anchor_ptr,
    key_ptr,
    n_cols,
    scale_s,
    scale_b,
    seed_key,
    row_offset,
    FAST_LOG2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Keys relative to each row's ``anchor`` of a row of candidates ``[N, L]`` (fp32
    logits, int64 global ids): the numbers ``scan_kernel`` gives those tokens with that key
    anchor, through the same helpers."""
    row = tl.program_id(0)
    rk = _row_key(seed_key, row, row_offset)
    key_from = tl.load(anchor_ptr + row) * scale_s
    base = row.to(tl.int64) * n_cols
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inb = cols < n_cols
        x = tl.load(x_ptr + base + cols, mask=inb, other=float("-inf"))
        ids = tl.load(id_ptr + base + cols, mask=inb, other=0).to(tl.int32)
        key = _key(x, x * scale_s - key_from, scale_b, _gumbel(rk, ids, FAST_LOG2))
        tl.store(key_ptr + base + cols, key, mask=inb)


# -- a whole decode call at TP = 1 in one launch ------------------------------------------------
# ROWS rows per program (one on a GPU: decode has few rows; more in the interpreter, whose cost
# is per operation), each row's state a lane of a [ROWS] vector. Thresholds are found by
# bisection over the logits' values: a value's order-preserving integer (``_ordered``) in
# steps of 2**GRAIN (bf16 and fp16 logits read as fp32 have that many low bits zero), each
# step one read of the rows (from L2 at decode sizes).


@triton.jit
def _tile(z_ptr, base, live, start, v_local, BLOCK: tl.constexpr):
    """Columns ``start + [0, BLOCK)`` of the rows at ``base`` ([ROWS, BLOCK] fp32, NaN as +inf,
    past the row or in a dead row -inf), and those columns."""
    cols = start + tl.arange(0, BLOCK)
    inb = live[:, None] & (cols < v_local)[None, :]
    x = tl.load(z_ptr + base[:, None] + cols[None, :], mask=inb, other=float("-inf")).to(tl.float32)
    return tl.where(x != x, float("inf"), x), cols


@triton.jit
def _ordered(x):
    """An fp32 value's order-preserving int64 (-0.0 and 0.0 alike)."""
    u = x.to(tl.int32, bitcast=True)
    mag = (u & 0x7FFFFFFF).to(tl.int64)
    return tl.where(u < 0, -mag, mag)


@triton.jit
def _value(o):
    """The fp32 value of an ordered int64 (``_ordered``'s inverse)."""
    f = tl.abs(o).to(tl.int32).to(tl.float32, bitcast=True)
    return tl.where(o < 0, -f, f)


@triton.jit
def _row_max(z_ptr, base, live, v_local, vocab_start, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Each row's max, its lowest global id, and the row's min."""
    max_x = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)
    max_i = tl.full([ROWS, BLOCK], NONE_ID, tl.int32)
    min_x = tl.full([ROWS, BLOCK], float("inf"), tl.float32)
    for start in range(0, v_local, BLOCK):
        x, cols = _tile(z_ptr, base, live, start, v_local, BLOCK)
        up = x > max_x
        max_x = tl.where(up, x, max_x)
        max_i = tl.where(up, (vocab_start + cols)[None, :], max_i)
        min_x = tl.minimum(min_x, tl.where((cols < v_local)[None, :], x, float("inf")))
    m = tl.max(max_x, 1)
    return m, tl.min(tl.where(max_x == m[:, None], max_i, NONE_ID), 1), tl.min(min_x, 1)


@triton.jit
def _count_at_least(z_ptr, base, live, v_local, t, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.zeros([ROWS, BLOCK], tl.int32)
    for start in range(0, v_local, BLOCK):
        x, _ = _tile(z_ptr, base, live, start, v_local, BLOCK)
        n += (x >= t[:, None]).to(tl.int32)
    return tl.sum(n, 1)


@triton.jit
def _mass_above(z_ptr, base, live, v_local, t, vk, anchor, scale_s, scale_b, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Per row ``sum 2**gap(x, anchor)`` over x > t and x >= vk (``anchor`` scaled by s), and
    how many x equal t (with t >= vk)."""
    s = tl.zeros([ROWS, BLOCK], tl.float32)
    ties = tl.zeros([ROWS, BLOCK], tl.int32)
    for start in range(0, v_local, BLOCK):
        x, _ = _tile(z_ptr, base, live, start, v_local, BLOCK)
        kept = x >= vk[:, None]
        w = tl.exp2((x * scale_s - anchor[:, None]) * scale_b)
        s += tl.where((x > t[:, None]) & kept, w, 0.0)
        ties += ((x == t[:, None]) & kept).to(tl.int32)
    return tl.sum(s, 1), tl.sum(ties, 1)


@triton.jit
def _count_ties_upto(z_ptr, base, live, v_local, vocab_start, t, last, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Per row how many x equal t at global ids up to ``last``."""
    n = tl.zeros([ROWS, BLOCK], tl.int32)
    for start in range(0, v_local, BLOCK):
        x, cols = _tile(z_ptr, base, live, start, v_local, BLOCK)
        n += ((x == t[:, None]) & ((vocab_start + cols)[None, :] <= last[:, None])).to(tl.int32)
    return tl.sum(n, 1)


@triton.jit
def _draw(
    z_ptr,
    base,
    live,
    v_local,
    vocab_start,
    rk,
    key_from,
    scale_s,
    scale_b,
    vk,
    cut_x,
    cut_id,
    anchor,
    log2_min_p,
    FILTER: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per row the Gumbel-max (ties to the lowest id): keys ``gap(x, key_from) + noise``; with
    FILTER over the tokens with x >= vk, before the cut (x > cut_x, or x == cut_x at an id
    below cut_id) and kept by min-p (gap(x, anchor) >= log2_min_p). Its global id, or
    NONE_ID where no key is above -inf."""
    best_k = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([ROWS, BLOCK], NONE_ID, tl.int32)
    for start in range(0, v_local, BLOCK):
        x, cols = _tile(z_ptr, base, live, start, v_local, BLOCK)
        ids = (vocab_start + cols)[None, :]
        xs = x * scale_s
        key = _key(x, xs - key_from[:, None], scale_b, _gumbel(rk[:, None], ids, FAST_LOG2))
        ok = (cols < v_local)[None, :]
        if FILTER:
            before = (x > cut_x[:, None]) | ((x == cut_x[:, None]) & (ids < cut_id[:, None]))
            ok = ok & (x >= vk[:, None]) & before & ((xs - anchor[:, None]) * scale_b >= log2_min_p)
        key = tl.where(ok, key, float("-inf"))
        better = key > best_k
        best_k = tl.where(better, key, best_k)
        best_i = tl.where(better, ids, best_i)
    top = tl.max(best_k, 1)
    return tl.min(tl.where(best_k == top[:, None], best_i, NONE_ID), 1)


@triton.jit(do_not_specialize=["seed_key", "row_offset", "n_rows", "rows_b"])
def decode_kernel(
    z_ptr,
    out_ptr,
    seed_key,
    n_rows,
    rows_b,
    stride_a,
    stride_b,
    v_local,
    vocab_start,
    scale_s,
    scale_b,
    row_offset,
    top_k,
    top_p,
    log2_min_p,
    GUMBEL: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_P: tl.constexpr,
    MIN_P: tl.constexpr,
    GRAIN: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Each row's token id (int64) of ``argmax`` or ``sample`` on the whole vocabulary: the
    numbers ``vtp_runtime.sampling.run`` gives, with its keys (``_key``, ``_gumbel``), found
    in the program.

    argmax: the lowest id of the max (0 where every logit is -inf). sample: where the max M
    is not finite, as argmax. Otherwise the kept set is x >= v_k (TOP_K: v_k the top_k-th
    largest, by bisection on the count of x >= t), then (TOP_P) the prefix of the order
    (logit desc, id asc) whose mass before each token is below top_p times the kept mass
    (the cut value by bisection on the mass above it, the tied tokens at the cut by id),
    then (MIN_P) gap(x, M) >= log2_min_p; the draw is the Gumbel-max over it, keys relative
    to M with TOP_K or where raw keys lose the noise's resolution (|gap(M, 0)| >= RAW_BITS),
    raw otherwise."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < n_rows
    r64 = rows.to(tl.int64)
    base = (r64 // rows_b) * stride_a + (r64 % rows_b) * stride_b
    m, m_id, x_min = _row_max(z_ptr, base, live, v_local, vocab_start, ROWS, BLOCK)
    answer = tl.where(m == float("-inf"), 0, m_id)
    if GUMBEL:
        finite = tl.abs(m) < float("inf")
        a = tl.where(finite, m, 0.0) * scale_s  # the anchor, scaled
        relative = tl.abs((a - 0.0) * scale_b) >= RAW_BITS
        if TOP_K:
            key_from = a
        else:
            key_from = tl.where(relative, a, 0.0)
        rk = _row_key(seed_key, rows, row_offset)
        vk = tl.full([ROWS], float("-inf"), tl.float32)
        cut_x = tl.full([ROWS], float("-inf"), tl.float32)
        cut_id = tl.full([ROWS], NONE_ID, tl.int32)  # ties at cut_x kept below this id
        if TOP_K:  # the largest t with at least top_k logits >= t
            lo = _ordered(x_min) >> GRAIN
            hi = _ordered(m) >> GRAIN
            while tl.max(hi - lo, 0) > 0:
                mid = lo + (hi - lo + 1) // 2
                enough = _count_at_least(z_ptr, base, live, v_local, _value(mid << GRAIN), ROWS, BLOCK) >= top_k
                open_ = lo < hi
                lo = tl.where(open_ & enough, mid, lo)
                hi = tl.where(open_ & ~enough, mid - 1, hi)
            vk = _value(lo << GRAIN)
        if TOP_P:  # the smallest t whose mass above is below top_p times the kept mass
            total, _ = _mass_above(z_ptr, base, live, v_local, cut_x, vk, a, scale_s, scale_b, ROWS, BLOCK)
            limit = top_p * total
            lo = _ordered(tl.maximum(x_min, vk)) >> GRAIN
            hi = _ordered(m) >> GRAIN
            # The first probe: at most v_local tokens of weight w(t) or less lie at or below t
            # (the max weighs 1, so total >= 1), hence the mass above t is still >= limit where
            # v_local w(t) <= (1 - top_p) total; with half that as margin, the probe is t_low,
            # the largest such t. Logits spread over many binades put the cut far above the
            # row's min, and this first step skips most of the bisection's range. Any probe in
            # [lo, hi) keeps the search exact: it moves lo or hi as a midpoint would.
            q = tl.log2((1.0 - top_p) * 0.5 * total / v_local)
            t_low = (a + q / scale_b) / scale_s
            first = tl.minimum(tl.maximum(_ordered(t_low) >> GRAIN, lo), hi)
            while tl.max(hi - lo, 0) > 0:
                mid = tl.where((lo < first) & (first < hi), first, lo + (hi - lo) // 2)
                first = lo  # probed once
                above, _ = _mass_above(
                    z_ptr, base, live, v_local, _value(mid << GRAIN), vk, a, scale_s, scale_b, ROWS, BLOCK
                )
                open_ = lo < hi
                hi = tl.where(open_ & (above < limit), mid, hi)
                lo = tl.where(open_ & ~(above < limit), mid + 1, lo)
            cut_x = _value(lo << GRAIN)
            before, ties = _mass_above(z_ptr, base, live, v_local, cut_x, vk, a, scale_s, scale_b, ROWS, BLOCK)
            # the tied tokens at the cut in id order: the mass before the r-th is before + r w
            w = tl.exp2((cut_x * scale_s - a) * scale_b)
            room = tl.where(w > 0, tl.ceil((limit - before) / w), float("inf"))
            keep = tl.maximum(tl.minimum(room, ties.to(tl.float32)), 1.0).to(tl.int32)
            # where fewer than all ties are kept: the id of the keep-th, by bisection
            id_lo = tl.zeros([ROWS], tl.int32) + vocab_start
            id_hi = tl.where(keep < ties, vocab_start + v_local - 1, id_lo)
            while tl.max(id_hi - id_lo, 0) > 0:
                id_mid = id_lo + (id_hi - id_lo) // 2
                enough = _count_ties_upto(z_ptr, base, live, v_local, vocab_start, cut_x, id_mid, ROWS, BLOCK) >= keep
                open_ = id_lo < id_hi
                id_hi = tl.where(open_ & enough, id_mid, id_hi)
                id_lo = tl.where(open_ & ~enough, id_mid + 1, id_lo)
            cut_id = tl.where(keep < ties, id_lo + 1, cut_id)
        drawn = _draw(
            z_ptr,
            base,
            live,
            v_local,
            vocab_start,
            rk,
            key_from,
            scale_s,
            scale_b,
            vk,
            cut_x,
            cut_id,
            a,
            log2_min_p,
            TOP_K or TOP_P or MIN_P,
            FAST_LOG2,
            ROWS,
            BLOCK,
        )
        answer = tl.where(finite, tl.where(drawn == NONE_ID, 0, drawn), answer)
    tl.store(out_ptr + rows, answer.to(tl.int64), mask=live)
