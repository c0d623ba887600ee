"""Hugging Face transformers: the LM head fused into the loss, and a causal-LM loss for
vocabulary-sharded logits.

One added line, like Liger's ``apply_liger_kernel_to_llama``::

    fuse_lm_head(model)          # model(labels=...) and Trainer: the loss straight from the hidden states

``fuse_lm_head`` patches ``model.forward`` (this instance): in training with labels, the
model's own forward runs with its head replaced by ``vtp.Head`` (see ``lm_head.py``), so the
``[tokens, V_local]`` logits are never formed and ``logits`` comes back as None; otherwise
(no labels, or ``model.eval()``, or ``skip_logits=False``) the usual logits come back. It
works on a full head, on transformers' ``tp_plan`` (``"colwise"`` and the default
``"colwise_gather_output"``), torch's ``ColwiseParallel``, DeepSpeed AutoTP's
vocabulary-parallel head, FSDP2 (with TP) and a head split by hand. ``unfuse_lm_head``
undoes it.

``apply_fused_lm_head("llama")`` (or a class, or no argument: every causal LM) is the
class-level switch, as Liger's ``apply_liger_kernel_to_llama()``: every model of that type
built afterwards comes out fused; ``revert_fused_lm_head`` undoes it.

``use_vocab_parallel_loss(model)`` keeps the logits and computes the loss on their shards.
This module does not import transformers.
"""

from __future__ import annotations

import inspect
import types
import warnings
from typing import Any

import torch
import torch.nn.functional as F

import vtp_runtime as vtp

from ..comm import group_size
from . import generation
from . import lm_head as heads
from .lm_head import lm_head_layout
from .tensor_parallel import is_dtensor


def causal_lm_loss(
    logits: Any,
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
    a DTensor sharded on its last dimension (taken as it is), or fused ``HeadLogits``.
    ``labels``: ``[batch, seq]`` global ids, shifted here (position i predicts label i+1;
    the last position predicts nothing), or ``shift_labels`` already shifted.
    ``ignore_index`` labels count for nothing. Without ``num_items_in_batch`` the mean over
    counted tokens (0 when there are none); with it (int or tensor) their sum divided by it.
    ``vocab_size`` (what models pass) is checked against the global vocabulary. Other
    keywords models pass are ignored, as transformers does.
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("causal_lm_loss needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    options: dict[str, Any] = {
        "ignore_index": ignore_index,
        "reduction": "mean" if num_items_in_batch is None else "sum",
        "normalizer": num_items_in_batch,
    }
    if isinstance(logits, heads.HeadLogits):
        head, layout = logits.vtp_inputs()
        return heads.local(vtp.cross_entropy(head, shift_labels.to(logits.device), **options, **layout))
    if is_dtensor(logits):
        if tp_group is not None or vocab_start is not None or vocab_end is not None:
            options.update(tp_group=tp_group, vocab_start=vocab_start, vocab_end=vocab_end)
    else:
        _check_not_gathered(logits, vocab_start, vocab_end)
        options.update(tp_group=tp_group, vocab_start=vocab_start, vocab_end=vocab_end, global_vocab_size=vocab_size)
    return heads.local(vtp.cross_entropy(logits, shift_labels.to(logits.device), **options))


def _check_not_gathered(logits: torch.Tensor, vocab_start: int | None, vocab_end: int | None) -> None:
    if vocab_start is not None and vocab_end is not None and logits.shape[-1] != vocab_end - vocab_start:
        raise ValueError(
            f"the logits have {logits.shape[-1]} vocabulary entries, but this rank's lm_head holds ids "
            f"[{vocab_start}, {vocab_end}): its output is gathered. Load the model with "
            f"tp_plan={{'lm_head': 'colwise'}} (not the default 'colwise_gather_output') so each rank keeps "
            f"its shard of the logits, or fuse the head (fuse_lm_head), which never forms them"
        )


class VtpCausalLMLoss:
    """``causal_lm_loss`` for a model's ``loss_function``, on the layout of its head.

    With ``head`` (the output-head module), the layout is read from it at every call (a
    DTensor weight, DeepSpeed AutoTP's head; under FSDP2 the weight is gathered only inside
    the forward); ``tp_group``, ``vocab_start``, ``vocab_end`` fix it instead (a head split
    by hand). ``gathered="full"`` takes logits as wide as the global vocabulary as a full
    vocabulary (the head gathered them); the default refuses them.
    """

    def __init__(
        self,
        tp_group=None,
        vocab_start: int | None = None,
        vocab_end: int | None = None,
        *,
        head: Any = None,
        gathered: str = "refuse",
    ) -> None:
        if gathered not in ("refuse", "full"):
            raise ValueError(f"gathered must be 'refuse' or 'full', got {gathered!r}")
        self.tp_group, self.vocab_start, self.vocab_end = tp_group, vocab_start, vocab_end
        self.head, self.gathered = head, gathered

    def layout(self) -> tuple[object, int | None, int | None]:
        if self.tp_group is not None or self.vocab_start is not None or self.head is None:
            return self.tp_group, self.vocab_start, self.vocab_end
        return heads.head_layout(self.head)

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
        if isinstance(logits, heads.HeadLogits) or is_dtensor(logits):
            return causal_lm_loss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels)
        group, start, end = self.layout()
        full = vocab_size if vocab_size is not None else (self.head.weight.shape[0] if self.head is not None else None)
        if self.gathered == "full" and start is not None and logits.shape[-1] == full:
            group = start = end = None  # the head gathered its output: every rank holds the whole vocabulary
        return causal_lm_loss(
            logits,
            labels,
            vocab_size,
            num_items_in_batch,
            ignore_index,
            shift_labels,
            tp_group=group,
            vocab_start=start,
            vocab_end=end,
        )

    def __repr__(self) -> str:
        where = (
            f"head={type(self.head).__name__}"
            if self.head is not None
            else (f"tp_group={self.tp_group!r}, vocab_start={self.vocab_start}, vocab_end={self.vocab_end}")
        )
        return f"{type(self).__name__}({where})"


class VocabParallelCausalLMLoss(VtpCausalLMLoss):
    """Deprecated name of ``VtpCausalLMLoss`` (it is also the name of DeepSpeed's own loss)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        warnings.warn(
            "VocabParallelCausalLMLoss is deprecated (DeepSpeed has a loss of that name); use VtpCausalLMLoss",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(*args, **kwargs)


def use_vocab_parallel_loss(model, tp_group=None, vocab_start: int | None = None, vocab_end: int | None = None):
    """Make ``model(labels=...)`` (and so transformers' ``Trainer``) compute its causal-LM
    loss with ``vtp_runtime`` on the head's vocabulary shards. Returns ``model``.

    The logits are still formed (``fuse_lm_head`` does without them). Without arguments the
    layout is read from the model's head at every call; pass ``tp_group`` (and
    ``vocab_start``/``vocab_end`` unless the shards are in rank order) for a head you split
    yourself, and put ``copy_to_tp_region`` before it. On a head split over the vocabulary,
    ``model.generate()`` then warns once where its logits are a shard and
    ``use_vocab_parallel_sampling`` is off (``warn_on_sharded_generation``).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if tp_group is None and vocab_start is None and vocab_end is None:
        model.loss_function = VtpCausalLMLoss(head=head)
    else:
        model.loss_function = VtpCausalLMLoss(tp_group, vocab_start, vocab_end)
    warn_on_generation_if_split(model, tp_group)
    return model


def warn_on_generation_if_split(model, tp_group=None) -> None:
    """A head split over the vocabulary: ``model.generate()`` warns once where its logits
    are a shard and vocabulary-parallel sampling is off (``generation.warn_on_sharded_generation``)."""
    group = tp_group if tp_group is not None else lm_head_layout(model)[0]
    if group_size(group) > 1:
        generation.warn_on_sharded_generation(model)


# -- the fused head ----------------------------------------------------------------------------

_STATE = "_vtp_fused_lm_head"  # the instance attribute holding what fuse_lm_head replaced


def fuse_lm_head(
    model,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_end: int | None = None,
    *,
    chunk_rows: int | None = None,
):
    """Patch ``model.forward`` so that in training with labels the causal-LM loss comes
    straight from the hidden states through ``vtp.Head``: the ``[tokens, V_local]`` logits
    are never formed, and ``output.logits`` is None. Returns ``model``.

    - When: ``model.training`` and ``labels`` (or ``shift_labels``) given, as Liger does;
      ``model(..., skip_logits=True/False)`` decides explicitly. Otherwise the model's own
      forward runs and returns its logits, with the loss (when labels are given) computed
      by ``VtpCausalLMLoss`` on their shards.
    - Layout: read from the head at every call (DTensor weight, DeepSpeed AutoTP); pass
      ``tp_group`` (and ``vocab_start``/``vocab_end``) for a plain ``nn.Linear`` holding
      this rank's rows, split by hand.
    - ``chunk_rows``: tokens per chunk of ``vtp.Head`` (default: its own rule).
    - Refuses (``ValueError``) a head that is not an ``nn.Linear`` (or DeepSpeed's
      ``VocabParallelLinear``) and final logit soft-capping (Gemma 2 and 3), before any
      forward; a forward that transforms the logits beyond a positive scalar factor raises
      ``UnfusableLogits`` at its first call.

    Generation (no labels) runs the model's own forward. On a head split over the
    vocabulary, ``model.generate()`` warns once where its logits are a shard and
    ``use_vocab_parallel_sampling`` is off (``warn_on_sharded_generation``).

    Idempotent (a second call with the same arguments changes nothing; with others it
    raises); ``unfuse_lm_head(model)`` restores the forward and the loss function. A deep
    copy of the model (a trainer's reference model) is fused and runs on its own weights.
    Tied or untied heads alike: the gradient goes to the head's weight, whichever module
    owns it.
    """
    heads.output_head(model)
    heads.check_fusable(model)
    explicit = {"tp_group": tp_group, "vocab_start": vocab_start, "vocab_end": vocab_end}
    layout = explicit if any(v is not None for v in explicit.values()) else None
    state = model.__dict__.get(_STATE)
    if state is not None:
        if state["layout"] != layout or state["chunk_rows"] != chunk_rows:
            raise ValueError(
                "fuse_lm_head was already applied to this model with other arguments; call unfuse_lm_head(model) first"
            )
        return model
    signature = inspect.signature(type(model).forward)

    def forward(self, *args, skip_logits: bool | None = None, **kwargs):
        original = _unfused_forward(self)
        try:
            labels = signature.bind_partial(self, *args, **kwargs).arguments.get("labels")
        except TypeError:  # let the model's own forward say what is wrong with the arguments
            labels = kwargs.get("labels")
        labelled = labels is not None or kwargs.get("shift_labels") is not None
        fuse = skip_logits if skip_logits is not None else (self.training and labelled)
        if not fuse:
            return original(*args, **kwargs)
        if not labelled:
            raise ValueError("skip_logits=True needs labels (or shift_labels): there would be nothing to return")
        with heads.intercepted(self, layout, chunk_rows):
            out = original(*args, **kwargs)
        return heads.without_logits(out)

    forward.__wrapped__ = type(model).forward  # type: ignore[attr-defined]  # generate() reads the signature
    model.__dict__[_STATE] = {
        "layout": layout,
        "chunk_rows": chunk_rows,
        "forward": model.__dict__.get("forward"),
        "loss_function": model.__dict__.get("_loss_function"),
        "had_loss_function": "_loss_function" in model.__dict__,
    }
    model.forward = types.MethodType(forward, model)
    model.forward.__func__._vtp_fused = True  # type: ignore[attr-defined]
    if layout is None:
        model.loss_function = VtpCausalLMLoss(head=heads.output_head(model), gathered="full")
    else:
        model.loss_function = VtpCausalLMLoss(tp_group, vocab_start, vocab_end)
    warn_on_generation_if_split(model, tp_group)
    return model


def _unfused_forward(model):
    """The forward ``fuse_lm_head`` wraps, bound to ``model`` now: the instance's own as it
    was (a copy of the model holds its copy, bound to itself), else its class's."""
    saved = model.__dict__[_STATE]["forward"]
    return saved if saved is not None else types.MethodType(type(model).forward, model)


def unfuse_lm_head(model):
    """Undo ``fuse_lm_head``: the forward and the loss function the model had. Returns
    ``model``; a model that was not fused is returned as it is."""
    state = model.__dict__.get(_STATE)
    if state is None:
        return model
    if not getattr(getattr(model.forward, "__func__", None), "_vtp_fused", False):
        raise RuntimeError(
            "model.forward was wrapped again after fuse_lm_head (by another patch); unwrap that first, "
            "so that unfuse_lm_head does not drop it"
        )
    if state["forward"] is None:
        del model.__dict__["forward"]
    else:
        model.__dict__["forward"] = state["forward"]
    if state["had_loss_function"]:
        model._loss_function = state["loss_function"]
    else:
        model.__dict__.pop("_loss_function", None)
    del model.__dict__[_STATE]
    return model


def is_fused(model) -> bool:
    """Whether ``fuse_lm_head`` is in effect on ``model``."""
    return _STATE in model.__dict__


# -- the switch: every model of a class fused as it is built ---------------------------------------

# model class (None: every causal LM) -> fuse_lm_head's keywords; filled by apply_fused_lm_head
_SWITCHED: dict[type | None, dict[str, Any]] = {}
_POST_INIT: list[Any] = []  # PreTrainedModel.post_init as transformers defines it, while the switch is on
_LEFT_UNFUSED: set[type] = set()  # classes the every-causal-LM switch could not fuse (warned once each)


def apply_fused_lm_head(*model_types: str | type, chunk_rows: int | None = None) -> None:
    """Fuse the LM head of every model of ``model_types`` built from now on, as Liger's
    ``apply_liger_kernel_to_llama()`` patches a class: whatever builds the model --
    ``from_pretrained``, ``from_config``, the Trainer's ``model_init``, a trainer loading or
    copying a reference model -- it comes out as ``fuse_lm_head(model, chunk_rows=chunk_rows)``
    would leave it (at any TP size: the head's layout is read at every call, so a
    ``tp_plan`` that shards it after construction is taken as it is).

    ``model_types``: ``model_type`` names as in a model's config (``"llama"``, ``"qwen2"``,
    ``"qwen3"``, ``"mistral"``, ``"gemma"``, ``"phi3"``: any that ``AutoModelForCausalLM``
    maps to a class), or classes (a ``*ForCausalLM`` of your own); subclasses included.
    A model of a named type whose head cannot be fused raises ``ValueError`` as it is built,
    as ``fuse_lm_head`` does. With none: every causal LM (a class ``AutoModelForCausalLM``
    maps to, or whose name ends in ``ForCausalLM``); one whose head cannot be fused (not an
    ``nn.Linear``, final logit soft-capping) is then left as it is, with a warning once per
    class.

    The hook is ``PreTrainedModel.post_init``, which every transformers model calls at the end
    of its ``__init__``. Models built before the call are unchanged (``fuse_lm_head`` them).
    Idempotent: the same call again changes nothing; another ``chunk_rows`` for a type already
    on raises ``ValueError``. ``revert_fused_lm_head`` undoes it.
    """
    keys: list[type | None] = [_model_class(t) for t in model_types] or [None]
    options = {"chunk_rows": chunk_rows}
    for key in keys:
        if key in _SWITCHED and _SWITCHED[key] != options:
            raise ValueError(
                f"apply_fused_lm_head was already called for {_switch_name(key)} with {_SWITCHED[key]}; "
                f"call revert_fused_lm_head first"
            )
    if not _POST_INIT:
        from transformers import PreTrainedModel

        _POST_INIT.append(PreTrainedModel.post_init)
        PreTrainedModel.post_init = _post_init  # type: ignore[method-assign]
    for key in keys:
        _SWITCHED[key] = options


def revert_fused_lm_head(*model_types: str | type) -> None:
    """Undo ``apply_fused_lm_head`` for ``model_types`` (none given: for every type it was
    called with): models of those types built afterwards keep their logits. Models already
    built stay fused (``unfuse_lm_head(model)`` each). Once no type is left, transformers'
    ``post_init`` is restored."""
    keys = [_model_class(t) for t in model_types] if model_types else list(_SWITCHED)
    for key in keys:
        _SWITCHED.pop(key, None)
    if not _SWITCHED and _POST_INIT:
        from transformers import PreTrainedModel

        PreTrainedModel.post_init = _POST_INIT.pop()  # type: ignore[method-assign]


def _post_init(self) -> None:
    _POST_INIT[0](self)
    switch = _switch_for(type(self))
    if switch is None or is_fused(self):
        return
    key, options = switch
    if key is not None:
        fuse_lm_head(self, **options)
    else:
        try:
            fuse_lm_head(self, **options)
        except ValueError as exc:
            if type(self) not in _LEFT_UNFUSED:
                _LEFT_UNFUSED.add(type(self))
                warnings.warn(f"apply_fused_lm_head(): {type(self).__name__} keeps its logits: {exc}", stacklevel=2)
            return
    if hasattr(self, "_get_logits_processor"):  # it generates; a tp_plan may split its head after __init__:
        generation.warn_on_sharded_generation(self)  # generate() warns where its logits come as a shard


def _switch_for(cls: type) -> tuple[type | None, dict[str, Any]] | None:
    for base in cls.__mro__:
        if base in _SWITCHED:
            return base, _SWITCHED[base]
    if None in _SWITCHED and _is_causal_lm(cls):
        return None, _SWITCHED[None]
    return None


def _causal_lm_names() -> dict[str, str]:
    """``model_type -> class name`` of ``AutoModelForCausalLM``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {k: v if isinstance(v, str) else v[0] for k, v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}


def _is_causal_lm(cls: type) -> bool:
    return cls.__name__.endswith("ForCausalLM") or cls.__name__ in _causal_lm_names().values()


def _model_class(model_type: str | type) -> type:
    if isinstance(model_type, type):
        from transformers import PreTrainedModel

        if not issubclass(model_type, PreTrainedModel):
            raise ValueError(f"apply_fused_lm_head takes transformers model classes; {model_type.__name__} is not one")
        return model_type
    names = _causal_lm_names()
    if model_type not in names:
        raise ValueError(
            f"{model_type!r} is not a model_type that transformers' AutoModelForCausalLM knows; pass the model "
            f"class itself (apply_fused_lm_head(MyForCausalLM)), or no argument for every causal LM"
        )
    import transformers

    return getattr(transformers, names[model_type])


def _switch_name(key: type | None) -> str:
    return "every causal LM" if key is None else key.__name__
