"""Megatron-core on 2 gloo ranks: its tensor-parallel group, from
``parallel_state.initialize_model_parallel``, passed to ``vtp_runtime``'s ops, and a
``ColumnParallelLinear(gather_output=False)`` feeding ``vtp.cross_entropy``: per-token loss and
the gradients of the hidden states and of the weight shard equal those through Megatron's
own ``vocab_parallel_cross_entropy`` (without label smoothing, where Megatron is exact; its
smoothing matches ``label_smoothing=a*V/(V-1)`` at TP=1). No adapter is needed.
"""

import importlib.util

import pytest
import torch

from vtp_runtime.testing.distributed import RankPool

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (pip install -e '.[integrations]')")

H, V = 16, 50


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(2, env={"VTP_BACKEND": "eager"})  # the integration is under test, not the kernels
    yield pool
    pool.close()


def _head(world):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    config = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True,
                                 params_dtype=torch.float32)
    torch.manual_seed(0)  # the same full weight on every rank, each keeping its rows
    return ColumnParallelLinear(H, V, config=config, init_method=lambda w: torch.nn.init.normal_(w, std=0.5),
                                bias=False, gather_output=False)


def _step(head, hidden, loss_fn, upstream):
    head.weight.grad = None
    hidden = hidden.detach().requires_grad_()
    logits, _ = head(hidden)
    loss = loss_fn(logits)
    (loss * upstream).sum().backward()
    return loss.detach(), hidden.grad, head.weight.grad.clone()


def _megatron_job(rank, world, group):
    import warnings
    from functools import partial

    warnings.simplefilter("ignore")  # Megatron warns about missing Apex / Transformer Engine
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    import vtp_runtime as vtp

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 2, H, generator=g)  # [seq, batch, hidden], replicated
    target = torch.randint(0, V, (5, 2), generator=g)
    upstream = torch.rand(5, 2, generator=g)  # a loss mask / token weights
    out = {}
    for tp, smoothing in ((world, 0.0), (1, 0.1)):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            tp_group = parallel_state.get_tensor_model_parallel_group()
            head = _head(tp)
            assert head.weight.shape == (V // tp, H)
            eps = smoothing * V / (V - 1)  # Megatron's alpha spreads over the V-1 other classes
            want = _step(head, hidden, partial(vocab_parallel_cross_entropy, target=target,
                                               label_smoothing=smoothing), upstream)
            got = _step(head, hidden, partial(vtp.cross_entropy, labels=target, label_smoothing=eps,
                                              tp_group=tp_group), upstream)
            for name, w, h in zip(("loss", "hidden grad", "weight grad"), want, got):
                torch.testing.assert_close(h, w, rtol=1e-5, atol=1e-6, msg=f"TP={tp}: {name}")
            out[tp] = tuple(want)
        finally:
            parallel_state.destroy_model_parallel()
    return out


@pytest.mark.timeout(300)
def test_column_parallel_linear_feeds_vtp(pool):
    results = pool.run(_megatron_job, timeout=240)
    # the sharded head really is sharded: per-rank weight gradients are different rows
    assert not torch.equal(results[0][2][2], results[1][2][2])
