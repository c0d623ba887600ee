"""The collectives a backend may use (public: third-party backends import them).

With ``group=None`` (or a group of one) they do nothing. Their number per call must never
depend on the local vocabulary size: every rank of the group issues the same collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_into",
    "all_gather_stack",
    "all_reduce",
    "group_rank",
    "group_size",
    "is_group",
    "reduce_scatter_into",
]


def is_group(group) -> bool:
    """Whether ``group`` is a torch.distributed ProcessGroup (None is not: no group)."""
    return group is not None and dist.is_available() and isinstance(group, dist.ProcessGroup)


def group_size(group) -> int:
    """The number of ranks of ``group`` (1 without a group or without torch.distributed)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank within ``group`` (0 without a group)."""
    if group_size(group) == 1:
        return 0
    return dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce over ``group`` (``op`` is "sum" or "max"); returns ``tensor``."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return tensor


def all_gather_stack(tensor: torch.Tensor, group) -> torch.Tensor:
    """Gather ``tensor`` from every rank into one new tensor of shape ``[world, *tensor.shape]``,
    in rank order, with a single collective."""
    world = group_size(group)
    if world == 1:
        return tensor.unsqueeze(0)
    flat = tensor.contiguous().view(-1)
    # the concatenated form: every process group backend (gloo too) accepts it
    out = torch.empty(world * flat.numel(), dtype=tensor.dtype, device=tensor.device)
    all_gather_into(out, flat, group)
    return out.view(world, *tensor.shape)


# torch >= 2.13 names the two below *_single (the old names are deprecated); 2.11 has only the old.


def all_gather_into(out: torch.Tensor, tensor: torch.Tensor, group, async_op: bool = False):
    """Every rank's ``tensor`` into ``out`` (``world`` times its size, rank order) with one
    collective; the work handle where ``async_op``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, tensor, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, tensor: torch.Tensor, group, async_op: bool = False):
    """This rank's block of the sum over the ranks of ``tensor`` (``world`` blocks the size of
    ``out``) into ``out``, with one collective; the work handle where ``async_op``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
