"""The fused linear head: every op straight from hidden states and a vocabulary-sharded
weight, without the ``[tokens, V_local]`` logits ever existing in full.

``Head(hidden, weight, bias)`` stands for ``hidden @ weight.T + bias`` on this rank's
vocabulary shard. Every op takes it wherever it takes logits::

    loss = vtp.cross_entropy(vtp.Head(hidden, weight), labels, reduction="mean", tp_group=g)

The Head's checks and its stand-in logits live here; how a call with Head inputs runs, in
token chunks, is ``vtp_runtime.head_chunks``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

Tensor = torch.Tensor


class Head:
    """A lazy ``hidden @ weight.T + bias`` on this rank's vocabulary shard.

    - ``hidden``: ``[..., H]``, identical on every rank of ``tp_group`` (as after Megatron's
      copy-to-TP region).
    - ``weight``: this rank's shard ``[V_local, H]`` of the output projection (any even,
      uneven or empty split; rank order by default, or the op's ``vocab_start``/``vocab_end``).
    - ``bias``: ``[V_local]`` or None. The three share one floating dtype and device.
    - ``reduce_hidden_grad``: all-reduce the hidden gradient over ``tp_group`` (default), so
      it is complete on every rank; False leaves this rank's partial sum, for frameworks
      that all-reduce it themselves.
    - ``chunk_rows``: tokens per chunk (default: ``vtp_runtime.head_chunks.chunk_rows``, a
      ``[rows, V_local]`` buffer of at most ``CHUNK_BYTES`` for the widest shard); the same on every rank.
    - ``sequence_parallel`` (Megatron's sequence parallelism): ``hidden`` ``[S_r, ..., H]`` is
      this rank's contiguous shard of the tokens instead, shards concatenated along the first
      dimension in rank order (uneven, or empty, shards allowed; the other dimensions the
      same on every rank). The op runs over all ``S = sum S_r`` tokens: labels, index, mask
      and the other input cover all of them, and the result (``[S, ...]``) is replicated on
      every rank as usual. ``hidden``'s gradient is this rank's rows of the complete hidden
      gradient (the reduce-scatter is done here), so ``reduce_hidden_grad=False`` does not
      apply. At TP 1 it is a plain Head.

    Gradients flow to ``hidden``, ``weight`` and ``bias`` (whichever require grad).
    """

    __slots__ = ("hidden", "weight", "bias", "reduce_hidden_grad", "chunk_rows", "sequence_parallel")

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None = None,
        reduce_hidden_grad: bool = True,
        *,
        chunk_rows: int | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.reduce_hidden_grad, self.chunk_rows = reduce_hidden_grad, chunk_rows
        self.sequence_parallel = sequence_parallel

    @property
    def shape(self) -> torch.Size:
        """The shape of the logits it stands for: ``hidden.shape[:-1] + (V_local,)`` (this
        rank's tokens only, for a sequence-parallel Head)."""
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def logits(self) -> Tensor:
        """The local logits ``[..., V_local]``, materialized (e.g. for generation)."""
        return torch.nn.functional.linear(self.hidden, self.weight, self.bias)

    def __repr__(self) -> str:
        return (
            f"Head(hidden={tuple(self.hidden.shape)}, weight={tuple(self.weight.shape)}, "
            f"bias={None if self.bias is None else tuple(self.bias.shape)}, dtype={self.dtype}"
            + (", sequence_parallel=True)" if self.sequence_parallel else ")")
        )


def _check(head: Head, name: str) -> None:
    """Raise TypeError/ValueError on a malformed Head (before the metadata gather)."""
    for part in ("hidden", "weight", "bias"):
        t = getattr(head, part)
        if t is None and part == "bias":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: Head.{part} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: Head.{part} must be a floating tensor, got {t.dtype}")
    h, w, b = head.hidden, head.weight, head.bias
    if h.dim() < 1:
        raise ValueError(f"{name}: Head.hidden must be [..., H], got a scalar")
    if w.dim() != 2 or w.shape[1] != h.shape[-1]:
        raise ValueError(
            f"{name}: Head.weight must be [V_local, H] with H = hidden.shape[-1] = {h.shape[-1]}, got {tuple(w.shape)}"
        )
    if b is not None and tuple(b.shape) != (w.shape[0],):
        raise ValueError(f"{name}: Head.bias must be [V_local] = [{w.shape[0]}], got {tuple(b.shape)}")
    dtypes = {t.dtype for t in (h, w, b) if t is not None}
    if len(dtypes) > 1:
        raise TypeError(
            f"{name}: Head.hidden ({h.dtype}), weight ({w.dtype})"
            + ("" if b is None else f" and bias ({b.dtype})")
            + " must share one dtype"
        )
    devices = {t.device for t in (h, w, b) if t is not None}
    if len(devices) > 1:
        raise ValueError(
            f"{name}: Head.hidden, weight and bias must be on one device, got " + ", ".join(sorted(map(str, devices)))
        )
    if not isinstance(head.reduce_hidden_grad, bool):
        raise TypeError(f"{name}: Head.reduce_hidden_grad must be a bool, got {head.reduce_hidden_grad!r}")
    rows = head.chunk_rows
    if rows is not None and not (isinstance(rows, int) and not isinstance(rows, bool) and rows > 0):
        raise ValueError(f"{name}: Head.chunk_rows must be a positive int or None, got {rows!r}")
    if not isinstance(head.sequence_parallel, bool):
        raise TypeError(f"{name}: Head.sequence_parallel must be a bool, got {head.sequence_parallel!r}")
    if head.sequence_parallel:
        if not head.reduce_hidden_grad:
            raise ValueError(
                f"{name}: Head(sequence_parallel=True) hands each rank its rows of the complete hidden gradient "
                f"(it reduce-scatters them over tp_group itself); reduce_hidden_grad=False, a partial sum for a "
                f"framework to all-reduce, does not apply to it: leave reduce_hidden_grad out"
            )
        if h.dim() < 2:
            raise ValueError(
                f"{name}: Head(sequence_parallel=True) needs hidden [S_r, ..., H] (this rank's tokens first), "
                f"got shape {tuple(h.shape)}"
            )


def stand_ins(
    inputs: Sequence[Any], names: Sequence[str], *, world: int = 1, tokens: int | None = None
) -> tuple[tuple[Head | None, ...] | None, tuple]:
    """``(heads, inputs)``: each Head among ``inputs`` checked and replaced by a stand-in
    logits tensor of its shape, dtype and device that owns no memory (a zero-stride
    expansion), so the core validates and dispatches it like logits. ``heads`` is None when
    no input is a Head, else one entry per input (None for logits).

    With ``world`` > 1 ranks, a sequence-parallel Head stands for logits of every rank's
    tokens: ``(tokens, *hidden.shape[1:-1], V_local)``, ``tokens`` the first dimension of
    an input that covers them all (labels, index, mask, another input), or this rank's
    ``hidden.shape[0]`` where there is none (the metadata gather gives the sum)."""
    if not any(isinstance(t, Head) for t in inputs):
        return None, tuple(inputs)
    heads: list[Head | None] = []
    out: list[Any] = []
    local = None
    for name, t in zip(names, inputs):
        if not isinstance(t, Head):
            heads.append(None)
            out.append(t)
            continue
        _check(t, name)
        shape = t.shape
        if t.sequence_parallel and world > 1:
            if local is not None and tuple(t.hidden.shape[:-1]) != local:
                raise ValueError(
                    f"{name}: the sequence-parallel Heads of one call must hold the same tokens: hidden "
                    f"{tuple(t.hidden.shape)} beside hidden [{', '.join(map(str, local))}, H]"
                )
            local = tuple(t.hidden.shape[:-1])
            shape = torch.Size((local[0] if tokens is None else tokens, *local[1:], t.weight.shape[0]))
        needs = any(p is not None and p.requires_grad for p in (t.hidden, t.weight, t.bias))
        seed = torch.empty((), dtype=t.dtype, device=t.device, requires_grad=needs)
        heads.append(t)
        out.append(seed.expand(shape))
    return tuple(heads), tuple(out)


def sequence_tokens(heads: Sequence[Head | None] | None) -> tuple[int, ...] | None:
    """The local token shape ``hidden.shape[:-1]`` of the sequence-parallel Heads among
    ``heads`` (checked to be one by ``stand_ins``), or None when there is none."""
    for h in heads or ():
        if h is not None and h.sequence_parallel:
            return tuple(h.hidden.shape[:-1])
    return None


def grad_needed(t: Tensor | None) -> bool:
    return t is not None and torch.is_grad_enabled() and t.requires_grad


def fingerprint(heads: Sequence[Head | None] | None) -> str:
    """What every rank must agree on about its Head inputs (it decides the chunk count and
    the hidden-gradient all-reduces): appended to the options fingerprint."""
    if heads is None:
        return ""
    parts = []
    for h in heads:
        if h is None:
            parts.append("logits")
        else:
            grads = "".join(str(int(grad_needed(t))) for t in (h.hidden, h.weight, h.bias))
            sequence = f",sequence_parallel=[S_r, {', '.join(map(str, h.hidden.shape[1:-1]))}]"
            parts.append(
                f"head:H={h.hidden.shape[-1]},bias={int(h.bias is not None)},grads={grads},"
                f"reduce={int(h.reduce_hidden_grad)},rows={h.chunk_rows}" + (sequence if h.sequence_parallel else "")
            )
    return "|inputs=" + ";".join(parts)


__all__ = ["Head"]
