"""One correctness case, run on every rank: shard fresh random logits, call vtp_runtime,
compare values and local gradients with the float64 dense reference on the full logits.

Every rank draws the same full inputs from the case's seed, takes its own vocabulary
shard, and checks its own gradient slice, so a wrong shard offset or a missing cross-rank
term fails on the rank where it happens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

import vtp_runtime as vtp
from vtp_runtime.ops import get_spec

from .reference import values_and_grads

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# Elementwise relative tolerance of gradients, which are rounded to the input dtype.
GRAD_RTOL = {"float32": 2e-4, "bfloat16": 2e-2, "float16": 4e-3, "float64": 1e-7}
VALUE_RTOL = {"float32": 2e-5, "bfloat16": 2e-5, "float16": 2e-5, "float64": 1e-9}
# the edge inputs make_inputs knows (see there); any other name is refused, not ignored
EDGES = ("", "neg_inf", "offset", "disjoint", "all_neg_inf", "all_neg_inf_masked", "bad_index")
# Memory layouts of the local inputs (``Case.view``); each holds the same values as the
# contiguous shard. Padding the views skip holds NaN, so reading it shows.
VIEWS = {
    "transposed": "vocabulary-major storage, sliced, like (W @ h.T).T[..., a:b] (vocabulary stride != 1)",
    "every_other": "every other column of a wider tensor, x[..., ::2] (vocabulary stride 2)",
    "permuted": "[batch, seq] stored seq-major with padded rows (3-D, rows without a single stride)",
    "expanded_teacher": "one teacher row broadcast to every token with expand (row stride 0)",
}


@dataclass(frozen=True)
class Case:
    op: str
    dtype: str = "float32"
    shape: tuple[int, ...] = (3, 4)  # leading (token) shape
    vocab: int = 37  # global V (rounded down to a multiple of the TP size for "even")
    layout: str = "uneven"  # "even", "uneven", "empty" (rank 1 holds none) or "explicit" (permuted)
    options: tuple[tuple[str, Any], ...] = ()  # e.g. (("label_smoothing", 0.1),)
    topk: int = 0  # logprobs: index with a trailing k dimension
    masked: str = ""  # "", "labels" or "mask": how tokens are masked (about a quarter)
    grads: tuple[bool, bool] = (True, True)  # (student/logits, teacher) require grad
    edge: str = ""  # one of EDGES
    strided: bool = False  # pass a causal-shift view logits[:, :-1]
    view: str = ""  # another memory layout of the local inputs, one of VIEWS
    second_order: bool = False  # take the gradient with create_graph=True; differentiating it must raise
    backend: str | None = "eager"
    device: str = "cpu"  # "cuda": each rank's current CUDA device
    seed: int = 0
    scale: float = 3.0

    def __post_init__(self) -> None:
        if self.edge not in EDGES:
            raise ValueError(f"unknown edge {self.edge!r}; make_inputs knows {EDGES[1:]}")

    def with_(self, **kw) -> Case:
        return replace(self, **kw)

    @property
    def id(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        parts = [
            self.op,
            self.dtype,
            self.layout,
            opts,
            f"k{self.topk}" if self.topk else "",
            self.masked,
            self.edge,
            "strided" if self.strided else "",
            self.view,
            "second_order" if self.second_order else "",
            "" if self.grads == (True, True) else f"grads{int(self.grads[0])}{int(self.grads[1])}",
        ]
        return "-".join(p for p in parts if p)


def shard_sizes(layout: str, vocab: int, world: int, seed: int) -> tuple[list[int], list[int] | None]:
    """(V_local per rank, explicit vocab_start per rank or None for rank order)."""
    g = torch.Generator().manual_seed(1000 + seed)
    if layout == "even" or world == 1 and layout != "explicit":
        return [vocab // world] * world, None
    if layout == "uneven":
        cuts = sorted(torch.randperm(vocab - 1, generator=g)[: world - 1].add(1).tolist())
        bounds = [0, *cuts, vocab]
        return [bounds[i + 1] - bounds[i] for i in range(world)], None
    if layout == "empty":  # rank 1 (or the only rank) holds nothing... the only rank can't
        sizes, _ = shard_sizes("uneven", vocab, world - 1, seed)
        return sizes[:1] + [0] + sizes[1:], None
    if layout == "explicit":  # uneven shards laid out in a permuted order
        sizes, _ = shard_sizes("uneven", vocab, world, seed) if world > 1 else ([vocab], None)
        order = torch.randperm(world, generator=g).tolist()
        starts, pos = [0] * world, 0
        for r in order:
            starts[r] = pos
            pos += sizes[r]
        return sizes, starts
    raise ValueError(f"unknown layout {layout!r}")


def make_inputs(case: Case, vocab: int):
    """Full inputs, identical on every rank: logits tuple, index, mask/labels options."""
    g = torch.Generator().manual_seed(case.seed)
    spec = get_spec(case.op)
    n = math.prod(case.shape)
    shape = (*case.shape, vocab)
    logits = [torch.randn(shape, generator=g, dtype=torch.float64) * case.scale for _ in spec.inputs]
    ignore = dict(case.options).get("ignore_index", -100)
    if case.edge == "neg_inf":  # a masked-out vocabulary slice and scattered -inf
        for z in logits:
            z[..., : max(1, vocab // 5)] = -math.inf
        holes = torch.rand(n, vocab, generator=g) < 0.2
        for z in logits:  # the same holes in teacher and student: KL stays finite
            z.view(n, vocab)[holes] = -math.inf
    if case.edge == "offset":
        for z in logits:
            z += 1e4
    if case.edge == "disjoint" and len(logits) == 2:  # teacher and student supports disjoint
        half = vocab // 2
        logits[0][..., :half] = -math.inf
        logits[1][..., half:] = -math.inf
    if case.edge in ("all_neg_inf_masked", "all_neg_inf"):
        for z in logits:
            z.view(n, vocab)[0] = -math.inf
    if case.view == "expanded_teacher":  # every token's teacher row is the first one's
        assert len(logits) == 2, "expanded_teacher needs a two-input op"
        logits[1] = logits[1].reshape(n, vocab)[:1].expand(n, vocab).reshape(shape).clone()
    logits = [z.to(DTYPES[case.dtype]) for z in logits]
    index = None
    if spec.index:
        ishape = (*case.shape, case.topk) if case.topk else case.shape
        index = torch.randint(0, vocab, ishape, generator=g)
        if case.masked:
            index[torch.rand(ishape, generator=g) < 0.25] = ignore
        if case.edge == "all_neg_inf_masked":
            index.view(n, -1)[0] = ignore
        if case.edge == "bad_index":
            index.view(-1)[1] = vocab + 3
        if case.edge in ("neg_inf", "disjoint"):  # labels where the logit is finite
            flat = logits[0].view(n, vocab)
            best = flat.float().argmax(-1)
            index = best.view(case.shape) if not case.topk else best.view(*case.shape, 1).expand(ishape).clone()
    extra = {}
    if not spec.index and (case.masked or case.edge == "all_neg_inf_masked"):
        keep = torch.rand(case.shape, generator=g) >= 0.25
        if case.edge == "all_neg_inf_masked":
            keep.view(-1)[0] = False
        if case.masked == "labels":
            labels = torch.randint(0, vocab, case.shape, generator=g)
            labels[~keep] = ignore
            extra["labels"] = labels
        else:
            extra["mask"] = keep
    return logits, index, extra


def laid_out(local: torch.Tensor, view: str, need: bool) -> torch.Tensor:
    """The values of ``local`` ``[..., V_local]`` in the memory layout ``view`` (see VIEWS):
    a view of a new base tensor, which requires grad when ``need`` (so the gradient reaches
    the view through autograd's view functions, as it does for a user's tensor)."""
    v = local.shape[-1]
    nan = torch.tensor(math.nan, dtype=local.dtype, device=local.device)
    if view == "transposed":  # [V + 2, ...] storage, a NaN column each side
        base = nan.expand(v + 2, *local.shape[:-1]).clone()
        base[1:-1] = local.movedim(-1, 0)
        return base.requires_grad_(need).movedim(0, -1)[..., 1 : v + 1]
    if view == "every_other":
        base = nan.expand(*local.shape[:-1], 2 * v).clone()
        base[..., ::2] = local
        return base.requires_grad_(need)[..., ::2]
    if view == "permuted":  # [A, B, V] as a transposed [B, A, V + 1]
        assert local.dim() == 3, "the permuted view needs a [batch, seq] token shape"
        a, b = local.shape[:2]
        base = nan.expand(b, a, v + 1).clone()
        base[..., :v] = local.transpose(0, 1)
        return base.requires_grad_(need).transpose(0, 1)[..., :v]
    if view == "expanded_teacher":  # make_inputs gave every token the same teacher row
        rows = local.reshape(math.prod(local.shape[:-1]), v)  # not -1: an empty shard has v = 0
        base = rows[:1].clone()
        return base.requires_grad_(need).expand(rows.shape).reshape(local.shape)
    raise ValueError(f"unknown view {view!r}; known: {', '.join(VIEWS)}")


def run_case(rank: int, world: int, group, case: Case) -> dict:
    """Run ``case`` on this rank and assert it matches the reference. Returns max errors."""
    torch.manual_seed(case.seed)
    full_vocab = case.vocab - case.vocab % world if case.layout == "even" else case.vocab
    sizes, starts = shard_sizes(case.layout, full_vocab, world, case.seed)
    full_vocab = sum(sizes)
    logits, index, extra = make_inputs(case, full_vocab)
    start = starts[rank] if starts is not None else sum(sizes[:rank])
    end = start + sizes[rank]
    opts = dict(case.options)
    if case.strided:  # a causal-shift view: the last position of every sequence dropped
        assert len(case.shape) == 2, "strided cases need a [batch, seq] token shape"
        logits = [z[:, :-1] for z in logits]
        index = None if index is None else index[:, :-1]
        extra = {k: v[:, :-1] for k, v in extra.items()}
    lead = logits[0].shape[:-1]
    n = math.prod(lead)
    dev = torch.device("cuda", torch.cuda.current_device()) if case.device == "cuda" else torch.device(case.device)
    index = None if index is None else index.to(dev)
    extra_dev = {k: v.to(dev) for k, v in extra.items()}
    # local shards: slice a padded copy so that strided views stay strided views
    assert not (case.strided and case.view), "strided and view are separate layouts"
    local = []
    for i, (z, need) in enumerate(zip(logits, case.grads)):
        if case.strided:  # the shard of the full [B, S, V] logits, then the view
            base = torch.cat([z, z[:, :1]], dim=1)[..., start:end].contiguous().to(dev)
            shard = base.requires_grad_(need)[:, :-1] if need else base[:, :-1]
        elif case.view and not (case.view == "expanded_teacher" and i == 0):
            shard = laid_out(z[..., start:end].to(dev), case.view, need)
        else:
            shard = z[..., start:end].contiguous().to(dev).requires_grad_(need)
        local.append(shard)
    before = [t.detach().clone() for t in local]
    kwargs = {**opts, **extra_dev, "tp_group": group if world > 1 else None}
    if case.layout == "explicit":
        kwargs.update(vocab_start=start, vocab_end=end)
    if case.backend:
        kwargs["backend"] = case.backend
    tensors = local + ([index] if index is not None else [])
    out = vtp.loss(case.op, *tensors, **kwargs)

    # the reference runs on the case's device (float64 is quick on a GPU at real sizes);
    # its results come back to the CPU for the comparisons
    flat_logits = tuple(z.reshape(n, full_vocab).to(dev) for z in logits)
    flat_index = None if index is None else index.reshape(n, case.topk) if case.topk else index.reshape(n)
    flat_extra = {k: v.reshape(n).to(dev) for k, v in extra.items()}
    outs = outputs(out)
    ref_outs, upstreams, ref_rows, ref_grads = reference(
        case, flat_logits, flat_index, flat_extra, [o.shape for o in outs], case.grads[: len(flat_logits)]
    )
    del flat_logits
    errors: dict[str, float] = {}
    close_values(outs, ref_outs, VALUE_RTOL[case.dtype], errors)  # fp32 accumulation against float64
    if any(t.requires_grad for t in local):
        wanted = [t for t in local if t.requires_grad]

        def objective():
            return weighted_sum(outs, upstreams)

        # with second_order, the first backward builds a graph of the gradient
        grads = torch.autograd.grad(objective(), wanted, retain_graph=True, create_graph=case.second_order)
        if case.second_order:
            _check_no_second_order(case.op, grads, wanted)
            grads = tuple(gr.detach() for gr in grads)
        it = iter(grads)
        for i, (t, rg) in enumerate(zip(local, ref_grads)):
            if not t.requires_grad:
                continue
            got = next(it)
            assert got.dtype == t.dtype, f"gradient dtype {got.dtype} != input dtype {t.dtype}"
            want = rg.reshape(n, full_vocab)[:, start:end].reshape(t.shape)
            # the gradient of a token whose value is inf or NaN is undefined: skip those rows,
            # but every other row must still match (no NaN leaking across tokens)
            got = got.cpu()
            undefined = ~torch.isfinite(ref_rows).reshape(*t.shape[:-1], 1).expand(t.shape)
            got = torch.where(undefined, torch.zeros((), dtype=got.dtype), got)
            want = torch.where(undefined, torch.zeros((), dtype=want.dtype), want)
            close(f"grad[{i}]", got.cpu().double(), want, GRAD_RTOL[case.dtype], errors)
        # a second backward through the retained graph gives the same gradient, or a
        # RuntimeError of the backend's saying why it cannot (Liger's kernels overwrite what
        # they saved), never a different gradient
        try:
            again = torch.autograd.grad(objective(), wanted)
        except RuntimeError as exc:
            assert not torch_refusal(exc), f"a second backward hit torch's own refusal: {exc}"
        else:
            for a, b in zip(grads, again):
                assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), "second backward differs from the first"
    for t, b in zip(local, before):
        assert torch.equal(torch.nan_to_num(t.detach()), torch.nan_to_num(b)), "an input was modified"
    return errors


def torch_refusal(exc: RuntimeError) -> bool:
    """torch's own error for a graph freed by the first backward: the op kept too little,
    not a backend's deliberate refusal."""
    return "backward through the graph a second time" in str(exc)


def _check_no_second_order(op: str, grads, inputs) -> None:
    """Differentiating a gradient of a vtp_runtime op (a gradient penalty) must raise, never
    give a second-order term that is silently missing."""
    penalty = sum(gr.double().nan_to_num().pow(2).sum() for gr in grads)
    try:
        torch.autograd.grad(penalty, inputs, retain_graph=True)
    except RuntimeError as exc:
        assert "second-order gradients" in str(exc), f"{op}: differentiating the gradient raised {exc!r}"
    else:
        raise AssertionError(
            f"{op}: differentiating the gradient (create_graph=True) gave a number; it must "
            f"raise, since the second-order term is not computed"
        )


def outputs(out) -> tuple[torch.Tensor, ...]:
    """A call's outputs as a tuple: ``logprobs`` with ``return_entropy`` has two."""
    return out if isinstance(out, tuple) else (out,)


def weighted_sum(outs: tuple[torch.Tensor, ...], upstreams) -> torch.Tensor:
    """``sum_i sum(outs[i] * upstreams[i])`` in float64: the objective whose gradients are checked."""
    return sum((o.double() * u.to(o.device)).sum() for o, u in zip(outs, upstreams))


def reference(case: Case, flat_logits, flat_index, flat_extra: dict, out_shapes, needs_grad: tuple[bool, ...]):
    """The float64 reference of ``case`` on the full ``[N, V]`` logits (on their device), for a
    call whose outputs have the shapes ``out_shapes`` (one; two for ``logprobs`` with
    ``return_entropy``: the log-probs, then the entropy of the tokens whose index is not
    entirely ``ignore_index``). Returns, on the CPU: ``(per output: its value (shaped like it,
    or reduced), per output: the upstream gradient to back-propagate from it, per-token values
    (non-finite where any output's is), float64 gradient of sum_i sum(output_i * upstream_i)
    w.r.t. each logits input or None)``."""
    opts = dict(case.options)
    parts = [(case.op, flat_index, flat_extra)]
    if opts.get("return_entropy"):
        kept = (flat_index if case.topk else flat_index[:, None]) != opts.get("ignore_index", -100)
        parts.append(("entropy", None, {"mask": kept.any(-1)}))
    assert len(out_shapes) == len(parts), f"{len(out_shapes)} outputs, expected {len(parts)}"
    g = torch.Generator().manual_seed(case.seed + 7)
    values, upstreams, rows, grads = [], [], 0, None
    for (op, index, extra), shape in zip(parts, out_shapes):
        upstream = (
            torch.randn(shape, generator=g, dtype=torch.float64)
            if len(shape)
            else torch.tensor(1.5, dtype=torch.float64)
        )
        value, part_rows, part_grads = _reference_output(
            case, op, flat_logits, index, extra, shape, upstream, needs_grad
        )
        values.append(value)
        upstreams.append(upstream)
        rows = rows + part_rows
        grads = part_grads if grads is None else tuple(a if b is None else a + b for a, b in zip(grads, part_grads))
    return values, upstreams, rows, grads


def _reference_output(
    case: Case, op: str, flat_logits, flat_index, flat_extra: dict, out_shape, upstream, needs_grad: tuple[bool, ...]
):
    """One output's reference: ``(value, per-token values, gradients)``, on the CPU."""
    opts = dict(case.options)
    n, dev = flat_logits[0].shape[0], flat_logits[0].device
    reduction = opts.get("reduction", "none")
    ref_opts = {k: v for k, v in opts.items() if k not in ("reduction", "normalizer", "return_entropy")}
    ref_vals, _ = values_and_grads(op, flat_logits, flat_index, **ref_opts, **flat_extra)
    ref_vals = ref_vals.cpu()
    ref_rows = ref_vals if ref_vals.dim() == 1 else ref_vals.sum(-1)  # per token
    ref_vals = ref_vals.view(out_shape) if reduction == "none" else ref_vals
    # the reference of the reduction, and the upstream gradient it sends to every token
    if reduction == "none":
        topk = flat_index is not None and flat_index.dim() == 2  # [N, k] values
        per_token_grad = upstream.reshape(flat_index.shape) if topk else upstream.reshape(n)  # [0, k] too
        ref_out = ref_vals
    else:
        ii = opts.get("ignore_index", -100)
        if flat_index is not None:
            count = (flat_index != ii).sum()
        elif flat_extra:
            keep = flat_extra.get("mask", torch.ones(n, dtype=torch.bool, device=dev))
            if "labels" in flat_extra:
                keep = keep & (flat_extra["labels"] != ii)
            count = keep.sum()
        else:
            count = torch.tensor(n)
        div = opts.get("normalizer") or (1 if reduction == "sum" else max(int(count), 1))
        ref_out = ref_vals.sum() / div
        per_token_grad = torch.full(ref_vals.shape, float(upstream) / div, dtype=torch.float64)
    _, ref_grads = values_and_grads(
        op, flat_logits, flat_index, per_token_grad.to(dev), needs_grad=needs_grad, **ref_opts, **flat_extra
    )
    return ref_out, ref_rows, tuple(None if rg is None else rg.cpu() for rg in ref_grads)


def close_values(outs: tuple[torch.Tensor, ...], ref_outs: Any, rtol: float, errors: dict) -> None:
    """``close`` for each output of a call against its reference, named ``value``, ``value[1]``, ..."""
    for i, (o, ref_out) in enumerate(zip(outs, ref_outs)):
        close(
            "value" if i == 0 else f"value[{i}]",
            o.detach().cpu().double(),
            ref_out.double().reshape(o.shape),
            rtol,
            errors,
        )


def close(what: str, got: torch.Tensor, want: torch.Tensor, rtol: float, errors: dict) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_got, nan_want), (
        f"{what}: NaN at {nan_got.nonzero().tolist()[:5]}, reference NaN at {nan_want.nonzero().tolist()[:5]}"
    )
    inf_want = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf_want) and torch.equal(got[inf_want], want[inf_want]), (
        f"{what}: infinities differ from the reference"
    )
    finite = ~(nan_want | inf_want)
    g, w = got[finite], want[finite]
    scale = w.abs().max().item() if w.numel() else 0.0
    atol = rtol * max(scale, 1e-3)
    err = (g - w).abs()
    bad = err > atol + rtol * w.abs()
    errors[what] = err.max().item() if err.numel() else 0.0
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {w.numel()} elements off; max error "
        f"{errors[what]:.3g} (atol {atol:.3g}, rtol {rtol:g}); first bad at "
        f"{bad.nonzero()[0].tolist()}: got {g[bad][0].item():.6g}, want {w[bad][0].item():.6g}"
    )
