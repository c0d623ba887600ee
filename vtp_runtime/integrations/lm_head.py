"""A model's output head, fused: the logits it would compute stand as a ``HeadLogits``, and
every op reads them through ``vtp.Head`` without forming ``[tokens, V_local]``.

``intercepted(model)`` swaps the module that ``model.get_output_embeddings()`` names for a
stand-in for the duration of one forward: the model's own forward runs unchanged (its
backbone, ``logits_to_keep``, MoE router losses, its ``loss_function`` call), and where it
calls ``self.lm_head(hidden)`` it gets a ``HeadLogits`` holding ``hidden`` and the head.
What the model does to the logits afterwards must be something vtp can fuse exactly: a
positive scalar factor (Cohere's ``logit_scale``, Granite's ``logits_scaling``) becomes a
temperature; anything else (Gemma 2's ``tanh`` soft-capping, an upcast, a slice over the
vocabulary) raises ``UnfusableLogits`` naming it, never a wrong number.

The head module is swapped, not called, so none of its hooks or forward patches run:
transformers' TP forward, torch's ``ColwiseParallel`` hooks and DeepSpeed's copy into the TP
region are all replaced by ``vtp.Head``, which all-reduces the hidden gradient over the TP
group itself. A head whose parameters FSDP2 shards as a unit of its own is therefore not
gathered: shard it together with the module that runs before it (transformers groups the
final norm with ``lm_head``); ``vtp.Head`` says so if it meets an FSDP-sharded weight.

The layout of the head's vocabulary shard is read at every call, from the module as it is
then (inside the forward, where FSDP2 has gathered it): a DTensor weight (``Shard(0)`` on
the TP mesh dimension: transformers' ``tp_plan``, torch's ``ColwiseParallel``) is passed to
the ops as it is; DeepSpeed AutoTP's vocabulary-parallel head gives ``mp_group`` and its
bounds; a head split by hand takes the layout given to ``fuse_lm_head``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import vtp_runtime as vtp

from ..backend import value_dtype
from ..comm import group_size
from .tensor_parallel import dtensor_vocab_layout, is_dtensor


class UnfusableLogits(AttributeError, ValueError):
    """The model's forward does something to its logits that vtp cannot fuse into the head.

    An AttributeError too, so that ``hasattr`` probes on a ``HeadLogits`` answer False."""


def is_vocab_parallel_linear(module: nn.Module) -> bool:
    """DeepSpeed AutoTP's vocabulary-parallel head (``tensor_parallel.vocab_parallel_lm_head``)."""
    return bool(getattr(module, "is_vocab_parallel_lm_head", False))


def head_layout(head: Any) -> tuple[object, int | None, int | None]:
    """``(tp_group, vocab_start, vocab_end)`` of an output head module on this rank, now (see
    ``lm_head_layout``)."""
    if is_vocab_parallel_linear(head):
        return head.mp_group, int(head.vocab_start_index), int(head.vocab_end_index)
    weight = getattr(head, "weight", None)
    if is_dtensor(weight):
        group, start, end, _ = dtensor_vocab_layout(weight, 0)  # weight: [V, hidden]
        if group is not None:
            return group, start, end
    return None, None, None


def lm_head_layout(model) -> tuple[object, int | None, int | None]:
    """``(tp_group, vocab_start, vocab_end)`` of a model's output head on this rank, now.

    Read from the head's weight when it is a DTensor sharded over the vocabulary
    (transformers' ``tp_plan``; FSDP2's ``_StridedShard`` over the data-parallel dimension
    leaves the TP bounds as they are), or from DeepSpeed AutoTP's vocabulary-parallel head
    (``mp_group``, ``vocab_start_index``, ``vocab_end_index``); ``(None, None, None)`` for a
    head that is not split over the vocabulary.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None, None, None
    return head_layout(head)


def output_head(model: nn.Module) -> nn.Module:
    """``model.get_output_embeddings()``, checked to be a head ``vtp.Head`` can stand for."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        raise ValueError(
            f"{type(model).__name__} has no output embeddings (get_output_embeddings() gives None): "
            f"vtp_runtime fuses the LM head of causal language models"
        )
    if not (isinstance(head, nn.Linear) or is_vocab_parallel_linear(head)):
        hint = ""
        if hasattr(head, "base_layer"):
            hint = " (a PEFT adapter on the head: remove 'lm_head' from target_modules)"
        raise ValueError(
            f"the output head of {type(model).__name__} is a {type(head).__name__}{hint}; vtp_runtime fuses "
            f"an nn.Linear head (or DeepSpeed AutoTP's VocabParallelLinear) into the loss"
        )
    return head


def check_fusable(model: nn.Module) -> None:
    """Refuse, before any forward, what is known not to fuse: final logit soft-capping."""
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    cap = getattr(text, "final_logit_softcapping", None)
    if cap is not None:
        raise ValueError(
            f"{type(model).__name__} soft-caps its logits (final_logit_softcapping={cap}: cap * tanh(z / cap)), "
            f"which vtp.Head cannot fuse. Keep the logits and use use_vocab_parallel_loss(model) (exact, on the "
            f"materialized shards), or train with config.final_logit_softcapping = None"
        )


class HeadLogits:
    """The logits ``scale * (hidden @ weight.T + bias)`` of ``module`` on this rank's shard,
    not computed. ``vtp_inputs()`` turns them into a ``vtp.Head`` and the op keywords."""

    __slots__ = ("hidden", "module", "layout", "scale", "chunk_rows")
    hidden: Any  # a tensor or a DTensor
    module: Any  # the head: nn.Linear or DeepSpeed's VocabParallelLinear

    def __init__(
        self,
        hidden: torch.Tensor,
        module: nn.Module,
        layout: dict | None,
        scale: float = 1.0,
        chunk_rows: int | None = None,
    ) -> None:
        self.hidden, self.module, self.layout, self.scale, self.chunk_rows = hidden, module, layout, scale, chunk_rows

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:-1], self.module.weight.shape[0]))

    @property
    def dtype(self) -> torch.dtype:
        return self.module.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def dim(self) -> int:
        return self.hidden.dim()

    def _with(self, hidden: torch.Tensor | None = None, scale: float | None = None) -> HeadLogits:
        return HeadLogits(
            self.hidden if hidden is None else hidden,
            self.module,
            self.layout,
            self.scale if scale is None else scale,
            self.chunk_rows,
        )

    def __mul__(self, other: Any) -> HeadLogits:
        return self._with(scale=self.scale * _positive(other, "multiplies"))

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> HeadLogits:
        return self._with(scale=self.scale / _positive(other, "divides"))

    def __getitem__(self, key: Any) -> HeadLogits:
        """Slices over the leading (token) dimensions; the vocabulary is kept whole."""
        key = key if isinstance(key, tuple) else (key,)
        lead = self.hidden.dim() - 1
        rest = key[lead:]
        whole = not rest or (len(rest) == 1 and isinstance(rest[0], slice) and rest[0] == slice(None))
        if not whole or any(k is Ellipsis or k is None for k in key):
            raise UnfusableLogits(
                f"the forward indexes the logits with {key!r}, which touches the vocabulary dimension; "
                f"vtp_runtime can only slice the token dimensions of fused logits"
            )
        return self._with(hidden=self.hidden[key[:lead]])

    def __getattr__(self, name: str) -> Any:
        raise UnfusableLogits(
            f"the model's forward reads logits.{name} after its LM head, but the head is fused into the loss "
            f"(vtp_runtime's fuse_lm_head): the logits do not exist. Models that transform their logits "
            f"beyond a scalar factor cannot be fused; use use_vocab_parallel_loss(model) instead"
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise UnfusableLogits(
            f"the model's forward applies {getattr(func, '__name__', func)} to its logits after the LM head "
            f"(e.g. soft-capping), which vtp_runtime cannot fuse into the head; use use_vocab_parallel_loss(model)"
        )

    def _binary(self, *_):
        raise UnfusableLogits(
            "the model's forward adds to or negates its logits after the LM head, which vtp_runtime cannot fuse "
            "(only a positive scalar factor is); use use_vocab_parallel_loss(model)"
        )

    __add__ = __radd__ = __sub__ = __rsub__ = __neg__ = __pow__ = __rtruediv__ = _binary

    def __repr__(self) -> str:
        return f"HeadLogits(shape={tuple(self.shape)}, scale={self.scale}, head={type(self.module).__name__})"

    # -- what the ops get -----------------------------------------------------------------
    def vtp_inputs(self, temperature: float = 1.0, dtype: torch.dtype | None = None) -> tuple[vtp.Head, dict[str, Any]]:
        """``(vtp.Head, op keywords)``: the layout of the head's shard and the temperature
        that folds the model's scalar factor in (softmax(s z / T) = softmax(z / (T / s))).
        The head runs in ``dtype``, by default the autocast dtype where autocast is on (as
        ``F.linear`` would, and TRL's fused head), else the weight's; run the op itself
        under ``no_autocast``."""
        module = self.module
        hidden, weight, bias = self.hidden, module.weight, module.bias
        device_type = hidden.device.type
        if dtype is None:
            autocast = torch.is_autocast_enabled(device_type)
            dtype = torch.get_autocast_dtype(device_type) if autocast else weight.dtype
        if weight.dtype != dtype:
            weight = weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        if hidden.dtype != dtype:
            hidden = hidden.to(dtype)
        if is_dtensor(hidden) and is_dtensor(weight) and hidden.device_mesh.ndim == 1:
            # a sequence-parallel hidden (ColwiseParallel's input hook would gather it too)
            hidden = hidden.redistribute(placements=[_replicate()])
        options = dict(self.layout if self.layout is not None else layout_of(module))
        options["temperature"] = temperature / self.scale
        return vtp.Head(hidden, weight, bias, chunk_rows=self.chunk_rows), options


def no_autocast(device: torch.device):
    """Autocast off for a vtp op (its matmuls write into its own buffers, in the head's dtype)."""
    return torch.autocast(device.type, enabled=False)


def _replicate():
    from torch.distributed.tensor import Replicate

    return Replicate()


def _positive(value: Any, verb: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and float(value) > 0:
        return float(value)
    raise UnfusableLogits(
        f"the model's forward {verb} its logits by {value!r}; vtp_runtime fuses a positive finite scalar factor "
        f"(as a temperature) and nothing else"
    )


def layout_of(module: Any) -> dict[str, Any]:
    """Op keywords for the shard ``module``'s weight holds now: empty for a DTensor weight
    (it carries its layout) or a full vocabulary; DeepSpeed AutoTP's group and bounds."""
    if is_vocab_parallel_linear(module):
        return {
            "tp_group": module.mp_group,
            "vocab_start": int(module.vocab_start_index),
            "vocab_end": int(module.vocab_end_index),
        }
    return {}


def local_output(model: nn.Module) -> bool:
    """Whether the head's own forward returns this rank's vocabulary shard of the logits
    (DeepSpeed's vocabulary-parallel head, transformers' ``"colwise"`` style) rather than
    gathered or DTensor logits: generation from them needs the vocabulary-parallel sampler
    (TRL's trainers refuse continuous batching on them, which does not run it)."""
    head: Any = output_head(model)
    if is_vocab_parallel_linear(head):
        return group_size(head.mp_group) > 1
    plan = getattr(model, "_tp_plan", None) or getattr(model, "tp_plan", None) or {}
    names = [name for name, m in model.named_modules() if m is head]
    return isinstance(plan, dict) and any(plan.get(name) == "colwise" for name in names)


class _Stand(nn.Module):
    """What the model calls in place of its head during a fused forward."""

    def __init__(self, head: Any, layout: dict | None, chunk_rows: int | None) -> None:
        super().__init__()
        self.__dict__["head"] = head  # not a submodule: its parameters stay where they are
        self.layout, self.rows, self.calls = layout, chunk_rows, 0

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # the head's own (weight, out_features, ...): a forward may read them
            return getattr(self.__dict__["head"], name)

    def forward(self, hidden: torch.Tensor) -> HeadLogits:  # type: ignore[override]
        self.calls += 1
        return HeadLogits(hidden, self.__dict__["head"], self.layout, chunk_rows=self.rows)


# model -> [(weak parent, name)] where its head is held; weak, since the model itself is one parent
_HOLDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _holders(model: nn.Module, head: nn.Module) -> list[tuple[nn.Module, str]]:
    """Where modules of ``model`` hold ``head``: found once, found again when a wrapper
    (FSDP, PEFT) has moved it."""
    cached = [(ref(), name) for ref, name in _HOLDERS.get(model, ())]
    if cached and all(parent is not None and parent._modules.get(name) is head for parent, name in cached):
        return cached  # type: ignore[return-value]  # every parent checked not None
    holders = [(parent, name) for parent in model.modules() for name, child in parent._modules.items() if child is head]
    _HOLDERS[model] = [(weakref.ref(parent), name) for parent, name in holders]
    return holders


@contextlib.contextmanager
def intercepted(model: nn.Module, layout: dict | None = None, chunk_rows: int | None = None):
    """For the block, ``model``'s head (wherever a module holds it) is a stand-in that
    returns ``HeadLogits``. Not thread-safe: one forward of a model at a time."""
    head = output_head(model)
    holders = _holders(model, head)
    stand = _Stand(head, layout, chunk_rows)
    for parent, name in holders:
        parent._modules[name] = stand
    try:
        yield head
    finally:
        for parent, name in holders:
            parent._modules[name] = head
    if not stand.calls:  # the forward projected without calling the module: it formed the logits itself
        raise RuntimeError(
            f"{type(model).__name__}'s forward did not call its output head module ({type(head).__name__}); "
            f"vtp_runtime cannot fuse the head of this model (use use_vocab_parallel_loss on its logits). A patched "
            f"forward that computes the loss from the head's weight itself does this: Liger's, for one; "
            f"apply_liger_kernel_to_*(fused_linear_cross_entropy=False) keeps Liger's other kernels"
        )


def logits_of(out: Any) -> HeadLogits:
    """The ``HeadLogits`` a forward run under ``intercepted`` returned."""
    logits = out.logits if hasattr(out, "logits") else out[0]
    if not isinstance(logits, HeadLogits):
        raise RuntimeError(
            f"the model's forward did not call its output head ({type(logits).__name__} logits came back); "
            f"vtp_runtime cannot fuse this model's head"
        )
    return logits


def without_logits(out: Any) -> Any:
    """The model's output with its ``HeadLogits`` dropped (``logits=None``)."""
    if isinstance(out, tuple):
        return tuple(None if isinstance(x, HeadLogits) else x for x in out)
    return type(out)(**{k: v for k, v in out.items() if not isinstance(v, HeadLogits)})


def mean_logits(logits: HeadLogits, temperature: float = 1.0) -> torch.Tensor:
    """Each token's mean over the global vocabulary of ``logits / temperature``, fp32, no
    gradient: linear in the weight, so ``hidden @ sum_v W[v] + sum_v b[v]`` over V, with one
    all-reduce of the column sums (and the shard widths) over the TP group."""
    module = logits.module
    with torch.no_grad():
        weight: Any = module.weight
        bias: Any = module.bias
        acc = value_dtype(weight.dtype)
        if is_dtensor(weight):
            sums = weight.sum(0, dtype=acc).full_tensor()
            bias_sum = bias.sum(dtype=acc).full_tensor() if bias is not None else 0.0
            vocab = weight.shape[0]
        else:
            parts = [
                weight.sum(0, dtype=acc),
                (bias.sum(dtype=acc) if bias is not None else weight.new_zeros((), dtype=acc)).reshape(1),
                torch.tensor([weight.shape[0]], dtype=acc, device=weight.device),
            ]
            flat = torch.cat(parts)
            group = (logits.layout if logits.layout is not None else layout_of(module)).get("tp_group")
            if group_size(group) > 1:
                dist.all_reduce(flat, group=group)
            sums, bias_sum, vocab = flat[:-2], flat[-2], flat[-1]
        hidden = logits.hidden
        hidden = (hidden.full_tensor() if is_dtensor(hidden) else hidden).to(acc)
        return (hidden @ sums + bias_sum) * (logits.scale / (vocab * temperature))


def is_top1(logits: HeadLogits, labels: torch.Tensor) -> torch.Tensor:
    """Whether each label is the first most likely id (TRL's token accuracy), from
    ``vtp.argmax`` on the head: no logits are gathered."""
    argmax = getattr(vtp, "argmax", None)
    if argmax is None:
        raise RuntimeError(
            "this statistic (TRL's is_top1: the token accuracy metric) needs vtp.argmax, the vocabulary-parallel "
            "argmax, which this vtp_runtime does not have yet"
        )
    head, options = logits.vtp_inputs()
    options.pop("temperature")  # a positive factor does not move the argmax
    with torch.no_grad():
        ids = argmax(head, **options)
    if is_dtensor(ids):
        ids = ids.to_local()  # type: ignore[attr-defined]
    return ids == labels


def local(t: Any) -> Any:
    """A result replicated over the TP group as a plain tensor (this rank's copy), which the
    caller may modify in place: transformers' Trainer scales its loss with ``loss *= ...``,
    and MoE forwards add their router loss with ``loss += ...``. ``DTensor.to_local()`` is a
    view made inside an autograd Function, which autograd forbids modifying in place, so
    the copy is a clone (a scalar, or one value per token)."""
    if is_dtensor(t):
        if not all(p.is_replicate() for p in t.placements):
            return t
        return t.to_local().clone()
    return t
