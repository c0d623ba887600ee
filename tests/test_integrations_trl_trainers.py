"""TRL's trainers through vtp with one changed line: ``VocabParallel<X>Trainer`` logs what TRL's
own ``<X>Trainer`` logs -- every loss and metric of every step (SFT's entropy and token
accuracy, DPO's log-prob sums, mean logits and WPO weights, KTO's KL, GRPO's and RLOO's
importance ratios, KL and entropy, GKD's generalized JSD) -- on the same seed and data, at
TP=1 in this process and at TP=2 on gloo (a tiny Llama loaded with transformers' TP plan:
the head's weight a ``Shard(0)`` DTensor), against the stock trainer on one process.

Token accuracy comes from ``vtp.argmax`` on the fused head. The trainers that generate (GRPO,
RLOO, on-policy GKD) sample with vtp's sampler, which they turn on themselves; the stock
trainer they are compared with gets it by hand (``use_vocab_parallel_sampling``), and every
completion is compared token for token. On a head that keeps its vocabulary shard
(``tp_plan={"lm_head": "colwise"}``) TP=2 must generate one process's completions on both
ranks; TRL's own sampler there does not (the control).

Each TP rank runs the trainer as a single process (accelerate has no CPU tensor
parallelism, so the model's ``tp_size`` is hidden from the Trainer): both ranks see the whole
batch, as tensor parallelism wants; the reference model TRL loads is sharded as the policy
(else the policy's and the reference's log-probs differ in their last bits at TP=2, and
AdamW turns that noise, where the gradient is exactly 0 at TP=1, into full-size steps).
fp32 throughout (``bf16=False``): the adapters are under test, not bf16 rounding.
"""

import importlib.util
import os
from typing import Any

import pytest
import torch

from vtp_runtime.testing.distributed import RankPool

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("trl") is None, reason="trl is not installed (pip install -e '.[integrations]')"
)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(61)]  # V = 64: 32 ids per TP rank
KINDS = ("SFT", "DPO", "KTO", "GRPO", "RLOO", "GKD")
# what each trainer is run with: DPO with WPO's weights (log Σp²), GRPO/RLOO with a reference
# model (beta > 0) and a sampling temperature, GKD on-policy (the student samples each batch)
EXTRA: dict[str, dict[str, Any]] = {
    "SFT": {},
    "DPO": {"use_weighting": True},
    "KTO": {},
    "GRPO": {"num_generations": 2, "max_completion_length": 4, "beta": 0.1, "temperature": 0.8},
    "RLOO": {"num_generations": 2, "max_completion_length": 4, "beta": 0.1, "temperature": 0.8},
    "GKD": {"lmbda": 1.0, "beta": 0.5, "max_new_tokens": 3, "temperature": 0.9},  # on-policy: every step samples
}
SKIP = ("runtime", "per_second", "step_time")  # wall-clock entries of the logs
SAMPLERS = ("GRPO", "RLOO", "GKD")  # the trainers that generate (GKD: on-policy, lmbda > 0)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _save_models(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    for seed in (0, 1):  # the policy (student), and GKD's teacher
        torch.manual_seed(seed)
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(WORDS),
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                initializer_range=0.5,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=1,
            )
        ).save_pretrained(os.path.join(path, str(seed)))


def _text(g, n):
    # a trailing space: prompt + completion tokenizes as the prompt's tokens, then the completion's
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 61, (n,), generator=g)) + " "


def _rows(kind):
    g = torch.Generator().manual_seed(0)
    if kind == "SFT":
        return [{"prompt": _text(g, 3), "completion": _text(g, 4)} for _ in range(8)]
    if kind == "DPO":
        return [{"prompt": _text(g, 3), "chosen": _text(g, 3), "rejected": _text(g, 4)} for _ in range(8)]
    if kind == "KTO":
        return [{"prompt": _text(g, 3), "completion": _text(g, 3), "label": bool(i % 2)} for i in range(8)]
    if kind == "GKD":
        return [{"input_ids": torch.randint(3, len(WORDS), (6,), generator=g).tolist()} for _ in range(8)]
    return [{"prompt": _text(g, 3)} for _ in range(8)]


def _gkd_collate(batch):
    ids = torch.tensor([row["input_ids"] for row in batch])
    labels = ids.clone()
    labels[:, :2] = -100  # the prompt
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": labels,
        "prompts": ids[:, :2],
        "prompt_attention_mask": torch.ones_like(ids[:, :2]),
    }


def _reward(completions, **kwargs):
    return [len(c) / 10 for c in completions]


def _config(kind, out, **extra):
    import trl

    config: Any
    if kind == "GKD":
        try:
            from trl.experimental.gkd import GKDConfig

            config = GKDConfig
        except ImportError:
            config = trl.GKDConfig  # type: ignore[attr-defined]  # older trl's top-level name (newer: trl.experimental)
    else:
        config = getattr(trl, f"{kind}Config")
    fields = {
        "max_steps": 2,
        "model_init_kwargs": None if kind == "GKD" else {"dtype": torch.float32},
        **EXTRA[kind],
        **extra,
    }
    return config(
        output_dir=out,
        per_device_train_batch_size=4,
        logging_steps=1,
        learning_rate=1e-2,
        seed=0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        bf16=False,
        **fields,
    )


def _train(kind, trainer_class, path, out, tp=None, plan=None, sampler=False, generated=None, **extra):
    """The trainer's log history after its steps; ``tp``: load the models with transformers'
    TP plan over that many ranks (``plan``: rules over the model's own, e.g. the head's
    ``"colwise"``; without it the head's default plan gathers its output). ``sampler``: the
    stock trainer's models sample with ``use_vocab_parallel_sampling`` (what the VocabParallel
    trainers turn on themselves). ``generated``: a list that receives ``(who, sequences)`` of
    every ``generate()`` call. ``extra``: config fields over ``EXTRA[kind]``."""
    import warnings

    from datasets import Dataset
    from transformers import LlamaForCausalLM

    warnings.simplefilter("ignore")

    def load(seed):
        kw: dict[str, Any] = {}
        if tp is not None:
            from transformers.distributed import DistributedConfig

            kw["distributed_config"] = DistributedConfig(tp_size=tp, tp_plan=plan)
        model = LlamaForCausalLM.from_pretrained(os.path.join(path, str(seed)), dtype=torch.float32, **kw)
        model._tp_size = None  # each TP rank runs the Trainer as one process (see the module docstring)
        return model

    if tp is not None and kind != "GKD":
        from transformers.distributed import DistributedConfig

        # the reference model TRL loads (GRPO, RLOO, DPO, KTO with beta > 0) is sharded as the policy
        extra.setdefault(
            "model_init_kwargs",
            {"dtype": torch.float32, "distributed_config": DistributedConfig(tp_size=tp, tp_plan=plan)},
        )
    kw = {
        "args": _config(kind, out, **extra),
        "train_dataset": Dataset.from_list(_rows(kind)),
        "processing_class": _tokenizer(),
    }
    kw["model"] = load(0) if tp is not None or kind == "GKD" else os.path.join(path, "0")
    if kind in ("GRPO", "RLOO"):
        kw["reward_funcs"] = _reward
    if kind == "GKD":
        kw.update(teacher_model=load(1), data_collator=_gkd_collate)
    trainer = trainer_class(**kw)
    models = {"policy": trainer.model, "teacher": getattr(trainer, "teacher_model", None)}
    for who, model in models.items():
        if model is None:
            continue
        if sampler:
            from vtp_runtime.integrations.generation import use_vocab_parallel_sampling

            use_vocab_parallel_sampling(model)
        if generated is not None:
            model.generate = _recorded(model, who, generated)
    trainer.train()
    return [{k: v for k, v in entry.items() if not any(s in k for s in SKIP)} for entry in trainer.state.log_history]


Generation = tuple[str, torch.Tensor, bool]  # what _recorded appends: who, sequences, sampler on


def _recorded(model, who, into):
    """``model.generate``, recording ``(who, sequences, whether vtp's sampler is on)``."""
    from vtp_runtime.integrations.generation import is_vocab_parallel_sampling

    generate = model.generate

    def wrapper(*args, **kwargs):
        out = generate(*args, **kwargs)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        into.append((who, sequences.clone(), is_vocab_parallel_sampling(model)))
        return out

    return wrapper


def _stock(kind):
    import vtp_runtime.integrations.trl as vtp_trl

    return vtp_trl._trl_trainer(kind)


def _ours(kind):
    import vtp_runtime.integrations.trl as vtp_trl

    return getattr(vtp_trl, f"VocabParallel{kind}Trainer")


def _counted(fn, calls):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapper


def _run_ours(kind, path, out, tp=None, **kw):
    """``VocabParallel<kind>Trainer``'s logs, and how many calls reached vtp's fused head."""
    import vtp_runtime as vtp
    import vtp_runtime.integrations.trl as vtp_trl

    calls: list[int] = []
    saved = vtp_trl.per_token_outputs, vtp_trl.generalized_jsd_loss
    vtp_trl.per_token_outputs = _counted(saved[0], calls)
    vtp_trl.generalized_jsd_loss = _counted(saved[1], calls)
    try:
        with vtp.use_backend("eager"):
            return _train(kind, _ours(kind), path, out, tp, **kw), len(calls)
    finally:
        vtp_trl.per_token_outputs, vtp_trl.generalized_jsd_loss = saved


def _run_stock(kind, path, out, **kw):
    """The stock trainer on one process; trainers that generate sample with vtp's sampler
    (as ``VocabParallel<kind>Trainer`` does), on the same backend as ours (a draw is the same
    for one seed at any TP size on one backend)."""
    import vtp_runtime as vtp

    with vtp.use_backend("eager"):
        return _train(kind, _stock(kind), path, out, sampler=kind in SAMPLERS, **kw)


def _assert_same_logs(ours, stock, steps=2):
    assert len(ours) == len(stock) == steps + 1, (len(ours), len(stock))
    compared = 0
    for got, want in zip(ours, stock):
        assert got.keys() == want.keys(), got.keys() ^ want.keys()
        for key, value in want.items():
            if isinstance(value, float):
                # KL-like metrics are differences of nearby log-prob sums: an absolute floor
                torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)
                compared += 1
    return compared


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    _save_models(path)
    return path


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_tp1_trainer_logs_what_trl_logs(kind, models, tmp_path):
    stock = _run_stock(kind, models, str(tmp_path / "stock"))
    ours, calls = _run_ours(kind, models, str(tmp_path / "vtp"))
    assert calls >= 2, f"{kind}: vtp's fused head ran {calls} times"
    assert _assert_same_logs(ours, stock) >= 8


# -- TP=2 ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(2, env={"VTP_BACKEND": "eager"})  # the adapters are under test, not the kernels
    yield pool
    pool.close()


def _tp2_job(rank, world, group, kind, path, out):
    logs, calls = _run_ours(kind, path, os.path.join(out, str(rank)), tp=world)
    return logs, calls


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", KINDS)
def test_tp2_trainer_logs_what_one_process_logs(kind, models, pool, tmp_path):
    stock = _run_stock(kind, models, str(tmp_path / "stock"))
    per_rank = pool.run(_tp2_job, kind, models, str(tmp_path), timeout=300)
    for logs, calls in per_rank:
        assert calls >= 2
        _assert_same_logs(logs, stock)


# -- on-policy generation from a head that keeps its vocabulary shard (TP=2, "colwise") ---------
# The head's output is this rank's shard of the logits: sampling from it alone picks local ids.
# The VocabParallel trainers turn on vtp's sampler by themselves (at any TP size), whose draws
# depend on the global logits, the seed and the row only; the base seed of each generate() is
# drawn from torch's generator (which the Trainer seeds with args.seed) on the group's first
# rank. So TP=2 must generate exactly the completions of one process with the same seed, and
# log what it logs.

COLWISE = {"lm_head": "colwise"}
ON_POLICY = {  # case: (trainer, config fields over EXTRA)
    "GKD-on-policy": ("GKD", {}),  # lmbda=1: the student samples every step
    # the default lmbda=0.5 with seq_kd: python's random (seeded by the Trainer) picks the
    # student or the teacher each step; four steps give both
    "GKD-seq_kd": ("GKD", {"lmbda": 0.5, "seq_kd": True, "max_steps": 4}),
    "GRPO": ("GRPO", {}),
    "RLOO": ("RLOO", {}),
}


def _colwise_job(rank, world, group, kind, path, out, extra, ours=True):
    generated: list[Generation] = []
    out = os.path.join(out, f"{'ours' if ours else 'stock'}{rank}")
    if ours:
        logs, calls = _run_ours(kind, path, out, tp=world, plan=COLWISE, generated=generated, **extra)
    else:  # TRL's own sampler on the shards
        import vtp_runtime as vtp

        with vtp.use_backend("eager"):
            logs, calls = _train(kind, _stock(kind), path, out, tp=world, plan=COLWISE, generated=generated, **extra), 0
    return logs, calls, generated


def _assert_same_generations(got, want):
    assert len(got) == len(want) > 0, (len(got), len(want))
    for (who, ids, on), (want_who, want_ids, _) in zip(got, want):
        assert on, f"{who} generated without vtp's sampler"
        assert who == want_who
        assert torch.equal(ids, want_ids), (ids, want_ids)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", list(ON_POLICY))
def test_on_policy_generation_from_a_sharded_head_at_tp2(case, models, pool, tmp_path):
    kind, extra = ON_POLICY[case]
    steps = extra.get("max_steps", 2)
    want: list[Generation] = []  # the stock trainer on one process, vtp's sampler on its models
    stock = _run_stock(kind, models, str(tmp_path / "stock"), generated=want, **extra)
    tp1: list[Generation] = []  # ours on one process: the sampler is turned on by the trainer, at TP=1 too
    logs, _ = _run_ours(kind, models, str(tmp_path / "tp1"), generated=tp1, **extra)
    _assert_same_generations(tp1, want)
    _assert_same_logs(logs, stock, steps)
    if case == "GKD-seq_kd":
        assert {who for who, _, _ in want} == {"policy", "teacher"}, [who for who, _, _ in want]
    per_rank = pool.run(_colwise_job, kind, models, str(tmp_path), extra, timeout=400)
    for logs, calls, generated in per_rank:
        assert calls >= steps
        _assert_same_generations(generated, want)  # both ranks, token for token
        _assert_same_logs(logs, stock, steps)
    if case == "GKD-on-policy":  # the control: TRL's own sampler on the shards picks local ids
        per_rank = pool.run(_colwise_job, kind, models, str(tmp_path), extra, ours=False, timeout=400)
        assert not all(
            torch.equal(ids, w) for _, _, generated in per_rank for (_, ids, _), (_, w, _) in zip(generated, want)
        )


def _continuous_batching_job(rank, world, group, path, out):
    try:
        _run_ours(
            "GRPO",
            path,
            os.path.join(out, str(rank)),
            tp=world,
            plan=COLWISE,
            use_transformers_continuous_batching=True,
        )
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(300)
def test_continuous_batching_on_a_sharded_head_is_refused(models, pool, tmp_path):
    """transformers' continuous batching samples without the logits processors' hook: on a
    head that keeps its shard it would pick local ids, so the trainer refuses it."""
    for message in pool.run(_continuous_batching_job, models, str(tmp_path), timeout=200):
        assert "use_transformers_continuous_batching" in message and "local ids" in message, message
