"""One correctness case with ``vtp.Head`` inputs, run on every rank: fresh random hidden
states and full weights, this rank's vocabulary shard of each weight, the op through
``Head``; values and the gradients of hidden, weight and bias against the float64 dense
reference on ``logits = hidden @ W.T + b`` computed in float64 (``reference.py`` via
``cases.reference``).

Every rank checks its own hidden gradient -- the full one (``dlogits @ W`` over the whole
vocabulary) by default, this rank's partial sum with ``reduce_hidden_grad=False``, this
rank's rows of the full one for a sequence-parallel Head (``sequence``: each rank passes its
shard of the tokens, split along the first token dimension) -- and its own weight and bias
shard gradients. The chunk size is small so that calls run several
token chunks (and so several rounds of cross-rank statistics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

import vtp_runtime as vtp
from vtp_runtime.ops import get_spec

from .cases import (
    DTYPES,
    GRAD_RTOL,
    Case,
    close,
    close_values,
    make_inputs,
    outputs,
    reference,
    shard_sizes,
    torch_refusal,
    weighted_sum,
)

# Values go through logits rounded to the input dtype (the reference's are float64), so the
# low-precision tolerances are those of the logits, not of the op.
HEAD_VALUE_RTOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 4e-3, "float64": 1e-9}
# how a sequence-parallel Head's tokens can be split over the ranks (see token_split)
TOKEN_SPLITS = ("even", "uneven", "empty")


@dataclass(frozen=True)
class HeadCase(Case):
    """A ``Case`` whose inputs are ``vtp.Head``s where ``heads`` says so (per op input: student
    or logits, teacher). ``grads`` says which inputs require grad; within a Head that does,
    ``head_grads`` names the parts: ``h`` hidden, ``w`` weight, ``b`` bias."""

    heads: tuple[bool, ...] = (True, True)
    hidden: int = 8  # H
    bias: bool = False
    head_grads: str = "hwb"
    reduce_hidden_grad: bool = True
    chunk_rows: int | None = 5
    # Head(sequence_parallel=True): how the first token dimension is split over the ranks
    # (one of TOKEN_SPLITS; "empty": rank 1 holds none), "" for a hidden replicated on every rank;
    # sequence_inputs says which Head inputs are sequence-parallel (the others replicated)
    sequence: str = ""
    sequence_inputs: tuple[bool, bool] = (True, True)

    @property
    def id(self) -> str:
        n_in = len(get_spec(self.op).inputs)
        kinds = "".join("H" if h else "L" for h in self.heads[:n_in])
        extra = [
            f"head{kinds}",
            f"H{self.hidden}",
            "bias" if self.bias else "",
            "" if self.head_grads == "hwb" else f"g-{self.head_grads or 'none'}",
            "" if self.reduce_hidden_grad else "partial",
            f"rows{self.chunk_rows}",
            f"sp-{self.sequence}" + ("" if self.sequence_inputs == (True, True) else f"-{self.sequence_inputs}")
            if self.sequence
            else "",
        ]
        return "-".join(p for p in [super().id, *extra] if p)


def _head_tensors(case: HeadCase, vocab: int, n_inputs: int):
    """Full float64 (hidden, weight, bias) per Head input, identical on every rank, already
    rounded to the case's dtype."""
    g = torch.Generator().manual_seed(case.seed + 100)
    dtype = DTYPES[case.dtype]
    out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None] = []
    for i in range(n_inputs):
        if not case.heads[i]:
            out.append(None)
            continue
        hidden = torch.randn(*case.shape, case.hidden, generator=g, dtype=torch.float64)
        scale = case.scale / math.sqrt(case.hidden)
        weight = torch.randn(vocab, case.hidden, generator=g, dtype=torch.float64) * scale
        bias = None
        if case.bias or case.edge == "neg_inf":
            bias = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.5
            if case.edge == "neg_inf":  # a masked-out vocabulary slice, through the bias
                bias[: max(1, vocab // 5)] = -math.inf
            bias = bias.to(dtype).double()
        out.append((hidden.to(dtype).double(), weight.to(dtype).double(), bias))
    return out


def token_split(layout: str, tokens: int, world: int, seed: int) -> list[int]:
    """Tokens per rank of a sequence-parallel Head: ``even`` (the remainder to the first
    ranks), ``uneven`` (random cuts, no rank empty where the tokens allow) or ``empty``
    (rank 1 holds none, the others uneven)."""
    if layout not in TOKEN_SPLITS:
        raise ValueError(f"unknown token split {layout!r}; known: {', '.join(TOKEN_SPLITS)}")
    if layout == "even":
        return [tokens // world + (r < tokens % world) for r in range(world)]
    g = torch.Generator().manual_seed(seed + 7)
    holders = [r for r in range(world) if not (layout == "empty" and r == 1)]
    k = len(holders)
    if tokens >= k:
        cuts = sorted((torch.randperm(tokens - 1, generator=g)[: k - 1] + 1).tolist()) if k > 1 else []
    else:
        cuts = sorted(torch.randint(0, tokens + 1, (k - 1,), generator=g).tolist())
    parts = [b - a for a, b in zip([0, *cuts], [*cuts, tokens])]
    out = [0] * world
    for r, n in zip(holders, parts):
        out[r] = n
    return out


def run_head_case(rank: int, world: int, group, case: HeadCase) -> dict:
    """Run ``case`` on this rank and assert it matches the reference. Returns max errors."""
    spec = get_spec(case.op)
    n_in = len(spec.inputs)
    full_vocab = case.vocab - case.vocab % world if case.layout == "even" else case.vocab
    sizes, starts = shard_sizes(case.layout, full_vocab, world, case.seed)
    full_vocab = sum(sizes)
    logits, index, extra = make_inputs(case, full_vocab)  # logits inputs, index, mask/labels
    parts = _head_tensors(case, full_vocab, n_in)
    start = starts[rank] if starts is not None else sum(sizes[:rank])
    end = start + sizes[rank]
    n = math.prod(case.shape)
    dtype = DTYPES[case.dtype]
    dev = torch.device("cuda", torch.cuda.current_device()) if case.device == "cuda" else torch.device(case.device)
    flat_logits = []
    for i in range(n_in):
        if parts[i] is None:
            flat_logits.append(logits[i].reshape(n, full_vocab).double())
        else:
            h, w, b = parts[i]
            z = h.reshape(n, case.hidden) @ w.T
            flat_logits.append(z if b is None else z + b)
    if case.edge == "neg_inf" and index is not None:  # labels where the logit is finite
        best = flat_logits[0].argmax(-1)
        index = best.view(case.shape) if not case.topk else best.view(*case.shape, 1).expand(index.shape).clone()

    # a sequence-parallel Head: this rank's tokens [first, first + rows[rank]) of the first dim
    spread = bool(case.sequence) and len(case.shape) > 0
    rows = token_split(case.sequence, case.shape[0], world, case.seed) if spread else []
    first = sum(rows[:rank])
    tokens = slice(first, first + rows[rank]) if spread else slice(None)

    # this rank's arguments: a Head of local shards, or the local logits shard
    args: list[Any] = []
    leaves: list[torch.Tensor] = []
    checks: list[tuple[str, Any, torch.Tensor, torch.Tensor | None]] = []  # what, tensor, expected grad, rows
    for i in range(n_in):
        need = case.grads[i]
        if parts[i] is None:
            z = logits[i][..., start:end].contiguous().to(dev).requires_grad_(need)
            args.append(z)
            leaves.append(z)
            continue
        h, w, b = parts[i]
        sp = spread and case.sequence_inputs[i]
        local = [
            (h[tokens] if sp else h).to(dtype).to(dev),
            w[start:end].to(dtype).to(dev),
            None if b is None else b[start:end].to(dtype).to(dev),
        ]
        for t, letter in zip(local, "hwb"):
            if t is not None:
                t.requires_grad_(need and letter in case.head_grads)
        args.append(
            vtp.Head(
                local[0],
                local[1],
                local[2],
                reduce_hidden_grad=case.reduce_hidden_grad,
                chunk_rows=case.chunk_rows,
                sequence_parallel=sp,
            )
        )
        leaves += [t for t in local if t is not None]
    before = [t.detach().clone() for t in leaves]
    if index is not None:
        args.append(index.to(dev))
    kwargs = {
        **dict(case.options),
        **{k: v.to(dev) for k, v in extra.items()},
        "tp_group": group if world > 1 else None,
    }
    if case.layout == "explicit":
        kwargs.update(vocab_start=start, vocab_end=end)
    if case.backend:
        kwargs["backend"] = case.backend
    out = vtp.loss(case.op, *args, **kwargs)

    flat_index = None if index is None else index.reshape(n, case.topk) if case.topk else index.reshape(n)
    flat_extra = {k: v.reshape(n) for k, v in extra.items()}
    dlogit_needed = tuple(bool(case.grads[i] and (parts[i] is None or case.head_grads)) for i in range(n_in))
    outs = outputs(out)
    ref_outs, upstreams, ref_rows, ref_grads = reference(
        case, tuple(flat_logits), flat_index, flat_extra, [o.shape for o in outs], dlogit_needed
    )
    errors: dict = {}
    close_values(outs, ref_outs, HEAD_VALUE_RTOL[case.dtype], errors)

    # expected gradients; a token whose value is inf/NaN has no defined gradient: its rows are
    # skipped, and the weight/bias gradients (sums over every token) are not checked then
    finite = torch.isfinite(ref_rows)
    rtol = GRAD_RTOL[case.dtype]
    for i in range(n_in):
        dl = ref_grads[i]
        if dl is None:
            continue
        dl = torch.where(finite[:, None], dl, torch.zeros((), dtype=dl.dtype))
        if parts[i] is None:
            checks.append((f"grad[{i}] logits", args[i], dl[:, start:end].reshape(args[i].shape), finite))
            continue
        h, w, b = parts[i]
        head = args[i]
        dh = dl @ w if case.reduce_hidden_grad else dl[:, start:end] @ w[start:end]
        own_rows = finite
        if head.sequence_parallel:  # this rank's rows of the complete hidden gradient
            dh = dh.reshape(*case.shape, case.hidden)[tokens]
            own_rows = finite.reshape(case.shape)[tokens].reshape(-1)
        checks.append((f"grad[{i}] hidden", head.hidden, dh.reshape(head.hidden.shape), own_rows))
        if bool(finite.all()):
            checks.append((f"grad[{i}] weight", head.weight, dl[:, start:end].T @ h.reshape(n, case.hidden), None))
            if b is not None:
                checks.append((f"grad[{i}] bias", head.bias, dl[:, start:end].sum(0), None))
    expected = {id(c[1]): c for c in checks}
    wanted = [t for t in leaves if t.requires_grad]
    if wanted:
        objective = weighted_sum(outs, upstreams)
        grads = torch.autograd.grad(objective, wanted, retain_graph=True)
        for t, got in zip(wanted, grads):
            assert got.dtype == t.dtype, f"gradient dtype {got.dtype} != input dtype {t.dtype}"
            if id(t) not in expected:  # a weight/bias gradient summing an undefined row
                continue
            what, _, want, rows_ok = expected[id(t)]
            got = got.detach().cpu().double()
            if rows_ok is not None:  # zero the rows of tokens without a defined gradient
                keep = rows_ok.reshape(*got.shape[:-1], 1)
                got = torch.where(keep, got, torch.zeros((), dtype=got.dtype))
            close(what, got, want.reshape(got.shape), rtol, errors)
        # a second backward: a RuntimeError where the first one handed its gradients over
        # (sum/mean: computed in forward), else exact or a backend's RuntimeError saying why
        # (with return_entropy the head runs per token whatever the reduction: outputs.head_reduction)
        scalar = dict(case.options).get("reduction", "none") != "none" and not dict(case.options).get("return_entropy")
        scalar = scalar and math.prod(case.shape) > 0  # zero tokens: no backend ran, nothing handed over
        try:
            again = torch.autograd.grad(objective, wanted)
        except RuntimeError as exc:
            assert not torch_refusal(exc), f"a second backward hit torch's own refusal: {exc}"
        else:
            assert not scalar, "a second backward ran where the first one handed its gradients over"
            for a, b in zip(grads, again):
                assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), "second backward differs from the first"
    for t, b in zip(leaves, before):
        assert torch.equal(torch.nan_to_num(t.detach()), torch.nan_to_num(b)), "an input was modified"
    return errors
