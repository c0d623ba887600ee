"""TRL's trainers on a tiny Llama (V = 64) and its data, run as the tests compare them: a
``VocabParallel<X>Trainer`` (or TRL's own class after ``use_vtp()``) against TRL's own
``<X>Trainer`` on the same seed and data, in this process or on a rank of a launched pool;
their logs, generations, and the fused heads vtp's ops read, and the checks that compare
them. tests/test_integrations_trl_trainers.py (TP=1) and test_integrations_trl_launched.py
(TP=2) use it."""

import contextlib
import os
import re
from typing import Any

import torch

from tests.helpers import ROOT

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


def save_models(path):
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


def dataset_rows(kind):
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


def train(
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
    keyword arguments beyond TRL's; ``rows``: the dataset's rows (default ``dataset_rows(kind)``);
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
        "train_dataset": Dataset.from_list(dataset_rows(kind) if rows is None else rows),
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


def trl_class(kind):
    import vtp_runtime.integrations.trl as vtp_trl

    return vtp_trl.trl_trainer(kind)


def vtp_class(kind):
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


def run_ours(kind, path, out, tp=None, switch=False, **kw):
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
            return train(kind, trl_class(kind) if switch else vtp_class(kind), path, out, tp, **kw), heads


_STOCK: dict[str, Any] = {}  # the stock runs on one process, by kind and config: each is run once


def run_stock(kind, path, out, **kw):
    """The stock trainer's logs and generations on one process; trainers that generate sample
    with vtp's sampler (as ``VocabParallel<kind>Trainer`` does), on the same backend as ours
    (a draw is the same for one seed at any TP size on one backend)."""
    import vtp_runtime as vtp

    key = repr((kind, sorted(kw.items())))
    if key not in _STOCK:
        generated: list[Generation] = []
        with vtp.use_backend("eager"):
            logs = train(kind, trl_class(kind), path, out, sampler=kind in SAMPLERS, generated=generated, **kw)
        _STOCK[key] = logs, generated
    return _STOCK[key]


def assert_same_logs(ours, stock, steps=2, skip=()):
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


def assert_same_generations(got, want):
    assert len(got) == len(want) > 0, (len(got), len(want))
    for (who, ids, on), (want_who, want_ids, _) in zip(got, want):
        assert on, f"{who} generated without vtp's sampler"
        assert who == want_who
        assert torch.equal(ids, want_ids), (ids, want_ids)


def documented_options() -> dict[str, str]:
    """Each ``vtp_*`` trainer option docs/integrations.md lists, with the trainers it names."""
    text = (ROOT / "docs/integrations.md").read_text()
    section = text[text.index("## TRL") : text.index("## FSDP2")]
    return {m[1]: m[2] for m in re.finditer(r"^\| `(vtp_\w+)=[^|]*\| ([^|]*) \|", section, re.M)}
