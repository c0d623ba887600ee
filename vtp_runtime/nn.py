"""``VocabParallelHead``: an output projection sharded over the vocabulary, as a module.

    lm_head = vtp.VocabParallelHead(hidden_size=4096, vocab_size=151936, tp_group=g)
    loss = vtp.cross_entropy(lm_head(hidden), labels, reduction="mean", tp_group=g)

Rank ``r`` of a TP group of size ``t`` owns rows ``[r * c, (r + 1) * c)`` of the ``[V, H]``
weight, clipped to ``V``, with ``c = ceil(V / t)``: ``torch.chunk``'s split, the one
DTensor's ``Shard(0)`` uses. Shards are in rank order, so ops need no ``vocab_start``; the
last ranks may hold fewer rows or none (V=10 on 4 ranks: 3, 3, 3, 1).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .comm import all_gather_stack, group_rank, group_size
from .head import Head

Tensor = torch.Tensor


def shard_bounds(vocab_size: int, tp_size: int, rank: int) -> tuple[int, int]:
    """``(vocab_start, vocab_end)`` of ``rank``: torch.chunk's split, ``ceil(V / tp)`` rows per rank."""
    per = -(-vocab_size // tp_size)
    start = min(rank * per, vocab_size)
    return start, min(start + per, vocab_size)


class VocabParallelHead(nn.Module):
    """This rank's vocabulary shard of a ``hidden_size -> vocab_size`` linear head.

    ``weight`` is ``[V_local, hidden_size]`` (``bias`` ``[V_local]``), initialized like
    ``nn.Linear`` (uniform in ``±1/sqrt(hidden_size)``) from each rank's own RNG; use
    ``from_full`` to shard a given weight. ``module(hidden)`` (or ``.head(hidden)``) returns a
    ``vtp.Head`` for any op; ``.logits(hidden)`` materializes the local (or, with
    ``gather=True``, the full) logits, e.g. for generation. ``hidden`` must be identical on
    every rank of ``tp_group``; its gradient is complete on every rank unless
    ``reduce_hidden_grad=False``. With ``sequence_parallel=True`` (Megatron's sequence
    parallelism) ``hidden`` is this rank's shard of the tokens instead, and its gradient this
    rank's rows (see ``vtp.Head``). The state dict holds the local shard and its vocabulary
    bounds, checked on load.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        tp_group: Any = None,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        reduce_hidden_grad: bool = True,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        if not (isinstance(hidden_size, int) and hidden_size > 0 and isinstance(vocab_size, int) and vocab_size > 0):
            raise ValueError(f"hidden_size and vocab_size must be positive ints, got {hidden_size!r}, {vocab_size!r}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.tp_group = tp_group
        self.tp_size, self.rank = group_size(tp_group), group_rank(tp_group)
        self.vocab_start, self.vocab_end = shard_bounds(vocab_size, self.tp_size, self.rank)
        self.reduce_hidden_grad, self.sequence_parallel = reduce_hidden_grad, sequence_parallel
        v_local = self.vocab_end - self.vocab_start
        self.weight = nn.Parameter(torch.empty(v_local, hidden_size, dtype=dtype, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(v_local, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1 / math.sqrt(self.hidden_size)
        if self.weight.device.type != "meta":
            with torch.no_grad():
                self.weight.uniform_(-bound, bound)
                if self.bias is not None:
                    self.bias.uniform_(-bound, bound)

    @classmethod
    def from_full(
        cls,
        weight: Tensor,
        bias: Tensor | None = None,
        tp_group: Any = None,
        reduce_hidden_grad: bool = True,
        sequence_parallel: bool = False,
    ) -> VocabParallelHead:
        """This rank's shard of the full ``[V, H]`` ``weight`` (and ``[V]`` ``bias``), copied,
        in ``weight``'s dtype and device. Every rank passes the same full tensors."""
        if weight.dim() != 2:
            raise ValueError(f"weight must be [vocab_size, hidden_size], got {tuple(weight.shape)}")
        v, h = weight.shape
        if bias is not None and tuple(bias.shape) != (v,):
            raise ValueError(f"bias must be [vocab_size] = [{v}], got {tuple(bias.shape)}")
        module = cls(
            h,
            v,
            tp_group,
            bias=bias is not None,
            dtype=weight.dtype,
            device="meta",
            reduce_hidden_grad=reduce_hidden_grad,
            sequence_parallel=sequence_parallel,
        )
        start, end = module.vocab_start, module.vocab_end
        module.weight = nn.Parameter(weight.detach()[start:end].clone())
        if bias is not None:
            module.bias = nn.Parameter(bias.detach()[start:end].clone().to(weight.device))
        return module

    def head(self, hidden: Tensor) -> Head:
        """``vtp.Head(hidden, weight, bias)``: pass it to any op instead of logits."""
        return Head(hidden, self.weight, self.bias, self.reduce_hidden_grad, sequence_parallel=self.sequence_parallel)

    forward = head

    def logits(self, hidden: Tensor, gather: bool = False) -> Tensor:
        """Local logits ``[..., V_local]``; with ``gather=True`` the full ``[..., V]`` on every
        rank (one all-gather over ``tp_group``; no gradient through the gather)."""
        local = nn.functional.linear(hidden, self.weight, self.bias)
        if not gather or self.tp_size == 1:
            return local
        per = -(-self.vocab_size // self.tp_size)
        padded = local.new_zeros((*local.shape[:-1], per))
        padded[..., : local.shape[-1]] = local.detach()
        shards = all_gather_stack(padded, self.tp_group)
        parts = []
        for r in range(self.tp_size):
            start, end = shard_bounds(self.vocab_size, self.tp_size, r)
            parts.append(shards[r][..., : end - start])
        return torch.cat(parts, dim=-1)

    # -- the state dict holds the shard's bounds, and loading checks them --------------------------
    def get_extra_state(self) -> dict:
        return {
            "vocab_start": self.vocab_start,
            "vocab_end": self.vocab_end,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "tp_size": self.tp_size,
        }

    def set_extra_state(self, state: dict) -> None:
        mine = (self.vocab_start, self.vocab_end, self.vocab_size)
        theirs = (state.get("vocab_start"), state.get("vocab_end"), state.get("vocab_size"))
        if theirs != mine:
            raise ValueError(
                f"this state dict holds vocabulary rows [{theirs[0]}, {theirs[1]}) of {theirs[2]} "
                f"(TP size {state.get('tp_size')}), but this module (rank {self.rank} of {self.tp_size}) "
                f"holds [{mine[0]}, {mine[1]}) of {mine[2]}; load it with the same TP size, or "
                f"build the module from the full weight with VocabParallelHead.from_full"
            )

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, rank {self.rank} of {self.tp_size} "
            f"holds [{self.vocab_start}, {self.vocab_end}), bias={self.bias is not None}"
        )
