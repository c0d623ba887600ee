"""Adapters that let training frameworks use ``vtp_runtime``'s losses with one changed line.

- ``vtp_runtime.integrations.transformers``: ``use_vocab_parallel_loss(model)`` and the
  causal-LM loss behind it (transformers' ``tp_plan``, DeepSpeed AutoTP's vocabulary-parallel head).
- ``vtp_runtime.integrations.trl``: ``generalized_jsd_loss`` with TRL's reductions and
  ``VocabParallelGKDTrainer``.
- here: ``copy_to_tp_region`` for heads split by hand, ``vocab_shard`` for DTensor logits.

The adapters hold no loss math: they translate conventions and call ``vtp_runtime``'s ops.
Importing them does not import the frameworks.
"""

from .tensor_parallel import VocabShard, copy_to_tp_region, vocab_shard

__all__ = ["VocabShard", "copy_to_tp_region", "vocab_shard"]
