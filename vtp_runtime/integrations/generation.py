"""transformers' ``model.generate()`` on a model whose ``lm_head`` is sharded over the vocabulary.

With the head split over the vocabulary and its output not gathered (transformers'
``tp_plan={"lm_head": "colwise"}``, DeepSpeed AutoTP's vocabulary-parallel head, a head split
by hand), each rank's logits are its own shard: ``generate()``'s softmax and
``torch.multinomial`` (or ``argmax``) then pick a *local* id on every rank, and the ranks
drift apart. One line makes it pick with ``vtp.sample`` / ``vtp.argmax`` instead -- global ids,
the same on every rank, the logits never gathered; greedy decoding gives the ids of the
unsharded model::

    model = AutoModelForCausalLM.from_pretrained(
        name, distributed_config=DistributedConfig(tp_plan={"lm_head": "colwise"}))
    use_vocab_parallel_sampling(model)      # or: with vocab_parallel_sampling(model): ...
    out = model.generate(ids, do_sample=True, top_p=0.9, max_new_tokens=64)

How. ``generate()`` builds its logits processors once per call (``_get_logits_processor``);
on this model that method is wrapped so that the list holds, instead of the sampling
warpers (temperature, top-k, top-p, min-p), one processor that draws the token itself and
returns scores that are 0 at the drawn global id and ``-inf`` elsewhere (``[batch, V]``);
with ``do_sample=True`` the call's own copy of the generation config is switched to greedy
decoding once the processors are built, so transformers' loop takes that id with its
``argmax`` instead of drawing it again with a softmax and a ``multinomial``. Everything else
of the decoding loop (stopping, padding, caches, streamers, ``torch.compile`` of the
forward) is transformers' own. The selector runs between forwards, eagerly; beyond vtp's
draw (whose host reads ``vtp_runtime.sampling`` lists) it adds two kernels a step, the
scores' fill and the drawn id's write, and reads nothing on the host.

Which logits. At each step the processor looks at the scores it gets: a DTensor, or a
plain tensor as wide as this rank's shard of a head split over a TP group of more than one
rank, is a shard (``vtp.sample`` on the shards); anything else holds the whole vocabulary
on every rank (a head that gathers its output, TP=1), and ``vtp.sample`` runs on it as it
is. So the same line is right on any head, and a draw depends on the global logits, the
seed and the row only: one seed gives the same tokens at any TP size and head layout.

Seeds. Step ``t`` of a call (the sequence length so far) draws with seed
``base * 2**32 + t``; ``base`` is ``seed=`` if given, else drawn once per ``generate()`` from
torch's default generator on the first rank of the TP group and broadcast (so
``torch.manual_seed`` before ``generate()`` makes a run repeatable, and the ranks agree
even where their generators differ).

Other logits processors (repetition penalty, bad words, min length, ...) index the full
vocabulary: on logits that hold it they run first, as in transformers; on shards they are
refused with a ValueError at the first step. Beam search (``num_beams > 1``) is refused
before any step. ``output_scores`` holds the one-hot scores.

Without it, a generation on a vocabulary-sharded head is wrong silently;
``warn_on_sharded_generation(model)`` makes ``generate()`` warn once where the logits it
gets are a shard (``fuse_lm_head`` and ``use_vocab_parallel_loss`` call it on a head split
over the vocabulary). With the sampler off, a model whose head holds the whole vocabulary
(a plain weight with a row for every id) decodes with exactly transformers' processors.
This module does not import transformers.
"""

from __future__ import annotations

import contextlib
import copy
import math
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import vtp_runtime as vtp
from vtp_runtime.comm import group_size

from .lm_head import is_vocab_parallel_linear, lm_head_layout
from .tensor_parallel import is_dtensor

_STATE = "_vtp_generation"


class _Hook:
    """What a model's wrapped ``_get_logits_processor`` knows: whether vocabulary-parallel
    sampling is on, the head's layout, the seed, and whether it has warned."""

    def __init__(self, original) -> None:
        self.original = original
        self.enabled = False
        self.layout: dict[str, Any] = {}
        self.vocab_size: int | None = None
        self.seed: int | None = None
        self.warned = False


def _hook(model) -> _Hook:
    hook = model.__dict__.get(_STATE)
    if hook is None:
        hook = _Hook(model._get_logits_processor)
        model.__dict__[_STATE] = hook
        model._get_logits_processor = types.MethodType(_get_logits_processor, model)
    return hook


def _head_layout(model) -> tuple[Any, int | None, int | None, int | None]:
    """``(tp_group, vocab_start, vocab_end, V)`` of the model's output head (None, ... when it
    is not split over the vocabulary; V None where the head does not say)."""
    group, start, end = lm_head_layout(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight: Any = getattr(head, "weight", None)
    size = None
    if is_dtensor(weight):
        size = int(weight.shape[0])  # a DTensor's shape is the global one
    elif head is not None and is_vocab_parallel_linear(head):
        size = int(head.vocab_size)
    return group, start, end, size


def _global_vocab(model, vocab_size: int | None = None) -> int:
    if vocab_size is not None:
        return vocab_size
    head_vocab = _head_layout(model)[3]
    return head_vocab if head_vocab is not None else int(model.config.get_text_config().vocab_size)


def use_vocab_parallel_sampling(
    model,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_end: int | None = None,
    vocab_size: int | None = None,
    seed: int | None = None,
):
    """Make ``model.generate()`` pick each token with ``vtp.sample`` (``do_sample=True``) or
    ``vtp.argmax`` (greedy) on the head's vocabulary shards. Returns ``model``.

    Without layout arguments it comes from the model's head (as for
    ``use_vocab_parallel_loss``: a DTensor weight, DeepSpeed AutoTP's head). For a head split
    by hand pass ``tp_group`` (and ``vocab_start``/``vocab_end`` unless the shards are in
    rank order) and ``vocab_size`` (the global V; default ``model.config.vocab_size``).
    Logits that hold the whole vocabulary (a head that gathers its output, TP=1) are
    sampled as they are, other logits processors first. ``seed``: the base of every
    step's seed, the same on every rank (default: a new one per ``generate()`` call from
    torch's generator on the group's first rank, broadcast).
    """
    hook = _hook(model)
    if tp_group is None and vocab_start is None and vocab_end is None:
        tp_group, vocab_start, vocab_end, head_vocab = _head_layout(model)
        vocab_size = vocab_size if vocab_size is not None else head_vocab
    hook.layout = {"tp_group": tp_group, "vocab_start": vocab_start, "vocab_end": vocab_end}
    hook.vocab_size = vocab_size
    hook.seed = seed
    hook.enabled = True
    return model


def is_vocab_parallel_sampling(model) -> bool:
    """Whether ``use_vocab_parallel_sampling`` is in effect on ``model``."""
    hook = model.__dict__.get(_STATE)
    return hook is not None and hook.enabled


@contextlib.contextmanager
def vocab_parallel_sampling(model, **kwargs: Any) -> Iterator[Any]:
    """``use_vocab_parallel_sampling(model, **kwargs)`` inside the block only."""
    hook = _hook(model)
    saved = (hook.enabled, hook.layout, hook.vocab_size, hook.seed)
    use_vocab_parallel_sampling(model, **kwargs)
    try:
        yield model
    finally:
        hook.enabled, hook.layout, hook.vocab_size, hook.seed = saved


def warn_on_sharded_generation(model):
    """Make ``model.generate()`` warn (once per model) where vocabulary-parallel sampling is
    off and the logits it gets are a shard of the vocabulary: a DTensor sharded over it, or
    narrower than the global V (the head's, else ``config.vocab_size``). Returns ``model``."""
    _hook(model)
    return model


_WARNING = (
    "generate() on a model whose lm_head returns this rank's shard of the vocabulary ({what}): every rank picks "
    "a token from its own shard of the logits (a local id, different on every rank). Call "
    "vtp_runtime.integrations.generation.use_vocab_parallel_sampling(model) first (TRL's VocabParallelGRPOTrainer, "
    "VocabParallelRLOOTrainer and VocabParallelGKDTrainer do)"
)


def _get_logits_processor(self, generation_config=None, *args: Any, **kwargs: Any) -> Any:
    hook: _Hook = self.__dict__[_STATE]
    if generation_config is None:
        generation_config = args[0]
        args = args[1:]
    if not hook.enabled:
        processors = hook.original(generation_config, *args, **kwargs)
        if not hook.warned and not _holds_the_vocabulary(self):  # nothing to watch for on such a head
            processors.append(_shard_check(self, hook))
        return processors
    _check_supported(generation_config)
    plain = copy.copy(generation_config)
    plain.do_sample = False  # no sampling warpers: the selector below does their work
    processors = hook.original(plain, *args, **kwargs)
    others = type(processors)(processors)  # run first where the logits hold the whole vocabulary
    processors.clear()
    processors.append(_selector(self, hook, generation_config, kwargs.get("device"), others))
    if generation_config.do_sample and "model_kwargs" in kwargs:
        # generate()'s own copy of the config, which its decoding loop reads next: the selector
        # has drawn the token, so the loop's argmax of the one-hot scores takes it, where its
        # softmax + multinomial would draw it a second time. (Continuous batching passes the
        # config alone, and may pass the model's own: that one is left as it is.)
        generation_config.do_sample = False
    return processors


def _holds_the_vocabulary(model) -> bool:
    """Whether the model's head gives every rank the logits of the whole vocabulary: a weight
    that is a plain tensor (not a DTensor, not DeepSpeed's vocabulary-parallel head) with a
    row for every id."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if head is None or not isinstance(weight, torch.Tensor) or is_dtensor(weight) or is_vocab_parallel_linear(head):
        return False
    return weight.shape[0] >= _global_vocab(model)


def _shard_check(model, hook: _Hook):
    from transformers import LogitsProcessor

    vocab = _global_vocab(model)

    class VocabShardCheck(LogitsProcessor):
        """Warns (once per model) where the scores are a shard of the vocabulary; changes nothing."""

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if hook.warned:
                return scores
            what = None
            if is_dtensor(scores):
                if any(p.is_shard() for p in scores.placements):  # type: ignore[attr-defined]
                    what = "DTensor logits sharded over it"
            elif scores.shape[-1] < vocab:
                what = f"{scores.shape[-1]} of {vocab} ids"
            if what is not None:
                hook.warned = True
                warnings.warn(_WARNING.format(what=what), RuntimeWarning, stacklevel=2)
            return scores

    return VocabShardCheck()


def _check_supported(cfg) -> None:
    if (getattr(cfg, "num_beams", 1) or 1) > 1:
        raise ValueError("vocabulary-parallel generation does not do beam search (num_beams > 1)")
    if not cfg.do_sample:
        return
    unsupported = [
        f"{name}={getattr(cfg, name)}"
        for name, off in (("typical_p", 1.0), ("epsilon_cutoff", 0.0), ("eta_cutoff", 0.0), ("top_h", None))
        if getattr(cfg, name, off) not in (off, None)
    ]
    if unsupported:
        raise ValueError(
            f"vocabulary-parallel sampling takes temperature, top_k, top_p and min_p; not {', '.join(unsupported)}"
        )


def _base_seed(hook: _Hook, device) -> int:
    if hook.seed is not None:
        return hook.seed
    base = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    group: Any = hook.layout.get("tp_group")
    if group_size(group) > 1:  # every rank takes the first rank's draw
        where = torch.device(device) if device is not None else torch.device("cpu")
        agreed = base.to(where)
        dist.broadcast(agreed, src=dist.get_global_rank(group, 0), group=group)
        base = agreed.cpu()
    return int(base.item())


def _selector(model, hook: _Hook, cfg, device, others):
    from transformers import LogitsProcessor

    sample = bool(cfg.do_sample)
    options: dict[str, Any] = {}
    if sample:
        t = cfg.temperature if cfg.temperature is not None else 1.0
        options = {
            "temperature": float(t),
            "top_k": cfg.top_k if cfg.top_k else None,
            "top_p": cfg.top_p if cfg.top_p is not None and cfg.top_p < 1.0 else None,
            "min_p": cfg.min_p if cfg.min_p else None,
        }
    layout = dict(hook.layout)
    vocab = _global_vocab(model, hook.vocab_size)
    base = _base_seed(hook, device) if sample else 0

    def shard_options(scores: torch.Tensor) -> dict[str, Any] | None:
        """The op keywords where ``scores`` is this rank's shard; None where it holds the
        whole vocabulary."""
        if is_dtensor(scores):
            return {}  # it carries its layout
        width = scores.shape[-1]
        start, end = layout.get("vocab_start"), layout.get("vocab_end")
        if group_size(layout.get("tp_group")) <= 1:
            return None
        if start is None or end is None or end - start == width:
            return {**layout, "global_vocab_size": vocab}
        if width == vocab:
            return None  # the head gathered its output
        raise ValueError(
            f"the logits have {width} vocabulary entries: neither this rank's shard of the head, ids "
            f"[{start}, {end}), nor the whole vocabulary ({vocab})"
        )

    class VocabParallelTokenSelector(LogitsProcessor):
        """Draws the next token of every row on the vocabulary shards; scores 0 there, -inf elsewhere."""

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            kw = shard_options(scores)
            if kw is None:
                kw = {}
                scores = others(input_ids, scores)
                width = scores.shape[-1]
            elif len(others):
                names = ", ".join(type(p).__name__ for p in others)
                raise ValueError(
                    f"vocabulary-parallel generation on a sharded head takes no other logits processors ({names}): "
                    f"they index the full vocabulary, which each rank holds only a shard of. Remove them from the "
                    f"call and generation_config"
                )
            else:
                width = vocab
            if sample:
                ids = vtp.sample(scores, seed=base * 2**32 + input_ids.shape[-1], **options, **kw)
            else:
                ids = vtp.argmax(scores, **kw)
            if is_dtensor(ids):
                ids = ids.to_local()  # type: ignore[attr-defined]  # replicated over the vocabulary
            out = torch.full((ids.shape[0], width), -math.inf, dtype=torch.float32, device=ids.device)
            return out.scatter_(1, ids[:, None], 0.0)

    return VocabParallelTokenSelector()
