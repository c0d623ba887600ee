"""TRL: GKD's generalized JSD loss on vocabulary-sharded logits, with TRL's reductions.

One changed line for a ``GKDTrainer`` user::

    from vtp_runtime.integrations.trl import VocabParallelGKDTrainer as GKDTrainer

``VocabParallelGKDTrainer`` is TRL's ``GKDTrainer`` with ``VocabParallelGKDMixin`` in front:
its loss runs through ``vtp_runtime`` on the heads' vocabulary shards (group and bounds
read from the student's ``lm_head``), everything else is TRL's. This module imports trl
only when ``VocabParallelGKDTrainer`` is first used.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import vtp_runtime as vtp

from .tensor_parallel import VocabShard, _group_size, is_dtensor, vocab_shard
from .transformers import lm_head_layout

REDUCTIONS = ("batchmean", "sum", "mean", "none")


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    num_items_in_batch: torch.Tensor | int | None = None,
    tp_group=None,
    *,
    vocab_start: int | None = None,
    vocab_end: int | None = None,
) -> torch.Tensor:
    """TRL's ``GKDTrainer.generalized_jsd_loss`` on vocabulary shards: fp32, identical on
    every rank of the TP group, gradients to the student (and to the teacher if it requires
    grad).

    ``student_logits``, ``teacher_logits``: ``[batch, seq, V_local]`` local shards laid out
    alike (with ``tp_group``, and ``vocab_start``/``vocab_end`` unless in rank order), or
    DTensors sharded on their last dimension. ``labels``: ``[batch, seq]``, tokens with
    label -100 count for nothing. ``beta=0`` is KL(teacher||student), ``beta=1``
    KL(student||teacher); both logits are divided by ``temperature`` (no T² factor).

    Reductions, as TRL's: ``num_items_in_batch`` (int or tensor) given: sum / it, whatever
    ``reduction`` says. Otherwise ``"batchmean"``: sum / counted tokens with labels (0 when
    none), sum / batch size (``logits.shape[0]``) without; ``"sum"``; ``"mean"``: sum /
    (tokens × global V), tokens being the counted ones with labels (0 when none, where TRL
    gives NaN). ``"none"``: per-token ``[batch, seq]`` values, 0 at ignored tokens (TRL
    returns per-vocabulary-entry values, ``[..., V]``, of which these are the sums).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}; got {reduction!r}")
    student = vocab_shard(student_logits, tp_group, vocab_start, vocab_end)
    teacher = vocab_shard(teacher_logits, tp_group, vocab_start, vocab_end)
    layout = student.options()
    if layout["global_vocab_size"] is None:
        layout["global_vocab_size"] = teacher.vocab_size

    def jsd(reduction_: str, normalizer=None) -> torch.Tensor:
        return vtp.jsd(
            student.logits,
            teacher.logits,
            beta=beta,
            labels=labels,
            temperature=temperature,
            reduction=reduction_,
            normalizer=normalizer,
            **layout,
        )

    if num_items_in_batch is not None:
        return jsd("sum", num_items_in_batch)
    if reduction == "batchmean":
        return jsd("mean") if labels is not None else jsd("sum", max(student.logits.shape[0], 1))
    if reduction == "sum":
        return jsd("sum")
    if reduction == "none":
        return jsd("none")
    # "mean": TRL averages over every (token, vocabulary entry) pair of the full logits
    tokens = (labels != -100).sum().clamp(min=1) if labels is not None else student.logits.shape[:-1].numel()
    return jsd("sum") / (tokens * _global_vocab_size(student))


def _global_vocab_size(shard: VocabShard) -> int | torch.Tensor:
    if shard.vocab_size is not None:
        return shard.vocab_size
    if _group_size(shard.tp_group) == 1:
        return shard.logits.shape[-1]
    size = torch.tensor([shard.logits.shape[-1]], dtype=torch.int64, device=shard.logits.device)
    dist.all_reduce(size, group=shard.tp_group)
    return size[0]


class VocabParallelGKDMixin:
    """Put in front of TRL's ``GKDTrainer`` (``class T(VocabParallelGKDMixin, GKDTrainer)``):
    its ``generalized_jsd_loss`` runs through ``vtp_runtime``, on the vocabulary layout of
    the student's ``lm_head`` (see ``lm_head_layout``; a teacher must be sharded alike).
    Set ``vtp_layout = (tp_group, vocab_start, vocab_end)`` on the trainer for a head split
    by hand.
    """

    vtp_layout: tuple | None = None

    def generalized_jsd_loss(
        self,
        student_logits,
        teacher_logits,
        labels=None,
        beta=0.5,
        temperature=1.0,
        reduction="batchmean",
        num_items_in_batch=None,
    ):
        if self.vtp_layout is None:
            self.vtp_layout = lm_head_layout(self.model)
        group, start, end = self.vtp_layout
        if group is None or is_dtensor(student_logits):
            group = start = end = None  # a full vocabulary, or DTensors that carry their layout
        return generalized_jsd_loss(
            student_logits,
            teacher_logits,
            labels,
            beta,
            temperature,
            reduction,
            num_items_in_batch,
            group,
            vocab_start=start,
            vocab_end=end,
        )


def _gkd_trainer():
    try:
        from trl.experimental.gkd import GKDTrainer  # where newer trl keeps it
    except ImportError:
        from trl import GKDTrainer
    return GKDTrainer


def __getattr__(name: str):
    # built on first use so that importing this module does not import trl
    if name == "VocabParallelGKDTrainer":
        cls = type(
            "VocabParallelGKDTrainer",
            (VocabParallelGKDMixin, _gkd_trainer()),
            {
                "__module__": __name__,
                "__doc__": "TRL's GKDTrainer with its loss on vocabulary shards (VocabParallelGKDMixin).",
            },
        )
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
