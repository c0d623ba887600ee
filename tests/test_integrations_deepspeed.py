"""DeepSpeed AutoTP on 2 gloo ranks: a tiny random Llama trained with
``tensor_parallel.vocab_parallel_lm_head`` (an uneven 501/500 split of 1001 ids), its loss
swapped for ``vtp_runtime``'s with ``use_vocab_parallel_loss(engine.module)``, then the head
fused with ``fuse_lm_head(engine.module)`` (no logits): loss and every parameter gradient
equal the single-process ``model(labels=...)``'s, and vtp ops take the TP group from
``deepspeed.utils.groups``.
"""

import importlib.util

import pytest
import torch

from tests.helpers import tiny_llama_config
from vtp_runtime.testing.distributed import RankPool

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("transformers") is None,
    reason="deepspeed or transformers is not installed (pip install -e '.[integrations]')",
)

V = 1001


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(2, env={"VTP_BACKEND": "eager"})  # the integration is under test, not the kernels
    yield pool
    pool.close()


def _engine(rank, world, model):
    import importlib
    import os

    import deepspeed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    # On CPU ranks DeepSpeed JIT-compiles a shared-memory all-reduce kernel when its comm
    # backend starts (minutes with a C++ compiler); plain gloo does the same job here.
    # (``deepspeed.comm.torch`` as an attribute is torch itself, re-exported: import the module;
    # mypy sees a bare ModuleType there, whose attributes it cannot know)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # type: ignore[attr-defined]
    deepspeed.init_distributed(dist_backend="gloo")  # reuses the ranks' process group
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 0},
        "tensor_parallel": {"autotp_size": world, "vocab_parallel_lm_head": True},
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def _loss_and_grads(model, ids, labels, num_items):
    model.zero_grad(set_to_none=True)
    kw = {} if num_items is None else {"num_items_in_batch": num_items}
    loss = model(input_ids=ids, labels=labels, **kw).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _deepspeed_job(rank, world, group):
    import copy
    import warnings

    warnings.simplefilter("ignore")
    from deepspeed.utils import groups
    from transformers import LlamaForCausalLM

    import vtp_runtime as vtp
    from vtp_runtime.integrations.transformers import VtpCausalLMLoss, fuse_lm_head, use_vocab_parallel_loss

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(V))
    reference = copy.deepcopy(model)
    engine = _engine(rank, world, model)
    head = engine.module.get_output_embeddings()
    assert type(head).__name__ == "VocabParallelLinear"
    ds_loss = engine.module.loss_function  # DeepSpeed's own, replaced by the next line
    use_vocab_parallel_loss(engine.module)
    assert isinstance(engine.module.loss_function, VtpCausalLMLoss)

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 7), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    results = {}
    for fused in (False, True):
        if fused:
            fuse_lm_head(engine.module)  # the head's own forward (and its copy into the TP region) is bypassed
        for num_items in (None, torch.tensor(9)):
            want, want_grads = _loss_and_grads(reference, ids, labels, num_items)
            got, got_grads = _loss_and_grads(engine.module, ids, labels, num_items)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            results[fused, num_items is None] = (
                {n: g.clone() for n, g in got_grads.items()},
                want_grads if rank == 0 else None,
            )
    assert engine.module(input_ids=ids, labels=labels).logits is None

    # the loss DeepSpeed installed gives the same value (it is what the line above replaces)
    with torch.no_grad():
        logits = engine.module(input_ids=ids).logits
        torch.testing.assert_close(
            ds_loss(logits, labels, vocab_size=V), reference(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-6
        )
        # any vtp op with DeepSpeed's TP group and the head's bounds
        lp = vtp.logprobs(
            logits[:, :-1],
            ids[:, 1:],
            tp_group=groups.get_tensor_model_parallel_group(),
            vocab_start=head.vocab_start_index,
            vocab_end=head.vocab_end_index,
        )
        want_lp = torch.log_softmax(reference(input_ids=ids).logits[:, :-1].double(), -1)
        assert isinstance(lp, torch.Tensor)  # no return_entropy: the log-probs alone
        torch.testing.assert_close(lp.double(), want_lp.gather(-1, ids[:, 1:, None])[..., 0], rtol=1e-5, atol=1e-5)
    return results, (head.vocab_start_index, head.vocab_end_index)


@pytest.mark.timeout(300)
def test_autotp_vocab_parallel_head(pool):
    per_rank = pool.run(_deepspeed_job, timeout=240)
    assert [bounds for _, bounds in per_rank] == [(0, 501), (501, 1001)]
    for key in ((f, n) for f in (False, True) for n in (True, False)):  # fused or not; num_items_in_batch or not
        want = per_rank[0][0][key][1]
        for name, full in want.items():
            local = [rank_results[0][key][0][name] for rank_results in per_rank]
            if local[0].shape == full.shape:  # replicated: every rank holds the whole gradient
                for grad in local:
                    torch.testing.assert_close(grad, full, rtol=1e-4, atol=1e-6, msg=name)
            else:  # sharded along the one dimension whose size differs, in rank order
                dim = next(d for d, (a, b) in enumerate(zip(local[0].shape, full.shape)) if a != b)
                torch.testing.assert_close(torch.cat(local, dim), full, rtol=1e-4, atol=1e-6, msg=name)
