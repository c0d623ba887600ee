"""Input forms, normalized at the API boundary: backends only ever see plain local tensors.

``normalize(op, tensors, options)`` runs first in ``loss`` and ``explain``. Plain tensors
pass through untouched (a type check per tensor: this is on every call's path). A DTensor
(``torch.distributed.tensor``) whose last dimension -- the vocabulary -- is sharded on one
mesh dimension becomes its local shard plus the layout facts the core needs: the process
group of that mesh dimension (``tp_group``), this rank's ``[vocab_start, vocab_end)`` by
torch's own chunking (ceil(V/tp) per rank, the last shards smaller or empty) and the global
V (``global_vocab_size``). Every rank derives them from the same placement, so they agree.

Other mesh dimensions may shard the batch (``Shard(d)``, ``d`` before the vocabulary) or
replicate: the local batch is what this rank computes. The result is wrapped back into a
DTensor on the same mesh, placed as ``loss_parallel()`` places ``F.cross_entropy``'s
result: ``Replicate()`` on the vocabulary's mesh dimension (every TP rank holds the same
loss); per token (``reduction="none"``) it keeps the batch sharding; reduced, it is
``Partial("sum")`` over batch-sharded mesh dimensions (each rank holds its batch's part),
except on the one whose group is ``sp_group``: summed there already, and ``Replicate()``.
``to_local`` and ``from_local`` are differentiable, so the gradient of a DTensor input is a
DTensor with the input's placement.

A ``Head`` whose weight (and bias) is a DTensor sharded over the vocabulary (``Shard(0)``
on one mesh dimension, replicated on the others) stands for logits of shape
``hidden.shape[:-1] + (V,)`` placed the same way, the batch placed as a hidden DTensor
places it (a plain hidden: replicated, on a 1-D mesh only); it becomes the Head of the
local tensors. A hidden DTensor placed ``Shard(0)`` on the vocabulary's mesh dimension
(Megatron's sequence parallelism: the tokens split over the TP ranks) makes it a
sequence-parallel Head.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from .head import Head
from .ops import TENSOR_OPTIONS, OpSpec, get_spec
from .weak import IdentityMap

Tensor = torch.Tensor
Wrap = Callable[[Tensor], Any]

_DT: Any = None  # the torch DTensor names, imported on first use (see _dtensor)


def normalize(
    op: str, tensors: tuple, options: dict[str, Any]
) -> tuple[tuple, dict[str, Any], Wrap | None, Exception | None]:
    """``(tensors, options, wrap, failure)`` for the pipeline: plain local tensors, options
    with the layout a DTensor carries, and ``wrap`` to turn the result back into a DTensor
    (None when no DTensor was given: use the result as it is). A DTensor layout vtp_runtime
    cannot take is not raised here but returned as ``failure`` (ValueError/TypeError), with
    ``options["tp_group"]`` the group this rank's call would have used, so that the pipeline
    raises it on every rank through the metadata gather: a rank that raised alone here would
    leave the others waiting in the gather."""
    for t in tensors:
        if type(t) is not Tensor:
            return _normalize_or_fail(op, tensors, options)
    for name in TENSOR_OPTIONS:
        t = options.get(name)
        if t is not None and type(t) is not Tensor and isinstance(t, Tensor):
            return _normalize_or_fail(op, tensors, options)
    return tensors, options, None, None


def _normalize_or_fail(
    op: str, tensors: tuple, options: dict[str, Any]
) -> tuple[tuple, dict[str, Any], Wrap | None, Exception | None]:
    seen: dict[str, Any] = {"group": options.get("tp_group")}  # the group, as soon as it is known
    try:
        return (*_normalize(op, tensors, options, seen), None)
    except Exception as exc:  # raised on every rank by the pipeline, through the gather
        return tensors, {**options, "tp_group": seen["group"]}, None, exc


def _dtensor():
    """torch's DTensor names (DTensor, Shard, Replicate, Partial, and the function giving a
    shard's shape and offset), or None where torch.distributed is not built."""
    global _DT
    if _DT is None:
        if not torch.distributed.is_available():
            _DT = False
            return None
        try:  # torch >= 2.5
            dt = importlib.import_module("torch.distributed.tensor")
        except ImportError:  # torch 2.4
            dt = importlib.import_module("torch.distributed._tensor")
        utils = importlib.import_module(f"{dt.__name__}._utils")
        _DT = _Torch(dt.DTensor, dt.Shard, dt.Replicate, dt.Partial, utils.compute_local_shape_and_global_offset)
    return _DT or None


class _Torch:
    """The torch DTensor names this module uses."""

    def __init__(self, dtensor, shard, replicate, partial, local_shape_and_offset):
        self.DTensor, self.Shard, self.Replicate, self.Partial = dtensor, shard, replicate, partial
        self.local_shape_and_offset = local_shape_and_offset


@dataclass(frozen=True)
class _Placement:
    """What a logits DTensor's placement says about the shards on this rank; the same for
    every batch shape and every mesh of one shape (cached per mesh)."""

    placements: tuple
    vocab_mesh_dim: int | None  # None: the vocabulary is replicated
    batch_sharded: bool
    vocab_start: int | None
    vocab_end: int | None
    vocab_size: int


@dataclass(frozen=True)
class _Layout(_Placement):
    """A logits DTensor's placement with its mesh and the vocabulary's process group, for
    one call (never cached: a cache holding them would keep them alive)."""

    mesh: Any  # DeviceMesh
    group: Any  # the vocabulary's ProcessGroup; None when vocab_mesh_dim is None


def _placements(t, torch_names: _Torch) -> tuple:
    """``t.placements`` with shard dimensions counted from the front (Shard(-1) -> Shard(ndim-1))."""
    return tuple(torch_names.Shard(p.dim % t.dim()) if p.is_shard() and p.dim < 0 else p for p in t.placements)


# per mesh (held weakly, by identity: an equal mesh of a re-initialized world gets its own),
# at most 256 placements each: (placements, ndim, (V,)) -> _Placement
_PLACEMENTS: IdentityMap[dict] = IdentityMap()
MAX_PLACEMENTS = 256


def _layout_for(mesh, placements: tuple, shape: tuple, names: _Torch, seen: dict | None = None) -> _Layout:
    """The layout of logits of ``shape`` placed so on ``mesh`` (its placement cached per mesh;
    the group read from the mesh on every call). ``seen["group"]``: set to the group as soon
    as it is known, for a failure that follows."""
    cached = _PLACEMENTS.setdefault(mesh, dict)
    key = (placements, len(shape), shape[-1:])
    placement = cached.get(key)
    if placement is None:
        placement = _new_placement(mesh, placements, shape, names)
        if len(cached) >= MAX_PLACEMENTS:
            cached.clear()
        cached[key] = placement
    group = None if placement.vocab_mesh_dim is None else mesh.get_group(placement.vocab_mesh_dim)
    if seen is not None and group is not None:
        seen["group"] = group
    return _Layout(**vars(placement), mesh=mesh, group=group)


def _new_placement(mesh, placements: tuple, shape: tuple, names: _Torch) -> _Placement:
    ndim = len(shape)
    if ndim < 1:
        raise ValueError("logits must have a vocabulary dimension: shape [..., V]")
    vocab_dims, batch_sharded = [], False
    for i, p in enumerate(placements):
        # a strided shard (FSDP2 + TP) also reports is_shard() on some torch versions
        if p.is_shard() and not hasattr(p, "split_factor"):
            if p.dim == ndim - 1:
                vocab_dims.append(i)
            else:
                batch_sharded = True
        elif not p.is_replicate():
            what = "a pending reduction (Partial)" if p.is_partial() else "not a plain Shard or Replicate"
            raise ValueError(
                f"the logits DTensor has placement {p} on mesh dimension {i}, {what}; "
                f"vtp_runtime takes Shard(-1) on the vocabulary's mesh dimension and "
                f"Shard/Replicate elsewhere: redistribute it first (.redistribute(mesh, placements))"
            )
    if len(vocab_dims) > 1:
        raise ValueError(
            f"the logits DTensor shards the vocabulary on mesh dimensions {vocab_dims} "
            f"(placements {placements}); shard it on exactly one"
        )
    vocab_size = shape[-1]
    if not vocab_dims:
        return _Placement(placements, None, batch_sharded, None, None, vocab_size)
    if mesh.get_coordinate() is None:
        raise ValueError(
            "this rank is not part of the logits DTensor's device mesh; call vtp_runtime only on the ranks of the mesh"
        )
    # The bounds torch's chunking gives this rank; they do not depend on the other dimensions
    # (so the placement is cached without them). The local tensor is checked against them after
    # the metadata gather, so a DTensor built with a wrong global shape fails on every rank.
    # An empty shard sits at the end, [V, V), whatever offset this torch reports for it.
    local_shape, offset = names.local_shape_and_offset(shape, mesh, placements)
    size = int(local_shape[-1])
    start = int(offset[-1]) if size else vocab_size
    return _Placement(placements, vocab_dims[0], batch_sharded, start, start + size, vocab_size)


def _normalize(
    op: str, tensors: tuple, options: dict[str, Any], seen: dict[str, Any]
) -> tuple[tuple, dict[str, Any], Wrap | None]:
    names = _dtensor()
    if names is None:
        return tensors, options, None
    DTensor = names.DTensor
    spec = get_spec(op)
    n_logits = len(spec.inputs)
    logits = tensors[0] if tensors else None
    if _sharded_head(logits, names):
        _see_group(logits.weight, 0, seen)
        lay, lead = _head_layout(logits, names, seen), tuple(logits.hidden.shape[:-1])
    elif isinstance(logits, DTensor):
        _see_group(logits, logits.dim() - 1, seen)
        lay = _layout_for(logits.device_mesh, _placements(logits, names), tuple(logits.shape), names, seen)
        lead = tuple(logits.shape[:-1])
    else:
        named = _named_tensors(spec, tensors, options)
        sharded = [name for name, t in named if isinstance(t, DTensor) or _sharded_head(t, names)]
        if sharded:
            raise TypeError(
                f"{', '.join(sharded)} {'is a DTensor' if len(sharded) == 1 else 'are DTensors'} but "
                f"{spec.inputs[0]} is not; pass the logits as a DTensor too, or pass this "
                f"rank's local parts (.to_local())"
            )
        return tensors, options, None

    options = dict(options)
    if lay.vocab_mesh_dim is not None:
        _check_layout_options(lay, options)
        options.update(
            tp_group=lay.group, vocab_start=lay.vocab_start, vocab_end=lay.vocab_end, global_vocab_size=lay.vocab_size
        )
    if "row_offset" in spec.options and lay.batch_sharded:  # sample: rows numbered over the global batch
        offset = spec.options["row_offset"].canonical(options.get("row_offset", 0))
        if type(offset) is int:  # anything else: the option's check says what is wrong
            options["row_offset"] = offset + _row_offset(lay, lead, names)

    local = [_local_input(name, t, lay, lead, names) for name, t in zip(spec.inputs, tensors[:n_logits])]
    for name, t in zip((spec.index,) if spec.index else (), tensors[n_logits:]):
        local.append(_local_part(name, t, lay, names))
    local.extend(tensors[n_logits + (1 if spec.index else 0) :])  # too many: _prepare says so
    for name in ("mask", "labels"):
        if options.get(name) is not None:
            options[name] = _local_part(name, options[name], lay, names)
    normalizer = options.get("normalizer")
    if isinstance(normalizer, DTensor):
        if not all(p.is_replicate() for p in normalizer.placements):
            raise ValueError(
                f"normalizer is a DTensor with placements {tuple(normalizer.placements)}; pass "
                f"a replicated one (.full_tensor() or .redistribute(mesh, [Replicate()] * ndim))"
            )
        options["normalizer"] = normalizer.to_local()

    reduced = options.get("reduction", "none") != "none"
    sequence_dim = _sequence_dim(lay, options.get("sp_group"))
    partial = [i for i in _batch_dims(lay) if i != sequence_dim]  # what a reduced result leaves pending
    if reduced and partial and options.get("reduction") == "mean" and options.get("normalizer") is None:
        raise ValueError(
            f"reduction='mean' on logits whose batch is sharded across the mesh (placements "
            f"{lay.placements}) would average per-rank means; use reduction='sum' with "
            f"normalizer= the global count of tokens (e.g. num_items_in_batch), or reduction='none'"
            + ("" if sequence_dim is not None else ", or pass sp_group= the group of the mesh dimension sharding them")
        )
    return tuple(local), options, _wrapper(lay, lead, reduced, names, sequence_dim)


def _row_offset(lay: _Layout, lead: tuple, names: _Torch) -> int:
    """The global number of this rank's first row, for logits of global shape ``lead + (V,)``
    laid out as ``lay`` with a sharded batch: rows are the leading dimensions flattened in
    order, numbered over the global batch, so that each batch shard draws what one call on
    the whole batch draws. Raises ValueError where this rank's rows are not one run of the
    global rows (a batch sharded past a leading dimension longer than 1)."""
    local, offset = names.local_shape_and_offset(lead + (lay.vocab_size,), lay.mesh, lay.placements)
    local, offset = tuple(local[:-1]), tuple(offset[:-1])
    partial = [i for i, (a, b) in enumerate(zip(local, lead)) if a != b]
    if not partial or math.prod(local) == 0:
        return 0
    if any(local[i] != 1 for i in range(partial[-1])):
        raise ValueError(
            f"sample numbers a DTensor's rows over its global batch, but this rank's rows (local shape "
            f"{list(local)} of {list(lead)}, placements {lay.placements}) are not one run of the global rows; "
            f"shard the batch on the first dimension (Shard(0)), or pass this rank's local tensor (.to_local()) "
            f"with row_offset= the number of its first row"
        )
    return sum(o * math.prod(lead[i + 1 :]) for i, o in enumerate(offset))


def _batch_dims(lay: _Layout) -> list[int]:
    """The mesh dimensions that shard the logits' tokens."""
    return [i for i, p in enumerate(lay.placements) if p.is_shard() and i != lay.vocab_mesh_dim]


def _sequence_dim(lay: _Layout, sp_group: Any) -> int | None:
    """The mesh dimension whose process group is ``sp_group`` (None without one), which must
    shard the logits' tokens: a reduced result is then summed over it and replicated there."""
    if sp_group is None:
        return None
    if not (torch.distributed.is_available() and isinstance(sp_group, torch.distributed.ProcessGroup)):
        return None  # the option's own check says what is wrong
    for i in _batch_dims(lay):
        if _same_group(lay.mesh.get_group(i), sp_group):
            return i
    raise ValueError(
        f"sp_group is not the process group of a mesh dimension that shards the logits' tokens (placements "
        f"{lay.placements}); pass the group of that dimension (mesh.get_group(dim)), or leave sp_group out to "
        f"get a sum pending over it (Partial)"
    )


def _see_group(dt, vocab_dim: int, seen: dict[str, Any]) -> None:
    """``seen["group"]``: the group of the mesh dimension that shards ``dt``'s vocabulary
    (``vocab_dim``), found before any check of the layout, so that a check failing on this
    rank only still reaches the other ranks through that group's metadata gather."""
    for i, p in enumerate(dt.placements):
        if p.is_shard() and p.dim % dt.dim() == vocab_dim and not hasattr(p, "split_factor"):
            seen["group"] = dt.device_mesh.get_group(i)
            return


def _named_tensors(spec, tensors, options):
    names = spec.inputs + ((spec.index,) if spec.index else ())
    yield from zip(names, tensors)
    for name in TENSOR_OPTIONS:
        yield name, options.get(name)


class _ToLocal(torch.autograd.Function):
    """``dt.to_local()`` whose backward gives the gradient the DTensor's own global shape and
    stride. torch's ``to_local`` backward infers the global stride from the local shard,
    which is wrong for uneven shards (V=9 on 2 ranks: (30, 10, 1) and (24, 8, 1) for
    (27, 9, 1)); ``AccumulateGrad`` then re-lays the gradient out, through a collective."""

    @staticmethod
    def forward(ctx, dt, grad_placements):
        ctx.meta = (dt.device_mesh, grad_placements or dt.placements, dt.shape, dt.stride())
        local = dt._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        mesh, placements, shape, stride = ctx.meta
        grad = _dtensor().DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride)
        return grad, None


def _to_local(dt, grad_placements: tuple | None = None):
    """``dt``'s local tensor; its gradient placed as ``dt`` (or as ``grad_placements``)."""
    return _ToLocal.apply(dt, grad_placements) if dt.requires_grad else dt.to_local()


def _sharded_head(t, names: _Torch) -> TypeGuard[Head]:
    return isinstance(t, Head) and isinstance(t.weight, names.DTensor)


def _local_input(name: str, t, lay: _Layout, lead: tuple, names: _Torch):
    """This rank's part of a logits input: a DTensor, or a Head whose weight is a DTensor,
    laid out like the first input (``lay``, logits ``lead + (V,)``); anything else as it is."""
    if _sharded_head(t, names):
        theirs = _head_layout(t, names)
        if (theirs.mesh, theirs.placements, theirs.vocab_size) != (lay.mesh, lay.placements, lay.vocab_size) or tuple(
            t.hidden.shape[:-1]
        ) != lead:
            raise ValueError(
                f"{name} is a Head standing for logits of shape {tuple(t.hidden.shape[:-1]) + (theirs.vocab_size,)} "
                f"placed {theirs.placements}; it must be laid out like the first input (shape "
                f"{lead + (lay.vocab_size,)}, placements {lay.placements}, same mesh)"
            )
        return _local_head(t, names)
    if isinstance(t, names.DTensor):
        shape = lead + (lay.vocab_size,)
        if t.device_mesh != lay.mesh or _placements(t, names) != lay.placements or tuple(t.shape) != shape:
            raise ValueError(
                f"{name} is a DTensor of shape {tuple(t.shape)} with placements "
                f"{tuple(t.placements)}; it must be laid out like the first input "
                f"(shape {shape}, placements {lay.placements}, same mesh): "
                f"{name}.redistribute(mesh, placements)"
            )
        return _to_local(t)
    return t


def _head_layout(head: Head, names: _Torch, seen: dict | None = None) -> _Layout:
    """The layout of the logits a Head with a DTensor weight stands for. The weight's
    ``Shard(0)`` (its vocabulary) is the logits' last dimension; on the weight's other mesh
    dimensions (replicated) the batch is placed as the hidden DTensor places it. A plain
    hidden tensor is taken as replicated, which only a 1-D mesh allows."""
    w: Any = head.weight  # DTensors (device_mesh, placements)
    h: Any = head.hidden
    ndim = h.dim()
    strided = [i for i, p in enumerate(w.placements) if hasattr(p, "split_factor")]
    if strided:
        # FSDP2 over a TP weight: between forwards each rank holds a slice of its vocabulary
        # shard, and the head needs the whole shard, which only FSDP2's all-gather gives
        raise ValueError(
            f"Head.weight is a DTensor placed {tuple(w.placements)}: mesh dimension {strided[0]} shards each "
            f"vocabulary shard again (_StridedShard), as FSDP2 leaves a tensor-parallel weight between forward "
            f"passes. Pass the weight FSDP2 gathers for the forward (Shard(0) on the TP mesh only): build the Head "
            f"inside the forward of the fully_shard unit that holds the weight -- shard the head together with "
            f"the module that runs before it, fully_shard([model.norm, model.lm_head]), as transformers does -- or "
            f"call unshard() on that unit first"
        )
    hidden = _placements(h, names) if isinstance(h, names.DTensor) else None
    if hidden is None and w.device_mesh.ndim > 1:
        raise ValueError(
            f"Head.weight is a DTensor on a {w.device_mesh.ndim}-D mesh but hidden is a plain tensor; pass "
            f"hidden as a DTensor on the same mesh (so that the batch's placement is known), replicated "
            f"on the mesh dimension that shards the vocabulary"
        )
    if hidden is not None and (h.device_mesh != w.device_mesh or not head.reduce_hidden_grad):
        raise ValueError(
            "Head: a DTensor hidden must be on the weight's mesh, and gets its complete gradient "
            "(reduce_hidden_grad=False is for plain tensors whose framework all-reduces it)"
        )
    if head.bias is not None and (
        not isinstance(head.bias, names.DTensor)
        or head.bias.device_mesh != w.device_mesh
        or _placements(head.bias, names) != _placements(w, names)
    ):
        raise ValueError("Head.bias must be a DTensor placed like Head.weight (Shard(0) on the same mesh dimension)")
    sequence = _sequence_dims(head, names)
    if head.sequence_parallel and not sequence:
        raise ValueError(
            "Head(sequence_parallel=True) with a DTensor weight takes hidden as a DTensor placed Shard(0) on the "
            "weight's vocabulary mesh dimension (its tokens split over the TP ranks); the placement says so, "
            "sequence_parallel may then be left out"
        )
    placements = []
    for i, p in enumerate(_placements(w, names)):
        q = hidden[i] if hidden is not None else names.Replicate()
        if p.is_shard() and p.dim == 0 and (q.is_replicate() or i in sequence):
            placements.append(names.Shard(ndim - 1))  # a sequence-parallel hidden: every rank's tokens
        elif p.is_replicate() and not (q.is_shard() and q.dim == ndim - 1):
            placements.append(q)
        else:
            raise ValueError(
                f"Head.weight placed {p} and hidden placed {q} on mesh dimension {i}: vtp_runtime takes "
                f"the weight's Shard(0) (the vocabulary) with a replicated hidden on one mesh dimension, "
                f"and a replicated weight elsewhere (the hidden's batch sharded or replicated there)"
            )
    return _layout_for(w.device_mesh, tuple(placements), tuple(h.shape[:-1]) + (w.shape[0],), names, seen)


def _sequence_dims(head: Head, names: _Torch) -> list[int]:
    """The mesh dimensions where a Head's hidden DTensor is sharded on its first (token)
    dimension and its weight on the vocabulary: Megatron's sequence parallelism."""
    h: Any = head.hidden
    w: Any = head.weight
    if not isinstance(h, names.DTensor) or h.dim() < 2 or h.device_mesh != w.device_mesh:
        return []
    return [
        i
        for i, (p, q) in enumerate(zip(_placements(w, names), _placements(h, names)))
        if p.is_shard() and p.dim == 0 and q.is_shard() and q.dim == 0
    ]


def _local_head(head: Head, names: _Torch) -> Head:
    """The Head of this rank's local tensors. Where the hidden DTensor shards the batch, the
    replicated weight and bias get a pending sum (``Partial``) as gradient: each batch shard
    holds its part, as torch's own DTensor matmul gives it. A hidden sharded over the tokens
    on the vocabulary's mesh dimension makes a sequence-parallel Head, whose weight gradient
    covers every token there."""
    h: Any = head.hidden
    weight: Any = head.weight
    batch = _placements(h, names) if isinstance(h, names.DTensor) else ()
    sequence = _sequence_dims(head, names)
    weight_grad = tuple(
        names.Partial() if i < len(batch) and batch[i].is_shard() and i not in sequence else p
        for i, p in enumerate(weight.placements)
    )
    h = _to_local(h) if batch else h
    w = _to_local(weight, weight_grad)
    b = None if head.bias is None else _to_local(head.bias, weight_grad)
    return Head(h, w, b, head.reduce_hidden_grad, chunk_rows=head.chunk_rows, sequence_parallel=bool(sequence))


def _local_part(name: str, t, lay: _Layout, names: _Torch):
    """This rank's part of labels, index or mask: a plain tensor is taken as it is; a
    DTensor must be replicated, or sharded over the batch like the logits."""
    if not isinstance(t, names.DTensor):
        return t
    target = tuple(names.Replicate() if i == lay.vocab_mesh_dim else p for i, p in enumerate(lay.placements))
    placements = _placements(t, names)
    if t.device_mesh != lay.mesh or (placements != target and not all(p.is_replicate() for p in placements)):
        raise ValueError(
            f"{name} is a DTensor with placements {placements}; it must be on the logits' mesh "
            f"and either replicated or placed {target} (the logits' batch sharding)"
        )
    if placements != target:  # replicated: keep this rank's batch (no communication)
        t = t.redistribute(lay.mesh, target)
    return t.to_local()


def _same_group(a, b) -> bool:
    if a is b:
        return True
    ranks = torch.distributed.get_process_group_ranks
    return ranks(a) == ranks(b)


def _check_layout_options(lay: _Layout, options: dict[str, Any]) -> None:
    group = options.get("tp_group")
    if group is not None and not _same_group(group, lay.group):
        raise ValueError(
            f"tp_group is not the process group of mesh dimension {lay.vocab_mesh_dim}, which "
            f"shards the logits DTensor's vocabulary; leave tp_group out (the DTensor gives it)"
        )
    if options.get("vocab_start") is not None or options.get("vocab_end") is not None:
        raise ValueError(
            f"vocab_start/vocab_end come from the logits DTensor's placement (this rank holds "
            f"[{lay.vocab_start}, {lay.vocab_end})); leave them out, or pass plain local tensors "
            f"(.to_local()) to use another tiling"
        )
    stated = options.get("global_vocab_size")
    if stated is not None and stated != lay.vocab_size:
        raise ValueError(f"global_vocab_size={stated!r} but the logits DTensor's vocabulary has V={lay.vocab_size}")


def _wrapper(lay: _Layout, lead: tuple, reduced: bool, names: _Torch, sequence_dim: int | None = None) -> Wrap:
    """Wraps this rank's result into a DTensor; ``lead`` is the global shape of the logits
    without the vocabulary; ``sequence_dim``: the mesh dimension of ``sp_group``, over which
    a reduced result is summed already."""
    DTensor, Replicate, Partial = names.DTensor, names.Replicate, names.Partial
    if reduced:  # a scalar: each batch shard holds its part of the sum (summed over sp_group)
        placements = tuple(
            Partial() if p.is_shard() and i not in (lay.vocab_mesh_dim, sequence_dim) else Replicate()
            for i, p in enumerate(lay.placements)
        )
    else:  # the logits' batch sharding; replicated over the vocabulary's mesh dimension
        placements = tuple(Replicate() if i == lay.vocab_mesh_dim else p for i, p in enumerate(lay.placements))

    def wrap(out: Tensor):
        shape = () if reduced else lead + tuple(out.shape[len(lead) :])  # + (k,) for top-k log-probs
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        return DTensor.from_local(out, lay.mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)

    return wrap


def index_and_mask(
    spec: OpSpec, topk: bool, n: int, index: Tensor | None, options: Mapping[str, Any]
) -> tuple[Tensor | None, Tensor | None]:
    """The index as int64 rows (``[N]``, ``[N, k]``) for ops that take one, else the mask as
    bool ``[N]``: ``mask`` and ``labels != ignore_index`` combined (None: every token counts)."""
    if spec.index:
        assert index is not None  # the op takes an index: checked with the call
        return (index.reshape(n, index.shape[-1]) if topk else index.reshape(n)).long(), None
    mask, labels = options.get("mask"), options.get("labels")
    if mask is not None:
        mask = mask.reshape(n)
    if labels is not None:
        keep = labels.reshape(n) != options.get("ignore_index", -100)
        mask = keep if mask is None else mask & keep
    return None, mask
