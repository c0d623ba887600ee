"""transformers' generate() on a tiny random Llama whose lm_head is vocabulary-sharded on 2 gloo
ranks (``tp_plan={"lm_head": "colwise"}``): with ``use_vocab_parallel_sampling`` greedy
decoding gives the unsharded model's sequences and sampling the same sequences on both
ranks (and, for one seed, the unsharded model's with vtp's sampler); without it, generate()
warns once. The same through ``fuse_lm_head`` and ``use_vocab_parallel_loss``, which install
the warning on a head split over the vocabulary (the "colwise" plan, a head split by hand)
and not where the head gathers its output (the default plan: there the sampler takes the
whole logits, other logits processors first). In one process, on the whole vocabulary: a
sampled step draws once (vtp's draw, not transformers' multinomial again), with the ids,
scores, streamer and EOS stopping of the documented seeds; with the sampler off again,
transformers' own processors."""

import copy
import importlib.util

import pytest
import torch

from tests.helpers import tiny_llama_config
from vtp_runtime.testing.distributed import RankPool

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install -e '.[integrations]')",
)

V, WORLD = 1000, 2


def _save_job(rank, world, group, path):
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    if rank == 0:
        torch.manual_seed(0)
        config = tiny_llama_config(V, 64, bos_token_id=1, eos_token_id=None, pad_token_id=0)
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
    found = [str(w.message) for w in caught if "shard of the vocabulary" in str(w.message)]
    out["warnings"], out["message"] = len(found), found[0] if found else ""

    use_vocab_parallel_sampling(sharded)
    out["greedy"] = sharded.generate(prompt, do_sample=False, **kw)
    torch.manual_seed(100 + rank)  # the ranks' generators differ: the base seed is the first rank's
    multinomial, out["multinomial calls"] = torch.multinomial, 0

    def counted(*args, **kwargs):
        out["multinomial calls"] += 1
        return multinomial(*args, **kwargs)

    torch.multinomial = counted  # the token is vtp's draw: transformers' own draw is not run
    try:
        out["sampled"] = sharded.generate(prompt, do_sample=True, temperature=0.9, top_k=50, top_p=0.9, **kw)
        out["sampled_min_p"] = sharded.generate(prompt, do_sample=True, min_p=0.05, **kw)
    finally:
        torch.multinomial = multinomial
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
    assert r0["multinomial calls"] == r1["multinomial calls"] == 0
    # without it: local ids, and one warning per model
    assert r0["warnings"] == r1["warnings"] == 1
    assert "use_vocab_parallel_sampling(model)" in r0["message"]
    assert not torch.equal(r1["unguarded"], r1["greedy_ref"])
    assert "RepetitionPenaltyLogitsProcessor" in r0["refused"]


def _warnings(fn):
    """``fn()``'s result and how many vocabulary-shard warnings it raised."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, sum("shard of the vocabulary" in str(w.message) for w in caught)


def _patched_job(rank, world, group, path):
    from torch import nn
    from transformers.distributed import DistributedConfig

    from vtp_runtime.integrations.generation import use_vocab_parallel_sampling, vocab_parallel_sampling
    from vtp_runtime.integrations.transformers import fuse_lm_head, use_vocab_parallel_loss

    ref = _load(path)
    prompt = torch.randint(3, V, (3, 5), generator=torch.Generator().manual_seed(3))
    kw = {"max_new_tokens": 6, "pad_token_id": 0}
    sampled = {"do_sample": True, "temperature": 0.7, "top_k": 40}
    penalty = {"do_sample": True, "repetition_penalty": 1.3}
    want = {"greedy": ref.generate(prompt, do_sample=False, **kw)}
    with vocab_parallel_sampling(ref, seed=11):  # one process, vtp's sampler on the whole logits
        want["seeded"] = ref.generate(prompt, **sampled, **kw)
        want["penalty"] = ref.generate(prompt, **penalty, **kw)

    def hand_split():  # this rank's rows of the head in a plain nn.Linear
        model = _load(path)
        start, end = (0, 400) if rank == 0 else (400, V)
        head = nn.Linear(model.config.hidden_size, end - start, bias=False)
        head.weight.data.copy_(ref.lm_head.weight.data[start:end])
        model.lm_head = head
        return model, {"tp_group": group, "vocab_start": start, "vocab_end": end}

    colwise = {"lm_head": "colwise"}
    out = {}
    for name, patch, plan in (
        ("fused", fuse_lm_head, colwise),
        ("loss", use_vocab_parallel_loss, colwise),
        ("fused gathered", fuse_lm_head, None),
        ("fused by hand", fuse_lm_head, "hand"),
    ):

        def load(plan=plan, patch=patch):
            if plan == "hand":
                model, layout = hand_split()
                return patch(model, **layout).train(), layout
            config = DistributedConfig(tp_plan=plan, tp_size=world)
            return patch(_load(path, distributed_config=config)).train(), {}

        got = {}
        plain, layout = load()  # a plain generate(): warns (once) where the logits are shards
        got["plain"], got["warnings"] = _warnings(
            lambda plain=plain: [plain.generate(prompt, do_sample=False, **kw) for _ in range(2)][0]
        )
        model, layout = load()  # with the sampler: no warning, the unsharded model's tokens
        use_vocab_parallel_sampling(model, **layout)

        def generate(model=model, layout=layout, plan=plan):
            result = {"greedy": model.generate(prompt, do_sample=False, **kw)}
            with vocab_parallel_sampling(model, seed=11, **layout):
                result["seeded"] = model.generate(prompt, **sampled, **kw)
                if plan is None:  # the whole logits on every rank: other processors run first
                    result["penalty"] = model.generate(prompt, **penalty, **kw)
            return result

        result, got["sampler warnings"] = _warnings(generate)
        out[name] = {**got, **result}
    return want, out


@pytest.mark.timeout(600)
def test_generate_through_the_patched_models(pool):
    """``fuse_lm_head`` and ``use_vocab_parallel_loss`` with ``model.generate()``: the warning
    once where the head's output is a shard (never with the sampler, never where it is
    gathered), and with ``use_vocab_parallel_sampling`` the unsharded model's sequences
    (greedy; sampled for one seed, against the one process sampling with vtp's sampler)."""
    pool, path = pool
    per_rank = pool.run(_patched_job, path, timeout=500)
    for rank, (want, out) in enumerate(per_rank):
        for name, got in out.items():
            sharded = name != "fused gathered"
            assert got["warnings"] == (1 if sharded else 0), (rank, name, got["warnings"])
            assert got["sampler warnings"] == 0, (rank, name)
            for key in ("greedy", "seeded") + (() if sharded else ("penalty",)):
                assert torch.equal(got[key], want[key]), (rank, name, key)
        assert not torch.equal(want["seeded"], want["greedy"])
        assert not torch.equal(want["penalty"], want["seeded"])
    # a plain generate() picks from each rank's shard: wrong where the head's output is one
    for name in per_rank[0][1]:
        right = [torch.equal(out[name]["plain"], want["greedy"]) for want, out in per_rank]
        assert (right == [True, True]) if name == "fused gathered" else (not all(right)), (name, right)


# -- one process, the whole vocabulary: what a sampled step costs, and the same ids ----------

SEED, PROMPT, NEW = 5, 4, 6


@pytest.fixture(scope="module")
def small():
    """A tiny random Llama (SDPA attention: no softmax of its own) and a prompt of 3 rows."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(200, 32, bos_token_id=1, eos_token_id=None, pad_token_id=0, attn_implementation="sdpa")
    prompt = torch.randint(3, 200, (3, PROMPT), generator=torch.Generator().manual_seed(4))
    return LlamaForCausalLM(config).eval(), prompt


def _drawn_by_hand(model, prompt, **options):
    """``vtp.sample`` on each step's last logits, with the seeds generation.py documents
    (``base * 2**32 + sequence length``), without transformers' decoding loop."""
    import vtp_runtime as vtp

    ids = prompt
    for _ in range(NEW):
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float()
        drawn = vtp.sample(logits, seed=SEED * 2**32 + ids.shape[-1], **options)
        ids = torch.cat([ids, drawn[:, None]], dim=-1)
    return ids


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls of ``torch.multinomial`` and ``F.softmax`` (transformers' sampling draw)."""
    calls = {"multinomial": 0, "softmax": 0}

    def counting(module, name):
        original = getattr(module, name)

        def count(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, count)

    counting(torch, "multinomial")
    counting(torch.nn.functional, "softmax")
    return calls


@pytest.mark.timeout(120)
def test_a_sampled_step_draws_once(small, counted):
    """With the sampler on, ``generate(do_sample=True)`` draws each token with ``vtp.sample``
    only: transformers' softmax and ``torch.multinomial`` are not run on the one-hot scores
    (the decoding loop takes their argmax); the tokens are those of ``vtp.sample`` with the
    documented seeds, the scores the one-hot of each drawn id, a streamer gets each token,
    and neither the caller's generation config nor the model's is changed."""
    from transformers import GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    import vtp_runtime as vtp
    from vtp_runtime.integrations.generation import vocab_parallel_sampling

    model, prompt = small
    options = {"temperature": 0.8, "top_p": 0.9}
    config = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=NEW, **options)

    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.append(value)

        def end(self):
            pass

    streamer = Collect()
    with vtp.use_backend("eager"), vocab_parallel_sampling(model, seed=SEED):
        out = model.generate(
            prompt, generation_config=config, output_scores=True, return_dict_in_generate=True, streamer=streamer
        )
        assert counted == {"multinomial": 0, "softmax": 0}
        want = _drawn_by_hand(model, prompt, **options)
    assert torch.equal(out.sequences, want)
    drawn = out.sequences[:, PROMPT:]
    assert len(out.scores) == NEW
    for step, scores in enumerate(out.scores):
        one_hot = torch.full_like(scores, -torch.inf).scatter_(1, drawn[:, step, None], 0.0)
        assert torch.equal(scores, one_hot), step
    assert torch.equal(torch.cat([t.reshape(3, -1) for t in streamer.tokens[1:]], dim=1), drawn)
    assert config.do_sample and model.generation_config.do_sample in (None, False)


@pytest.mark.timeout(120)
def test_eos_stops_a_sampled_row_with_the_sampler(small):
    """transformers' stopping on EOS and padding after it, through the greedy path the sampler
    hands the decoding loop: a row that draws the EOS id stops there and is padded, the other
    rows draw what they drew without the EOS id (the draws depend on the step and row only)."""
    import vtp_runtime as vtp
    from vtp_runtime.integrations.generation import vocab_parallel_sampling

    model, prompt = small
    kw = {"do_sample": True, "top_k": 0, "max_new_tokens": NEW, "pad_token_id": 0}
    with vtp.use_backend("eager"), vocab_parallel_sampling(model, seed=SEED):
        free = model.generate(prompt, **kw)[:, PROMPT:]
        eos = int(free[0, 1])  # row 0 draws it at its second step
        stopped = model.generate(prompt, eos_token_id=eos, **kw)[:, PROMPT:]
    want = free.clone()
    for row in want:
        hits = (row == eos).nonzero()
        if len(hits):
            row[int(hits[0]) + 1 :] = 0
    done = max(int((r == eos).nonzero()[0]) + 1 if (r == eos).any() else NEW for r in free)
    assert torch.equal(stopped, want[:, :done])
    assert stopped[0, 1] == eos and (stopped[0, 2:] == 0).all()


@pytest.mark.timeout(120)
def test_greedy_with_the_sampler_is_transformers_greedy(small):
    """Greedy decoding with the sampler on gives transformers' own greedy sequences."""
    import vtp_runtime as vtp
    from vtp_runtime.integrations.generation import vocab_parallel_sampling

    model, prompt = small
    kw = {"do_sample": False, "max_new_tokens": NEW}
    want = model.generate(prompt, **kw)
    with vtp.use_backend("eager"), vocab_parallel_sampling(model):
        assert torch.equal(model.generate(prompt, **kw), want)


@pytest.mark.timeout(120)
def test_the_sampler_off_leaves_transformers_processors(small):
    """After the sampler was on (and off again), ``generate()`` on a head that holds the whole
    vocabulary runs transformers' own logits processors and nothing more; on a head split by
    hand the processor that watches for shards is still added."""
    from transformers import GenerationConfig

    from vtp_runtime.integrations.generation import vocab_parallel_sampling, warn_on_sharded_generation

    model, prompt = small
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=0, max_new_tokens=NEW)

    def processors(m):  # as generate() asks for them, on its own copy of the config
        found = m._get_logits_processor(generation_config=copy.deepcopy(config), model_kwargs={})
        return [type(p).__name__ for p in found]

    want = processors(model)
    with vocab_parallel_sampling(model):
        assert processors(model) == ["VocabParallelTokenSelector"]
    assert processors(model) == want == ["TemperatureLogitsWarper"]
    split = type(model)(model.config)
    split.lm_head = torch.nn.Linear(32, 120, bias=False)  # this rank's 120 of the 200 ids
    warn_on_sharded_generation(split)
    assert processors(split) == want + ["VocabShardCheck"]
