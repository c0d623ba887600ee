"""``argmax`` and ``sample`` in plain PyTorch: the local primitives ``vtp_runtime.sampling.run``
takes, over chunks of token rows so that the fp32 temporaries (and the int64 noise
counters) stay near ``CHUNK_ELEMENTS`` whatever N and V_local."""

from __future__ import annotations

import math

import torch

from vtp_runtime import sampling
from vtp_runtime.backend import Call, value_dtype
from vtp_runtime.sampling import FIELDS, ID, KEY, MAX, MAX_ID, NONE_ID, SEED_WORDS, SUM, Scan, X

Tensor = torch.Tensor

CHUNK_ELEMENTS = 1 << 22


def _chunks(n: int, v: int):
    step = max(1, CHUNK_ELEMENTS // max(v, 1))
    for lo in range(0, n, step):
        yield lo, min(lo + step, n)


def _read(z: Tensor, lo: int, hi: int) -> Tensor:
    """Rows ``lo:hi`` in the accumulation dtype, NaN as ``+inf`` (a new tensor)."""
    x = z[lo:hi].to(value_dtype(z.dtype), copy=True)
    return x.masked_fill_(torch.isnan(x), math.inf)


def _first(values: Tensor, top: Tensor) -> Tensor:
    """``[rows, 1]``: the lowest column holding each row's ``top``."""
    v = values.shape[1]
    cols = torch.arange(v, device=values.device)
    return torch.where(values == top[:, None], cols, v).amin(1, keepdim=True).clamp_max(v - 1)


class EagerKernels:
    """``vtp_runtime.sampling.Kernels`` in PyTorch (any device, fp64 too)."""

    def scan(self, call: Call, z: Tensor, scan: Scan) -> Tensor:
        n, v = z.shape
        acc = value_dtype(z.dtype)
        payload = torch.empty(n * FIELDS + SEED_WORDS, dtype=acc, device=z.device)
        part = payload[:-SEED_WORDS].view(n, FIELDS)
        none = sampling.id_bits(torch.full((n,), NONE_ID, device=z.device), acc)
        part[:, KEY], part[:, X], part[:, MAX], part[:, SUM] = -math.inf, -math.inf, -math.inf, 0.0
        part[:, ID], part[:, MAX_ID] = none, none
        scale = sampling.Scale.of(call.options["temperature"])
        ids = torch.arange(call.vocab_start, call.vocab_start + v, device=z.device)
        for lo, hi in _chunks(n, v) if v else ():
            x = _read(z, lo, hi)
            eligible = None
            if scan.bound is not None:
                assert scan.anchor is not None
                bx, bid = scan.bound[0][lo:hi, None], scan.bound[1][lo:hi, None]
                anchor = scan.anchor[lo:hi, None]
                eligible = ((x > bx) | ((x == bx) & (ids < bid))) & (scale.gap(x, anchor) >= scan.log2_min_p)
            if scan.gumbel:
                rows = sampling.row_numbers(call, lo, hi, z.device)[:, None]
                relative_to = 0.0 if scan.key_anchor is None else scan.key_anchor[lo:hi, None].to(acc)
                key = sampling.keys(x, relative_to, scale, scan.seed, rows, ids)
            else:
                key = x
            if eligible is not None:
                key = torch.where(eligible, key, -math.inf)
            top = key.amax(1)
            col = _first(key, top)
            found = top > -math.inf
            part[lo:hi, KEY] = top
            part[lo:hi, ID] = sampling.id_bits(torch.where(found, ids[col[:, 0]], NONE_ID), acc)
            part[lo:hi, X] = torch.where(found, x.gather(1, col)[:, 0], -math.inf)
            m = x.amax(1)
            part[lo:hi, MAX] = m
            seen = m > -math.inf
            part[lo:hi, MAX_ID] = sampling.id_bits(torch.where(seen, ids[_first(x, m)[:, 0]], NONE_ID), acc)
            if scan.stats:
                a = sampling.anchor_of(m)
                part[lo:hi, SUM] = torch.exp2(scale.gap(x, a[:, None])).sum(1)
            elif eligible is not None:
                assert scan.anchor is not None
                terms = torch.exp2(scale.gap(x, scan.anchor[lo:hi, None]))
                part[lo:hi, SUM] = torch.where(eligible, terms, 0.0).sum(1)
        if scan.active is not None:  # rows not asked for: empty partials
            idle = ~scan.active
            part[:, KEY] = part[:, KEY].masked_fill(idle, -math.inf)
            part[:, ID] = torch.where(idle, none, part[:, ID])
            part[:, SUM] = part[:, SUM].masked_fill(idle, 0.0)
        if scan.write_seed:
            sampling.fill_seed(payload, scan.seed)
        return payload

    def top(self, call: Call, z: Tensor, c: int) -> tuple[Tensor, Tensor]:
        n, v = z.shape
        vals = torch.empty(n, c, dtype=value_dtype(z.dtype), device=z.device)
        ids = torch.empty(n, c, dtype=torch.int64, device=z.device)
        for lo, hi in _chunks(n, v):
            got = _read(z, lo, hi).topk(c, dim=1)
            vals[lo:hi], ids[lo:hi] = got.values, got.indices + call.vocab_start
        return vals, ids

    def candidate_keys(self, call: Call, x: Tensor, ids: Tensor, seed: int, anchor: Tensor) -> Tensor:
        rows = sampling.row_numbers(call, 0, x.shape[0], x.device)[:, None]
        scale = sampling.Scale.of(call.options["temperature"])
        return sampling.keys(x, anchor[:, None].to(x.dtype), scale, seed, rows, ids)


KERNELS = EagerKernels()


def forward(call: Call, z: Tensor) -> Tensor:
    """int64 global ids ``[N]`` of ``call`` (argmax or sample) on the rows ``z`` ``[N, V_local]``."""
    return sampling.run(call, z, KERNELS)
