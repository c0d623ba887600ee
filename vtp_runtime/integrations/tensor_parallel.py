"""What every framework adapter needs from a tensor-parallel setup: the hidden-state copy
into the TP region, and the vocabulary bounds a DTensor weight gives this rank.

Nothing here computes a loss; the adapters pass the results to ``vtp_runtime``'s ops.
"""

from __future__ import annotations

import sys
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..comm import group_size


class _CopyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, group):
        ctx.group = group
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        # a private buffer: the all-reduce is in place and autograd may hold grad elsewhere
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def copy_to_tp_region(hidden: torch.Tensor, tp_group) -> torch.Tensor:
    """Identity in forward, all-reduce (sum over ``tp_group``) of the gradient in backward.

    Megatron's "copy to tensor-parallel region". Put it between a backbone whose hidden
    states are replicated on every TP rank and a head split by hand over the vocabulary
    (``logits = copy_to_tp_region(hidden, g) @ weight_shard.T``): each rank's head shard
    sees only its part of the vocabulary, so its ``d loss / d hidden`` is a partial sum.
    Without the all-reduce every rank back-propagates its partial sum into the backbone
    and the backbone gradients are silently wrong. Heads that are already column-parallel
    (Megatron's ``ColumnParallelLinear``, transformers' ``tp_plan`` styles, DeepSpeed AutoTP)
    do this themselves: don't add it twice.

    ``hidden``: any shape, any floating dtype, identical on every rank of ``tp_group``.
    With ``tp_group=None`` (or a group of one) it is the identity in both directions.
    """
    if group_size(tp_group) == 1:
        return hidden
    return _CopyToTPRegion.apply(hidden, tp_group)


class VocabShard(NamedTuple):
    """Logits ``[..., V_local]`` and the layout keywords of ``vtp_runtime``'s ops for them.

    For a DTensor, ``logits`` is the DTensor itself and the layout fields are None: the ops
    read the group, the bounds and V from it. ``vocab_start``/``vocab_end``/``vocab_size``
    are None when the caller did not know them (rank order is then the runtime's default);
    ``tp_group`` is None for a full vocabulary.
    """

    logits: torch.Tensor
    tp_group: object
    vocab_start: int | None
    vocab_end: int | None
    vocab_size: int | None

    def options(self) -> dict:
        """The layout keywords of ``vtp_runtime``'s ops for this shard."""
        return {
            "tp_group": self.tp_group,
            "vocab_start": self.vocab_start,
            "vocab_end": self.vocab_end,
            "global_vocab_size": self.vocab_size,
        }


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor, without importing DTensor (a second of import time): none
    exists before its module is imported (``torch.distributed._tensor`` on torch 2.4)."""
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        module = sys.modules.get(name)
        if module is not None and isinstance(t, getattr(module, "DTensor", ())):
            return True
    return False


def _strided(p) -> bool:
    """FSDP2's ``_StridedShard`` (sharding within another mesh dimension's shards): not a
    ``Shard`` on torch 2.13, one on some older versions."""
    return hasattr(p, "split_factor")


def dtensor_vocab_layout(t, dim: int) -> tuple[object, int, int, int]:
    """``(tp_group, vocab_start, vocab_end, vocab_size)`` of this rank for a DTensor whose
    dimension ``dim`` is the vocabulary: torch shards a dimension like ``torch.chunk``,
    ceil(V / tp) per rank, the trailing shards smaller or empty.

    Exactly one mesh dimension may ``Shard`` the vocabulary (that mesh dimension is the TP
    group); the others replicate it, shard another tensor dimension, or -- FSDP2 over a TP
    weight -- ``_StridedShard`` it within the TP shards, which leaves the TP bounds as they
    are. With no mesh dimension sharding the vocabulary, every rank holds all of it:
    ``tp_group`` is None.
    """
    ndim = t.dim()
    dim = dim % ndim
    size = t.shape[dim]  # a DTensor's shape is the global shape
    tp_dims = []
    for mesh_dim, p in enumerate(t.placements):
        if _strided(p):
            continue
        if p.is_shard() and p.dim % ndim == dim:
            tp_dims.append(mesh_dim)
        elif not (p.is_shard() or p.is_replicate()):
            raise ValueError(
                f"a DTensor with placements {tuple(t.placements)} has pending (partial) values on mesh "
                f"dimension {mesh_dim}; redistribute it to Shard or Replicate placements first"
            )
    if not tp_dims:
        return None, 0, size, size
    if len(tp_dims) > 1:
        raise ValueError(
            f"the vocabulary dimension is sharded over mesh dims {tp_dims} "
            f"(placements {tuple(t.placements)}); exactly one mesh dim may shard it"
        )
    mesh = t.device_mesh
    tp = mesh.size(tp_dims[0])
    rank = mesh.get_local_rank(tp_dims[0])
    chunk = -(-size // tp)
    start = min(rank * chunk, size)
    return mesh.get_group(tp_dims[0]), start, min(start + chunk, size), size


def vocab_shard(
    logits: torch.Tensor, tp_group=None, vocab_start: int | None = None, vocab_end: int | None = None
) -> VocabShard:
    """Deprecated: every op takes DTensor logits directly. ``logits`` with the layout
    keywords for ``vtp_runtime``'s ops: ``vtp.entropy(s.logits, **s.options())``.

    A DTensor comes back as it is, with no layout keywords (the ops read them from it);
    a plain tensor is this rank's shard with the given layout.
    """
    warnings.warn(
        "vocab_shard is deprecated: pass DTensor logits to vtp_runtime's ops directly", DeprecationWarning, stacklevel=2
    )
    return VocabShard(logits, tp_group, vocab_start, vocab_end, None)
