"""The public API: ``loss`` and the typed helpers, ``explain``.

Each function states its shapes, dtypes and what is replicated across ranks, and hands the
call to the pipeline (``vtp_runtime.pipeline``), which checks it, plans it (gathering the
metadata of every rank on the first call of a signature), runs the chosen backend under one
autograd node and reduces the result; ``docs/architecture.md`` draws the whole flow.
"""

from __future__ import annotations

from typing import Any

import torch

from . import dispatch, head, pipeline, topk

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
    """
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
