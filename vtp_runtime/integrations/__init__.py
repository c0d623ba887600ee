"""Adapters that let training frameworks use ``vtp_runtime``'s losses with one changed line.

- ``vtp_runtime.integrations.transformers``: ``fuse_lm_head(model)`` (the head fused into the
  loss: no logits), ``apply_fused_lm_head(model_type)`` (the same for every model of a class
  built afterwards), ``use_vocab_parallel_loss(model)`` and the causal-LM loss behind it
  (transformers' ``tp_plan``, DeepSpeed AutoTP's vocabulary-parallel head, FSDP2 × TP).
- ``vtp_runtime.integrations.lm_head``: how a model's head is fused (``HeadLogits``).
- ``vtp_runtime.integrations.trl``: ``VocabParallel<X>Trainer`` for TRL's SFT, DPO, KTO,
  GRPO, RLOO and GKD trainers, ``add_fused_lm_head``, ``generalized_jsd_loss``.
- ``vtp_runtime.integrations.torchtitan``: ``VtpCrossEntropyLoss``, ``compute_logprobs``.
- ``vtp_runtime.integrations.megatron``: ``VtpLanguageModelLossMixin`` for ``GPTModel``.
- here: ``copy_to_tp_region`` for heads split by hand; ``vocab_shard`` (deprecated: DTensor
  logits go to the ops as they are).

The adapters hold no loss math: they translate conventions and call ``vtp_runtime``'s ops.
Importing them does not import the frameworks.
"""

from .tensor_parallel import VocabShard, copy_to_tp_region, vocab_shard

__all__ = ["VocabShard", "copy_to_tp_region", "vocab_shard"]
