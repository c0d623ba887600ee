"""vtp_runtime: exact vocabulary-parallel losses on logits sharded over the vocabulary.

import vtp_runtime as vtp
loss = vtp.loss("jsd", student_logits, teacher_logits, beta=0.3, tp_group=group)
loss = vtp.cross_entropy(vtp.Head(hidden, weight_shard), labels, reduction="mean", tp_group=group)
next_ids = vtp.sample(logits, seed=step, top_p=0.9, tp_group=group)  # global ids, the same on every rank
"""

from .api import argmax, cross_entropy, entropy, explain, jsd, kl, logprobs, loss, sample
from .backend import Backend, Call, Compiles, HeadSupport, OpCapability, Reduces, Request, SavedState, TakesHead
from .dispatch import Explanation, use_backend
from .errors import BackendUnavailable, PluginError, ShardError, UnknownBackend, VtpError
from .head import Head
from .nn import VocabParallelHead
from .ops import FEATURES, OPS
from .registry import hookimpl, register
from .topk import TopK

__version__ = "0.1.0"

__all__ = [
    "loss",
    "cross_entropy",
    "logprobs",
    "entropy",
    "kl",
    "jsd",
    "argmax",
    "sample",
    "explain",
    "use_backend",
    "Head",
    "VocabParallelHead",
    "TopK",
    "Explanation",
    "Backend",
    "Call",
    "OpCapability",
    "TakesHead",
    "HeadSupport",
    "Compiles",
    "Reduces",
    "Request",
    "SavedState",
    "FEATURES",
    "OPS",
    "hookimpl",
    "register",
    "VtpError",
    "ShardError",
    "BackendUnavailable",
    "UnknownBackend",
    "PluginError",
]
