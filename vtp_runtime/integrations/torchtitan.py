"""torchtitan (0.3.0): its loss-parallel cross entropy and its RL log-probs through vtp.

In a torchtitan config, one changed line::

    config.loss = VtpCrossEntropyLoss.Config(global_vocab_size=model_config.vocab_size)

``VtpCrossEntropyLoss`` is torchtitan's ``CrossEntropyLoss`` (a ``BaseLoss``: the summed
loss divided by ``global_valid_tokens``) with ``cross_entropy_loss`` below as its function;
``compute_logprobs`` replaces ``torchtitan.components.loss.compute_logprobs``, which gathers
the whole vocabulary on every rank. Both take the logits in each of torchtitan's forms:

- ``spmd_types`` (torchtitan 0.3.0's default backend): plain local logits ``[b, s, V_local]``
  of this rank's ``torch.chunk`` shard; the TP group is the ``"tp"`` dimension of
  torchtitan's current SPMD mesh and ``global_vocab_size`` the full V;
- DTensor logits sharded on the vocabulary (``partial_dtensor``/``full_dtensor``), with
  plain labels, or with DTensor labels on a (dp, tp) mesh (the result then a DTensor:
  ``Partial`` over the batch-sharded dimensions, as torchtitan's own);
- a full vocabulary (no TP).

This module imports torchtitan when ``VtpCrossEntropyLoss`` is first used, and where a
plain tensor meets torchtitan's SPMD mesh.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

import vtp_runtime as vtp

from . import lm_head as heads
from .tensor_parallel import is_dtensor

IGNORE_INDEX = -100  # torchtitan's


def _spmd_tp_group() -> Any:
    """The TP group of torchtitan's current SPMD mesh, or None (no mesh, or TP of one)."""
    if "torchtitan" not in sys.modules:  # a mesh exists only once torchtitan runs
        return None
    from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size

    if spmd_mesh_size("tp") <= 1:
        return None
    mesh = current_spmd_mesh()
    assert mesh is not None  # spmd_mesh_size found the "tp" axis on it
    return mesh.get_group("tp")


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor, *, global_vocab_size: int | None = None) -> Any:
    """torchtitan's ``cross_entropy_loss``: the fp32 sum over tokens of the cross entropy of
    ``pred`` ``[b, s, V(_local)]`` against global ``labels`` ``[b, s]`` (-100: ignored),
    identical on every TP rank. A DTensor ``pred`` with plain labels gives a plain tensor;
    with DTensor labels, a DTensor placed as torchtitan's. ``global_vocab_size``: the full V,
    checked, for local shards."""
    if is_dtensor(pred):
        loss = vtp.cross_entropy(pred, labels, reduction="sum")
        return loss if is_dtensor(labels) else heads.local(loss)
    group = _spmd_tp_group()
    return vtp.cross_entropy(
        pred,
        labels,
        reduction="sum",
        tp_group=group,
        global_vocab_size=global_vocab_size if group is not None else None,
    )


def compute_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, return_entropy: bool = False) -> Any:
    """torchtitan's ``compute_logprobs``: per-token ``log p[label]`` ``[b, s]`` (0 at -100,
    with no gradient there) and, with ``return_entropy``, each token's entropy ``[b, s]``
    (every token, masked or not, without gradient, as torchtitan's), from one read of the
    vocabulary shards: nothing is gathered. fp32 plain tensors, identical on every TP rank."""
    group = None if is_dtensor(logits) else _spmd_tp_group()
    mask = labels != IGNORE_INDEX
    index = labels.masked_fill(~mask, 0) if return_entropy else labels  # the entropy of every token
    if is_dtensor(index) or is_dtensor(logits):
        out = vtp.logprobs(logits, index, return_entropy=return_entropy)
    else:
        out = vtp.logprobs(logits, index, return_entropy=return_entropy, tp_group=group)
    if not return_entropy:
        return heads.local(out)
    logprobs, entropy = (heads.local(t) for t in out)
    return logprobs.masked_fill(~mask, 0), entropy.detach()


def _loss_class():
    from dataclasses import dataclass

    from torchtitan.components.loss import CrossEntropyLoss

    class VtpCrossEntropyLoss(CrossEntropyLoss):
        """torchtitan's ``CrossEntropyLoss`` computed by vtp_runtime on the vocabulary shards
        (``vtp_runtime.integrations.torchtitan.cross_entropy_loss``)."""

        @dataclass(kw_only=True, slots=True)
        class Config(CrossEntropyLoss.Config):
            pass

        def __init__(self, config: Any, *, compile_config: Any = None) -> None:
            self.fn = cross_entropy_loss
            self._maybe_compile(compile_config)
            self.global_vocab_size = config.global_vocab_size

    VtpCrossEntropyLoss.__module__ = __name__
    return VtpCrossEntropyLoss


def __getattr__(name: str):
    # built on first use so that importing this module does not import torchtitan
    if name == "VtpCrossEntropyLoss":
        cls = _loss_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
