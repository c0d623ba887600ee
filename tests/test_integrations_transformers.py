"""transformers: a tiny random Llama whose lm_head is vocabulary-sharded on 2 gloo ranks
gives the loss and every parameter gradient of the single-process ``model(labels=...)``.

Two ways to shard: transformers' own ``tp_plan`` (``{"lm_head": "colwise"}``, its output
not gathered), and a head split by hand, which needs ``copy_to_tp_region`` in front of it:
without it the backbone gradients are silently wrong, and the test shows that too.
One rank pool for the module: importing transformers costs seconds per rank. The ranks use
the eager backend: the adapters are under test here, not the kernels (which would run
through Triton's slow CPU interpreter on these 32000-entry rows).
"""

import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from vtp_runtime.testing.distributed import RankPool

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install -e '.[integrations]')")

V, WORLD = 32000, 2
SPLIT = 12345  # the hand-split head's uneven boundary


def _save_job(rank, world, group, path):
    from transformers import LlamaConfig, LlamaForCausalLM

    if rank == 0:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier(group)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    pool = RankPool(WORLD, env={"VTP_BACKEND": "eager"})
    path = str(tmp_path_factory.mktemp("llama"))
    pool.run(_save_job, path, timeout=240)  # the first job pays for importing transformers
    yield pool, path
    pool.close()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 7), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt
    labels[1, -1] = -100  # padding
    return ids, labels


def _load(path, **kw):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)


def _loss_and_grads(model, ids, labels, num_items):
    model.zero_grad(set_to_none=True)
    kw = {} if num_items is None else {"num_items_in_batch": num_items}
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters()}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _tp_plan_job(rank, world, group, path):
    from transformers.distributed import DistributedConfig

    from vtp_runtime.integrations.transformers import use_vocab_parallel_loss

    ref = _load(path)
    sharded = use_vocab_parallel_loss(_load(path, distributed_config=DistributedConfig(
        tp_plan={"lm_head": "colwise"}, tp_size=world)))
    ids, labels = _batch()
    for num_items in (None, torch.tensor(9)):
        want, want_grads = _loss_and_grads(ref, ids, labels, num_items)
        got, got_grads = _loss_and_grads(sharded, ids, labels, num_items)
        assert got.logits.shape == (2, 7, V // world), got.logits.shape  # local shards, not gathered
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
        assert want_grads.keys() == got_grads.keys()
        for name, grad in want_grads.items():  # every rank gathers every DTensor, in the same order
            torch.testing.assert_close(_full(got_grads[name]), grad, rtol=1e-4, atol=1e-6, msg=name)

    # the default plan gathers the output: the loss refuses it instead of computing garbage
    gathered = use_vocab_parallel_loss(_load(path, distributed_config=DistributedConfig(tp_size=world)))
    try:
        gathered(input_ids=ids, labels=labels)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(300)
def test_tp_plan_colwise_lm_head(pool):
    pool, path = pool
    for message in pool.run(_tp_plan_job, path, timeout=240):
        assert "colwise_gather_output" in message


class _HandSplitHead(torch.nn.Module):
    """This rank's rows ``[start, end)`` of a full lm_head, with or without the copy into
    the TP region in front of it."""

    def __init__(self, full, start, end, group, copy):
        super().__init__()
        self.weight = torch.nn.Parameter(full.weight.detach()[start:end].clone())
        self.group, self.copy = group, copy

    def forward(self, hidden):
        from vtp_runtime.integrations import copy_to_tp_region

        if self.copy:
            hidden = copy_to_tp_region(hidden, self.group)
        return F.linear(hidden, self.weight)


def _hand_split_job(rank, world, group, path):
    from vtp_runtime.integrations.transformers import use_vocab_parallel_loss

    bounds = [0, SPLIT, V]
    start, end = bounds[rank], bounds[rank + 1]
    ref = _load(path)
    ids, labels = _batch()
    wrong = []
    for copy in (True, False):
        model = _load(path)
        model.lm_head = _HandSplitHead(model.lm_head, start, end, group, copy)
        use_vocab_parallel_loss(model, group, start, end)
        for num_items in (None, 9):
            want, want_grads = _loss_and_grads(ref, ids, labels, num_items)
            got, got_grads = _loss_and_grads(model, ids, labels, num_items)
            torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got_grads["lm_head.weight"], want_grads["lm_head.weight"][start:end],
                                       rtol=1e-4, atol=1e-6)
            backbone = [name for name in want_grads if name != "lm_head.weight"]
            if copy:
                for name in backbone:
                    torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
            else:
                wrong.append(sum(not torch.allclose(got_grads[n], want_grads[n], rtol=1e-2, atol=1e-4)
                                 for n in backbone))
    return wrong, len(backbone)


@pytest.mark.timeout(300)
def test_hand_split_head_needs_copy_to_tp_region(pool):
    pool, path = pool
    for wrong, n_backbone in pool.run(_hand_split_job, path, timeout=240):
        # without the copy every backbone gradient is a partial sum: wrong, and nothing says so
        assert wrong == [n_backbone, n_backbone], (wrong, n_backbone)
