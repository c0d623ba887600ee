"""The Megatron-SP layout of a ``vtp.Head`` (``Head(..., sequence_parallel=True)``): the
ranks of ``tp_group`` hold contiguous token shards of the hidden states. ``SequenceLayout``
says which rows of which rank each token chunk holds; ``HiddenChunks`` all-gathers them
chunk by chunk (the next chunk's gather in flight while this one computes) and
reduce-scatters each chunk's hidden gradient back to the ranks that own its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .comm import all_gather_into, reduce_scatter_into

Tensor = torch.Tensor


@dataclass(frozen=True)
class SequenceLayout:
    """Which hidden rows a sequence-parallel ``Head`` gathers for each token chunk.

    Rank ``r`` of ``tp_group`` holds ``rows[r]`` contiguous tokens, in rank order, so the
    global tokens are their concatenation. Chunk ``c`` takes each rank's local rows
    ``[c * per_rank, (c + 1) * per_rank)`` (fewer, or none, where its shard ends): every rank
    contributes a block of the same size to the chunk's all-gather (even shards: no padding)
    and gets a block of the same size back from its reduce-scatter. A chunk's tokens are
    therefore not contiguous in the global order, but a fixed permutation of it (``order``);
    with one chunk, or one rank, it is the identity. Everything here derives from the
    gathered metadata, so it is the same on every rank.
    """

    rows: tuple[int, ...]  # tokens per rank
    rank: int
    per_rank: int  # each rank's rows per chunk

    @property
    def tp_size(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(self.rows)

    @property
    def chunks(self) -> int:
        most: int = max(self.rows, default=0)
        return -(-most // self.per_rank)

    @property
    def max_chunk(self) -> int:
        """Tokens of the largest chunk (the first)."""
        return sum(min(n, self.per_rank) for n in self.rows)

    def counts(self, c: int) -> tuple[int, ...]:
        """Rows each rank holds in chunk ``c``."""
        lo = c * self.per_rank
        return tuple(max(0, min(n - lo, self.per_rank)) for n in self.rows)

    def offsets(self) -> tuple[int, ...]:
        return tuple(sum(self.rows[:r]) for r in range(len(self.rows)))

    def starts(self) -> list[int]:
        """Where each chunk starts in the chunk order of the tokens (and its end last)."""
        out = [0]
        for c in range(self.chunks):
            out.append(out[-1] + sum(self.counts(c)))
        return out

    def identity(self) -> bool:
        return self.chunks <= 1 or self.tp_size == 1

    def order(self, device: torch.device) -> Tensor | None:
        """``[N]`` int64: the global token at each position of the chunk order (None: the
        identity). Built on the device from ``arange``s: no host-to-device copy."""
        if self.identity():
            return None
        offsets = self.offsets()
        parts = []
        for c in range(self.chunks):
            lo = c * self.per_rank
            for off, n in zip(offsets, self.counts(c)):
                if n:
                    parts.append(torch.arange(off + lo, off + lo + n, device=device))
        return torch.cat(parts)


def on_gloo(group: Any, device: torch.device) -> bool:
    """Whether the collectives of ``group`` on ``device`` run on gloo. Its reduce-scatter is an
    all-reduce of a copy of the input, so an all-reduce in place is the same traffic without
    the copy; and its all-gather allocates a tensor the size of its whole output (on the
    output's device) each time it is issued (``getOutputTensors`` of its work, called when
    the work is queued), so each rank's block is broadcast instead, which allocates nothing."""
    backend = str(dist.get_backend(group)).lower()
    return backend == "gloo" or (device.type == "cpu" and "gloo" in backend)


class HiddenChunks:
    """The hidden rows of each chunk of a sequence-parallel Head, gathered from the ranks of
    ``group``, and the reduce-scatter of each chunk's hidden gradient back to them.

    Collectives, per chunk: one all-gather of ``[tp, m, H]`` (``m`` the largest block of the
    chunk; with even shards ``m = per_rank`` and no padding), issued asynchronously one chunk
    ahead, so that chunk ``c + 1``'s gather runs while chunk ``c``'s matmuls do (on NCCL its
    stream waits for the compute stream when issued and the compute stream for it at
    ``wait``: no host sync); on gloo, which runs them on its own threads, one broadcast of
    each rank's block instead, straight into its place in the chunk (no padding, no
    compaction), since torch's gloo all-gather allocates a second tensor of its whole output
    whenever it is issued (one more chunk buffer at the peak, on the GPU too); and, where the
    hidden gradient is needed, one reduce-scatter of ``[tp, m, H]`` (asynchronous as well,
    waited for in ``finish``; torch's gloo runs it as an all-reduce, twice the bytes). Their
    number and sizes derive from the layout only, never from V_local. Memory: two gather
    buffers of ``[tp * per_rank, H]``, and one compaction buffer where blocks are padded (not
    on gloo); never the ``[N, H]`` of every rank's tokens. A chunk's partial hidden gradient
    is written over its
    hidden rows (``grad_rows``: the chunk's weight gradient is computed first), and the
    gather two chunks later writes that buffer only after the reduce-scatter has read it:
    on NCCL and XCCL the collectives of a group run in issue order, on one stream; on gloo,
    whose reduce-scatter is an all-reduce of a copy of its input, the gradient is
    all-reduced in place instead (no copy) and waited for before the buffer is gathered into
    again.

    ``in_flight`` holds the gathers issued and not yet waited for (by chunk: works, output,
    input), ``gathered`` the two gather buffers (None until first used).
    """

    def __init__(self, hidden: Tensor, layout: SequenceLayout, group: Any) -> None:
        self.hidden, self.layout, self.group = hidden, layout, group
        self.world, self.width = layout.tp_size, hidden.shape[-1]
        self._starts = layout.starts()
        self.gathered: list[Tensor | None] = [None, None]
        self.in_flight: dict[int, tuple[list[Any], Tensor, Tensor]] = {}  # chunk -> (works, output, input)
        self._compact: Tensor | None = None
        self._current: tuple[int, Tensor] | None = None  # the chunk rows() gave last
        # gloo: gathers by broadcasts (compact, no padding), scatters by an all-reduce in place
        self._gloo = on_gloo(group, hidden.device)
        self._scatters: list[tuple[Any, Tensor, Tensor, Tensor | None]] = []  # work, input, output, place

    def chunk_at(self, lo: int) -> int:
        """The chunk that starts at position ``lo`` of the chunk order."""
        return self._starts.index(lo)

    def _buffer(self, buffers: list[Tensor | None], slot: int) -> Tensor:
        if buffers[slot] is None:
            buffers[slot] = self.hidden.new_empty(self.world * self.layout.per_rank, self.width)
        buf = buffers[slot]
        assert buf is not None
        return buf

    def _padded(self, c: int) -> bool:
        counts = self.layout.counts(c)
        return len(set(counts)) > 1

    # -- the hidden rows ------------------------------------------------------------------
    def start_gather(self, c: int) -> None:
        """Issue chunk ``c``'s gather, unless it is issued already or past the last chunk."""
        if c >= self.layout.chunks or c in self.in_flight:
            return
        if self._gloo:  # an all-reduce in place may still be reading this buffer
            self._wait()
        counts = self.layout.counts(c)
        m, mine, lo = max(counts), counts[self.layout.rank], c * self.layout.per_rank
        send = self.hidden[lo : lo + mine]
        if self._gloo:  # each rank's rows broadcast into their place in the chunk order
            out = self._buffer(self.gathered, c % 2)[: sum(counts)]
            at = sum(counts[: self.layout.rank])
            out[at : at + mine].copy_(send)
            works, at = [], 0
            for r, k in enumerate(counts):
                if k:
                    src = dist.get_global_rank(self.group, r)
                    works.append(dist.broadcast(out[at : at + k], src=src, group=self.group, async_op=True))
                at += k
            self.in_flight[c] = (works, out, send)
            return
        if mine < m:  # every rank sends a block of the chunk's largest size
            send = torch.cat([send, send.new_zeros(m - mine, self.width)])
        out = self._buffer(self.gathered, c % 2)[: self.world * m]
        work = all_gather_into(out, send.contiguous(), self.group, async_op=True)
        self.in_flight[c] = ([work], out, send)

    def rows(self, c: int) -> Tensor:
        """The hidden rows of chunk ``c``, ``[tokens of the chunk, H]`` in chunk order (rank
        0's block first), valid until ``rows(c + 1)``; starts the gather of chunk ``c + 1``."""
        self.start_gather(c)
        works, out, _ = self.in_flight.pop(c)
        for work in works:
            work.wait()
        self.start_gather(c + 1)
        if self._gloo or not self._padded(c):  # broadcast into place: compact already
            self._current = (c, out)
            return out
        counts = self.layout.counts(c)
        blocks = out.view(self.world, max(counts), self.width)
        if self._compact is None:
            self._compact = self.hidden.new_empty(self.layout.max_chunk, self.width)
        compact = self._compact[: sum(counts)]
        torch.cat([blocks[r, :k] for r, k in enumerate(counts) if k], out=compact)
        self._current = (c, compact)
        return compact

    # -- the hidden gradient --------------------------------------------------------------
    def grad_rows(self, c: int) -> Tensor:
        """A ``[tokens of chunk c, H]`` buffer for chunk ``c``'s partial hidden gradient (this
        rank's vocabulary shard's part), to be handed to ``scatter``: the chunk's hidden rows
        themselves, which nothing reads after the chunk's weight gradient."""
        assert self._current is not None and self._current[0] == c  # rows(c) gave the chunk's rows
        self._wait(keep=1)  # keep the scatters in flight few: their padded outputs wait for a copy
        return self._current[1]

    def scatter(self, c: int, partial: Tensor, out: Tensor) -> None:
        """Sum chunk ``c``'s ``partial`` hidden gradient over the ranks and write this rank's
        rows of it into ``out``, this rank's ``[rows, H]`` hidden gradient (when ``finish``
        returns)."""
        counts = self.layout.counts(c)
        m, mine, lo = max(counts), counts[self.layout.rank], c * self.layout.per_rank
        send = partial
        if self._padded(c):  # blocks of m rows, zero past each rank's rows
            send = partial.new_zeros(self.world * m, self.width)
            blocks, at = send.view(self.world, m, self.width), 0
            for r, k in enumerate(counts):
                blocks[r, :k].copy_(partial[at : at + k])
                at += k
        place = out[lo : lo + mine]
        if self._gloo:  # this rank's block of the sum, copied into place when it is done
            work = dist.all_reduce(send, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self._scatters.append((work, send, send.view(self.world, m, self.width)[self.layout.rank], place))
            return
        target = place if mine == m else partial.new_empty(m, self.width)
        work = reduce_scatter_into(target, send, self.group, async_op=True)
        self._scatters.append((work, send, target, None if target is place else place))

    def _wait(self, keep: int = 0) -> None:
        while len(self._scatters) > keep:
            work, _, target, place = self._scatters.pop(0)
            work.wait()
            if place is not None:  # this rank's rows, where the collective did not write them
                place.copy_(target[: place.shape[0]])

    def finish(self) -> None:
        """Wait for every reduce-scatter: the hidden gradient is complete after it."""
        self._wait()

    def release(self) -> None:
        """Wait for what is in flight and drop every buffer."""
        self._wait()
        for works, _, _ in self.in_flight.values():
            for work in works:
                work.wait()
        self.in_flight.clear()
        self.gathered, self._compact, self._current = [None, None], None, None


__all__ = ["SequenceLayout", "HiddenChunks"]
