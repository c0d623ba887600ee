"""FSDP2 × TP on 4 gloo ranks (2 data-parallel × 2 tensor-parallel), a tiny Llama with
V=1001 (uneven 501/500 vocabulary shards). Between forward passes FSDP2 leaves the head's
weight placed ``(_StridedShard(0), Shard(0))`` on the (dp, tp) mesh; inside the forward it
is gathered to ``Shard(0)`` on the TP mesh. Each data-parallel rank trains on its own batch:
the loss is that batch's, and every gradient (reduce-scattered by FSDP2: the mean over the
data-parallel ranks) equals the mean of the single-process gradients of the two batches.

- transformers' own setup (``DistributedConfig(tp_size=2, fsdp_size=2)``, which shards the
  final norm and ``lm_head`` as one unit): ``fuse_lm_head`` and ``use_vocab_parallel_loss``.
- by hand: ``parallelize_module(..., ColwiseParallel(use_local_output=False))`` on the head,
  ``fully_shard`` on the layer, on ``[norm, lm_head]`` and on the model.
- what does not work says what to do: a Head on the weight as FSDP2 leaves it between
  passes, or on a head that is a ``fully_shard`` unit of its own, which the fused forward
  does not call (so FSDP2 does not gather it).
"""

import importlib.util

import pytest
import torch

from tests.helpers import tiny_llama_config
from vtp_runtime.testing.distributed import RankPool

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install -e '.[integrations]')",
)

V, DP, TP = 1001, 2, 2


def _config():

    return tiny_llama_config(V)


def _save_job(rank, world, group, path):
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    if rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(_config()).save_pretrained(path)
    dist.barrier(group)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    pool = RankPool(DP * TP, env={"VTP_BACKEND": "eager"})  # the adapters are under test, not the kernels
    path = str(tmp_path_factory.mktemp("llama"))
    pool.run(_save_job, path, timeout=240)
    yield pool, path
    pool.close()


def _batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(DP):
        ids = torch.randint(0, V, (2, 7), generator=g)
        labels = ids.clone()
        labels[0, :3] = -100
        out.append((ids, labels))
    return out


def _load(path, **kw):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).train()


def _reference(path):
    """Per data-parallel rank: the single-process loss of its batch; and the mean gradients."""
    ref = _load(path)
    losses: list[torch.Tensor] = []
    grads: dict[str, torch.Tensor] = {}
    for ids, labels in _batches():
        ref.zero_grad(set_to_none=True)
        loss = ref(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        for name, p in ref.named_parameters():
            grads[name] = grads.get(name, 0) + p.grad / DP
    return losses, grads


def _check(model, dp_rank, path, fused):
    losses, grads = _reference(path)
    ids, labels = _batches()[dp_rank]
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    assert (out.logits is None) == fused
    out.loss.backward()
    torch.testing.assert_close(out.loss, losses[dp_rank], rtol=1e-5, atol=1e-6)
    placements = None
    for name, p in model.named_parameters():
        full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(full, grads[name], rtol=1e-4, atol=1e-6, msg=name)
        if name == "lm_head.weight":
            placements = tuple(map(repr, p.grad.placements))
    return placements


def _transformers_job(rank, world, group, path):
    from transformers.distributed import DistributedConfig

    from vtp_runtime.integrations.transformers import fuse_lm_head, lm_head_layout, use_vocab_parallel_loss

    out = []
    for apply, fused in ((fuse_lm_head, True), (use_vocab_parallel_loss, False)):
        model = _load(
            path, distributed_config=DistributedConfig(tp_size=TP, fsdp_size=DP, tp_plan={"lm_head": "colwise"})
        )
        weight = model.lm_head.weight
        mesh = weight.device_mesh
        out.append((tuple(map(repr, weight.placements)), lm_head_layout(model)[1:]))
        out.append(_check(apply(model), mesh.get_local_rank("fsdp"), path, fused))
    return out


@pytest.mark.timeout(400)
def test_transformers_fsdp_size_and_tp_size(pool):
    pool, path = pool
    results = pool.run(_transformers_job, path, timeout=300)
    for rank, per_apply in enumerate(results):
        tp_rank = rank % TP
        for (placements, bounds), grad_placements in zip(per_apply[::2], per_apply[1::2]):
            assert placements == ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), placements
            assert bounds == ((0, 501), (501, 1001))[tp_rank]  # the TP shard, whatever FSDP2 does within it
            assert grad_placements == placements


def _by_hand(path, head_unit):
    """A plain model, its head parallelized by torch's TP and the model sharded by FSDP2:
    ``head_unit`` "with norm" (one unit) or "alone" (its own unit)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = _load(path)
    parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel(use_local_output=False)})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    if head_unit == "with norm":
        fully_shard([model.model.norm, model.lm_head], mesh=mesh["dp"])
    else:
        fully_shard(model.lm_head, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh["dp"].get_local_rank()


def _by_hand_job(rank, world, group, path):
    import vtp_runtime as vtp
    from vtp_runtime.integrations.transformers import fuse_lm_head

    model, dp_rank = _by_hand(path, "with norm")
    placements = _check(fuse_lm_head(model), dp_rank, path, fused=True)

    errors = []
    # the weight as FSDP2 leaves it between passes
    try:
        vtp.cross_entropy(
            vtp.Head(torch.randn(3, 32), model.lm_head.weight), torch.zeros(3, dtype=torch.long), reduction="sum"
        )
    except ValueError as exc:
        errors.append(str(exc))
    # a head that is its own FSDP2 unit: the fused forward does not call it, so it is not gathered
    model, dp_rank = _by_hand(path, "alone")
    ids, labels = _batches()[dp_rank]
    try:
        fuse_lm_head(model)(input_ids=ids, labels=labels)
    except ValueError as exc:
        errors.append(str(exc))
    return placements, errors


@pytest.mark.timeout(400)
def test_fully_shard_and_parallelize_module_by_hand(pool):
    pool, path = pool
    for placements, errors in pool.run(_by_hand_job, path, timeout=300):
        assert placements == ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), placements
        assert len(errors) == 2, errors
        for message in errors:
            assert "_StridedShard" in message and "fully_shard([model.norm, model.lm_head])" in message, message
