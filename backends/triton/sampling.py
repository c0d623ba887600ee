"""``argmax`` and ``sample`` on the ``triton`` backend: the local primitives of
``vtp_runtime.sampling.run`` (which holds the algorithm and the collectives).

- ``scan``: ``sampling_kernels.scan_kernel``, one read of the shard, no ``[N, V_local]``
  temporary; each row's vocabulary is split over programs as the loss kernels split it
  (``LaunchConfig.target_programs``), so few rows still fill the device.
- ``top``: ``torch.topk`` on the shard in its own dtype (exact values, no fp32 copy of the
  logits).
- ``candidate_keys``: ``sampling_kernels.candidate_keys_kernel``, the noise of the scan, bit
  for bit (the same helpers), on the merged candidates.

Kernels are launched with keyword arguments through ``launch.launch``; the seed's words are
kernel arguments that are not specialized on, so a new seed per call neither recompiles nor
misses the launcher's cache. Importing this module never imports triton.
"""

from __future__ import annotations

from typing import Any

import torch

from vtp_runtime import sampling
from vtp_runtime.backend import Call, meets_layout
from vtp_runtime.sampling import FIELDS, SEED_WORDS, Scale, Scan

from .config import LaunchConfig
from .launch import launch

Tensor = torch.Tensor

_KERNELS: Any = None


def _kernels() -> Any:
    global _KERNELS
    if _KERNELS is None:  # imported on first use: importing this module never needs triton
        from . import sampling_kernels

        _KERNELS = sampling_kernels
    return _KERNELS


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
        tiles = max(1, _cdiv(_cdiv(call.vocab_size, call.request.tp_size), block))
        splits = max(1, min(_cdiv(cfg.target_programs, n), tiles, cfg.max_splits))
        chunk = max(block, _cdiv(_cdiv(v_local, splits), block) * block)
        payload = torch.empty(splits * n * FIELDS + SEED_WORDS, dtype=torch.float32, device=z.device)
        lo, hi = sampling.seed_words(scan.seed)
        bound, anchor, key_anchor = scan.bound, scan.anchor, scan.key_anchor
        launch(
            _kernels().scan_kernel,
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
            _kernels().candidate_keys_kernel,
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


def forward(cfg: LaunchConfig, call: Call, z: Tensor) -> Tensor:
    """int64 global ids ``[N]`` of ``call`` (argmax or sample) on this rank's rows ``z``."""
    return sampling.run(call, z, TritonKernels(cfg))
