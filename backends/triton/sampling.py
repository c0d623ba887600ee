"""``argmax`` and ``sample`` on the ``triton`` backend.

At TP = 1 a call is one launch of ``sampling_kernels.decode_kernel`` (``decode``), which
finds the ids in the kernel with the keys and kept sets of ``vtp_runtime.sampling.run``;
the call signature's plan (``decode_plan``, at most ``MAX_DECODE_PLANS``; ``decode_plans``
and ``clear_decode_plans`` show and drop them) keeps its arguments bound and, once launched,
the compiled kernel, launched directly (``launch.Bound``).
At TP > 1, the local primitives of ``vtp_runtime.sampling.run`` (which holds the algorithm
and the collectives):

- ``scan``: ``sampling_kernels.scan_kernel``, one read of the shard, no ``[N, V_local]``
  temporary; each row's vocabulary is split over programs as the loss kernels split it
  (``LaunchConfig.target_programs``), so few rows still fill the device.
- ``top``: ``torch.topk`` on the shard in its own dtype (exact values, no fp32 copy of the
  logits).
- ``candidate_keys``: ``sampling_kernels.candidate_keys_kernel``, the noise of the scan, bit
  for bit (the same helpers), on the merged candidates.

Those kernels are launched with keyword arguments through ``launch.launch``; the seed's words are
kernel arguments that are not specialized on, so a new seed per call neither recompiles nor
misses the launcher's cache. Importing this module never imports triton.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from vtp_runtime import sampling
from vtp_runtime.backend import Call, meets_layout
from vtp_runtime.comm import group_size
from vtp_runtime.sampling import FIELDS, SEED_WORDS, Scale, Scan

from . import source
from .config import LaunchConfig, cdiv, split_chunk, vocab_splits
from .launch import Bound, launch

Tensor = torch.Tensor


def _rows_and_strides(z: Tensor) -> dict[str, Any]:
    """The logits and their row geometry as the kernels name them: row ``r`` starts at
    ``(r // rows_b) * stride_a + (r % rows_b) * stride_b``; columns at unit stride."""
    if not meets_layout(z, "unit_vocab_stride_3d"):
        raise RuntimeError(
            f"triton sampling kernels need [N, V_local] or [A, B, V_local] logits with stride 1 on the "
            f"vocabulary dim; got shape {tuple(z.shape)} with strides {z.stride()}"
        )
    if z.dim() == 2:
        return {"z_ptr": z, "rows_b": max(z.shape[0], 1), "stride_a": 0, "stride_b": z.stride(0)}
    return {"z_ptr": z, "rows_b": max(z.shape[1], 1), "stride_a": z.stride(0), "stride_b": z.stride(1)}


def _noise_args(call: Call, seed: int) -> dict[str, Any]:
    """The kernels' arguments for the gaps (``Scale``) and the noise's keys of ``call``."""
    scale = Scale.of(call.options["temperature"])
    return {
        "scale_s": scale.s,
        "scale_b": scale.b,
        "seed_key": sampling.as_int32(sampling.seed_key(seed)),
        "row_offset": sampling.as_int32(call.options.get("row_offset", 0) % 2**32),
    }


class TritonKernels:
    """``vtp_runtime.sampling.Kernels`` through the Triton kernels, launched with ``cfg``."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg

    def scan(self, call: Call, z: Tensor, scan: Scan) -> Tensor:
        n, v_local = (z.shape[0] * z.shape[1] if z.dim() == 3 else z.shape[0]), z.shape[-1]
        cfg = self.cfg
        block = cfg.block_stats
        # the same on every rank (the partials of all ranks are gathered into one tensor)
        splits = vocab_splits(
            n, cdiv(call.vocab_size, call.request.tp_size), block, cfg.target_programs, cfg.max_splits
        )
        chunk = split_chunk(v_local, splits, block)
        payload = torch.empty(splits * n * FIELDS + SEED_WORDS, dtype=torch.float32, device=z.device)
        lo, hi = sampling.seed_words(scan.seed)
        bound, anchor, key_anchor = scan.bound, scan.anchor, scan.key_anchor
        launch(
            source.module("sampling_kernels").scan_kernel,
            (n * splits,),
            cfg.fast_launch,
            **_rows_and_strides(z),
            out_ptr=payload,
            tail_ptr=payload[-SEED_WORDS:].view(torch.int32),
            # pointers a call does not read (BOUND, HAS_ACTIVE off): the payload stands in
            bx_ptr=payload if bound is None else bound[0].float().contiguous(),
            bid_ptr=payload if bound is None else bound[1].to(torch.int32).contiguous(),
            anchor_ptr=payload if anchor is None else anchor.float().contiguous(),
            active_ptr=payload if scan.active is None else scan.active.contiguous().view(torch.uint8),
            key_anchor_ptr=payload if key_anchor is None else key_anchor.float().contiguous(),
            n_rows=n,
            v_local=v_local,
            vocab_start=call.vocab_start,
            splits=splits,
            chunk=chunk,
            log2_min_p=float(scan.log2_min_p),
            seed_lo=sampling.as_int32(lo),
            seed_hi=sampling.as_int32(hi),
            **_noise_args(call, scan.seed),
            GUMBEL=scan.gumbel,
            STATS=scan.stats,
            BOUND=bound is not None,
            HAS_ACTIVE=scan.active is not None,
            KEY_ANCHOR=key_anchor is not None,
            WRITE_SEED=scan.write_seed,
            FAST_LOG2=cfg.fast_log2,
            BLOCK=block,
            num_warps=cfg.warps_stats,
        )
        return payload

    def top(self, call: Call, z: Tensor, c: int) -> tuple[Tensor, Tensor]:
        got = torch.topk(z.reshape(-1, z.shape[-1]), c, dim=1)
        vals = got.values.float()
        return vals.masked_fill_(torch.isnan(vals), float("inf")), got.indices + call.vocab_start

    def candidate_keys(self, call: Call, x: Tensor, ids: Tensor, seed: int, anchor: Tensor) -> Tensor:
        x = x.float().contiguous()
        ids = ids.contiguous()
        out = torch.empty_like(x)
        n, width = x.shape
        cfg = self.cfg
        launch(
            source.module("sampling_kernels").candidate_keys_kernel,
            (n,),
            cfg.fast_launch,
            x_ptr=x,
            id_ptr=ids,
            anchor_ptr=anchor.float().contiguous(),
            key_ptr=out,
            n_cols=width,
            **_noise_args(call, seed),
            FAST_LOG2=cfg.fast_log2,
            BLOCK=min(1024, max(16, 1 << (width - 1).bit_length())),
            num_warps=4 if width > 256 else 1,
        )
        return out


# -- one launch per call at TP = 1 ------------------------------------------------------------

MAX_DECODE_PLANS = 64  # signatures kept; past it the kept plans are dropped and made again
GRAIN = {torch.float32: 0, torch.bfloat16: 16, torch.float16: 13}  # low fp32 bits always 0


# the per-call arguments of decode_kernel (the rest is bound in the plan)
PER_CALL = ("z_ptr", "out_ptr", "seed_key")


class DecodePlan:
    """What every call of one signature needs (no tensor, no group): the row count and the
    kernel's launch with every argument bound but the logits, the ids and the seed's key
    (``launch.Bound``: once launched, straight to the compiled kernel)."""

    __slots__ = ("n", "gumbel", "launch")

    def __init__(self, n: int, gumbel: bool, launch: Bound) -> None:
        self.n = n
        self.gumbel = gumbel
        self.launch = launch


_DECODE_PLANS: dict[tuple, DecodePlan] = {}


def decode_plan(cfg: LaunchConfig, call: Call, z: Tensor) -> DecodePlan:
    """The plan of a TP = 1 call's signature: looked up, or made and kept. The signature:
    the config, the request, the shard's bounds, the options but the seed, the logits'
    shape, strides, dtype, device and 16-byte alignment: all the kernel is specialized on in
    the per-call values (the ids are a new int64 tensor, the seed's key an int32), so the
    launch compares only the current device (``Bound.launch`` with ``checked``)."""
    key = (
        cfg,
        call.request,
        call.vocab_start,
        call.vocab_end,
        tuple(item for item in call.options.items() if item[0] != "seed"),
        z.shape,
        z.stride(),
        z.dtype,
        z.device,
        z.data_ptr() % 16 == 0,
    )
    plan = _DECODE_PLANS.get(key)
    if plan is None:
        if len(_DECODE_PLANS) >= MAX_DECODE_PLANS:
            _DECODE_PLANS.clear()
        plan = _DECODE_PLANS[key] = _make_plan(cfg, call, z)
    return plan


def decode_plans() -> list[DecodePlan]:
    """The plans kept now (at most ``MAX_DECODE_PLANS``)."""
    return list(_DECODE_PLANS.values())


def clear_decode_plans() -> None:
    """Drop every kept plan: the next call of each signature makes its plan again."""
    _DECODE_PLANS.clear()


def _make_plan(cfg: LaunchConfig, call: Call, z: Tensor) -> DecodePlan:
    sampling.check_vocabulary(call)
    restrict = sampling.limits(call)
    n, v_local = (z.shape[0] * z.shape[1] if z.dim() == 3 else z.shape[0]), z.shape[-1]
    geometry = _rows_and_strides(z)
    del geometry["z_ptr"]
    gumbel = restrict is not None
    scale = Scale.of(call.options["temperature"] if gumbel else 1.0)
    k = restrict.k if restrict is not None else None
    p = restrict.p if restrict is not None else None
    min_p = restrict.min_p if restrict is not None else None
    bisects = k is not None or p is not None
    launch = Bound(
        source.module("sampling_kernels").decode_kernel,
        (cdiv(n, cfg.decode_rows),),
        cfg.fast_launch,
        PER_CALL,
        n_rows=n,
        **geometry,
        v_local=v_local,
        vocab_start=call.vocab_start,
        scale_s=scale.s,
        scale_b=scale.b,
        row_offset=sampling.as_int32(call.options.get("row_offset", 0) % 2**32),
        top_k=0 if k is None else k,
        top_p=1.0 if p is None else float(p),
        log2_min_p=-math.inf if min_p is None else math.log2(min_p),
        GUMBEL=gumbel,
        TOP_K=k is not None,
        TOP_P=p is not None,
        MIN_P=min_p is not None,
        GRAIN=GRAIN[z.dtype],
        FAST_LOG2=cfg.fast_log2,
        ROWS=cfg.decode_rows,
        BLOCK=cfg.decode_bisect_block if bisects else cfg.decode_block,
        num_warps=cfg.decode_bisect_warps if bisects else cfg.decode_warps,
    )
    return DecodePlan(n, gumbel, launch)


def decode(cfg: LaunchConfig, call: Call, z: Tensor) -> Tensor:
    """int64 global ids ``[N]`` of a TP = 1 ``call`` on rows ``z``: one kernel launch
    (``sampling_kernels.decode_kernel``, ``cfg.decode_rows`` rows per program), no host read."""
    plan = decode_plan(cfg, call, z)
    out = torch.empty(plan.n, dtype=torch.int64, device=z.device)
    if plan.n:
        seed = sampling.as_int32(sampling.seed_key(call.options["seed"])) if plan.gumbel else 0
        plan.launch.launch((z, out, seed), checked=True)
    return out


def forward(cfg: LaunchConfig, call: Call, z: Tensor) -> Tensor:
    """int64 global ids ``[N]`` of ``call`` (argmax or sample) on this rank's rows ``z``: in one
    launch at TP = 1 (``decode``), else ``vtp_runtime.sampling.run``'s rounds."""
    if group_size(call.group) == 1:
        return decode(cfg, call, z)
    return sampling.run(call, z, TritonKernels(cfg))
