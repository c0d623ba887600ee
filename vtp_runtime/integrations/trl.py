"""TRL: every trainer whose loss reads the LM head runs through ``vtp.Head`` on the head's
vocabulary shards, with one changed line::

    from vtp_runtime.integrations.trl import VocabParallelSFTTrainer as SFTTrainer

TRL 1.16's SFT, DPO, GRPO, RLOO and KTO trainers call ``trl.trainer.utils.add_fused_lm_head``
on their models (and reference models), which patches ``model(..., fused_lm_head=True)`` to
return per-token log-probs (and entropy, ``log Σp²``, mean logits, top-1 hits) without the
full logits, but gathers the whole head weight on every rank. ``VocabParallel<X>Trainer``
is TRL's ``<X>Trainer`` with ``VocabParallelTrainerMixin`` in front: while TRL's
``__init__`` runs, its trainer module's ``add_fused_lm_head`` is this module's, which
returns the same ``FusedCausalLMOutput`` from ``vtp.Head`` (see ``lm_head.py``): the model's
own forward runs with its head swapped for a stand-in, and each field is a vtp statistic of
the shard. Everything else is TRL's.

``VocabParallelGKDTrainer`` is TRL's ``GKDTrainer`` with its logits fused too: student and
teacher logits stand as heads, and the generalized JSD is ``vtp.jsd`` on two ``vtp.Head``s,
with TRL's reductions (``generalized_jsd_loss``).

On-policy generation (GRPO and RLOO without vLLM, GKD with ``lmbda > 0``, GKD's teacher with
``seq_kd``) runs through the vocabulary-parallel sampler, which the trainers turn on
(``vtp_runtime.integrations.generation.use_vocab_parallel_sampling``) on every model they
generate from: right on a head that keeps its vocabulary shard (DeepSpeed's, transformers'
``"colwise"``), and on any head the same completions for one seed at every TP size. This
module imports trl only when a trainer class or ``add_fused_lm_head`` is first used.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from typing import Any

import torch
import torch.distributed as dist

import vtp_runtime as vtp

from ..comm import group_size
from . import generation
from . import lm_head as heads
from .tensor_parallel import is_dtensor
from .transformers import warn_on_generation_if_split

REDUCTIONS = ("batchmean", "sum", "mean", "none")
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
TRAINERS = ("SFT", "DPO", "GRPO", "RLOO", "KTO", "GKD")


# -- GKD's loss ---------------------------------------------------------------------------------


def generalized_jsd_loss(
    student_logits: Any,
    teacher_logits: Any,
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
    alike (with ``tp_group``, and ``vocab_start``/``vocab_end`` unless in rank order),
    DTensors sharded on their last dimension (taken as they are), or fused ``HeadLogits``
    (neither logits tensor is then formed). ``labels``: ``[batch, seq]``, tokens with
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
    given = {"tp_group": tp_group, "vocab_start": vocab_start, "vocab_end": vocab_end}
    student, layout, vocab = _op_input(student_logits, given, temperature)
    teacher, teacher_layout, _ = _op_input(teacher_logits, given, temperature)
    if layout.get("temperature") != teacher_layout.get("temperature"):
        raise ValueError(
            "the student's and the teacher's forwards scale their logits differently "
            f"(temperatures {layout['temperature']} and {teacher_layout['temperature']} after folding the scale in); "
            "vtp.jsd takes one temperature for both"
        )
    batch = student_logits.shape[0]

    def jsd(reduction_: str, normalizer=None) -> torch.Tensor:
        with heads.no_autocast(student_logits.device):
            out = vtp.jsd(
                student, teacher, beta=beta, labels=labels, reduction=reduction_, normalizer=normalizer, **layout
            )
        return heads.local(out)

    if num_items_in_batch is not None:
        return jsd("sum", num_items_in_batch)
    if reduction == "batchmean":
        return jsd("mean") if labels is not None else jsd("sum", max(batch, 1))
    if reduction == "sum":
        return jsd("sum")
    if reduction == "none":
        return jsd("none")
    # "mean": TRL averages over every (token, vocabulary entry) pair of the full logits
    tokens = (labels != -100).sum().clamp(min=1) if labels is not None else student_logits.shape[:-1].numel()
    return jsd("sum") / (tokens * vocab())


def _op_input(x: Any, given: dict, temperature: float):
    """``(op input, op keywords, () -> global V)`` for logits, a DTensor or ``HeadLogits``."""
    if isinstance(x, heads.HeadLogits):
        head, options = x.vtp_inputs(temperature)
        return head, options, lambda: _head_vocab(x, options)
    options = dict(given, temperature=temperature)
    if is_dtensor(x):
        return x, {k: v for k, v in options.items() if v is not None or k == "temperature"}, lambda: x.shape[-1]
    return x, options, lambda: _vocab_size(x.shape[-1], given["tp_group"], x.device)


def _head_vocab(x: heads.HeadLogits, options: dict) -> int | torch.Tensor:
    weight = x.module.weight
    if is_dtensor(weight):
        return weight.shape[0]
    if heads.is_vocab_parallel_linear(x.module):
        return int(x.module.vocab_size)
    return _vocab_size(weight.shape[0], options.get("tp_group"), weight.device)


def _vocab_size(v_local: int, group, device) -> int | torch.Tensor:
    if group_size(group) == 1:
        return v_local
    size = torch.tensor([v_local], dtype=torch.int64, device=device)
    dist.all_reduce(size, group=group)
    return size[0]


# -- TRL's fused LM head, through vtp ---------------------------------------------------------


def add_fused_lm_head(
    model,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    outputs: tuple[str, ...] = ("log_probs",),
    *,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_end: int | None = None,
    chunk_rows: int | None = None,
) -> None:
    """TRL's ``add_fused_lm_head`` with ``vtp.Head`` on the head's vocabulary shard.

    ``model(..., labels=labels, fused_lm_head=True)`` returns TRL's ``FusedCausalLMOutput``:
    per token ``[batch, seq - 1]`` (``[batch, seq]`` with ``shift_labels``), fp32, 0 where
    the label is -100, identical on every TP rank:

    - ``log_probs``: ``vtp.logprobs`` at temperature ``temperature`` (and the model's own
      positive logit factor folded in); ``entropy`` from the same read
      (``return_entropy=True``); both differentiable;
    - ``log_sum_sq_probs`` = ``log Σ p²``, no gradient: ``2 log p_y - log p'_y`` where
      ``p'`` is the softmax at half the temperature (one more ``vtp.logprobs`` pass);
    - ``mean_logits``: no gradient, from the column sums of the weight (the mean is linear
      in it; one all-reduce of a ``[H]`` vector), not from logits;
    - ``is_top1``: ``vtp.argmax`` on the head (raises where vtp has no ``argmax`` yet);
    - ``loss`` = ``-Σ log_probs / (counted tokens or num_items_in_batch)``, plus the MoE
      router loss as TRL adds it; ``label_mask``; ``aux_loss``.

    Without ``fused_lm_head=True`` the forward is the model's. ``tp_group``/``vocab_start``/
    ``vocab_end``: the layout of a head split by hand (else read from the head at each
    call). ``cast_lm_head_to_fp32``: the head in fp32 (TRL casts its module; here the
    hidden states follow).
    """
    from trl.trainer.utils import FusedCausalLMOutput

    unknown = set(outputs) - set(OUTPUTS)
    if unknown:
        raise ValueError(f"unknown outputs {sorted(unknown)}; add_fused_lm_head computes {', '.join(OUTPUTS)}")
    heads.output_head(model)
    heads.check_fusable(model)
    given = {"tp_group": tp_group, "vocab_start": vocab_start, "vocab_end": vocab_end}
    layout = given if any(v is not None for v in given.values()) else None
    text_config = model.config.get_text_config()
    original_forward = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            extra = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            return original_forward(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        with heads.intercepted(self, layout, chunk_rows):
            out = original_forward(*args, **kwargs)  # no labels: the model computes no loss
        logits = heads.logits_of(out)
        if shift_labels is None:
            logits, labels = logits[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        labels = labels.to(logits.device)
        mask = labels != -100
        fields = per_token_outputs(
            logits, labels, temperature, outputs, dtype=torch.float32 if cast_lm_head_to_fp32 else None
        )
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        log_probs = fields["log_probs"]
        assert log_probs is not None  # per_token_outputs always fills it
        loss = -log_probs.sum() / count
        aux_loss = out.get("aux_loss") if kwargs.get("output_router_logits") else None
        if aux_loss is not None:
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=aux_loss, **fields)

    forward._vtp_fused = True  # type: ignore[attr-defined]
    model.forward = types.MethodType(forward, model)
    warn_on_generation_if_split(model, tp_group)


def per_token_outputs(
    logits: heads.HeadLogits,
    labels: torch.Tensor,
    temperature: float = 1.0,
    outputs: tuple[str, ...] = ("log_probs",),
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor | None]:
    """The per-token fields of TRL's ``FusedCausalLMOutput`` (``add_fused_lm_head``) from
    fused logits ``[..., V]`` and global ``labels`` ``[...]`` (-100: ignored, every field 0)."""
    head, options = logits.vtp_inputs(temperature, dtype=dtype)
    mask = labels != -100
    out: dict[str, torch.Tensor | None] = dict.fromkeys(OUTPUTS)
    with heads.no_autocast(labels.device):
        if "entropy" in outputs:
            log_probs, entropy = vtp.logprobs(head, labels, return_entropy=True, **options)
            out["entropy"] = heads.local(entropy)
        else:
            log_probs = vtp.logprobs(head, labels, **options)
        out["log_probs"] = log_probs = heads.local(log_probs)
        with torch.no_grad():
            if "log_sum_sq_probs" in outputs:
                halved = dict(options, temperature=options["temperature"] / 2)
                out["log_sum_sq_probs"] = 2 * log_probs.detach() - heads.local(vtp.logprobs(head, labels, **halved))
            if "mean_logits" in outputs:
                out["mean_logits"] = heads.mean_logits(logits, temperature).float().masked_fill(~mask, 0)
            if "is_top1" in outputs:
                out["is_top1"] = heads.is_top1(logits, labels) & mask
    return out


# -- the trainers ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _vtp_fused_head(trainer_class: type, patch):
    """While the block runs, ``add_fused_lm_head`` is ``patch`` in every TRL module that
    defines a class of ``trainer_class``'s MRO (TRL's trainers import it by name)."""
    modules: list[Any] = []
    for cls in trainer_class.__mro__:
        module: Any = sys.modules.get(cls.__module__)
        if cls.__module__.startswith("trl.") and hasattr(module, "add_fused_lm_head") and module not in modules:
            modules.append(module)
    saved = [module.add_fused_lm_head for module in modules]
    for module in modules:
        module.add_fused_lm_head = patch
    try:
        yield modules
    finally:
        for module, original in zip(modules, saved):
            module.add_fused_lm_head = original


def _unwrapped(model):
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class VocabParallelTrainerMixin:
    """Put in front of a TRL trainer that calls ``add_fused_lm_head`` (SFT, DPO, GRPO, RLOO,
    KTO): its fused LM head is ``vtp.Head`` on the head's vocabulary shards.

    Extra keyword arguments: ``vtp_layout`` (``{"tp_group": g, "vocab_start": s,
    "vocab_end": e}``) for a head split by hand; ``vtp_chunk_rows`` for ``vtp.Head``.
    Raises at construction if the installed trl does not call ``add_fused_lm_head`` (vtp
    would not engage). GRPO and RLOO generating with ``model.generate`` (not vLLM) sample
    with ``use_vocab_parallel_sampling`` on the model (``_connect_sampling``).
    """

    def __init__(self, *args: Any, vtp_layout: dict | None = None, vtp_chunk_rows: int | None = None, **kwargs: Any):
        patch = functools.partial(add_fused_lm_head, chunk_rows=vtp_chunk_rows, **(vtp_layout or {}))
        with _vtp_fused_head(type(self), patch) as modules:
            if not modules:
                raise RuntimeError(
                    f"{type(self).__name__}: no TRL trainer module in its bases defines "
                    f"add_fused_lm_head; vtp_runtime cannot engage with it"
                )
            super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._vtp_split_by_hand = bool(vtp_layout) and group_size((vtp_layout or {}).get("tp_group")) > 1
        model = _unwrapped(self.model)  # type: ignore[attr-defined]
        reference = getattr(self, "ref_model", None)
        for name, m in (("model", model), ("reference model", reference)):
            if m is not None and not getattr(m.forward, "_vtp_fused", False):
                raise RuntimeError(
                    f"{type(self).__name__}: TRL did not install its fused LM head on the {name}, so vtp_runtime "
                    f"would not be used (this trl version may work differently from 1.16)"
                )
        if self._vtp_generates():
            _connect_sampling(self, [model], vtp_layout)

    def _vtp_generates(self) -> bool:
        """Whether the trainer samples completions with ``model.generate`` (not vLLM, not
        transformers' continuous batching, which it refuses on a head that keeps its shard)."""
        samplers = ("GRPOTrainer", "RLOOTrainer")
        trl_sampler = any(c.__name__ in samplers and c.__module__.startswith("trl.") for c in type(self).__mro__)
        args = getattr(self, "args", None)
        if not trl_sampler or getattr(args, "use_vllm", False):
            return False
        if getattr(args, "use_transformers_continuous_batching", False):
            model = _unwrapped(self.model)  # type: ignore[attr-defined]
            if heads.local_output(model) or getattr(self, "_vtp_split_by_hand", False):
                raise RuntimeError(
                    f"{type(self).__name__}: use_transformers_continuous_batching samples from each rank's shard of "
                    f"the logits, which the model's head returns (its vocabulary is split over the TP ranks), and "
                    f"would pick local ids; generate with model.generate (use_transformers_continuous_batching=False: "
                    f"vtp's vocabulary-parallel sampler) or vLLM"
                )
            return False  # the head's output holds the whole vocabulary: TRL's own sampling is right
        return True


def _connect_sampling(trainer, models, layout: dict | None = None) -> None:
    """On-policy generation through ``use_vocab_parallel_sampling``, on every model the
    trainer generates from: on a head that keeps its vocabulary shard (DeepSpeed's,
    transformers' ``"colwise"``) sampling from this rank's shard alone would be wrong, and on
    any head it makes the completions depend on the seed only, not on the TP size or the
    head's layout. ``layout``: the trainer's ``vtp_layout`` for a head split by hand. A
    model on which the sampler is already on (``use_vocab_parallel_sampling(model, seed=...)``
    before the trainer) keeps it as it is."""
    for m in models:
        if m is None or generation.is_vocab_parallel_sampling(m):
            continue
        given = {k: v for k, v in (layout or {}).items() if v is not None}
        generation.use_vocab_parallel_sampling(m, **given)


class VocabParallelGKDMixin:
    """Put in front of TRL's ``GKDTrainer`` (``class T(VocabParallelGKDMixin, GKDTrainer)``):
    student and teacher heads are fused, and the loss is ``generalized_jsd_loss`` on two
    ``vtp.Head``s, neither logits tensor being formed. Set ``vtp_layout = (tp_group,
    vocab_start, vocab_end)`` on the trainer for heads split by hand (laid out alike).
    ``generalized_jsd_loss`` on logits (e.g. from a subclass) runs through vtp as well.
    """

    vtp_layout: tuple | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        args_ = getattr(self, "args", None)
        layout = self._vtp_given() or None
        if getattr(args_, "lmbda", 0) > 0:
            _connect_sampling(self, [_unwrapped(self.model)], layout)  # type: ignore[attr-defined]
        teacher = getattr(self, "teacher_model", None)
        if getattr(args_, "seq_kd", False) and teacher is not None:
            unwrap = self.accelerator.unwrap_model  # type: ignore[attr-defined]
            _connect_sampling(self, [_unwrapped(unwrap(teacher))], layout)

    def _vtp_given(self) -> dict:
        if self.vtp_layout is None:
            return {}
        group, start, end = self.vtp_layout
        return {"tp_group": group, "vocab_start": start, "vocab_end": end}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        student = self.accelerator.unwrap_model(model)  # type: ignore[attr-defined]
        teacher_model = self.teacher_model  # type: ignore[attr-defined]
        teacher = self.accelerator.unwrap_model(teacher_model)  # type: ignore[attr-defined]
        layout = self._vtp_given() or None
        with heads.intercepted(_unwrapped(student), layout):
            student_outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        teacher_model.eval()
        with torch.no_grad(), heads.intercepted(_unwrapped(teacher), layout):
            teacher_outputs = teacher_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        # TRL's causal shift (GKDTrainer.compute_loss): position i predicts token i + 1
        loss = generalized_jsd_loss(
            heads.logits_of(student_outputs)[:, :-1],
            heads.logits_of(teacher_outputs)[:, :-1],
            inputs["labels"][:, 1:],
            beta=self.beta,  # type: ignore[attr-defined]
            num_items_in_batch=num_items_in_batch,
        )
        return (loss, heads.without_logits(student_outputs)) if return_outputs else loss

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
        if self.vtp_layout is None and not is_dtensor(student_logits):
            group, start, end = heads.lm_head_layout(self.model)  # type: ignore[attr-defined]
        else:
            group, start, end = self.vtp_layout or (None, None, None)
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


def _trl_trainer(kind: str):
    if kind == "GKD":
        try:
            from trl.experimental.gkd import GKDTrainer  # where newer trl keeps it
        except ImportError:
            from trl import GKDTrainer  # type: ignore[attr-defined,no-redef]
        return GKDTrainer
    import trl

    return getattr(trl, f"{kind}Trainer")


def _gkd_trainer():
    return _trl_trainer("GKD")


def __getattr__(name: str):
    # built on first use so that importing this module does not import trl
    for kind in TRAINERS:
        if name == f"VocabParallel{kind}Trainer":
            mixin = VocabParallelGKDMixin if kind == "GKD" else VocabParallelTrainerMixin
            cls = type(
                name,
                (mixin, _trl_trainer(kind)),
                {
                    "__module__": __name__,
                    "__doc__": f"TRL's {kind}Trainer with its LM head fused through vtp_runtime ({mixin.__name__}).",
                },
            )
            globals()[name] = cls
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
