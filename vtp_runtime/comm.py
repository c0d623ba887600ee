"""The few collectives backends use. With ``group=None`` (or a group of one) they do nothing."""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    if group_size(group) == 1:
        return 0
    return dist.get_rank(group)


def all_reduce_(tensor: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (``op`` is "sum" or "max"); returns ``tensor``."""
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
    # torch >= 2.13 names it all_gather_single (the old name is deprecated); 2.11 has only the old.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, flat, group=group)
    return out.view(world, *tensor.shape)
