"""Megatron-core on 2 gloo ranks: its tensor-parallel group, from
``parallel_state.initialize_model_parallel``, passed to ``vtp_runtime``'s ops, and a
``ColumnParallelLinear(gather_output=False)`` feeding ``vtp.cross_entropy``: per-token loss and
the gradients of the hidden states and of the weight shard equal those through Megatron's
own ``vocab_parallel_cross_entropy`` (without label smoothing, where Megatron is exact; its
smoothing matches ``label_smoothing=a*V/(V-1)`` at TP=1). No adapter is needed.

And a whole ``GPTModel`` at TP=2 (Megatron's shards are even: V=50), its
``compute_language_model_loss`` overridden by ``VtpLanguageModelLossMixin`` (the
``[s, b, V_local]`` logits and ``[b, s]`` labels transposed as Megatron does): the per-token
loss ``[b, s]`` and every parameter gradient equal Megatron's own.
"""

import importlib.util

import pytest
import torch

from vtp_runtime.testing.distributed import RankPool

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (pip install -e '.[integrations]')",
)

H, V = 16, 50


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(2, env={"VTP_BACKEND": "eager"})  # the integration is under test, not the kernels
    yield pool
    pool.close()


def _head(world):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    config = ModelParallelConfig(
        tensor_model_parallel_size=world, use_cpu_initialization=True, params_dtype=torch.float32
    )
    torch.manual_seed(0)  # the same full weight on every rank, each keeping its rows
    return ColumnParallelLinear(
        H, V, config=config, init_method=lambda w: torch.nn.init.normal_(w, std=0.5), bias=False, gather_output=False
    )


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
            want = _step(
                head, hidden, partial(vocab_parallel_cross_entropy, target=target, label_smoothing=smoothing), upstream
            )
            got = _step(
                head,
                hidden,
                partial(vtp.cross_entropy, labels=target, label_smoothing=eps, tp_group=tp_group),
                upstream,
            )
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


def _gpt_job(rank, world, group):
    """Megatron's GPTModel on CPU ranks: its attention asks for a CUDA buffer and its RNG
    tracker for CUDA states, which these test ranks answer with CPU ones (dropout is 0)."""
    import contextlib
    import warnings

    warnings.simplefilter("ignore")
    # Megatron asks torch.cuda.current_device() where its buffers go: answer "cpu" (a str where
    # torch declares an int index)
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    import vtp_runtime as vtp
    from vtp_runtime.integrations.megatron import VtpLanguageModelLossMixin

    class VtpGPTModel(VtpLanguageModelLossMixin, GPTModel):
        pass

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    try:
        config = TransformerConfig(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=4,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            tensor_model_parallel_size=world,
        )
        models = []
        for cls in (GPTModel, VtpGPTModel):
            torch.manual_seed(0)  # the same full weights on every rank, each keeping its shard
            models.append(
                cls(
                    config=config,
                    transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=V,
                    max_sequence_length=8,
                )
            )
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, V, (2, 8), generator=g)
        position_ids = torch.arange(8).expand(2, 8)
        mask = torch.ones(8, 8, dtype=torch.bool).tril().logical_not()[None, None]
        upstream = torch.rand(2, 8, generator=g)  # a loss mask
        out, calls = [], []
        cross_entropy = vtp.cross_entropy

        def counted(*a, **k):
            calls.append(1)
            return cross_entropy(*a, **k)

        vtp.cross_entropy = counted
        with vtp.use_backend("eager"):
            for model in models:
                loss = model(ids, position_ids, mask, labels=ids)  # [b, s]
                (loss * upstream).sum().backward()
                out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        vtp.cross_entropy = cross_entropy
        (want, want_grads), (got, got_grads) = out
        assert got.shape == (2, 8) and len(calls) == 1  # only the second model's loss went through vtp
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert got_grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        return models[1].output_layer.weight.shape
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.timeout(300)
def test_gpt_model_language_model_loss(pool):
    assert pool.run(_gpt_job, timeout=240) == [(V // 2, 16)] * 2
