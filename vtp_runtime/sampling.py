"""Vocabulary-parallel sampling: ``argmax`` and ``sample`` on logits sharded over the vocabulary.

Both return int64 **global** token ids shaped ``logits.shape[:-1]``, identical on every rank
of ``tp_group``, without gathering the logits. The public functions are in
``vtp_runtime/api.py``; this module holds everything about the algorithm that does not
depend on a backend: a backend supplies three local primitives (``Kernels``) and calls
``run``.

The draw. Token ``j`` of row ``r`` gets Gumbel noise from a counter-based generator keyed
by ``(seed, r, j)``, ``r`` the row's number: ``row_offset`` plus its index among the
flattened token rows, modulo 2**32 (``row_numbers``; ranks holding other rows of one batch
number them globally). The token drawn is the one with the largest key
``(x_j - c) log2(e) / T + g_j`` (Gumbel-max, in bits), ties to the lowest id, where the row's
constant ``c`` is 0 (raw keys) unless the row's global max ``M`` makes raw keys lose the
noise's resolution (``relative_rows``, a rule on ``M`` and ``T`` only), then ``M``. The gap
is formed as ``Scale.gap`` forms it, in fp32's normal range at every temperature, and
clamped (``keys``): every key of a finite logit is finite. A key depends on the logit, the
row's constant, the seed, the row's number and the global id only, so the same seed gives
the same tokens at any TP size and shard layout (even, uneven, empty shards) on a given
backend and device type. Backends compute the logarithms of the noise with their device's
functions: across backends or device types the keys can differ in the last bits, so a
near-tie can break differently there.

Restrictions (applied in transformers' order: temperature, top_k, top_p, min_p), each
exact, the kept set always a prefix of the tokens ordered by (logit desc, id asc):

- ``top_k``: keep ``x >= v_k``, the k-th largest logit (ties at ``v_k`` are all kept, as
  transformers' ``TopKLogitsWarper`` keeps them). Each rank sends its top ``k + 16``
  (value, id) candidates; the merged list is exact above the largest of the ranks' last
  values, and the kept set lies inside it unless a tie at ``v_k`` runs past the list
  (then every rank asks for twice as many). The draw is a Gumbel-max over the kept
  candidates, with the noise a full pass would give them. ``top_p``/``min_p`` after
  ``top_k`` are cut on the same candidates. One all-gather per round, one round unless a
  tie runs past the list.
- ``top_p`` (without top_k): keep the tokens whose mass before them (in that order) is
  below ``top_p``. Drawn by rejection with the same noise: the unrestricted winner ``j`` is
  the answer if it is in the nucleus; otherwise the answer lies strictly before ``j``, and
  the next round takes the winner there. A round is one read of the rows still open and
  one all-gather: the first gives each row's winner, max and normalizer, each later one the
  mass before the candidate (its test) and the next candidate. A row is settled in the
  first round when its winner is the most likely token; usually within two otherwise.
- ``min_p`` (without top_k): keep ``x / T >= max / T + log(min_p)``. The first round's winner
  is kept or not; a second round (rows that failed only) draws among the kept tokens.

Keys relative to ``M`` need ``M`` first: top-k has it from the merged candidates; top-p
and min-p gather it in their first round, and the rows that need it start over in the next
round; the plain sample reads those rows again in a second scan and all-gather, which it
skips where the host can see, without waiting for a device, that no row needs it (the
gathered data is on the CPU, or was read on the host for the seed check).

Collectives: one all-gather per round of O(tokens x candidates) numbers; argmax takes one
round, the plain sample one or two (above). Rounds after the first are decided on the host
from the gathered data (the same on every rank): top-k and top-p read one flag per round
(on a GPU that waits for the device); argmax, the plain sample and min-p read nothing
(with the seed check below as the exception).

A backend may compute a call on a single rank otherwise (``limits`` says what it draws
from): the triton backend does it in one kernel launch at TP = 1, with the keys and kept
sets of ``run`` and so its ids.

The seed is per-call data: it is not part of the plan (a generation loop passes a new one
every step). It rides in the first all-gather, so every rank sees every rank's seed: where
the metadata is checked per call (a group with a CPU transport such as gloo, or
``VTP_CHECK=1``), ranks passing different seeds all raise the same ``ShardError``; where it
is not (a device-only group such as NCCL, or ``VTP_CHECK=once``), reading it would wait for
the device, and instead every rank returns -1 in every row.

Edge rows: NaN counts as ``+inf`` (the lowest id holding NaN or ``+inf`` is the argmax, as
``torch.argmax`` takes the first NaN); a row of all ``-inf`` gives id 0.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from . import plans
from .backend import Call, value_dtype
from .comm import all_gather_stack, group_size
from .errors import ShardError
from .metadata import host_transport

Tensor = torch.Tensor

# -- the counter-based noise ---------------------------------------------------------------
# lowbias32 (a 32-bit integer finalizer) chained over the seed's two words, the row and the
# global id; the seed's part is mixed once per call on the host, the row's once per row.
# Backends compute the same 32 bits exactly (the Triton kernels with uint32 arithmetic).

M32 = 0xFFFFFFFF
MIX_A, MIX_B = 0x7FEB352D, 0x846CA68B
SEED_SALT, ROW_SALT, ID_MUL = 0x85EBCA6B, 0x68E31DA4, 0x9E3779B1
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
SERIES_BELOW = 1.0 / 16  # below it -ln(1 - w) is its series (the logarithm near 1 is inexact)
NONE_ID = 2**31 - 1  # "no token": a partial that saw nothing it could pick


def _mul32(h: Any, c: int) -> Any:
    # (h * c) mod 2**32 in two halves, so that int64 never overflows
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & M32


def mix32(h: Any) -> Any:
    """lowbias32 of ``h``: a Python int or an int64 tensor of values in ``[0, 2**32)``."""
    h = h ^ (h >> 16)
    h = _mul32(h, MIX_A)
    h = h ^ (h >> 15)
    h = _mul32(h, MIX_B)
    return h ^ (h >> 16)


def seed_words(seed: int) -> tuple[int, int]:
    """The seed modulo 2**64 as (low, high) 32-bit words."""
    seed %= 2**64
    return seed & M32, seed >> 32


def seed_key(seed: int) -> int:
    """The 32-bit key of a seed, mixed once per call."""
    lo, hi = seed_words(seed)
    return mix32(mix32(lo) ^ hi ^ SEED_SALT)


def as_int32(value: int) -> int:
    """A 32-bit word as the signed int32 with the same bits (how kernels take it)."""
    return value - 2**32 if value >= 2**31 else value


def row_numbers(call: Call, lo: int, hi: int, device: torch.device) -> Tensor:
    """int64 ``[hi - lo]``: the numbers the noise keys rows ``lo:hi`` of a call by, the call's
    ``row_offset`` added, modulo 2**32."""
    return (torch.arange(lo, hi, device=device) + call.options.get("row_offset", 0)) & M32


def noise_bits(seed: int, rows: Tensor, ids: Tensor) -> Tensor:
    """The generator's 32 bits for each (row number, global id) pair, broadcast: int64 tensors
    in (row numbers in ``[0, 2**32)``, ``row_numbers``), int64 out."""
    row_key = mix32(seed_key(seed) ^ mix32(rows ^ ROW_SALT))
    return mix32(row_key ^ ((ids * ID_MUL) & M32))


def uniform(bits: Tensor) -> Tensor:
    """``w`` in (0, 1) from 24 of the bits, fp32: 23 through the mantissa of a float in [1, 2),
    one as a half-step offset; exact below 1/2, never 0 or 1."""
    f = ((bits >> 9) | 0x3F800000).to(torch.int32).view(torch.float32)
    half = torch.where((bits & 0x100) != 0, 1.5 * 2.0**-24, 0.5 * 2.0**-24).to(torch.float32)
    return ((f - 1.0) + half).clamp_max(1.0 - 2.0**-24)


def gumbel_bits(w: Tensor) -> Tensor:
    """Gumbel noise in bits, ``-log2(E)`` with ``E = -ln(1 - w)`` an Exp(1) variate, fp32. Small
    ``E`` (the large noise that lets an unlikely token win) comes from the series of
    ``-ln(1 - w)``, exact where the logarithm of ``1 - w`` is not."""
    series = w * (1.0 + w * (1.0 / 2 + w * (1.0 / 3 + w * (1.0 / 4 + w * (1.0 / 5 + w * (1.0 / 6))))))
    e = torch.where(w < SERIES_BELOW, series, -torch.log2(1.0 - w) * LN2)
    return -torch.log2(e)


# -- logit gaps in bits, and the keys ------------------------------------------------------
# A temperature T turns the gap between logits x and a into ``(x - a) log2(e) / T`` bits. It is
# computed as ``gap(x, a) = (x s - a s) b``, with a power of two ``s`` and a factor ``b`` that
# ``Scale.of`` picks from T alone, so that no product overflows or leaves fp32's normal range
# where the result matters: s = 1, b = log2(e) / T (clamped to at most 2**126) down to
# T = 2**64 log2(e); above it the logits are scaled by s = 2**-64 first (their difference
# cannot overflow then) and b = 2**64 log2(e) / T (clamped to at least 2**-126).

SPLIT = 2.0**-64  # s above T = 2**64 log2(e)
B_MAX, B_MIN = 2.0**126, 2.0**-126
KEY_BOUND = 2.0**126  # the gap in a key of a finite logit is clamped to [-KEY_BOUND, KEY_BOUND]
# raw keys ``gap(x, 0) + g`` keep the noise's resolution while the row's max M has
# |gap(M, 0)| below this many bits (their rounding is then below 2**-15 bits); past it the
# row's keys are formed relative to M (``relative_rows``)
RAW_BITS = 2.0**8


@dataclass(frozen=True)
class Scale:
    """``gap(x, a) = (x s - a s) b``: the gap between logits ``x`` and ``a`` in bits, at one
    temperature (see above)."""

    s: float
    b: float

    @staticmethod
    def of(temperature: float) -> Scale:
        """The scale of ``temperature`` > 0 (any other value: of temperature 1, unused)."""
        k2 = LOG2E / temperature if temperature > 0 else LOG2E
        if k2 >= SPLIT:
            return Scale(1.0, min(k2, B_MAX))
        return Scale(SPLIT, max(k2 / SPLIT, B_MIN))

    def gap(self, x: Tensor, a: Any) -> Tensor:
        """``gap(x, a)`` in ``x``'s dtype; ``a`` broadcast against ``x``."""
        if self.s == 1.0:  # x * 1 is x: the same numbers in fewer passes
            return (x - a) * self.b
        return (x * self.s - a * self.s) * self.b


def keys(x: Tensor, anchor: Any, scale: Scale, seed: int, rows: Tensor, ids: Tensor) -> Tensor:
    """Gumbel-max keys ``gap(x, anchor) + g`` of logits ``x`` (in the accumulation dtype) at
    global ``ids`` of row numbers ``rows`` (int64, broadcast against ``x``; see
    ``row_numbers``). ``anchor``: 0 (raw keys) or each row's max (``[rows, 1]``). A finite
    logit's key is finite (its gap clamped to ``KEY_BOUND``: a clamped key never wins where
    it matters, the noise spanning under 30 bits); an infinite logit's key is the logit."""
    g = gumbel_bits(uniform(noise_bits(seed, rows, ids)))
    key = scale.gap(x, anchor).clamp(-KEY_BOUND, KEY_BOUND) + g.to(x.dtype)
    return torch.where(x.abs() == math.inf, x, key)


def anchor_of(m: Tensor) -> Tensor:
    """A row max ``m`` as a constant to form gaps from: ``m`` where finite, else 0."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def relative_rows(m: Tensor, scale: Scale) -> Tensor:
    """bool ``[N]``: the rows whose keys are formed relative to their max ``m`` (where raw
    keys would lose the noise's resolution, or overflow). A function of ``m`` and the
    temperature only, the same on every rank and shard layout."""
    return ~(scale.gap(anchor_of(m), 0.0).abs() < RAW_BITS)


# -- what a backend supplies ---------------------------------------------------------------

# Fields of a row of partials, ``[S, N, FIELDS]`` in the payload dtype (fp32, or fp64 for
# fp64 eager inputs); ids are stored as the bits of the int of the same width.
KEY, ID, X, MAX, MAX_ID, SUM = range(6)
FIELDS = 6
SEED_WORDS = 2  # a scan's payload ends with the seed's two words (as int bits)


@dataclass
class Scan:
    """One read of the shard: per row (and vocabulary split), over the eligible tokens, the
    largest key and its lowest global id (``NONE_ID`` and ``-inf`` where none has a key
    above ``-inf``) and that token's logit, and over all tokens the largest logit; with
    ``stats``, also that logit's lowest id (else the MAX_ID field may hold anything) and
    ``sum 2**gap(x, a)`` with ``a`` that max (0 when it is not finite); with ``bound``, the
    eligible tokens are those strictly before ``bound`` in the order (logit desc, id asc)
    and kept by min-p (``gap(x, anchor) >= log2_min_p``), and SUM is their
    ``sum 2**gap(x, anchor)``. ``gap`` is ``Scale.of(temperature).gap``. Logits are read as
    fp32 (fp64 for fp64 eager inputs), NaN as ``+inf``."""

    gumbel: bool  # keys gap(x, key_anchor) + noise (sample; see keys), or x (argmax)
    seed: int = 0
    stats: bool = False
    bound: tuple[Tensor, Tensor] | None = None  # (logit [N], global id [N] int64) of the bound
    anchor: Tensor | None = None  # [N] the rows' global max logit (finite), with bound
    log2_min_p: float = -math.inf
    active: Tensor | None = None  # bool [N]: rows to read; the others give empty partials
    write_seed: bool = False  # fill the payload's tail with the seed's words
    key_anchor: Tensor | None = None  # [N] what each row's keys are relative to; None: 0 (raw keys)


class Kernels(Protocol):
    """The local primitives a backend implements for ``run``; no collectives."""

    def scan(self, call: Call, z: Tensor, scan: Scan) -> Tensor:
        """The flat payload: ``[S, N, FIELDS]`` partials (see ``Scan``), then ``SEED_WORDS``
        elements holding the seed's words (``seed_words``) where ``scan.write_seed``. ``S``
        (vocabulary splits) must be the same on every rank."""
        ...

    def top(self, call: Call, z: Tensor, c: int) -> tuple[Tensor, Tensor]:
        """This shard's ``c`` largest logits per row (``c <= V_local``), in the payload dtype
        with NaN as ``+inf``, and their global ids (int64); in any order among ties."""
        ...

    def candidate_keys(self, call: Call, x: Tensor, ids: Tensor, seed: int, anchor: Tensor) -> Tensor:
        """Gumbel-max keys of candidates relative to each row's ``anchor`` ``[N]`` (``keys``):
        logits ``x`` ``[N, L]`` (payload dtype), global ids ``[N, L]`` (int64; ``NONE_ID`` on
        padding); the numbers ``scan`` gives those tokens with ``key_anchor=anchor``."""
        ...


# -- collectives and merging ---------------------------------------------------------------


def _int_view(dtype: torch.dtype) -> torch.dtype:
    return torch.int64 if dtype == torch.float64 else torch.int32


def ids_of(field: Tensor) -> Tensor:
    """Global ids stored as int bits in a float field, as int64."""
    return field.view(_int_view(field.dtype)).long()


def id_bits(ids: Tensor, dtype: torch.dtype) -> Tensor:
    """int64 ids as the bits of a float tensor of ``dtype`` (what ``ids_of`` reads)."""
    return ids.to(_int_view(dtype)).view(dtype)


def fill_seed(payload: Tensor, seed: int) -> None:
    """Write the seed's words into the payload's last ``SEED_WORDS`` elements."""
    tail = payload[-SEED_WORDS:].view(_int_view(payload.dtype))
    lo, hi = seed_words(seed)
    narrow = tail.dtype == torch.int32
    tail[0].fill_(as_int32(lo) if narrow else lo)
    tail[1].fill_(as_int32(hi) if narrow else hi)


def gather(call: Call, payload: Tensor, seed: int | None) -> tuple[Tensor, Tensor | None]:
    """Every rank's flat payload ``[W, L]`` (one all-gather), and with ``seed`` the seed check:
    raises the same ShardError on every rank when ranks disagree and the metadata is
    checked per call, else returns a device bool that is False when they disagree."""
    if group_size(call.group) == 1:
        return payload[None], None
    stacked = all_gather_stack(payload, call.group)
    if seed is None:
        return stacked, None
    words = stacked[:, -SEED_WORDS:].view(_int_view(stacked.dtype))
    if plans.metadata_mode(host_transport(call.group)) == "once":
        return stacked, (words == words[:1]).all()
    seeds = [(lo % 2**32) | ((hi % 2**32) << 32) for lo, hi in words.tolist()]
    if len(set(seeds)) > 1:
        listed = ", ".join(f"rank {r} = {s}" for r, s in enumerate(seeds))
        raise ShardError(
            f"the ranks of the TP group disagree on sample's seed ({listed}, modulo 2**64); every rank "
            f"of tp_group must pass the same seed (e.g. one derived from the step)"
        )
    return stacked, None


def partials(stacked: Tensor, n: int) -> Tensor:
    """``[W * S, N, FIELDS]`` from the gathered flat payloads of ``scan``."""
    body = stacked[:, :-SEED_WORDS]
    return body.reshape(-1, n, FIELDS)


def best(key: Tensor, ids: Tensor, *extra: Tensor) -> tuple[Tensor, ...]:
    """Over dim 0 (``[P, N]`` each): the largest key, the lowest id among the partials that
    hold it, and the ``extra`` fields of that partial. NaN keys are never given."""
    top = key.amax(0)
    hit = key == top
    pick = torch.where(hit, ids, NONE_ID).amin(0)
    if not extra:
        return top, pick
    first = (hit & (ids == pick)).to(torch.int8).argmax(0, keepdim=True)
    return (top, pick, *(e.gather(0, first).squeeze(0) for e in extra))


def _exclusive_cumsum(w: Tensor) -> Tensor:
    out = torch.zeros_like(w)
    out[:, 1:] = torch.cumsum(w[:, :-1], 1)
    return out


# -- the driver ----------------------------------------------------------------------------

EXTRA_CANDIDATES = 16  # top-k candidates beyond k, so that a tie at v_k rarely needs a second round
MAX_ROUNDS = 64  # top-p rounds; each strictly shrinks every open row's candidates


@dataclass(frozen=True)
class Limits:
    """The restrictions of a ``sample`` call that restrict anything: ``k`` below V, ``p``
    below 1, ``min_p`` above 0 (None where not)."""

    k: int | None
    p: float | None
    min_p: float | None


def limits(call: Call) -> Limits | None:
    """What ``call`` draws from: None for an argmax (the op, or temperature 0), else its
    ``Limits``."""
    options = call.options
    if call.op == "argmax" or options["temperature"] == 0:
        return None
    k, p, mp = options["top_k"], options["top_p"], options["min_p"]
    v = call.vocab_size
    return Limits(k if k is not None and k < v else None, p if p is not None and p < 1 else None, mp if mp else None)


def run(call: Call, z: Tensor, kernels: Kernels) -> Tensor:
    """``argmax`` or ``sample`` of ``call`` on this rank's rows ``z`` (``[N, V_local]`` or the
    ``[A, B, V_local]`` view a backend takes): int64 global ids ``[N]``, identical on every rank."""
    n = z.shape[0] * z.shape[1] if z.dim() == 3 else z.shape[0]
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=z.device)
    check_vocabulary(call)
    restrict = limits(call)
    if restrict is None:
        return _argmax(call, z, kernels, n)
    seed, scale = call.options["seed"], Scale.of(call.options["temperature"])
    if restrict.k is not None:
        ids, agree = _candidates(call, z, kernels, n, seed, scale, restrict)
    elif restrict.p is None and restrict.min_p is None:
        ids, agree = _plain(call, z, kernels, n, seed, scale)
    else:
        ids, agree = _rejection(call, z, kernels, n, seed, scale, restrict)
    return ids if agree is None else torch.where(agree, ids, -1)


def check_vocabulary(call: Call) -> None:
    """Raise where ids of ``call``'s vocabulary do not fit below ``NONE_ID``."""
    if call.vocab_size >= NONE_ID:
        raise ValueError(f"sampling takes vocabularies below {NONE_ID} ids, got V={call.vocab_size}")


def _final(ids: Tensor) -> Tensor:
    return torch.where(ids == NONE_ID, 0, ids)


def _scan(call: Call, z: Tensor, kernels: Kernels, n: int, scan: Scan, seed: int | None) -> tuple[Tensor, Any]:
    payload = kernels.scan(call, z, dataclasses.replace(scan, write_seed=seed is not None))
    stacked, agree = gather(call, payload, seed)
    return partials(stacked, n), agree


def _readable(call: Call, flags: Tensor) -> bool:
    """Whether reading ``flags`` on the host waits for no device: they are on the CPU, or
    the call's first gather was read on the host already (the seed check, where the metadata
    is checked per call). Otherwise the caller acts as if any flag were set."""
    if flags.device.type == "cpu":
        return True
    return group_size(call.group) > 1 and plans.metadata_mode(host_transport(call.group)) != "once"


def _argmax(call: Call, z: Tensor, kernels: Kernels, n: int) -> Tensor:
    part, _ = _scan(call, z, kernels, n, Scan(gumbel=False), None)
    return _final(best(part[..., KEY], ids_of(part[..., ID]))[1])


def _plain(call: Call, z: Tensor, kernels: Kernels, n: int, seed: int, scale: Scale) -> tuple[Tensor, Any]:
    """One scan with raw keys; the rows that need keys relative to their max (``relative_rows``,
    at extreme offsets and temperatures) take a second scan, which reads those rows only."""
    part, agree = _scan(call, z, kernels, n, Scan(gumbel=True, seed=seed), seed)
    ids = best(part[..., KEY], ids_of(part[..., ID]))[1]
    top_x = part[..., MAX].amax(0)
    relative = relative_rows(top_x, scale)
    if not _readable(call, relative) or bool(relative.any()):
        again = Scan(gumbel=True, seed=seed, key_anchor=anchor_of(top_x), active=relative)
        part, _ = _scan(call, z, kernels, n, again, None)
        ids = torch.where(relative, best(part[..., KEY], ids_of(part[..., ID]))[1], ids)
    return _final(ids), agree


def _rejection(
    call: Call, z: Tensor, kernels: Kernels, n: int, seed: int, scale: Scale, limits: Limits
) -> tuple[Tensor, Any]:
    """top-p and/or min-p without top-k (see the module docstring)."""
    part, agree = _scan(call, z, kernels, n, Scan(gumbel=True, seed=seed, stats=True), seed)
    _, cand, cand_x = best(part[..., KEY], ids_of(part[..., ID]), part[..., X])
    top_x, top_id = best(part[..., MAX], ids_of(part[..., MAX_ID]))
    anchor = anchor_of(top_x)
    # each partial's sum is relative to its own max: rescaled to the row's (empty partials add 0)
    seen = part[..., MAX] > -math.inf
    total = torch.where(seen, part[..., SUM] * torch.exp2(scale.gap(part[..., MAX], anchor)), 0.0).sum(0)
    log2_min_p = math.log2(limits.min_p) if limits.min_p else -math.inf
    # settled: the most likely token (always kept), or rows with nothing to restrict
    done = (cand == top_id) | (cand == NONE_ID) | ~torch.isfinite(top_x)
    # rows keyed relative to their max start over: the first round's raw keys lost their
    # resolution there, so the next round draws over every token (no bound) with their keys
    relative = relative_rows(top_x, scale)
    key_anchor = torch.where(relative, anchor, torch.zeros_like(anchor))
    done &= ~relative
    cand = torch.where(relative, NONE_ID, cand)
    cand_x = torch.where(relative, -math.inf, cand_x)
    kept_by_min_p = scale.gap(cand_x, anchor) >= log2_min_p
    if limits.p is None:
        done |= kept_by_min_p
    pending = ~done & kept_by_min_p  # candidates whose mass test is still to come (top-p)
    for _ in range(MAX_ROUNDS):
        if limits.p is not None and not bool((~done).any()):  # the one host read per round
            break
        bound = Scan(
            gumbel=True,
            seed=seed,
            bound=(cand_x, cand),
            anchor=anchor,
            log2_min_p=log2_min_p,
            active=~done,
            key_anchor=key_anchor,
        )
        part, _ = _scan(call, z, kernels, n, bound, None)
        _, nxt, nxt_x = best(part[..., KEY], ids_of(part[..., ID]), part[..., X])
        open_ = ~done
        if limits.p is not None:
            mass_before = part[..., SUM].sum(0)
            accept = pending & (mass_before < limits.p * total)
            move = open_ & ~accept & (nxt != NONE_ID)
            cand = torch.where(move, nxt, cand)
            cand_x = torch.where(move, nxt_x, cand_x)
            settled_now = accept | (move & (nxt == top_id)) | (open_ & (nxt == NONE_ID))
            done = done | settled_now
            pending = open_ & move & ~settled_now
        else:  # min-p alone: the winner among the kept tokens is the answer
            cand = torch.where(open_ & (nxt != NONE_ID), nxt, cand)
            done = torch.ones_like(done)
            break
    else:
        raise RuntimeError(f"top-p sampling did not settle within {MAX_ROUNDS} rounds")
    return _final(cand), agree


def _candidates(
    call: Call, z: Tensor, kernels: Kernels, n: int, seed: int, scale: Scale, limits: Limits
) -> tuple[Tensor, Any]:
    """top-k, then top-p and min-p on the top-k candidates (see the module docstring)."""
    assert limits.k is not None
    k, v, v_local = limits.k, call.vocab_size, z.shape[-1]
    c = min(k + EXTRA_CANDIDATES, v)
    agree = None
    first = True
    while True:
        vals, ids = kernels.top(call, z, min(c, v_local)) if v_local else _empty_top(z, n)
        dtype = vals.dtype
        if vals.shape[1] < c:  # a shard smaller than the list: padding that sorts last
            pad = c - vals.shape[1]
            vals = torch.cat([vals, vals.new_full((n, pad), -math.inf)], 1)
            ids = torch.cat([ids, ids.new_full((n, pad), NONE_ID)], 1)
        # everything above the last value is listed; values equal to it may not all be
        floor = vals[:, c - 1] if v_local > c else vals.new_full((n,), -math.inf)
        payload = torch.empty(n * (2 * c + 1) + SEED_WORDS, dtype=dtype, device=z.device)
        body = payload[:-SEED_WORDS].view(n, 2 * c + 1)
        body[:, :c], body[:, c : 2 * c], body[:, 2 * c] = vals, id_bits(ids, dtype), floor
        if first:
            fill_seed(payload, seed)
        stacked, checked = gather(call, payload, seed if first else None)
        agree = checked if first else agree
        first = False
        got = stacked[:, :-SEED_WORDS].reshape(-1, n, 2 * c + 1)
        all_vals = got[..., :c].permute(1, 0, 2).reshape(n, -1)
        all_ids = ids_of(got[..., c : 2 * c]).permute(1, 0, 2).reshape(n, -1)
        exact_above = got[..., 2 * c].amax(0)
        by_id = torch.argsort(all_ids, dim=1)
        all_vals, all_ids = all_vals.gather(1, by_id), all_ids.gather(1, by_id)
        order = torch.sort(all_vals, dim=1, descending=True, stable=True).indices
        all_vals, all_ids = all_vals.gather(1, order), all_ids.gather(1, order)
        v_k = all_vals[:, k - 1]
        exact = (v_k > exact_above) | (v_k == -math.inf)
        if c >= v or bool(exact.all()):  # a host read (see the module docstring)
            break
        c = min(2 * c, v)
    kept = all_vals >= v_k[:, None]
    top_x = all_vals[:, 0]  # the row's max: every gap and key is relative to it
    anchor = anchor_of(top_x)
    finite = torch.isfinite(top_x)[:, None]
    if limits.p is not None:
        w = torch.where(kept, torch.exp2(scale.gap(all_vals, anchor[:, None])), 0.0)
        before = _exclusive_cumsum(w)
        kept &= (before < limits.p * w.sum(1, keepdim=True)) | ~finite
    if limits.min_p is not None:
        kept &= (scale.gap(all_vals, anchor[:, None]) >= math.log2(limits.min_p)) | ~finite
    kept[:, 0] = True  # the most likely token is always kept
    kept &= (all_vals == top_x[:, None]) | finite  # a row holding +inf (or NaN): only those
    cand_keys = torch.where(kept, kernels.candidate_keys(call, all_vals, all_ids, seed, anchor), -math.inf)
    _, pick = best(cand_keys.t(), all_ids.t())
    return torch.where(top_x == -math.inf, 0, _final(pick)), agree  # a row of all -inf: 0


def _empty_top(z: Tensor, n: int) -> tuple[Tensor, Tensor]:
    return torch.empty(n, 0, dtype=value_dtype(z.dtype), device=z.device), torch.empty(
        n, 0, dtype=torch.int64, device=z.device
    )
