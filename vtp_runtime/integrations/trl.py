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
``"colwise"``), and on any head the same completions for one seed at every TP size.

The ranks of a TP group hold the same rows at every step: TRL's
``set_seed(seed, device_specific=True)`` (GRPO, RLOO: it decides each generation batch's
shuffle) adds the data-parallel index instead of the process index, and every
``compute_loss`` compares the batch across the group first (``check_same_rows``: a
``ShardError`` on every rank, naming the trainer and the step, where the rows differ).

``use_vtp()`` does all of this for TRL's own trainer classes, class-level, without the
changed import. This module imports trl only when a trainer class, ``use_vtp`` or
``add_fused_lm_head`` is first used.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

import vtp_runtime as vtp

from .. import metadata
from ..comm import all_gather_stack, group_size
from ..errors import ShardError
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
    shard_options = {"tp_group": tp_group, "vocab_start": vocab_start, "vocab_end": vocab_end}
    student, layout, vocab = _op_input(student_logits, shard_options, temperature)
    teacher, teacher_layout, _ = _op_input(teacher_logits, shard_options, temperature)
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


def _op_input(x: Any, shard_options: dict, temperature: float):
    """``(op input, op keywords, () -> global V)`` for logits, a DTensor or ``HeadLogits``."""
    if isinstance(x, heads.HeadLogits):
        head, options = x.vtp_inputs(temperature)
        return head, options, lambda: _head_vocab(x, options)
    options = dict(shard_options, temperature=temperature)
    if is_dtensor(x):
        return x, {k: v for k, v in options.items() if v is not None or k == "temperature"}, lambda: x.shape[-1]
    return x, options, lambda: _vocab_size(x.shape[-1], shard_options["tp_group"], x.device)


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
    shard_options = {"tp_group": tp_group, "vocab_start": vocab_start, "vocab_end": vocab_end}
    layout = shard_options if any(v is not None for v in shard_options.values()) else None
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


# -- the rows of a tensor-parallel group ----------------------------------------------------------

ROW_SLOTS = 31  # integer inputs compared one by one; any beyond are folded into the last slot


def check_same_rows(inputs: Mapping[str, Any], tp_group, where: str) -> None:
    """Raise the same ``ShardError`` on every rank of ``tp_group`` where its ranks hold
    different batches: every integer or boolean tensor of ``inputs`` (input ids, labels,
    completion ids, masks) is compared by its size and a checksum of its values and their
    positions (rows in another order differ). One all-gather of 64 int64 per rank; nothing
    without a group of more than one rank. ``where`` begins the message (a trainer and its
    step). Every rank of the group must call it (it is a collective)."""
    if group_size(tp_group) <= 1:
        return
    names = sorted(
        k for k, v in inputs.items() if isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex())
    )
    transport = metadata.gather_device(tp_group, inputs[names[0]].device if names else None)
    sizes = [0] * ROW_SLOTS
    sums = torch.zeros(ROW_SLOTS, dtype=torch.int64, device=transport)
    for i, name in enumerate(names):
        slot, t = min(i, ROW_SLOTS - 1), inputs[name]
        sizes[slot] += t.numel()
        # the checksum VTP_CHECK=1 compares labels with: exact integer sums, equal on every rank
        sums[slot] += metadata.checksums((t,), t.device)[0].to(transport)
    known = torch.tensor([len(names), metadata.stable_hash(",".join(names)), *sizes], dtype=torch.int64)
    table = all_gather_stack(torch.cat([known.to(transport), sums]), tp_group).cpu().tolist()
    if any(row != table[0] for row in table):
        raise ShardError(_rows_message(where, names, table))


def _rows_message(where: str, names: list[str], table: list[list[int]]) -> str:
    if any(row[:2] != table[0][:2] for row in table):
        found = "different inputs (the names of their integer tensors differ)"
    else:
        labels = names[: ROW_SLOTS - 1] + [", ".join(names[ROW_SLOTS - 1 :])]
        differ = []
        for slot, name in enumerate(labels[: len(names)]):
            values = [(row[2 + slot], row[2 + ROW_SLOTS + slot] & (2**64 - 1)) for row in table]
            if len(set(values)) > 1:
                ranks = ", ".join(f"rank {r} = {n} values, checksum {s:#x}" for r, (n, s) in enumerate(values))
                differ.append(f"{name}: {ranks}")
        found = "different rows: " + "; ".join(differ)
    return (
        f"{where}: the ranks of the tensor-parallel group hold {found}. Every rank of a TP group must train on "
        f"the same batch, row for row (vocabulary-parallel ops on rows that differ give wrong numbers, and no "
        f"error). The VocabParallel trainers seed the ranks of a TP group alike (TRL's set_seed(..., "
        f"device_specific=True) takes the data-parallel index); look for what else gives each process its own "
        f"rows: a data loader that shards over every process (the Trainer must know the model's tp_size), a "
        f"collator, reward function or callback that draws random numbers of its own"
    )


def data_parallel_index(trainer) -> int:
    """The index of the trainer's data-parallel replica: the process index over the size of
    its TP group, as accelerate hands out batches (every rank of a TP group gets the batch
    of ``process_index // tp_size``)."""
    return trainer.accelerator.process_index // group_size(_tp_group(trainer))


def _tp_group(trainer):
    """The TP group the trainer's ranks must agree over: ``vtp_layout``'s; else the TP
    dimension of accelerate's mesh (the Trainer found the model's ``tp_size``); else that
    of the model's head (DeepSpeed AutoTP's, a DTensor weight), unless FSDP2 shards the
    model: between passes its weights are ``Shard(0)`` over data-parallel ranks."""
    layout = getattr(trainer, "_vtp_layout", None) or {}
    if layout.get("tp_group") is not None:
        return layout["tp_group"]
    accelerator = trainer.accelerator
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None and config.tp_enabled:
        return accelerator.torch_device_mesh["tp"].get_group()
    model = getattr(trainer, "model", None)
    if model is None:
        return None
    model = _unwrapped(accelerator.unwrap_model(model))
    group = heads.lm_head_layout(model)[0]
    if group is not None and _sharded_by_fsdp(model):
        return None
    return group


def _sharded_by_fsdp(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _where(trainer) -> str:
    state = getattr(trainer, "state", None)
    return f"{type(trainer).__name__}, step {getattr(state, 'global_step', 0) + 1}"


def _set_seed_per_tp_group(trainer, set_seed):
    """``set_seed`` as TRL's trainer module has it, except that ``device_specific=True`` adds
    the data-parallel index instead of the process index: the ranks of one TP group draw
    the same random numbers (TRL's shuffle of each generation batch, the generations' base
    seed, dropout), while data-parallel replicas differ as TRL intends. At TP=1 the two
    indices are the same."""

    @functools.wraps(set_seed)
    def set_seed_per_tp_group(seed: int, device_specific: bool = False, **kwargs: Any) -> None:
        if device_specific:
            seed += data_parallel_index(trainer)
        set_seed(seed, **kwargs)

    return set_seed_per_tp_group


# -- the trainers ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _in_trl_modules(trainer_class: type, replacements: dict[str, Callable[[Any], Any]]):
    """While the block runs, each name of ``replacements`` is ``replacement(original)`` in every
    TRL module that defines a class of ``trainer_class``'s MRO and has that name (TRL's
    trainers import ``add_fused_lm_head`` and ``set_seed`` by name). Yields, per name, the
    modules where it was replaced."""
    modules: list[Any] = []
    for cls in trainer_class.__mro__:
        module: Any = sys.modules.get(cls.__module__)
        if cls.__module__.startswith("trl.") and module is not None and module not in modules:
            modules.append(module)
    saved = [
        (module, name, getattr(module, name)) for module in modules for name in replacements if hasattr(module, name)
    ]
    for module, name, original in saved:
        setattr(module, name, replacements[name](original))
    try:
        yield {name: [m for m, n, _ in saved if n == name] for name in replacements}
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _unwrapped(model):
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _engage(trainer, init: Callable[..., None], args: tuple, kwargs: dict, layout: dict | None, chunk_rows) -> None:
    """Run TRL's ``__init__`` (``init``) with vtp's replacements in its modules, then the
    mixin's own set-up; what ``VocabParallel<X>Trainer`` and ``use_vtp()`` both do."""
    unknown = set(layout or {}) - {"tp_group", "vocab_start", "vocab_end"}
    if unknown:
        raise ValueError(
            f"{type(trainer).__name__}: vtp_layout takes tp_group, vocab_start and vocab_end; not {sorted(unknown)}"
        )
    trainer._vtp_layout = {k: v for k, v in (layout or {}).items() if v is not None} or None
    trainer._vtp_chunk_rows = chunk_rows
    replacements: dict[str, Callable[[Any], Any]] = {
        "set_seed": lambda set_seed: _set_seed_per_tp_group(trainer, set_seed)
    }
    fuses = not isinstance(trainer, VocabParallelGKDMixin)  # GKD's loss is the mixin's own
    if fuses:
        fused = functools.partial(add_fused_lm_head, chunk_rows=chunk_rows, **(trainer._vtp_layout or {}))
        replacements["add_fused_lm_head"] = lambda _: fused
    with _in_trl_modules(type(trainer), replacements) as replaced:
        if fuses and not replaced["add_fused_lm_head"]:
            raise RuntimeError(
                f"{type(trainer).__name__}: no TRL trainer module in its bases defines "
                f"add_fused_lm_head; vtp_runtime cannot engage with it"
            )
        init(*args, **kwargs)
    trainer._vtp_set_up()


class VocabParallelTrainerMixin:
    """Put in front of a TRL trainer that calls ``add_fused_lm_head`` (SFT, DPO, GRPO, RLOO,
    KTO): its fused LM head is ``vtp.Head`` on the head's vocabulary shards.

    Extra keyword arguments: ``vtp_layout`` (``{"tp_group": g, "vocab_start": s,
    "vocab_end": e}``) for a head split by hand; ``vtp_chunk_rows`` for ``vtp.Head``.
    Raises at construction if the installed trl does not call ``add_fused_lm_head`` (vtp
    would not engage). GRPO and RLOO generating with ``model.generate`` (not vLLM) sample
    with ``use_vocab_parallel_sampling`` on the model (``_connect_sampling``).

    The ranks of a TP group hold the same rows at every step: TRL's
    ``set_seed(..., device_specific=True)`` gives every rank of a TP group the seed of its
    data-parallel replica, and each ``compute_loss`` first compares the batch's integer
    tensors across the group (``check_same_rows``), raising a ``ShardError`` that names the
    trainer and the step on every rank where they differ.
    """

    def __init__(self, *args: Any, vtp_layout: dict | None = None, vtp_chunk_rows: int | None = None, **kwargs: Any):
        _engage(self, super().__init__, args, kwargs, vtp_layout, vtp_chunk_rows)

    def _vtp_set_up(self) -> None:
        layout = self._vtp_layout  # type: ignore[attr-defined]
        self._vtp_split_by_hand = bool(layout) and group_size(layout.get("tp_group")) > 1
        model = _unwrapped(self.model)  # type: ignore[attr-defined]
        reference = getattr(self, "ref_model", None)
        for name, m in (("model", model), ("reference model", reference)):
            if m is not None and not getattr(m.forward, "_vtp_fused", False):
                raise RuntimeError(
                    f"{type(self).__name__}: TRL did not install its fused LM head on the {name}, so vtp_runtime "
                    f"would not be used (this trl version may work differently from 1.16)"
                )
        if self._vtp_generates():
            _connect_sampling(self, [model], layout)

    def compute_loss(self, model, inputs, *args: Any, **kwargs: Any):
        check_same_rows(inputs, _tp_group(self), _where(self))
        return super().compute_loss(model, inputs, *args, **kwargs)  # type: ignore[misc]

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
        generation.use_vocab_parallel_sampling(m, **(layout or {}))


class VocabParallelGKDMixin:
    """Put in front of TRL's ``GKDTrainer`` (``class T(VocabParallelGKDMixin, GKDTrainer)``):
    student and teacher heads are fused, and the loss is ``generalized_jsd_loss`` on two
    ``vtp.Head``s, neither logits tensor being formed. Extra keyword arguments, as for the
    other trainers: ``vtp_layout`` (``{"tp_group": g, "vocab_start": s, "vocab_end": e}``)
    for heads split by hand (laid out alike), ``vtp_chunk_rows`` for ``vtp.Head``.
    ``generalized_jsd_loss`` on logits (e.g. from a subclass) runs through vtp as well. The
    ranks of a TP group hold the same rows, checked at every step, as for the other trainers.
    """

    def __init__(self, *args: Any, vtp_layout: dict | None = None, vtp_chunk_rows: int | None = None, **kwargs: Any):
        _engage(self, super().__init__, args, kwargs, vtp_layout, vtp_chunk_rows)

    def _vtp_set_up(self) -> None:
        args_ = getattr(self, "args", None)
        layout = self._vtp_layout  # type: ignore[attr-defined]
        if getattr(args_, "lmbda", 0) > 0:
            _connect_sampling(self, [_unwrapped(self.model)], layout)  # type: ignore[attr-defined]
        teacher = getattr(self, "teacher_model", None)
        if getattr(args_, "seq_kd", False) and teacher is not None:
            unwrap = self.accelerator.unwrap_model  # type: ignore[attr-defined]
            _connect_sampling(self, [_unwrapped(unwrap(teacher))], layout)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        check_same_rows(inputs, _tp_group(self), _where(self))
        student = self.accelerator.unwrap_model(model)  # type: ignore[attr-defined]
        teacher_model = self.teacher_model  # type: ignore[attr-defined]
        teacher = self.accelerator.unwrap_model(teacher_model)  # type: ignore[attr-defined]
        layout, rows = self._vtp_layout, self._vtp_chunk_rows  # type: ignore[attr-defined]
        with heads.intercepted(_unwrapped(student), layout, rows):
            student_outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        teacher_model.eval()
        with torch.no_grad(), heads.intercepted(_unwrapped(teacher), layout, rows):
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
        layout = self._vtp_layout or {}  # type: ignore[attr-defined]
        if not layout and not is_dtensor(student_logits):
            group, start, end = heads.lm_head_layout(self.model)  # type: ignore[attr-defined]
        else:
            group, start, end = (layout.get(k) for k in ("tp_group", "vocab_start", "vocab_end"))
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


# -- the switch: TRL's own trainer classes ---------------------------------------------------------

_SWITCHED: dict[type, Any] = {}  # TRL's trainer class -> its own __init__ (None: inherited), while switched
_WITH_MIXIN: dict[tuple[type, type], type] = {}


def use_vtp(enabled: bool = True) -> None:
    """Turn vtp on in TRL's own trainer classes (``enabled=False``: off again): class-level,
    as Liger's ``apply_liger_kernel_to_llama()`` is. Every SFT, DPO, KTO, GRPO, RLOO and GKD
    trainer built while it is on, and every subclass of one, is what
    ``VocabParallel<X>Trainer`` would be: its fused LM head through ``vtp.Head`` (GKD: its
    loss), the same rows on every rank of a TP group, checked at every step, on-policy
    sampling through vtp's sampler; it takes the same extra keyword arguments
    (``vtp_layout``, ``vtp_chunk_rows``). A trainer keeps what it was built with; trainers
    built before the call, or after ``use_vtp(False)``, are TRL's own. Idempotent. Imports trl."""
    for kind in TRAINERS:
        cls = trl_trainer(kind)
        if enabled and cls not in _SWITCHED:
            _SWITCHED[cls] = cls.__dict__.get("__init__")
            cls.__init__ = _switched_init(kind, cls)  # type: ignore[misc]
        elif not enabled and cls in _SWITCHED:
            original = _SWITCHED.pop(cls)
            if original is None:
                del cls.__init__  # type: ignore[misc]
            else:
                cls.__init__ = original  # type: ignore[misc]


def uses_vtp(trainer) -> bool:
    """Whether ``trainer`` runs through vtp (a ``VocabParallel<X>Trainer``, or a TRL trainer
    built while ``use_vtp()`` was on)."""
    return isinstance(trainer, (VocabParallelTrainerMixin, VocabParallelGKDMixin))


def _switched_init(kind: str, cls: type):
    original = next(vars(c)["__init__"] for c in cls.__mro__ if "__init__" in vars(c))  # its own, or inherited
    mixin = VocabParallelGKDMixin if kind == "GKD" else VocabParallelTrainerMixin

    @functools.wraps(original)
    def __init__(self, *args: Any, vtp_layout: dict | None = None, vtp_chunk_rows: int | None = None, **kwargs: Any):
        if uses_vtp(self):  # a VocabParallel trainer, or a base class's __init__ under this one's
            return original(self, *args, **kwargs)
        # the mixin's methods (compute_loss, GKD's loss) in front of the class, whatever subclass it is
        key = (type(self), mixin)
        if key not in _WITH_MIXIN:
            base = type(self)
            attrs = {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__}
            _WITH_MIXIN[key] = type(base.__name__, (mixin, base), attrs)
        self.__class__ = _WITH_MIXIN[key]
        _engage(self, functools.partial(original, self), args, kwargs, vtp_layout, vtp_chunk_rows)

    return __init__


def trl_trainer(kind: str):
    """TRL's own trainer class of ``kind`` (one of ``TRAINERS``), wherever this TRL keeps it."""
    if kind == "GKD":
        try:
            from trl.experimental.gkd import GKDTrainer  # where newer trl keeps it
        except ImportError:
            from trl import GKDTrainer  # type: ignore[attr-defined,no-redef]
        return GKDTrainer
    import trl

    return getattr(trl, f"{kind}Trainer")


def __getattr__(name: str):
    # built on first use so that importing this module does not import trl
    for kind in TRAINERS:
        if name == f"VocabParallel{kind}Trainer":
            mixin = VocabParallelGKDMixin if kind == "GKD" else VocabParallelTrainerMixin
            cls = type(
                name,
                (mixin, trl_trainer(kind)),
                {
                    "__module__": __name__,
                    "__doc__": f"TRL's {kind}Trainer with its LM head fused through vtp_runtime ({mixin.__name__}).",
                },
            )
            globals()[name] = cls
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
