"""Stand-ins for runtime functions that other work adds (``vtp.argmax``), so that the
adapters calling them are tested now. Each is installed only where the runtime lacks the
real one, and is written the plain way (local logits, one all-gather of (max, id) per row):
slow, obviously right, test-only."""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

import vtp_runtime as vtp
from vtp_runtime.integrations.tensor_parallel import dtensor_vocab_layout, is_dtensor


def reference_argmax(logits, *, tp_group=None, vocab_start=None, vocab_end=None, global_vocab_size=None, **_):
    """The lowest global id of each row's maximum of ``logits`` (a tensor or ``vtp.Head``,
    local or with a DTensor weight), identical on every rank of the group."""
    if isinstance(logits, vtp.Head):
        w, b, h = logits.weight, logits.bias, logits.hidden
        if is_dtensor(w):
            tp_group, vocab_start, _, _ = dtensor_vocab_layout(w, 0)
            w, b = w.to_local(), None if b is None else b.to_local()
        z = F.linear(h, w, b)
    else:
        z = logits
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    if vocab_start is None:
        sizes = [torch.zeros((), dtype=torch.int64) for _ in range(world)]
        if world > 1:
            dist.all_gather(sizes, torch.tensor(z.shape[-1]), group=tp_group)
        vocab_start = int(sum(sizes[: dist.get_rank(tp_group)])) if world > 1 else 0
    value, index = z.float().max(-1)  # the first maximum of this shard
    ids = index + vocab_start
    if world == 1:
        return ids
    values = [torch.empty_like(value) for _ in range(world)]
    indices = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(values, value.contiguous(), group=tp_group)
    dist.all_gather(indices, ids.contiguous(), group=tp_group)
    values, indices = torch.stack(values), torch.stack(indices)
    best = values.max(0).values
    # ties across shards: the lowest id among the shards holding the maximum
    return torch.where(values == best, indices, torch.iinfo(torch.int64).max).min(0).values


@contextlib.contextmanager
def argmax_stand_in():
    """``vtp.argmax`` for the block, where the runtime has none."""
    if hasattr(vtp, "argmax"):
        yield
        return
    vtp.argmax = reference_argmax
    try:
        yield
    finally:
        del vtp.argmax
