"""Hugging Face transformers: a causal-LM loss for a vocabulary-sharded ``lm_head``.

One added line after loading a model whose ``lm_head`` is split over the vocabulary
without gathering its output (transformers' ``tp_plan={"lm_head": "colwise"}``, or
DeepSpeed AutoTP's ``vocab_parallel_lm_head``)::

    model = AutoModelForCausalLM.from_pretrained(
        name, distributed_config=DistributedConfig(tp_plan={"lm_head": "colwise"}))
    use_vocab_parallel_loss(model)              # model(labels=...) / Trainer now use it

The default plan of most models, ``"colwise_gather_output"``, gathers the full ``[..., V]``
logits on every rank before the loss: correct, but it saves nothing. This module does not
import transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import vtp_runtime as vtp

from .tensor_parallel import VocabShard, dtensor_vocab_layout, is_dtensor, vocab_shard


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    vocab_size: int | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    *,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_end: int | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on vocabulary-sharded logits: a fp32 scalar,
    identical on every rank of the TP group.

    ``logits``: ``[batch, seq, V_local]`` (any float dtype; not upcast), a local shard with
    ``tp_group`` (and ``vocab_start``/``vocab_end`` when the shards are not in rank order),
    or a DTensor sharded on its last dimension. ``labels``: ``[batch, seq]`` global ids,
    shifted here (position i predicts label i+1; the last position predicts nothing), or
    ``shift_labels`` already shifted. ``ignore_index`` labels count for nothing. Without
    ``num_items_in_batch`` the mean over counted tokens (0 when there are none); with it
    (int or tensor) their sum divided by it. ``vocab_size`` (what models pass) is checked
    against the global vocabulary. Other keywords models pass are ignored, as transformers does.
    """
    shard = vocab_shard(logits, tp_group, vocab_start, vocab_end)
    if shift_labels is None:
        if labels is None:
            raise ValueError("causal_lm_loss needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    _check_not_gathered(shard)
    return vtp.cross_entropy(
        shard.logits,
        shift_labels.to(shard.logits.device),
        ignore_index=ignore_index,
        reduction="mean" if num_items_in_batch is None else "sum",
        normalizer=num_items_in_batch,
        tp_group=shard.tp_group,
        vocab_start=shard.vocab_start,
        vocab_end=shard.vocab_end,
        global_vocab_size=shard.vocab_size if shard.vocab_size is not None else vocab_size,
    )


def _check_not_gathered(shard: VocabShard) -> None:
    if (
        shard.vocab_start is not None
        and shard.vocab_end is not None
        and shard.logits.shape[-1] != shard.vocab_end - shard.vocab_start
    ):
        raise ValueError(
            f"the logits have {shard.logits.shape[-1]} vocabulary entries, but this rank's lm_head holds ids "
            f"[{shard.vocab_start}, {shard.vocab_end}): its output is gathered. Load the model with "
            f"tp_plan={{'lm_head': 'colwise'}} (not the default 'colwise_gather_output') so each rank keeps "
            f"its shard of the logits"
        )


class VocabParallelCausalLMLoss:
    """``causal_lm_loss`` bound to one vocabulary layout: assign it to ``model.loss_function``.

    ``tp_group``, ``vocab_start``, ``vocab_end``: the layout of the head's local logits
    (None, None, None for a full vocabulary or a DTensor output). One instance serves any
    number of calls and models with that layout (a student and its teacher, for instance).
    """

    def __init__(self, tp_group=None, vocab_start: int | None = None, vocab_end: int | None = None):
        self.tp_group, self.vocab_start, self.vocab_end = tp_group, vocab_start, vocab_end

    def __call__(
        self,
        logits,
        labels=None,
        vocab_size=None,
        num_items_in_batch=None,
        ignore_index=-100,
        shift_labels=None,
        **kwargs,
    ) -> torch.Tensor:
        if is_dtensor(logits):
            return causal_lm_loss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels)
        return causal_lm_loss(
            logits,
            labels,
            vocab_size,
            num_items_in_batch,
            ignore_index,
            shift_labels,
            tp_group=self.tp_group,
            vocab_start=self.vocab_start,
            vocab_end=self.vocab_end,
        )

    def __repr__(self) -> str:
        return (
            f"VocabParallelCausalLMLoss(tp_group={self.tp_group!r}, vocab_start={self.vocab_start}, "
            f"vocab_end={self.vocab_end})"
        )


def lm_head_layout(model) -> tuple[object, int | None, int | None]:
    """``(tp_group, vocab_start, vocab_end)`` of a model's output head on this rank.

    Read from the head's weight when it is a DTensor sharded over the vocabulary
    (transformers' ``tp_plan``), or from DeepSpeed AutoTP's vocabulary-parallel head
    (``mp_group``, ``vocab_start_index``, ``vocab_end_index``); ``(None, None, None)`` for a
    head that is not split over the vocabulary.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None, None, None
    if getattr(head, "is_vocab_parallel_lm_head", False):  # DeepSpeed AutoTP's VocabParallelLinear
        return head.mp_group, int(head.vocab_start_index), int(head.vocab_end_index)
    weight = getattr(head, "weight", None)
    if is_dtensor(weight):
        group, start, end, _ = dtensor_vocab_layout(weight, 0)  # weight: [V, hidden]
        if group is not None:
            return group, start, end
    return None, None, None


def use_vocab_parallel_loss(model, tp_group=None, vocab_start: int | None = None, vocab_end: int | None = None):
    """Make ``model(labels=...)`` (and so transformers' ``Trainer``) compute its causal-LM
    loss with ``vtp_runtime`` on the head's vocabulary shards. Returns ``model``.

    Without arguments the layout comes from the model's head (``lm_head_layout``). Pass
    ``tp_group`` (and ``vocab_start``/``vocab_end`` unless the shards are in rank order) for
    a head you split yourself, and put ``copy_to_tp_region`` before it.
    """
    if tp_group is None and vocab_start is None and vocab_end is None:
        tp_group, vocab_start, vocab_end = lm_head_layout(model)
    model.loss_function = VocabParallelCausalLMLoss(tp_group, vocab_start, vocab_end)
    return model
