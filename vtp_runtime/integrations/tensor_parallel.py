"""What every framework adapter needs from a tensor-parallel setup: the hidden-state copy
into the TP region, and the local shard and vocabulary bounds of (possibly DTensor) logits.

Nothing here computes a loss; the adapters pass the results to ``vtp_runtime``'s ops.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.distributed as dist


def _group_size(group) -> int:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


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
    if _group_size(tp_group) == 1:
        return hidden
    return _CopyToTPRegion.apply(hidden, tp_group)


class VocabShard(NamedTuple):
    """This rank's logits ``[..., V_local]`` and where they sit in the global vocabulary.

    ``vocab_start``/``vocab_end``/``vocab_size`` are None when the caller did not know them
    (rank order is then the runtime's default); ``tp_group`` is None for a full vocabulary.
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


def dtensor_vocab_layout(t, dim: int) -> tuple[object, int, int, int]:
    """``(tp_group, vocab_start, vocab_end, vocab_size)`` of this rank for a DTensor whose
    dimension ``dim`` is the vocabulary: torch shards a dimension like ``torch.chunk``,
    ceil(V / tp) per rank, the trailing shards smaller or empty.

    Exactly one mesh dimension may shard the vocabulary (that mesh dimension is the TP
    group); the others must replicate it or shard another tensor dimension (tokens split
    over data-parallel ranks: reductions are then over this rank's tokens). With no mesh
    dimension sharding the vocabulary, every rank holds all of it: ``tp_group`` is None.
    """
    ndim = t.dim()
    dim = dim % ndim
    size = t.shape[dim]  # a DTensor's shape is the global shape
    tp_dims = []
    for mesh_dim, p in enumerate(t.placements):
        if p.is_shard() and p.dim % ndim == dim:
            tp_dims.append(mesh_dim)
        elif not (p.is_shard() or p.is_replicate()):
            raise ValueError(
                f"a DTensor with placements {tuple(t.placements)} has pending (partial) values; "
                f"redistribute it to Shard or Replicate placements first"
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
    """This rank's local logits and their layout, from a DTensor or from a local tensor.

    A DTensor sharded over the vocabulary (last dimension) gives its local tensor
    (``to_local()``: gradients flow back into the DTensor) with the group and bounds read
    from its mesh and placement; ``tp_group``/``vocab_start``/``vocab_end`` must then be
    left out. A plain tensor is this rank's shard as given, with the given layout.
    """
    if not is_dtensor(logits):
        return VocabShard(logits, tp_group, vocab_start, vocab_end, None)
    if tp_group is not None or vocab_start is not None or vocab_end is not None:
        raise ValueError(
            "DTensor logits carry their own process group and vocabulary bounds: "
            "leave out tp_group, vocab_start and vocab_end"
        )
    group, start, end, size = dtensor_vocab_layout(logits, -1)
    local = logits.to_local()  # type: ignore[attr-defined]  # a DTensor (is_dtensor above)
    if local.shape[-1] != end - start:
        raise ValueError(
            f"this rank's DTensor shard has {local.shape[-1]} vocabulary entries, but torch.chunk "
            f"layout gives it [{start}, {end}); call .to_local() yourself and pass tp_group, "
            f"vocab_start and vocab_end"
        )
    return VocabShard(local, group, start, end, size)
