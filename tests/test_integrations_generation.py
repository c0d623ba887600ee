"""transformers' generate() on a tiny random Llama whose lm_head is vocabulary-sharded on 2 gloo
ranks (``tp_plan={"lm_head": "colwise"}``): with ``use_vocab_parallel_sampling`` greedy
decoding gives the unsharded model's sequences and sampling the same sequences on both
ranks (and, for one seed, the unsharded model's); without it, generate() warns once."""

import importlib.util

import pytest
import torch

from vtp_runtime.testing.distributed import RankPool

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install -e '.[integrations]')")

V, WORLD = 1000, 2


def _save_job(rank, world, group, path):
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    if rank == 0:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                             bos_token_id=1, eos_token_id=None, pad_token_id=0)
        LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier(group)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    pool = RankPool(WORLD, env={"VTP_BACKEND": "eager"})
    path = str(tmp_path_factory.mktemp("llama"))
    pool.run(_save_job, path, timeout=240)
    yield pool, path
    pool.close()


def _load(path, **kw):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)


def _generate_job(rank, world, group, path):
    import warnings

    from transformers.distributed import DistributedConfig

    from vtp_runtime.integrations.generation import (
        use_vocab_parallel_sampling,
        vocab_parallel_sampling,
        warn_on_sharded_generation,
    )

    ref = _load(path)
    sharded = _load(path, distributed_config=DistributedConfig(tp_plan={"lm_head": "colwise"}, tp_size=world))
    prompt = torch.randint(3, V, (3, 5), generator=torch.Generator().manual_seed(2))
    kw = {"max_new_tokens": 8, "pad_token_id": 0}
    out = {"greedy_ref": ref.generate(prompt, do_sample=False, **kw)}

    warn_on_sharded_generation(sharded)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["unguarded"] = sharded.generate(prompt, do_sample=False, **kw)
        sharded.generate(prompt, do_sample=False, **kw)
    out["warnings"] = sum("split over the vocabulary" in str(w.message) for w in caught)

    use_vocab_parallel_sampling(sharded)
    out["greedy"] = sharded.generate(prompt, do_sample=False, **kw)
    torch.manual_seed(100 + rank)  # the ranks' generators differ: the base seed is the first rank's
    out["sampled"] = sharded.generate(prompt, do_sample=True, temperature=0.9, top_k=50, top_p=0.9, **kw)
    out["sampled_min_p"] = sharded.generate(prompt, do_sample=True, min_p=0.05, **kw)
    with vocab_parallel_sampling(sharded, seed=7):
        out["seeded"] = sharded.generate(prompt, do_sample=True, top_p=0.95, **kw)
    with vocab_parallel_sampling(ref, seed=7):  # one process, the same seed
        out["seeded_ref"] = ref.generate(prompt, do_sample=True, top_p=0.95, **kw)
    try:
        sharded.generate(prompt, do_sample=True, repetition_penalty=1.2, **kw)
        out["refused"] = "no error"
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


@pytest.mark.timeout(600)
def test_generate_on_a_vocabulary_sharded_head(pool):
    pool, path = pool
    r0, r1 = pool.run(_generate_job, path, timeout=500)
    assert torch.equal(r0["greedy"], r0["greedy_ref"]) and torch.equal(r1["greedy"], r1["greedy_ref"])
    assert r0["greedy"].shape == (3, 13)
    for key in ("sampled", "sampled_min_p", "seeded"):
        assert torch.equal(r0[key], r1[key]), key
    assert not torch.equal(r0["sampled"], r0["greedy"])
    assert torch.equal(r0["seeded"], r0["seeded_ref"])
    # without it: local ids, and one warning per model
    assert r0["warnings"] == r1["warnings"] == 1
    assert not torch.equal(r1["unguarded"], r1["greedy_ref"])
    assert "RepetitionPenaltyLogitsProcessor" in r0["refused"]
