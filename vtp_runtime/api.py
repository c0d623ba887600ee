"""The public API: ``loss`` and the typed helpers, ``argmax`` and ``sample``, ``explain``.

Each function states its shapes, dtypes and what is replicated across ranks, and hands the
call to the pipeline (``vtp_runtime.pipeline``), which checks it, plans it (gathering the
metadata of every rank on the first call of a signature), runs the chosen backend under one
autograd node and reduces the result; ``docs/architecture.md`` draws the whole flow.
"""

from __future__ import annotations

from typing import Any, Literal, overload

import torch

from . import dispatch, head, pipeline, topk
from .ops import OPS

Tensor = torch.Tensor
Logits = Tensor | head.Head  # logits [..., V_local], or a lazy hidden @ weight.T shard


# -- public functions ----------------------------------------------------------------------


def loss(op: str, *tensors: Any, **options: Any) -> Any:
    """Compute ``op`` on vocabulary-sharded logits; see the typed helpers for each op.

    ``tensors`` are the op's inputs in order (logits [, labels/index] or student, teacher),
    each rank passing its local ``[..., V_local]`` shard, or a ``vtp.Head`` standing for it
    (``hidden @ weight_shard.T + bias``, never formed in full; see ``vtp_runtime/head.py``).
    The result is fp32 (fp64 for fp64 inputs), shaped ``logits.shape[:-1]`` (``+ (k,)`` for
    top-k log-probs) or a scalar when reduced, and identical on every rank of ``tp_group``.
    DTensor logits give a DTensor result on their mesh (see ``vtp_runtime.inputs``).
    ``logprobs`` with ``return_entropy=True`` gives a pair ``(logprobs, entropy)``.

    ``sp_group``: the ranks holding the other tokens of the batch (DeepSpeed Ulysses, context
    parallelism). A ``"sum"``/``"mean"`` result then covers every rank's tokens ("mean": over
    their global count of counted tokens), replicated on every rank of ``sp_group`` and
    ``tp_group``; each rank backprops it once and gets the gradient of that global loss for
    its own tokens. ``"none"`` is per token as without it. Every rank of ``sp_group`` must
    make the same call but for its tokens (else they all raise); see
    ``vtp_runtime/sequence.py``. A ``vtp.Head(..., sequence_parallel=True)`` is Megatron's
    sequence parallelism inside ``tp_group`` instead (``vtp_runtime/head_gather.py``).
    """
    if op in OPS and OPS[op].returns_ids:
        raise TypeError(f"{op} returns token ids, not a loss: call vtp.{op}(logits, ...)")
    if op == "kl" and len(tensors) == 2 and isinstance(tensors[1], topk.TopK):
        return topk.kl(*tensors, **options)
    return pipeline.run(op, tensors, options)


def explain(op: str, *tensors: Any, gather: bool = False, **options: Any) -> dispatch.Explanation:
    """Which backend ``loss(op, *tensors, **options)`` would use and why not the others.

    By default this rank's view, with no communication, so it may be called on one rank only
    (``if rank == 0: print(vtp.explain(...))``): the other ranks' shards are assumed to be like
    this one's (rank order, equal sizes) unless ``global_vocab_size`` or ``vocab_start`` say
    otherwise, and their backends like this rank's. ``gather=True`` gathers the metadata as
    ``loss`` does and gives the verdict of the real call, the same on every rank: then, like
    ``loss``, every rank of ``tp_group`` must call it. With a ``vtp.TopK`` teacher, ``kl``'s
    verdict is that of the student's top-k log-probs, the one op it runs.
    """
    if op == "kl" and len(tensors) == 2 and isinstance(tensors[1], topk.TopK):
        return topk.explain(*tensors, gather=gather, **options)
    return pipeline.explain(op, tensors, options, gather=gather)


def cross_entropy(
    logits: Logits,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    **options: Any,
) -> Tensor:
    """Cross entropy of ``logits`` [..., V_local] against global ``labels`` [...] (int).

    ``(1-e)(lse - x[y]) + e(lse - mean_j x_j) + z_loss * lse^2`` with ``x = logits / T`` and
    the mean over the global vocabulary. ``ignore_index`` tokens give exactly 0.
    """
    return loss(
        "cross_entropy",
        logits,
        labels,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        **options,
    )


@overload
def logprobs(
    logits: Logits, index: Tensor, *, ignore_index: int = ..., return_entropy: Literal[False] = ..., **options: Any
) -> Tensor: ...
@overload
def logprobs(
    logits: Logits, index: Tensor, *, ignore_index: int = ..., return_entropy: Literal[True], **options: Any
) -> tuple[Tensor, Tensor]: ...
@overload
def logprobs(
    logits: Logits, index: Tensor, *, ignore_index: int = ..., return_entropy: bool, **options: Any
) -> Tensor | tuple[Tensor, Tensor]: ...


def logprobs(
    logits: Logits, index: Tensor, *, ignore_index: int = -100, return_entropy: bool = False, **options: Any
) -> Tensor | tuple[Tensor, Tensor]:
    """``log softmax(logits / T)`` at global vocabulary ids ``index`` (int, ``[...]`` or
    ``[..., k]``): shaped like ``logits.shape[:-1]`` or with a trailing top-k dimension;
    entries equal to ``ignore_index`` give 0.

    ``return_entropy=True`` returns ``(logprobs, entropy)`` from one read of the logits,
    ``entropy = -sum p log p`` of ``softmax(logits / T)`` shaped ``logits.shape[:-1]``, both
    differentiable (e.g. ``(lp * adv).sum() + c * ent.sum()``). A token's entropy is 0 when
    every entry of its index is ``ignore_index`` (the one entry of an ``[...]`` index, all k
    of an ``[..., k]`` one). ``reduction`` and ``normalizer`` apply to both outputs alike:
    ``"sum"`` sums each, ``normalizer`` divides each; ``"mean"`` divides the log-probs by
    their count of non-ignored entries and the entropy by its count of unmasked tokens.
    Both are replicated on every rank of ``tp_group``."""
    return loss("logprobs", logits, index, ignore_index=ignore_index, return_entropy=return_entropy, **options)


def entropy(logits: Logits, **options: Any) -> Tensor:
    """Entropy ``-sum p log p`` of ``softmax(logits / T)`` over the global vocabulary.
    Takes ``mask=`` (bool, True = keep) or ``labels=`` with ``ignore_index``."""
    return loss("entropy", logits, **options)


def kl(
    student_logits: Logits,
    teacher_logits: Logits | topk.TopK,
    *,
    reverse: bool = False,
    tail: bool = False,
    **options: Any,
) -> Tensor:
    """Forward ``KL(p_teacher || p_student)``, or reverse ``KL(p_student || p_teacher)``.

    A teacher given as ``vtp.TopK(logprobs, index)`` (its top-k log-probs and global ids,
    ``[..., k]``, replicated) gives the KL over those k ids, with ``tail=True`` plus the
    residual-mass term ``r_t log(r_t / r_s)``; see ``vtp_runtime.topk``."""
    if isinstance(teacher_logits, topk.TopK):
        return topk.kl(student_logits, teacher_logits, reverse=reverse, tail=tail, **options)
    if tail is not False:
        raise ValueError(
            "tail= applies to a teacher given as vtp.TopK(logprobs, index); with dense "
            "teacher logits the KL already covers the whole vocabulary"
        )
    return loss("kl", student_logits, teacher_logits, reverse=reverse, **options)


def jsd(student_logits: Logits, teacher_logits: Logits, *, beta: float = 0.5, **options: Any) -> Tensor:
    """Generalized JSD ``b KL(p_t||M) + (1-b) KL(p_s||M)``, ``M = b p_t + (1-b) p_s``;
    ``beta=0`` is forward KL(teacher||student), ``beta=1`` reverse KL(student||teacher)."""
    return loss("jsd", student_logits, teacher_logits, beta=beta, **options)


def argmax(logits: Logits, **options: Any) -> Tensor:
    """The global id of each row's largest logit, ties to the lowest id, as
    ``torch.argmax(full_logits, -1)`` gives it: int64 ``logits.shape[:-1]``, identical on
    every rank of ``tp_group``.

    ``logits``: this rank's ``[..., V_local]`` shard (fp32/bf16/fp16; fp64 on the eager
    backend), a ``vtp.Head`` standing for it (not a sequence-parallel one), or a DTensor
    sharded over its last dimension (the result is then a DTensor on its mesh,
    ``Replicate()`` on the vocabulary's mesh dimension). Options: ``tp_group``,
    ``vocab_start``/``vocab_end``, ``global_vocab_size``, ``backend`` (as for the losses);
    ``temperature`` is accepted and changes nothing. One all-gather of ``[N, 6]`` numbers
    per call. NaN counts as ``+inf``; a row of all ``-inf`` gives 0. Inside a compiled
    function it is a graph break (it runs eagerly).
    """
    if torch.compiler.is_compiling():
        return _eagerly("argmax", (logits,), options)
    return pipeline.ids("argmax", logits, options)


def sample(
    logits: Tensor,
    *,
    seed: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    row_offset: int = 0,
    **options: Any,
) -> Tensor:
    """One token per row drawn from ``softmax(logits / temperature)`` over the global
    vocabulary, restricted by ``top_k``, then ``top_p``, then ``min_p`` (transformers' order):
    int64 global ids shaped ``logits.shape[:-1]``, identical on every rank of ``tp_group``.

    ``seed``: an int (taken modulo 2**64), the same on every rank; pass a new one for every
    step (e.g. ``base * 2**32 + step``). A draw depends on the global logits, the seed and the
    row's number only: the same seed gives the same tokens at any TP size and shard layout
    on one backend. Rows are numbered from ``row_offset`` (an int >= 0; modulo 2**32) in the
    order of the flattened leading dimensions: ranks holding other rows of one batch (data
    parallel) pass the number of their first row, and draw what one call on the whole batch
    draws (a DTensor sharding its batch numbers its rows over the global batch by itself).
    ``temperature=0`` is ``argmax``; any temperature > 0, however small or large, draws
    from ``softmax(logits / temperature)`` (see the guide's "Edge values" for the bounds of
    exactness). ``top_k``: keep the logits ``>=`` the k-th largest (None: all). ``top_p`` in
    (0, 1]: keep the smallest prefix, by probability, whose mass reaches ``top_p`` (1: all).
    ``min_p`` in [0, 1]: keep tokens with ``p >= min_p * p_max`` (0: all). The most likely
    token is always kept.

    ``logits`` and the other options as for ``argmax``. Collectives and host reads per call:
    see ``vtp_runtime.sampling``. Ranks passing different seeds raise the same ShardError
    where the metadata is checked per call (gloo, ``VTP_CHECK=1``) and get -1 in every row
    otherwise (NCCL, ``VTP_CHECK=once``). Inside a compiled function it is a graph break.
    """
    sample_options = {"seed": seed, "temperature": temperature, "row_offset": row_offset, **options}
    for name, value in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if value is not None:
            sample_options[name] = value
    if torch.compiler.is_compiling():
        return _eagerly("sample", (logits,), sample_options)
    return pipeline.ids("sample", logits, sample_options)


@torch.compiler.disable  # inside a compiled function: a graph break, the call runs eagerly
def _eagerly(op: str, tensors: tuple, options: dict[str, Any]) -> Tensor:
    # (the decorator's own cost is paid only when compiling)
    return pipeline.run(op, tensors, options)
