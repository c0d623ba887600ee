"""torchtitan 0.3.0 on gloo: ``cross_entropy_loss`` / ``VtpCrossEntropyLoss`` and
``compute_logprobs`` give torchtitan's own values and logits gradients, for each form the
logits take there -- local shards under its default ``spmd_types`` backend (the TP group from
its SPMD mesh), DTensor logits with plain labels (``partial_dtensor``), and DTensor logits and
labels on a (dp, tp) mesh -- at TP=2 with uneven shards (V=11: 6 and 5 ids).

torchtitan's own ``compute_logprobs`` on local shards all-gathers them, which gloo refuses for
uneven ones (a size mismatch): there it is compared at V=12, and at V=11 against torchtitan's
on the full logits."""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (pip install -e '.[integrations]')",
)

V = 11


def _inputs(batch=2, vocab=V):
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(batch, 5, vocab, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (batch, 5), generator=g)
    labels[0, :2] = -100
    weights = torch.rand(batch, 5, generator=g, dtype=torch.float64)  # an upstream gradient per token
    return logits, labels, weights


def _shard(logits, tp_rank, tp):
    v = logits.shape[-1]
    chunk = -(-v // tp)
    return logits[..., tp_rank * chunk : min((tp_rank + 1) * chunk, v)]


def _value_and_grad(fn, logits, weights=None, local_of=lambda t: t):
    """``fn(x)``'s value (a tensor, or a tuple whose first element is differentiated) and the
    gradient of ``sum(value * weights)`` (or of the value) with respect to ``logits``'s local part."""
    x = logits.detach().clone().requires_grad_()
    out = fn(x)
    first = out[0] if isinstance(out, tuple) else out
    first_local = first.full_tensor() if hasattr(first, "full_tensor") else first
    (first_local * weights).sum().backward() if weights is not None else first_local.backward()
    return out, local_of(x.grad)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _close(ours, theirs):
    for a, b in zip(ours if isinstance(ours, tuple) else (ours,), theirs if isinstance(theirs, tuple) else (theirs,)):
        torch.testing.assert_close(_full(a).double(), _full(b).double(), rtol=1e-5, atol=1e-6)


def _spmd_job(rank, world, group, v):
    """Default backend: plain local shards, the TP group from torchtitan's SPMD mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components import loss as titan
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh

    import vtp_runtime as vtp
    from vtp_runtime.integrations import torchtitan as ours

    logits, labels, weights = _inputs(vocab=v)
    local = _shard(logits, rank, world).float()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with vtp.use_backend("eager"):  # torchtitan's at TP=1, on the full logits
        full = [
            _value_and_grad(
                lambda x, entropy=entropy: titan.compute_logprobs(x, labels, return_entropy=entropy),
                logits.float(),
                weights,
                lambda g: _shard(g, rank, world),
            )
            for entropy in (False, True)
        ]
    with set_current_spmd_mesh(mesh), vtp.use_backend("eager"):
        for a, b in (
            (
                lambda x: ours.cross_entropy_loss(x, labels, global_vocab_size=v),
                lambda x: titan.cross_entropy_loss(x, labels, global_vocab_size=v),
            ),
            (
                lambda x: ours.VtpCrossEntropyLoss.Config(global_vocab_size=v).build()(x, labels, torch.tensor(7.0))[0],
                lambda x: titan.CrossEntropyLoss.Config(global_vocab_size=v).build()(x, labels, torch.tensor(7.0))[0],
            ),
        ):
            (got, got_grad), (want, want_grad) = _value_and_grad(a, local), _value_and_grad(b, local)
            _close(got, want)
            _close(got_grad, want_grad)
        for entropy, (want, want_grad) in zip((False, True), full):
            got, got_grad = _value_and_grad(
                lambda x, entropy=entropy: ours.compute_logprobs(x, labels, return_entropy=entropy), local, weights
            )
            _close(got, want)
            _close(got_grad, want_grad)
            if v % world == 0:  # torchtitan's own on the shards (it cannot all-gather uneven ones)
                want, want_grad = _value_and_grad(
                    lambda x, entropy=entropy: titan.compute_logprobs(x, labels, return_entropy=entropy), local, weights
                )
                _close(got, want)
                _close(got_grad, want_grad)
    return type(ours.VtpCrossEntropyLoss.Config(global_vocab_size=v).build()).__name__


def _dtensor_job(rank, world, group, dims):
    """DTensor logits: plain labels on a 1-D "tp" mesh, DTensor labels on a (dp, tp) one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torchtitan.components import loss as titan
    from torchtitan.distributed import utils as titan_utils

    import vtp_runtime as vtp
    from vtp_runtime.integrations import torchtitan as ours

    dp = world // 2 if dims == 2 else 1
    mesh = init_device_mesh(
        "cpu", (dp, 2) if dims == 2 else (2,), mesh_dim_names=("dp", "tp") if dims == 2 else ("tp",)
    )
    tp_rank = mesh["tp"].get_local_rank() if dims == 2 else rank
    dp_rank = mesh["dp"].get_local_rank() if dims == 2 else 0
    logits, labels, weights = _inputs(batch=2 * dp)
    rows = slice(2 * dp_rank, 2 * dp_rank + 2)  # this data-parallel rank's batch
    local = _shard(logits[rows], tp_rank, 2).float()
    placements = [Shard(0), Shard(2)] if dims == 2 else [Shard(2)]
    full_shape = (2 * dp, 5, V)

    def dt(x):
        return DTensor.from_local(
            x,
            mesh,
            placements,
            run_check=False,
            shape=torch.Size(full_shape),
            stride=torch.empty(full_shape, device="meta").stride(),
        )

    if dims == 2:
        dt_labels = DTensor.from_local(labels[rows], mesh, [Shard(0), Replicate()], run_check=False)
        label_arg, lp_labels = dt_labels, labels[rows]
    else:
        label_arg = lp_labels = labels
    saved = titan_utils.get_spmd_backend()
    titan_utils.set_spmd_backend("partial_dtensor")  # the backend whose logits are DTensors
    try:
        with vtp.use_backend("eager"):
            got, got_grad = _value_and_grad(lambda x: ours.cross_entropy_loss(dt(x), label_arg), local)
            want, want_grad = _value_and_grad(lambda x: titan.cross_entropy_loss(dt(x), label_arg), local)
            assert type(got) is type(want), (type(got), type(want))
            _close(got, want)
            _close(got_grad, want_grad)
            if dims == 1:
                for entropy in (False, True):
                    got, got_grad = _value_and_grad(
                        lambda x, entropy=entropy: ours.compute_logprobs(dt(x), lp_labels, return_entropy=entropy),
                        local,
                        weights,
                    )
                    want, want_grad = _value_and_grad(
                        lambda x, entropy=entropy: titan.compute_logprobs(dt(x), lp_labels, return_entropy=entropy),
                        local,
                        weights,
                    )
                    _close(got, want)
                    _close(got_grad, want_grad)
    finally:
        titan_utils.set_spmd_backend(saved)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("v", [V, 12])
def test_spmd_types_local_shards(ranks, v):
    assert ranks(2, _spmd_job, v, timeout=180) == ["VtpCrossEntropyLoss"] * 2


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dims,world", [(1, 2), (2, 4)])
def test_dtensor_logits(ranks, dims, world):
    ranks(world, _dtensor_job, dims, timeout=180)


def test_full_vocabulary():
    """No TP: the same as torchtitan's, which is F.cross_entropy."""
    from torchtitan.components import loss as titan

    import vtp_runtime as vtp
    from vtp_runtime.integrations import torchtitan as ours

    logits, labels, weights = _inputs()
    with vtp.use_backend("eager"):
        for a, b, w in (
            (ours.cross_entropy_loss, titan.cross_entropy_loss, None),
            (ours.compute_logprobs, titan.compute_logprobs, weights),
        ):
            (got, got_grad), (want, want_grad) = (
                _value_and_grad(lambda x, f=f: f(x, labels), logits, w) for f in (a, b)
            )
            _close(got, want)
            _close(got_grad, want_grad)
