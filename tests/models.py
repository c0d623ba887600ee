"""The tiny transformers model the integration tests build: a one-layer Llama whose LM head
is not tied to its embeddings (so the head can be sharded on its own)."""

from __future__ import annotations

from typing import Any


def tiny_llama_config(vocab_size: int, hidden_size: int = 32, **overrides: Any):
    """A ``LlamaConfig`` of one layer, 4 attention heads on 2 key-value heads, an MLP twice as
    wide as ``hidden_size``, untied embeddings; ``overrides`` replace any of those."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**{**fields, **overrides})
