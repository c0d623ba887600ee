"""DTensor logits sharded over the vocabulary (what ColwiseParallel(use_local_output=False)
and transformers' TP plans produce), on gloo meshes TP 2, TP 4 and dp x tp 2 x 2 with
uneven and empty shards: values, gradients and result placements against torch's own
``loss_parallel()`` + ``F.cross_entropy``, and every op against the float64 reference
(``loss_parallel`` has only cross entropy, and fails on an empty shard). Every case runs
on gloo ranks with a timeout; DTensors are built with ``distribute_tensor``, so torch does
the chunking."""

import os
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import vtp_runtime as vtp
from tests.helpers import ROOT, as_dtensor, pool_mesh
from vtp_runtime import inputs
from vtp_runtime.errors import ShardError
from vtp_runtime.testing.reference import values_and_grads

ATOL = 2e-5

# (world, mesh shape, V): V=7 on 2 -> 4,3; V=10 on 4 -> 3,3,3,1; V=9 on 4 -> 3,3,3,0;
# on dp x tp 2 x 2, V=7 -> 4,3 and V=9 -> 5,4
MESHES_LP = [(2, (2,), 7), (4, (4,), 10), (4, (2, 2), 10), (4, (2, 2), 7)]
MESHES_REF = [(2, (2,), 7), (4, (4,), 9), (4, (2, 2), 9)]


def _placements(shape):
    """(logits placements, per-token placements): the vocabulary on the last mesh dimension,
    the batch on the first when there are two."""
    from torch.distributed.tensor import Replicate, Shard

    if len(shape) == 1:
        return (Shard(2),), (Replicate(),)
    return (Shard(0), Shard(2)), (Shard(0), Replicate())


def _close(got, want, what):
    got, want = got.double(), want.double()
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert got.shape == want.shape and err <= ATOL + 1e-5 * want.abs().max().item(), (
        f"{what}: shapes {tuple(got.shape)} / {tuple(want.shape)}, max error {err:.3g}"
    )


def _data(vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, vocab, generator=gen) * 3
    t = torch.randn(4, 3, vocab, generator=gen) * 3
    y = torch.randint(0, vocab, (4, 3), generator=gen)
    y[0, 0] = y[2, 1] = -100
    g = torch.randn(4, 3, 2, generator=gen)
    return x, t, y, g


# -- cross entropy against loss_parallel -------------------------------------------------


def ce_vs_loss_parallel(rank, world, group, shape, vocab, backend):
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = pool_mesh(world, shape)
    xpl, ypl = _placements(shape)
    x, _, y, g = _data(vocab, seed=vocab)
    dy = distribute_tensor(y, mesh, ypl)
    unsupported = []
    for reduction in ("none", "sum", "mean"):
        dx = distribute_tensor(x, mesh, xpl).requires_grad_()
        if reduction == "mean" and len(shape) > 1:  # loss_parallel refuses it too
            with pytest.raises(ValueError, match="per-rank means"):
                vtp.cross_entropy(dx, dy, reduction="mean")
            continue
        out = as_dtensor(vtp.cross_entropy(dx, dy, reduction=reduction, backend=backend))
        assert type(out) is type(dx)
        upstream = distribute_tensor(g[..., 0], mesh, out.placements) if reduction == "none" else None
        if upstream is None:
            out.backward()
        else:
            (out * upstream).sum().backward()
        # the layout a parameter's gradient must have (else AccumulateGrad re-lays it out
        # through a collective); torch's own to_local backward gets it wrong on uneven shards
        grad = as_dtensor(dx.grad)
        assert grad.placements == dx.placements and grad.stride() == dx.stride()

        # the float64 reference on the full logits
        n = y.numel()
        count = (y != -100).sum()
        grad_out = {"none": g[..., 0].reshape(n), "sum": torch.ones(n), "mean": torch.ones(n) / count}[reduction]
        ref, (ref_grad,) = values_and_grads("cross_entropy", (x.reshape(n, vocab),), y.reshape(n), grad_out)
        want = {"none": ref.view(4, 3), "sum": ref.sum(), "mean": ref.sum() / count}[reduction]
        _close(out.full_tensor(), want, f"{reduction} value vs float64")
        assert ref_grad is not None
        _close(grad.full_tensor(), ref_grad.view(x.shape), f"{reduction} grad vs float64")

        # torch's loss_parallel on the same DTensors: same values, gradients and placements
        tx = distribute_tensor(x, mesh, xpl).requires_grad_()
        try:
            with loss_parallel():
                lp = F.cross_entropy(tx.flatten(0, 1), dy.flatten(0, 1), reduction=reduction)
                if reduction == "none":
                    assert upstream is not None
                    lp = lp.view(4, 3)
                    (lp * upstream).sum().backward()
                else:
                    lp.backward()
        except NotImplementedError as exc:  # older torch: loss_parallel on a 1-D mesh only
            if len(shape) == 1:
                raise
            unsupported.append(str(exc).splitlines()[0])
            continue
        assert out.placements == as_dtensor(lp).placements, (out.placements, as_dtensor(lp).placements)
        _close(out.full_tensor(), as_dtensor(lp).full_tensor(), f"{reduction} value vs loss_parallel")
        _close(grad.full_tensor(), as_dtensor(tx.grad).full_tensor(), f"{reduction} grad vs loss_parallel")
    return unsupported


@pytest.mark.parametrize(
    "world,shape,vocab,backend",
    [(*m, "eager") for m in MESHES_LP] + [(4, (4,), 10, "triton")],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_cross_entropy_matches_loss_parallel(ranks, world, shape, vocab, backend):
    unsupported = ranks(world, ce_vs_loss_parallel, shape, vocab, backend, timeout=120)[0]
    if unsupported:  # the float64 comparison above ran and passed
        assert torch.__version__ < "2.13", f"loss_parallel refused a {shape} mesh: {unsupported}"
        pytest.skip(
            f"this torch's loss_parallel does not take a {shape} mesh ({unsupported[0]}); "
            f"compared with the float64 reference only"
        )


# -- every op against the float64 reference ----------------------------------------------

# (op, options, second input: "teacher", "labels", "topk" or None)
CALLS: list[tuple[str, dict[str, Any], str | None]] = [
    ("cross_entropy", {"label_smoothing": 0.1, "z_loss": 1e-3, "temperature": 1.5}, "labels"),
    ("logprobs", {}, "labels"),
    ("logprobs", {"temperature": 0.7}, "topk"),
    ("entropy", {"mask": True}, None),
    ("kl", {}, "teacher"),
    ("kl", {"reverse": True, "labels": True, "temperature": 2.0}, "teacher"),
    ("jsd", {"beta": 0.3, "labels": True}, "teacher"),
    ("jsd", {"beta": 0.0, "mask": True}, "teacher"),
]


def ops_vs_reference(rank, world, group, shape, vocab):
    from torch.distributed.tensor import distribute_tensor

    mesh = pool_mesh(world, shape)
    xpl, ypl = _placements(shape)
    x, t, y, g = _data(vocab, seed=100 + vocab)
    mask = torch.arange(12).view(4, 3) % 4 != 1
    topk = torch.stack([y.clamp(min=0), (y.clamp(min=0) + 1) % vocab], -1)
    topk[1, 1, 0] = -100
    n = y.numel()
    for op, opts, second in CALLS:
        ds = distribute_tensor(x, mesh, xpl).requires_grad_()
        per_token = {"mask": mask, "labels": y}
        ref_opts = {k: (per_token[k].reshape(n) if k in per_token else v) for k, v in opts.items()}
        call_opts = {k: (distribute_tensor(per_token[k], mesh, ypl) if k in per_token else v) for k, v in opts.items()}
        args, index = [ds], None
        needs: tuple[bool, ...] = (True,)
        if second == "teacher":
            dt = distribute_tensor(t, mesh, xpl).requires_grad_()
            args.append(dt)
            needs = (True, True)
        elif second is not None:
            index = y if second == "labels" else topk
            args.append(distribute_tensor(index, mesh, ypl))
        out = vtp.loss(op, *args, backend="eager", **call_opts)
        assert out.placements == ypl, (op, out.placements)
        upstream = g if second == "topk" else g[..., 0]
        (out * distribute_tensor(upstream, mesh, out.placements)).sum().backward()
        logits = (x.reshape(n, vocab),) + ((t.reshape(n, vocab),) if second == "teacher" else ())
        ref, ref_grads = values_and_grads(
            op,
            logits,
            None if index is None else index.reshape(n, -1).squeeze(-1),
            upstream.reshape(n, -1).squeeze(-1),
            needs_grad=needs,
            **ref_opts,
        )
        what = f"{op} {opts} on {shape}, V={vocab}"
        _close(out.full_tensor(), ref.view(upstream.shape), f"{what}: value")
        for a, ref_grad in zip(args[: len(needs)], ref_grads):
            grad = as_dtensor(a.grad)
            assert grad.placements == as_dtensor(a).placements and grad.stride() == a.stride(), what
            assert ref_grad is not None
            _close(grad.full_tensor(), ref_grad.view(x.shape), f"{what}: grad")


@pytest.mark.parametrize(
    "world,shape,vocab", MESHES_REF, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v)
)
def test_ops_match_reference(ranks, world, shape, vocab):
    ranks(world, ops_vs_reference, shape, vocab, timeout=120)


# -- other input forms, explain, and errors ------------------------------------------------


def forms_and_errors(rank, world, group):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh, line = pool_mesh(4, (2, 2)), pool_mesh(4, (4,))
    dp = mesh.get_coordinate()[0]
    x, t, y, _ = _data(10, seed=7)
    dx = distribute_tensor(x, mesh, [Shard(0), Shard(2)])
    dt = distribute_tensor(t, mesh, [Shard(0), Shard(2)])
    dy = distribute_tensor(y, mesh, [Shard(0), Replicate()])
    with vtp.use_backend("eager"):
        base = as_dtensor(vtp.cross_entropy(dx, dy)).to_local()
        # plain labels are this rank's local part; replicated labels are cut to the local batch
        assert torch.equal(as_dtensor(vtp.cross_entropy(dx, y[2 * dp : 2 * dp + 2])).to_local(), base)
        assert torch.equal(
            as_dtensor(vtp.cross_entropy(dx, distribute_tensor(y, mesh, [Replicate(), Replicate()]))).to_local(), base
        )
        # a plain teacher is this rank's local shard
        assert torch.equal(as_dtensor(vtp.kl(dx, dt.to_local())).to_local(), as_dtensor(vtp.kl(dx, dt)).to_local())
        # consistent layout options are accepted
        same = as_dtensor(vtp.cross_entropy(dx, dy, tp_group=mesh.get_group(1), global_vocab_size=10)).to_local()
        assert torch.equal(same, base)
        # a replicated DTensor normalizer
        seven = distribute_tensor(torch.tensor(7.0), mesh, [Replicate(), Replicate()])
        summed = as_dtensor(vtp.cross_entropy(dx, dy, reduction="sum", normalizer=seven))
        assert summed.placements == (Partial(), Replicate())
        _close(summed.full_tensor(), as_dtensor(vtp.cross_entropy(dx, dy)).full_tensor().sum() / 7, "normalizer")
        # a DTensor not sharded over the vocabulary: each rank holds its batch and all of V
        batch_only = as_dtensor(
            vtp.cross_entropy(distribute_tensor(x, line, [Shard(0)]), distribute_tensor(y, line, [Shard(0)]))
        )
        ref, _ = values_and_grads("cross_entropy", (x.reshape(12, 10),), y.reshape(12), needs_grad=(False,))
        assert batch_only.placements == (Shard(0),)
        _close(batch_only.full_tensor(), ref.view(4, 3), "vocabulary not sharded")

        # explain sees the shards, not the global shape
        assert "tp=2 V=10 tokens=6 shards=even" in str(vtp.explain("cross_entropy", dx, dy))
        x9 = distribute_tensor(x[..., :9], line, [Shard(2)])
        # every rank's shard size is known only after the gather (explain alone is this rank's view)
        assert "tp=4 V=9 tokens=12 shards=uneven, one empty" in str(vtp.explain("jsd", x9, x9, gather=True))

        partial_logits = DTensor.from_local(dx.to_local(), mesh, [Shard(0), Partial()])
        vocab_twice = distribute_tensor(x, mesh, [Shard(2), Shard(2)])
        replicated_mask = distribute_tensor(y > 0, mesh, [Replicate(), Replicate()])
        teacher_elsewhere = distribute_tensor(t, mesh, [Replicate(), Shard(2)])
        labels_elsewhere = distribute_tensor(y, mesh, [Shard(1), Replicate()])
        partial_count = DTensor.from_local(torch.tensor(1.0), mesh, [Partial(), Replicate()])
        # from_local without shape= assumes even shards: with V=10 on 4 ranks (3, 3, 3, 1), ranks
        # 0-2 read V=12 and rank 3 reads V=4; every rank raises all the same (after the gather)
        no_shape = DTensor.from_local(distribute_tensor(x, line, [Shard(2)]).to_local(), line, [Shard(2)])
        errors = [
            (ValueError, "come from the logits DTensor", lambda: vtp.cross_entropy(dx, dy, vocab_start=0, vocab_end=5)),
            (ValueError, "tp_group is not", lambda: vtp.cross_entropy(dx, dy, tp_group=group)),
            (ValueError, "global_vocab_size=11", lambda: vtp.cross_entropy(dx, dy, global_vocab_size=11)),
            (ValueError, "Partial", lambda: vtp.entropy(partial_logits)),
            (ValueError, "exactly one", lambda: vtp.entropy(vocab_twice)),
            (ValueError, "per-rank means", lambda: vtp.entropy(dx, reduction="mean")),
            (TypeError, "labels is a DTensor", lambda: vtp.cross_entropy(dx.to_local(), dy)),
            (TypeError, "mask is a DTensor", lambda: vtp.entropy(x, mask=replicated_mask)),
            (ValueError, "teacher_logits is a DTensor", lambda: vtp.kl(dx, teacher_elsewhere)),
            (ValueError, "labels is a DTensor", lambda: vtp.cross_entropy(dx, labels_elsewhere)),
            (ValueError, "normalizer is a DTensor", lambda: vtp.entropy(dx, reduction="sum", normalizer=partial_count)),
            (ShardError, "", lambda: vtp.entropy(no_shape)),
        ]
        for kind, match, call in errors:
            with pytest.raises(kind, match=match):
                call()
        # after every error, the ranks are still in step
        assert torch.equal(as_dtensor(vtp.cross_entropy(dx, dy)).to_local(), base)


def test_forms_explain_and_errors(ranks):
    ranks(4, forms_and_errors, timeout=120)


def test_plain_tensors_pass_through():
    """Without a DTensor, normalize hands back the very objects it got and no wrapper."""
    logits, labels = torch.randn(2, 5), torch.tensor([1, 2])
    options = {"mask": None, "normalizer": 3.0}
    tensors, out_options, wrap, failure = inputs.normalize("cross_entropy", (logits, labels), options)
    assert failure is None
    assert tensors[0] is logits and tensors[1] is labels and out_options is options and wrap is None
    param = torch.nn.Parameter(torch.randn(2, 5))  # a Tensor subclass that is not a DTensor
    tensors, _, wrap, failure = inputs.normalize("entropy", (param,), {})
    assert failure is None
    assert tensors[0] is param and wrap is None


# -- a Head whose weight is a DTensor (Shard(0), as ColwiseParallel's lm_head weight) -------


def head_with_dtensor_weight(rank, world, group, shape, vocab):
    """Cross entropy (sum, with bias) and JSD against a frozen teacher Head, both from Heads
    whose weights are DTensors sharded over the vocabulary: values, and the gradients of
    weight, bias and hidden against float64 on the full head, with the parameters' own
    placements and strides. A plain hidden on the 1-D mesh; on dp x tp a hidden DTensor
    sharding the batch over dp."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = pool_mesh(world, shape)
    gen = torch.Generator().manual_seed(vocab + len(shape))
    h = torch.randn(4, 3, 6, generator=gen)
    w, wt = torch.randn(vocab, 6, generator=gen), torch.randn(vocab, 6, generator=gen)
    b = torch.randn(vocab, generator=gen)
    y = torch.randint(0, vocab, (4, 3), generator=gen)
    y[0, 0] = -100
    dp = len(shape) - 1  # the mesh dimensions before the vocabulary's
    wpl, tokens = (Replicate(),) * dp + (Shard(0),), (Shard(0),) * dp + (Replicate(),)

    def leaf(t, placements):
        return distribute_tensor(t, mesh, placements).requires_grad_()

    def hidden_input():
        return leaf(h, tokens) if dp else h.clone().requires_grad_()

    logits = (h @ w.T + b).reshape(12, vocab)
    teacher = (h @ wt.T).reshape(12, vocab)
    g = torch.randn(12, generator=gen)
    cases: tuple[tuple[str, Callable[..., Any], tuple[torch.Tensor, ...], torch.Tensor | None, dict], ...] = (
        (
            "cross_entropy",
            lambda hid, dw, db: vtp.cross_entropy(
                vtp.Head(hid, dw, db), distribute_tensor(y, mesh, tokens) if dp else y, reduction="sum"
            ),
            (logits,),
            None,
            {},
        ),
        (
            "jsd",
            lambda hid, dw, db: vtp.jsd(
                vtp.Head(hid, dw, db), vtp.Head(hid.detach(), distribute_tensor(wt, mesh, wpl)), beta=0.3
            ),
            (logits, teacher),
            g,
            {"beta": 0.3},
        ),
    )
    for op, call, full_logits, upstream, opts in cases:
        hid, dw, db = hidden_input(), leaf(w, wpl), leaf(b, wpl)
        out = call(hid, dw, db)
        if upstream is None:
            out.backward()
            value = out.full_tensor()
        else:
            (out * distribute_tensor(upstream.view(4, 3), mesh, out.placements)).sum().backward()
            value = out.full_tensor().reshape(12)
        ref, (dz, *_) = values_and_grads(
            op,
            full_logits,
            y.reshape(12) if op == "cross_entropy" else None,
            upstream,
            needs_grad=(True,) + (False,) * (len(full_logits) - 1),
            **opts,
        )
        assert dz is not None
        _close(value, ref.sum() if upstream is None else ref, f"{op}: value")
        # the replicated weight's gradient is a pending sum over the batch shards (dp)
        grad_placements = (Partial(),) * dp + (Shard(0),)
        for param, want in ((dw, dz.T @ h.reshape(12, 6).double()), (db, dz.sum(0))):
            grad = as_dtensor(param.grad)
            assert grad.placements == grad_placements and grad.stride() == param.stride(), op
            _close(grad.full_tensor(), want, f"{op}: weight/bias grad")
        dh = (dz @ w.double()).view(4, 3, 6)
        if dp:
            grad = as_dtensor(hid.grad)
            assert grad.placements == hid.placements and grad.stride() == hid.stride(), op
            _close(grad.full_tensor(), dh, f"{op}: hidden grad (complete on every rank)")
        else:
            _close(hid.grad, dh, f"{op}: hidden grad (complete on every rank)")

    dw = leaf(w, wpl)
    errors = [
        (ValueError, "placed like Head.weight", lambda: vtp.entropy(vtp.Head(hidden_input(), dw, b))),
        (ValueError, "complete gradient", lambda: vtp.entropy(vtp.Head(leaf(h, tokens), dw, reduce_hidden_grad=False))),
    ]
    if dp:
        errors.append((ValueError, "hidden is a plain tensor", lambda: vtp.entropy(vtp.Head(h, dw))))
    for kind, match, bad in errors:
        with pytest.raises(kind, match=match):
            bad()
    assert (
        as_dtensor(vtp.entropy(vtp.Head(hidden_input(), dw), reduction="sum")).full_tensor().isfinite()
    )  # ranks in step


@pytest.mark.parametrize("world, shape, vocab", MESHES_REF, ids=lambda x: str(x))
def test_head_with_dtensor_weight(ranks, world, shape, vocab):
    ranks(world, head_with_dtensor_weight, shape, vocab, timeout=180)


# -- the guide's example -------------------------------------------------------------------


def guide_example(rank, world, group):
    from torch.distributed.tensor import Replicate, Shard

    blocks = [
        b
        for b in re.findall(r"```python\n(.*?)```", (ROOT / "docs/guide.md").read_text(), re.S)
        if "ColwiseParallel" in b
    ]
    assert len(blocks) == 1, "docs/guide.md should have one DTensor example"
    namespace: dict[str, Any] = {"__name__": "__guide_example__"}
    exec(compile(blocks[0], "<guide DTensor example>", "exec"), namespace)
    with vtp.use_backend("eager"):
        loss, head = namespace["main"]()
    assert loss.placements == (Replicate(),) and head.weight.grad.placements == (Shard(0),)


def test_guide_example_on_two_ranks(ranks):
    ranks(2, guide_example, timeout=120)


# -- on the GPU ----------------------------------------------------------------------------


def device_ops(rank, world, group, device):
    """Forced triton backend on DTensors of ``device``, V=9 on 2 ranks (5, 4). On "cuda", the
    gloo ranks share the GPU; the test compares each rank's local shard, so that no
    collective of the test itself moves CUDA tensors."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    cpu_mesh = pool_mesh(world, (world,))
    mesh = cpu_mesh if device == "cpu" else DeviceMesh(device, list(range(world)))
    x, t, y, g = _data(9, seed=3)

    def local(z, placements):  # torch chunks it (on the CPU mesh)
        return distribute_tensor(z, cpu_mesh, placements).to_local()

    def on_device(z, placements):
        return DTensor.from_local(local(z, placements).to(device), mesh, placements, shape=z.shape, stride=z.stride())

    for op, second in (("cross_entropy", y), ("jsd", t)):
        ds = on_device(x, [Shard(2)]).requires_grad_()
        other = on_device(second, [Replicate()] if op == "cross_entropy" else [Shard(2)])
        out = vtp.loss(op, ds, other, backend="triton")
        assert out.placements == (Replicate(),) and ds.grad is None
        loss = (out * on_device(g[..., 0], [Replicate()])).sum()
        # the gradient as the op hands it over must already have the parameter's layout
        # (global stride included: torch's own to_local backward gets it wrong on uneven
        # shards, and AccumulateGrad then re-lays it out through a collective)
        (raw,) = torch.autograd.grad(loss, ds, retain_graph=True)
        assert raw.placements == (Shard(2),) and raw.stride() == ds.stride(), (raw.stride(), ds.stride())
        loss.backward()
        logits = (x.reshape(12, 9),) + ((t.reshape(12, 9),) if op == "jsd" else ())
        ref, ref_grads = values_and_grads(
            op,
            logits,
            y.reshape(12) if op == "cross_entropy" else None,
            g[..., 0].reshape(12),
            needs_grad=(True,) + (False,) * (len(logits) - 1),
        )
        grad = as_dtensor(ds.grad)
        assert grad.placements == (Shard(2),) and grad.stride() == ds.stride()
        _close(out.to_local().cpu(), ref.view(4, 3), f"{op} on {device}: value")
        assert ref_grads[0] is not None
        _close(grad.to_local().cpu(), local(ref_grads[0].view(x.shape), [Shard(2)]), f"{op} on {device}: grad")


def test_triton_on_dtensor_cpu(ranks):
    """The GPU test's code, on CPU tensors through Triton's interpreter."""
    ranks(2, device_ops, "cpu", timeout=120)


@pytest.mark.gpu
def test_triton_on_dtensor_gpu(ranks):
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        pytest.skip(
            "needs a CUDA GPU with compiled Triton; run on the GPU machine: "
            "TRITON_INTERPRET=0 python -m pytest -m gpu tests/test_dtensor.py"
        )
    ranks(2, device_ops, "cuda", timeout=300)
