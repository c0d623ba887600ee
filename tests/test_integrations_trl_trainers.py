"""TRL's trainers through vtp with one changed line: ``VocabParallel<X>Trainer`` logs what TRL's
own ``<X>Trainer`` logs -- every loss and metric of every step (SFT's entropy and token
accuracy, DPO's log-prob sums, mean logits and WPO weights, KTO's KL, GRPO's and RLOO's
importance ratios, KL and entropy, GKD's generalized JSD) -- on the same seed and data.

At TP=1, in this process, each trainer is built with every option the docs list for it, and
those options reach ``vtp.Head``. At TP=2 the trainers run as ``torchrun --nproc-per-node 2``
runs them: spawned ranks with torchrun's environment (``RankPool(launched=True)``), the
models loaded with transformers' ``tp_size`` (the head's weight a ``Shard(0)`` DTensor) and
keeping the ``tp_size`` transformers gives them, so the Trainer hands accelerate a
``ParallelismConfig`` and accelerate gives both ranks the batches of one data-parallel
replica. They must log what one process logs, except the counts TRL and transformers sum
over every process (``PER_PROCESS``: each TP rank's copy of a batch counts there).

The trainers that generate (GRPO, RLOO, on-policy GKD) sample with vtp's sampler, which they
turn on themselves; the stock trainer they are compared with gets it by hand
(``use_vocab_parallel_sampling``), and every completion is compared token for token: at TP=2,
greedy and sampled, on the head's default plan and on ``"colwise"`` (a head that keeps its
vocabulary shard), both ranks must generate one process's completions. TRL seeds GRPO's and
RLOO's processes with ``set_seed(seed, device_specific=True)`` and shuffles each generation
batch with torch's generator: unless the trainer seeds the ranks of a TP group alike, they
hold the same rows in different orders and train on them silently. Ranks that hold different
rows on purpose must raise a ``ShardError`` naming the trainer and the step, on every rank;
data-parallel replicas must still draw apart as TRL seeds them.
TRL's own trainer classes behave as the VocabParallel ones after ``use_vtp()``.
fp32 throughout (``bf16=False``): the adapters are under test, not bf16 rounding.
"""

import contextlib
import importlib.util
import os
import re
from typing import Any

import pytest
import torch

from tests.helpers import ROOT
from vtp_runtime.testing.distributed import RankPool, outcome
from vtp_runtime.testing.launch import accelerate_tensor_parallel_on_cpu

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
# sums and spreads over every process's copy of a batch (accelerate's gather over the world):
# at TP=2 each TP rank's copy counts, as in TRL and transformers on GPUs
PER_PROCESS = ("num_tokens", "total_flos", "reward_std", "rewards/_reward/std")
SAMPLERS = ("GRPO", "RLOO", "GKD")  # the trainers that generate (GKD: on-policy, lmbda > 0)
GREEDY = {"generation_kwargs": {"do_sample": False}}
COLWISE = {"lm_head": "colwise"}  # a head that keeps its vocabulary shard: sampling it alone picks local ids
# the value each documented trainer option is tested with (docs/integrations.md lists them)
OPTIONS: dict[str, Any] = {
    "vtp_layout": {"tp_group": None, "vocab_start": 0, "vocab_end": len(WORDS)},  # a whole head, "split by hand"
    "vtp_chunk_rows": 3,
}


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
        "per_device_train_batch_size": 4,
        "logging_steps": 1,
        "learning_rate": 1e-2,
        "seed": 0,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "bf16": False,
        "max_steps": 2,
        "model_init_kwargs": None if kind == "GKD" else {"dtype": torch.float32},
        **EXTRA[kind],
        **extra,
    }
    return config(output_dir=out, **fields)


def _train(
    kind,
    trainer_class,
    path,
    out,
    tp=None,
    plan=None,
    sampler=False,
    generated=None,
    options=None,
    rows=None,
    after_init=None,
    **extra,
):
    """The trainer's log history after its steps. ``tp``: load the models with transformers'
    TP over that many ranks, as users do (``plan``: rules over the model's own, e.g. the
    head's ``"colwise"``; without it the head's default plan gathers its output).
    ``sampler``: the stock trainer's models sample with ``use_vocab_parallel_sampling`` (what
    the VocabParallel trainers turn on themselves). ``generated``: a list that receives
    ``(who, sequences, sampler on)`` of every ``generate()`` call. ``options``: the trainer's
    keyword arguments beyond TRL's; ``rows``: the dataset's rows (default ``_rows(kind)``);
    ``after_init(trainer)`` runs before training. ``extra``: config fields over ``EXTRA[kind]``."""
    import warnings

    from datasets import Dataset
    from transformers import LlamaForCausalLM

    warnings.simplefilter("ignore")

    def load(seed):
        kw: dict[str, Any] = {}
        if tp is not None:
            from transformers.distributed import DistributedConfig

            kw["distributed_config"] = DistributedConfig(tp_size=tp, tp_plan=plan)
        return LlamaForCausalLM.from_pretrained(os.path.join(path, str(seed)), dtype=torch.float32, **kw)

    if tp is not None and kind != "GKD":
        from transformers.distributed import DistributedConfig

        # the reference model TRL loads (GRPO, RLOO, DPO, KTO with beta > 0) is sharded as the policy
        extra.setdefault(
            "model_init_kwargs",
            {"dtype": torch.float32, "distributed_config": DistributedConfig(tp_size=tp, tp_plan=plan)},
        )
    kw = {
        "args": _config(kind, out, **extra),
        "train_dataset": Dataset.from_list(_rows(kind) if rows is None else rows),
        "processing_class": _tokenizer(),
        **(options or {}),
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
    if after_init is not None:
        after_init(trainer)
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

    return vtp_trl.trl_trainer(kind)


def _ours(kind):
    import vtp_runtime.integrations.trl as vtp_trl

    return getattr(vtp_trl, f"VocabParallel{kind}Trainer")


@contextlib.contextmanager
def _heads_recorded():
    """Yields a list that receives ``(chunk_rows, layout)`` of every fused head an op reads."""
    from vtp_runtime.integrations.lm_head import HeadLogits

    seen: list[tuple[Any, dict]] = []
    vtp_inputs = HeadLogits.vtp_inputs

    def recorded(self, *args, **kwargs):
        seen.append((self.chunk_rows, dict(self.layout or {})))
        return vtp_inputs(self, *args, **kwargs)

    HeadLogits.vtp_inputs = recorded  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        HeadLogits.vtp_inputs = vtp_inputs  # type: ignore[method-assign]


def _run_ours(kind, path, out, tp=None, switch=False, **kw):
    """``VocabParallel<kind>Trainer``'s logs (``switch``: TRL's own class after ``use_vtp()``),
    and the ``(chunk_rows, layout)`` of every fused head vtp's ops read."""
    import vtp_runtime as vtp
    import vtp_runtime.integrations.trl as vtp_trl

    with contextlib.ExitStack() as stack:
        if switch:
            vtp_trl.use_vtp()
            stack.callback(vtp_trl.use_vtp, False)
        heads = stack.enter_context(_heads_recorded())
        with vtp.use_backend("eager"):
            return _train(kind, _stock(kind) if switch else _ours(kind), path, out, tp, **kw), heads


_STOCK: dict[str, Any] = {}  # the stock runs on one process, by kind and config: each is run once


def _run_stock(kind, path, out, **kw):
    """The stock trainer's logs and generations on one process; trainers that generate sample
    with vtp's sampler (as ``VocabParallel<kind>Trainer`` does), on the same backend as ours
    (a draw is the same for one seed at any TP size on one backend)."""
    import vtp_runtime as vtp

    key = repr((kind, sorted(kw.items())))
    if key not in _STOCK:
        generated: list[Generation] = []
        with vtp.use_backend("eager"):
            logs = _train(kind, _stock(kind), path, out, sampler=kind in SAMPLERS, generated=generated, **kw)
        _STOCK[key] = logs, generated
    return _STOCK[key]


def _assert_same_logs(ours, stock, steps=2, skip=()):
    assert len(ours) == len(stock) == steps + 1, (len(ours), len(stock))
    compared = 0
    for got, want in zip(ours, stock):
        assert got.keys() == want.keys(), got.keys() ^ want.keys()
        for key, value in want.items():
            if isinstance(value, float) and key not in skip:
                # KL-like metrics are differences of nearby log-prob sums: an absolute floor
                torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)
                compared += 1
    return compared


def _assert_same_generations(got, want):
    assert len(got) == len(want) > 0, (len(got), len(want))
    for (who, ids, on), (want_who, want_ids, _) in zip(got, want):
        assert on, f"{who} generated without vtp's sampler"
        assert who == want_who
        assert torch.equal(ids, want_ids), (ids, want_ids)


def _documented_options() -> dict[str, str]:
    """Each ``vtp_*`` trainer option docs/integrations.md lists, with the trainers it names."""
    text = (ROOT / "docs/integrations.md").read_text()
    section = text[text.index("## TRL") : text.index("## FSDP2")]
    return {m[1]: m[2] for m in re.finditer(r"^\| `(vtp_\w+)=[^|]*\| ([^|]*) \|", section, re.M)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    _save_models(path)
    return path


# -- TP=1, in this process ---------------------------------------------------------------------


def test_the_docs_list_the_trainer_options():
    documented = _documented_options()
    assert documented, "docs/integrations.md lists no vtp_* trainer option"
    assert documented.keys() <= OPTIONS.keys(), f"documented options this test does not pass: {documented.keys()}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_tp1_trainer_with_every_documented_option_logs_what_trl_logs(kind, models, tmp_path):
    options = {name: OPTIONS[name] for name, trainers in _documented_options().items() if kind in trainers}
    assert options, f"the docs list no option for {kind}"
    stock, want = _run_stock(kind, models, str(tmp_path / "stock"))
    generated: list[Generation] = []
    ours, heads = _run_ours(kind, models, str(tmp_path / "vtp"), options=options, generated=generated)
    assert len(heads) >= 2, f"{kind}: vtp's fused head ran {len(heads)} times"
    for chunk_rows, layout in heads:  # every option reached vtp.Head
        assert chunk_rows == options.get("vtp_chunk_rows"), chunk_rows
        assert (layout.get("vocab_start"), layout.get("vocab_end")) == (0, len(WORDS)), layout
    assert _assert_same_logs(ours, stock) >= 8
    if kind in SAMPLERS:
        _assert_same_generations(generated, want)


@pytest.mark.timeout(300)
def test_use_vtp_makes_trls_own_trainers_vocabulary_parallel(models, tmp_path):
    import vtp_runtime.integrations.trl as vtp_trl

    sft, gkd = _stock("SFT"), _stock("GKD")
    inits = sft.__init__, gkd.__init__
    stock, _ = _run_stock("SFT", models, str(tmp_path / "stock"))
    ours, heads = _run_ours("SFT", models, str(tmp_path / "vtp"), switch=True)  # TRL's SFTTrainer, switched
    assert len(heads) >= 2, f"vtp's fused head ran {len(heads)} times"
    _assert_same_logs(ours, stock)
    assert (sft.__init__, gkd.__init__) == inits  # use_vtp(False) restored TRL's classes

    MySFTTrainer = type("MySFTTrainer", (sft,), {})  # a subclass, built while the switch is on

    vtp_trl.use_vtp()
    vtp_trl.use_vtp()  # idempotent
    try:
        built = _built("SFT", MySFTTrainer, models, str(tmp_path / "sub"), vtp_chunk_rows=2)  # takes the options
        assert vtp_trl.uses_vtp(built) and isinstance(built, MySFTTrainer) and type(built).__name__ == "MySFTTrainer"
        assert vtp_trl.uses_vtp(_built("GKD", gkd, models, str(tmp_path / "gkd")))
    finally:
        vtp_trl.use_vtp(False)
    assert not vtp_trl.uses_vtp(_built("SFT", sft, models, str(tmp_path / "off")))


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_liger_layer_kernels_compose_with_vtp(models, tmp_path):
    """``use_liger_kernel=True``: TRL keeps Liger's layer kernels (its fused linear cross
    entropy is refused in these trainers), which do not touch the head; vtp's fused head
    runs on top, and the run logs what the stock trainer with Liger logs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    liger = {"use_liger_kernel": True, "use_cpu": False}
    stock, _ = _run_stock("SFT", models, str(tmp_path / "stock"), **liger)
    ours, heads = _run_ours("SFT", models, str(tmp_path / "vtp"), **liger)
    assert len(heads) >= 2, f"vtp's fused head ran {len(heads)} times"
    _assert_same_logs(ours, stock)


def _built(kind, trainer_class, path, out, **options):
    """A trainer built as ``_train`` builds it, not trained."""
    built: list[Any] = []

    class Stop(Exception):
        pass

    def stop(trainer):
        built.append(trainer)
        raise Stop

    with contextlib.suppress(Stop):
        _train(kind, trainer_class, path, out, options=options, after_init=stop)
    return built[0]


# -- TP=2, launched as torchrun launches ------------------------------------------------------


@pytest.fixture(scope="module")
def launched():
    pool = RankPool(2, env={"VTP_BACKEND": "eager"}, launched=True)  # the adapters are under test, not the kernels
    yield pool
    pool.close()


def _launched_job(rank, world, group, kind, path, out, **kw):
    with accelerate_tensor_parallel_on_cpu():
        generated: list[Generation] = []
        logs, heads = _run_ours(kind, path, os.path.join(out, str(rank)), tp=world, generated=generated, **kw)
        return logs, len(heads), generated


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["SFT", "DPO", "KTO"])
def test_tp2_launched_trainer_logs_what_one_process_logs(kind, models, launched, tmp_path):
    stock, _ = _run_stock(kind, models, str(tmp_path / "stock"))
    for logs, calls, _ in launched.run(_launched_job, kind, models, str(tmp_path), timeout=300):
        assert calls >= 2
        _assert_same_logs(logs, stock, skip=PER_PROCESS)


# case: (trainer, config fields over EXTRA, the head's plan, through use_vtp() on TRL's own class)
ON_POLICY: dict[str, tuple[str, dict[str, Any], dict | None, bool]] = {
    "GRPO-greedy": ("GRPO", GREEDY, None, False),
    "GRPO-sampled-colwise": ("GRPO", {}, COLWISE, False),
    "GRPO-sampled-use_vtp": ("GRPO", {}, None, True),
    "RLOO-greedy-colwise": ("RLOO", GREEDY, COLWISE, False),
    "RLOO-sampled": ("RLOO", {}, None, False),
    "GKD-on-policy-colwise": ("GKD", {}, COLWISE, False),  # lmbda=1: the student samples every step
    # the default lmbda=0.5 with seq_kd: python's random (seeded by the Trainer) picks the
    # student or the teacher each step; four steps give both
    "GKD-seq_kd": ("GKD", {"lmbda": 0.5, "seq_kd": True, "max_steps": 4}, None, False),
}


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", list(ON_POLICY))
def test_tp2_launched_on_policy_trainer_generates_and_logs_what_one_process_does(case, models, launched, tmp_path):
    kind, extra, plan, switch = ON_POLICY[case]
    steps = extra.get("max_steps", 2)
    stock, want = _run_stock(kind, models, str(tmp_path / "stock"), **extra)  # vtp's sampler on its models
    if case == "GKD-seq_kd":
        assert {who for who, _, _ in want} == {"policy", "teacher"}, [who for who, _, _ in want]
    per_rank = launched.run(_launched_job, kind, models, str(tmp_path), plan=plan, switch=switch, **extra, timeout=400)
    for logs, calls, generated in per_rank:
        assert calls >= steps
        _assert_same_generations(generated, want)  # both ranks, token for token
        _assert_same_logs(logs, stock, steps, skip=PER_PROCESS)


def _data_parallel_job(rank, world, group, path, out):
    """GRPO on two data-parallel replicas (no tensor parallelism): ours and the stock trainer
    (with vtp's sampler, as ours), each rank its own prompts and seed."""
    import vtp_runtime as vtp

    generated: list[list[Generation]] = [[], []]
    logs, _ = _run_ours("GRPO", path, os.path.join(out, f"ours{rank}"), generated=generated[0])
    with vtp.use_backend("eager"):
        stock = _train(
            "GRPO", _stock("GRPO"), path, os.path.join(out, f"stock{rank}"), sampler=True, generated=generated[1]
        )
    return logs, stock, generated


@pytest.mark.timeout(300)
def test_dp2_launched_replicas_are_seeded_as_trl_seeds_them(models, launched, tmp_path):
    """Data-parallel replicas still draw apart: at TP=1 the data-parallel index is the process
    index, so each rank generates and logs what the stock trainer does there."""
    per_rank = launched.run(_data_parallel_job, models, str(tmp_path), timeout=200)
    for logs, stock, (ours, want) in per_rank:
        _assert_same_generations(ours, want)
        _assert_same_logs(logs, stock)
    (_, _, (first, _)), (_, _, (second, _)) = per_rank
    assert not torch.equal(first[0][1], second[0][1])  # the replicas hold other prompts


def _data_parallel_index_job(rank, world, group, path):
    """``data_parallel_index`` of a trainer whose model is sharded by transformers' TP (its
    head a ``Shard(0)`` DTensor; the Trainer's accelerator not told), and by FSDP2 alone
    (every weight a ``Shard(0)`` DTensor over the data-parallel ranks between passes)."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    from vtp_runtime.integrations.trl import data_parallel_index

    def index(model):
        accelerator = SimpleNamespace(process_index=rank, parallelism_config=None, unwrap_model=lambda m: m)
        return data_parallel_index(SimpleNamespace(accelerator=accelerator, model=model))

    name = os.path.join(path, "0")
    tensor_parallel = LlamaForCausalLM.from_pretrained(name, distributed_config=DistributedConfig(tp_size=world))
    data_parallel = LlamaForCausalLM.from_pretrained(name)
    fully_shard(data_parallel)
    return index(tensor_parallel), index(data_parallel)


@pytest.mark.timeout(200)
def test_data_parallel_index_tells_fsdp2_shards_from_tensor_parallel_ones(models, launched):
    assert launched.run(_data_parallel_index_job, models, timeout=120) == [(0, 0), (0, 1)]


def _stock_sampler_job(rank, world, group, path, out):
    """The stock GKD trainer, TRL's own sampler, on a head that keeps its shard."""
    import vtp_runtime as vtp

    with accelerate_tensor_parallel_on_cpu():
        generated: list[Generation] = []
        with vtp.use_backend("eager"):
            _train(
                "GKD",
                _stock("GKD"),
                path,
                os.path.join(out, f"stock{rank}"),
                tp=world,
                plan=COLWISE,
                generated=generated,
            )
        return generated


@pytest.mark.timeout(300)
def test_tp2_control_trls_own_sampler_on_a_sharded_head_picks_local_ids(models, launched, tmp_path):
    _, want = _run_stock("GKD", models, str(tmp_path / "stock"))
    per_rank = launched.run(_stock_sampler_job, models, str(tmp_path), timeout=200)
    assert not all(torch.equal(ids, w) for generated in per_rank for (_, ids, _), (_, w, _) in zip(generated, want))


def _continuous_batching_job(rank, world, group, path, out):
    with accelerate_tensor_parallel_on_cpu():
        return outcome(
            lambda: _run_ours(
                "GRPO",
                path,
                os.path.join(out, str(rank)),
                tp=world,
                plan=COLWISE,
                use_transformers_continuous_batching=True,
            )
        )


@pytest.mark.timeout(300)
def test_continuous_batching_on_a_sharded_head_is_refused(models, launched, tmp_path):
    """transformers' continuous batching samples without the logits processors' hook: on a
    head that keeps its shard it would pick local ids, so the trainer refuses it."""
    for kind, message in launched.run(_continuous_batching_job, models, str(tmp_path), timeout=200):
        assert kind == "RuntimeError", message
        assert "use_transformers_continuous_batching" in message and "local ids" in message, message


def _different_rows_job(rank, world, group, path, out):
    """Each rank's outcome where the ranks' rows differ: SFT on a dataset in another order on
    rank 1; GRPO with torch's generator seeded per process after the trainer's set-up (as
    TRL's ``set_seed(seed, device_specific=True)`` seeds it), so each rank shuffles the
    generation batch its own way."""
    with accelerate_tensor_parallel_on_cpu():
        rows = _rows("SFT")
        sft = outcome(lambda: _run_ours("SFT", path, f"{out}/sft{rank}", tp=world, rows=rows[::-1] if rank else rows))
        grpo = outcome(
            lambda: _run_ours("GRPO", path, f"{out}/grpo{rank}", tp=world, after_init=lambda _: torch.manual_seed(rank))
        )
        return sft, grpo


def _alive(rank, world, group):
    import torch.distributed as dist

    one = torch.ones(1)
    dist.all_reduce(one, group=group)
    return int(one.item())


@pytest.mark.timeout(300)
def test_ranks_holding_different_rows_raise_on_every_rank(models, launched, tmp_path):
    per_rank = launched.run(_different_rows_job, models, str(tmp_path), timeout=200)
    for trainer, (which, names) in enumerate(
        [("VocabParallelSFTTrainer", "input_ids"), ("VocabParallelGRPOTrainer", "completion_ids")]
    ):
        (kind, message), (_, other) = (rank[trainer] for rank in per_rank)
        assert kind == "ShardError", message
        assert message == other  # the same error on every rank
        assert message.startswith(f"{which}, step 1: the ranks of the tensor-parallel group hold different rows")
        assert f"{names}: rank 0 = " in message, message
    assert launched.run(_alive, timeout=60) == [2, 2]  # no rank left waiting in a collective
