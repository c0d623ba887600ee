"""Megatron-core: ``GPTModel``'s language-model loss through vtp.

Megatron's ``LanguageModule.compute_language_model_loss(labels, logits)`` takes labels
``[b, s]`` and the output layer's logits ``[s, b, V_local]`` (sequence first, this rank's
vocabulary shard), transposes the labels to ``[s, b]``, runs its vocabulary-parallel cross
entropy and transposes the per-token loss back to ``[b, s]``. ``VtpLanguageModelLossMixin``
in front of ``GPTModel`` (or any ``LanguageModule``) overrides that method with
``language_model_loss``; the rest of Megatron (loss masks, reductions, pipeline stages) is
unchanged. This module does not import Megatron.
"""

from __future__ import annotations

from typing import Any

import torch

import vtp_runtime as vtp


def language_model_loss(labels: torch.Tensor, logits: torch.Tensor, tp_group: Any = None) -> torch.Tensor:
    """Per-token cross entropy ``[b, s]`` (fp32, identical on every TP rank) of Megatron's
    ``[s, b, V_local]`` logits against ``[b, s]`` labels: the shards in rank order, as
    Megatron's ``ColumnParallelLinear`` leaves them. A label -100 gives 0 (Megatron has no
    ignore index; it masks afterwards)."""
    return vtp.cross_entropy(logits, labels.transpose(0, 1), tp_group=tp_group).transpose(0, 1).contiguous()


class VtpLanguageModelLossMixin:
    """``class GPTModel(VtpLanguageModelLossMixin, megatron.core.models.gpt.GPTModel)``:
    ``compute_language_model_loss`` through ``language_model_loss`` on the model's TP group
    (``pg_collection.tp`` where the model has one, else ``parallel_state``'s)."""

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        collection = getattr(self, "pg_collection", None)
        group = getattr(collection, "tp", None)
        if group is None:
            from megatron.core import parallel_state

            group = parallel_state.get_tensor_model_parallel_group()
        return language_model_loss(labels, logits, group)
