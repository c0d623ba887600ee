"""What several test files share: the repository's root, the tiny transformers models the
integration tests build (and a step of one), the docs' multi-rank examples, the device mesh and
DTensor check of rank jobs, float64 inputs with each rank's shard of them, counts of the
plans' full paths and gathers, the sampling tests' random logits, and rank pools that fail
fast."""

from __future__ import annotations

import inspect
import pathlib
import re
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

ROOT = pathlib.Path(__file__).resolve().parent.parent


# -- the tiny transformers models --------------------------------------------------------------


def tiny_llama_config(vocab_size: int, hidden_size: int = 32, **overrides: Any):
    """A ``LlamaConfig`` of one layer, 4 attention heads on 2 key-value heads, an MLP twice as
    wide as ``hidden_size``, untied embeddings (so the head can be sharded on its own);
    ``overrides`` replace any of those."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**{**fields, **overrides})


TINY_CONFIG: dict[str, Any] = {  # the tiny decoder of every family (vocabulary, sizes)
    "vocab_size": 101,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TINY_FAMILIES: dict[str, dict[str, Any]] = {  # the decoder families fuse_lm_head claims; extra config, tied head or not
    "Llama": {"tie_word_embeddings": False},
    "Llama-tied": {"tie_word_embeddings": True},
    "Qwen2": {},
    "Qwen3": {"head_dim": 8},
    "Mistral": {},
    "Phi3": {"pad_token_id": 0},
    "Gemma": {"head_dim": 8},
    "Gemma2": {"head_dim": 8, "final_logit_softcapping": None},
    "Cohere": {"logit_scale": 0.25},  # logits * 0.25
    "Granite": {"logits_scaling": 4.0},  # logits / 4
}


def tiny_causal_lm(name, **extra):
    """The tiny ``<family>ForCausalLM`` of ``name`` (a key of ``TINY_FAMILIES``), seeded;
    ``extra`` replaces any of its config."""
    import transformers

    base = name.split("-")[0]
    config = getattr(transformers, f"{base}Config")(**{**TINY_CONFIG, **TINY_FAMILIES.get(name, {}), **extra})
    torch.manual_seed(0)
    return getattr(transformers, f"{base}ForCausalLM")(config)


def _grads(model):
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def train_step(model, **kw):
    """``model(**kw)`` and its loss's backward: (the output, the loss, every parameter's gradient)."""
    model.zero_grad(set_to_none=True)
    out = model(**kw)
    loss = out.loss if not isinstance(out, tuple) else out[0]
    loss *= 1  # as transformers' Trainer scales it (average_tokens_across_devices): in place
    loss.backward()
    return out, loss.detach(), _grads(model)


def small_batch(v=101):
    """(ids, labels) of 2 x 9 tokens, a prompt and padding ignored (-100)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, v, (2, 9), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt
    labels[1, -2:] = -100  # padding
    return ids, labels


def assert_fused_like(model, reference):
    """``model`` fused (no logits) with ``reference``'s loss and gradients, ``reference``
    unfused; both with the same weights."""
    import vtp_runtime as vtp
    from vtp_runtime.integrations.transformers import is_fused

    assert is_fused(model) and not is_fused(reference)
    device = next(model.parameters()).device
    ids, labels = (t.to(device) for t in small_batch())
    with vtp.use_backend("eager"):
        _, want_loss, want_grads = train_step(reference.train(), input_ids=ids, labels=labels)
        got, got_loss, got_grads = train_step(model.train(), input_ids=ids, labels=labels)
    assert got.logits is None
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


# -- the docs' multi-rank examples, as written -------------------------------------------------


def torchrun_examples(text: str) -> list[tuple[int, str]]:
    """``(N, block)`` for each ``python`` block of ``text`` defining ``main()`` for
    ``torchrun --nproc-per-node N``."""
    out = []
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        world = re.search(r"torchrun --nproc-per-node (\d+)", block)
        if "def main(" in block and world:
            out.append((int(world.group(1)), block))
    return out


def run_main(block: str, source: str, **offered: Any) -> float:
    """Define the example ``block`` (from ``source``, for tracebacks) and call its ``main``
    on the eager backend, with those of ``offered`` it takes; its loss as a float."""
    import vtp_runtime as vtp

    namespace: dict[str, Any] = {"__name__": "__doc_example__"}
    exec(compile(block, f"<{source} example>", "exec"), namespace)
    main = namespace["main"]
    taken = {k: v for k, v in offered.items() if k in inspect.signature(main).parameters}
    with vtp.use_backend("eager"):
        return float(main(**taken))


# -- test ids ----------------------------------------------------------------------------------


def head_case_id(case) -> str:
    """A ``HeadCase``'s test id: its own id and its token shape."""
    return f"{case.id}-N{'x'.join(map(str, case.shape))}"


# -- DTensors in rank jobs ---------------------------------------------------------------------

_MESHES: dict = {}


def pool_mesh(world: int, shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    """The CPU mesh of ``shape`` (its dimensions named ``names``) over every rank of the pool,
    made once per rank process (a 2-D mesh creates process groups, a collective)."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (world, shape, names)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh("cpu", torch.arange(world).reshape(shape), mesh_dim_names=names)
    return _MESHES[key]


def as_dtensor(x: object) -> DTensor:
    """``x``, which must be a DTensor: a result of a call on DTensors, or its gradient."""
    from torch.distributed.tensor import DTensor

    assert isinstance(x, DTensor), f"a {type(x).__name__}, not a DTensor"
    return x


# -- float64 inputs on the full vocabulary, and each rank's shard of them ---------------------

SHARD_SIZES = {1: [13], 2: [5, 8]}  # the vocabulary's shards at TP 1 and 2: uneven at TP 2
H, K = 4, 3  # hidden size of the Heads, k of the TopK teachers


class FullInputs:
    """Fresh float64 inputs on the full vocabulary, the same on every rank for one seed."""

    def __init__(self, n: int, seed: int, vocab: int):
        g = torch.Generator().manual_seed(seed)
        self.z = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2
        self.t = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2
        self.y = torch.randint(0, vocab, (n,), generator=g)
        self.y[0] = -100
        self.m = torch.rand(n, generator=g) > 0.3
        self.idx = torch.randint(0, vocab, (n, 2), generator=g)
        teacher = torch.log_softmax(torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2, -1)
        self.lp, self.ids = teacher.topk(K, dim=-1)
        self.h = torch.randn(n, H, generator=g, dtype=torch.float64)
        self.w = torch.randn(vocab, H, generator=g, dtype=torch.float64)
        self.b = torch.randn(vocab, generator=g, dtype=torch.float64)
        self.wt = torch.randn(vocab, H, generator=g, dtype=torch.float64)


def shard(x: torch.Tensor, rank: int, sizes, dim: int = -1) -> torch.Tensor:
    """A copy of ``rank``'s block of ``x`` along ``dim``, the blocks of ``sizes`` in rank order."""
    start = sum(sizes[:rank])
    return x.narrow(dim, start, sizes[rank]).clone()


def max_error(got, want) -> float:
    """The largest absolute difference, in float64, of two tensors of one shape."""
    got, want = got.double(), want.double()
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    return (got - want).abs().max().item() if got.numel() else 0.0


def healthy_calls(rank: int, world: int, group) -> float:
    """Valid calls on every rank of ``group`` (its shards of ``SHARD_SIZES``): their largest
    deviation from float64 on the full logits."""
    import vtp_runtime as vtp
    from vtp_runtime.testing.reference import values as reference

    sizes = SHARD_SIZES[world]
    d = FullInputs(5, seed=77, vocab=sum(sizes))
    ce = vtp.cross_entropy(shard(d.z, rank, sizes), d.y, label_smoothing=0.2, tp_group=group)
    jsd = vtp.jsd(shard(d.z, rank, sizes), shard(d.t, rank, sizes), beta=0.3, tp_group=group)
    return max(
        max_error(ce, reference("cross_entropy", (d.z,), d.y, label_smoothing=0.2)),
        max_error(jsd, reference("jsd", (d.z, d.t), beta=0.3)),
    )


# -- plans ----------------------------------------------------------------------------------


class PlanCounts:
    """Counts full preparations (checks, gather, dispatch) and metadata gathers on this rank,
    by patching the two module functions for the duration of a block."""

    def __init__(self):
        self.prepared, self.gathered = 0, 0

    def __enter__(self):
        from vtp_runtime import metadata, plans

        self._prepare, self._gather = plans.full_path, metadata.gather

        def prepare(*args, **kwargs):
            self.prepared += 1
            return self._prepare(*args, **kwargs)

        def gather(*args, **kwargs):
            self.gathered += 1
            return self._gather(*args, **kwargs)

        plans.full_path, metadata.gather = prepare, gather
        return self

    def __exit__(self, *exc):
        from vtp_runtime import metadata, plans

        plans.full_path, metadata.gather = self._prepare, self._gather

    def take(self) -> tuple[int, int]:
        out = (self.prepared, self.gathered)
        self.prepared = self.gathered = 0
        return out


# -- random logits over the sampling tests' vocabulary --------------------------------------

SAMPLING_VOCAB = 23  # the vocabulary of the sampling tests: small, prime, split unevenly


def random_logits(n: int = 6, v: int = SAMPLING_VOCAB, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    """Float32 logits [n, v], normal with standard deviation ``scale``, the same for one seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale


# -- rank pools that fail fast ---------------------------------------------------------------


class QuickPools:
    """Gloo rank pools, one per world size, apart from the ``ranks`` fixture's: their
    collectives time out in ``collective_timeout`` s, so that a hang fails its test in
    seconds; a job that failed or timed out takes its ranks down with it (their collectives
    may be out of step), so that the next job starts on fresh ones."""

    def __init__(self, collective_timeout: float, job_timeout: float):
        self.collective_timeout, self.job_timeout = collective_timeout, job_timeout
        self._pools: dict = {}

    def run(self, world: int, fn, *args, timeout: float | None = None):
        """``fn(rank, world, group, *args)`` on ``world`` ranks; per-rank results in rank order."""
        from vtp_runtime.testing.distributed import RankPool

        pool = self._pools.get(world)
        if pool is None or not pool.alive:
            pool = self._pools[world] = RankPool(world, collective_timeout=self.collective_timeout)
        try:
            return pool.run(fn, *args, timeout=timeout or self.job_timeout)
        except AssertionError:  # RankFailure, RankTimeout: its collectives may be out of step now
            pool.close(force=True)
            raise

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
