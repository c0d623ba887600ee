"""TRL's trainers through vtp at TP=2, run as ``torchrun --nproc-per-node 2`` runs them:
spawned ranks with torchrun's environment (``RankPool(launched=True)``), the models loaded with
transformers' ``tp_size`` (the head's weight a ``Shard(0)`` DTensor) and keeping the
``tp_size`` transformers gives them, so the Trainer hands accelerate a ``ParallelismConfig``
and accelerate gives both ranks the batches of one data-parallel replica. They must log what
one process logs, except the counts TRL and transformers sum over every process
(``PER_PROCESS``: each TP rank's copy of a batch counts there). The trainers that generate
must give one process's completions token for token on both ranks, greedy and sampled, on the
head's default plan and on ``"colwise"``; ranks that hold different rows on purpose raise a
``ShardError`` naming the trainer and the step, on every rank; data-parallel replicas still
draw apart as TRL seeds them. What is compared, and TP=1: test_integrations_trl_trainers.py.
"""

import importlib.util
import os
from typing import Any

import pytest
import torch

from tests.trl_job import (
    COLWISE,
    GREEDY,
    PER_PROCESS,
    Generation,
    assert_same_generations,
    assert_same_logs,
    dataset_rows,
    run_ours,
    run_stock,
    train,
    trl_class,
)
from vtp_runtime.testing.distributed import RankPool, outcome
from vtp_runtime.testing.launch import accelerate_tensor_parallel_on_cpu

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("trl") is None, reason="trl is not installed (pip install -e '.[integrations]')"
)


# -- TP=2, launched as torchrun launches ------------------------------------------------------


@pytest.fixture(scope="module")
def launched():
    pool = RankPool(2, env={"VTP_BACKEND": "eager"}, launched=True)  # the adapters are under test, not the kernels
    yield pool
    pool.close()


def _launched_job(rank, world, group, kind, path, out, **kw):
    with accelerate_tensor_parallel_on_cpu():
        generated: list[Generation] = []
        logs, heads = run_ours(kind, path, os.path.join(out, str(rank)), tp=world, generated=generated, **kw)
        return logs, len(heads), generated


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["SFT", "DPO", "KTO"])
def test_tp2_launched_trainer_logs_what_one_process_logs(kind, trl_models, launched, tmp_path):
    stock, _ = run_stock(kind, trl_models, str(tmp_path / "stock"))
    for logs, calls, _ in launched.run(_launched_job, kind, trl_models, str(tmp_path), timeout=300):
        assert calls >= 2
        assert_same_logs(logs, stock, skip=PER_PROCESS)


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
def test_tp2_launched_on_policy_trainer_generates_and_logs_what_one_process_does(case, trl_models, launched, tmp_path):
    kind, extra, plan, switch = ON_POLICY[case]
    steps = extra.get("max_steps", 2)
    stock, want = run_stock(kind, trl_models, str(tmp_path / "stock"), **extra)  # vtp's sampler on its models
    if case == "GKD-seq_kd":
        assert {who for who, _, _ in want} == {"policy", "teacher"}, [who for who, _, _ in want]
    per_rank = launched.run(
        _launched_job, kind, trl_models, str(tmp_path), plan=plan, switch=switch, **extra, timeout=400
    )
    for logs, calls, generated in per_rank:
        assert calls >= steps
        assert_same_generations(generated, want)  # both ranks, token for token
        assert_same_logs(logs, stock, steps, skip=PER_PROCESS)


def _data_parallel_job(rank, world, group, path, out):
    """GRPO on two data-parallel replicas (no tensor parallelism): ours and the stock trainer
    (with vtp's sampler, as ours), each rank its own prompts and seed."""
    import vtp_runtime as vtp

    generated: list[list[Generation]] = [[], []]
    logs, _ = run_ours("GRPO", path, os.path.join(out, f"ours{rank}"), generated=generated[0])
    with vtp.use_backend("eager"):
        stock = train(
            "GRPO", trl_class("GRPO"), path, os.path.join(out, f"stock{rank}"), sampler=True, generated=generated[1]
        )
    return logs, stock, generated


@pytest.mark.timeout(300)
def test_dp2_launched_replicas_are_seeded_as_trl_seeds_them(trl_models, launched, tmp_path):
    """Data-parallel replicas still draw apart: at TP=1 the data-parallel index is the process
    index, so each rank generates and logs what the stock trainer does there."""
    per_rank = launched.run(_data_parallel_job, trl_models, str(tmp_path), timeout=200)
    for logs, stock, (ours, want) in per_rank:
        assert_same_generations(ours, want)
        assert_same_logs(logs, stock)
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
def test_data_parallel_index_tells_fsdp2_shards_from_tensor_parallel_ones(trl_models, launched):
    assert launched.run(_data_parallel_index_job, trl_models, timeout=120) == [(0, 0), (0, 1)]


def _stock_sampler_job(rank, world, group, path, out):
    """The stock GKD trainer, TRL's own sampler, on a head that keeps its shard."""
    import vtp_runtime as vtp

    with accelerate_tensor_parallel_on_cpu():
        generated: list[Generation] = []
        with vtp.use_backend("eager"):
            train(
                "GKD",
                trl_class("GKD"),
                path,
                os.path.join(out, f"stock{rank}"),
                tp=world,
                plan=COLWISE,
                generated=generated,
            )
        return generated


@pytest.mark.timeout(300)
def test_tp2_control_trls_own_sampler_on_a_sharded_head_picks_local_ids(trl_models, launched, tmp_path):
    _, want = run_stock("GKD", trl_models, str(tmp_path / "stock"))
    per_rank = launched.run(_stock_sampler_job, trl_models, str(tmp_path), timeout=200)
    assert not all(torch.equal(ids, w) for generated in per_rank for (_, ids, _), (_, w, _) in zip(generated, want))


def _continuous_batching_job(rank, world, group, path, out):
    with accelerate_tensor_parallel_on_cpu():
        return outcome(
            lambda: run_ours(
                "GRPO",
                path,
                os.path.join(out, str(rank)),
                tp=world,
                plan=COLWISE,
                use_transformers_continuous_batching=True,
            )
        )


@pytest.mark.timeout(300)
def test_continuous_batching_on_a_sharded_head_is_refused(trl_models, launched, tmp_path):
    """transformers' continuous batching samples without the logits processors' hook: on a
    head that keeps its shard it would pick local ids, so the trainer refuses it."""
    for kind, message in launched.run(_continuous_batching_job, trl_models, str(tmp_path), timeout=200):
        assert kind == "RuntimeError", message
        assert "use_transformers_continuous_batching" in message and "local ids" in message, message


def _different_rows_job(rank, world, group, path, out):
    """Each rank's outcome where the ranks' rows differ: SFT on a dataset in another order on
    rank 1; GRPO with torch's generator seeded per process after the trainer's set-up (as
    TRL's ``set_seed(seed, device_specific=True)`` seeds it), so each rank shuffles the
    generation batch its own way."""
    with accelerate_tensor_parallel_on_cpu():
        rows = dataset_rows("SFT")
        sft = outcome(lambda: run_ours("SFT", path, f"{out}/sft{rank}", tp=world, rows=rows[::-1] if rank else rows))
        grpo = outcome(
            lambda: run_ours("GRPO", path, f"{out}/grpo{rank}", tp=world, after_init=lambda _: torch.manual_seed(rank))
        )
        return sft, grpo


def _alive(rank, world, group):
    import torch.distributed as dist

    one = torch.ones(1)
    dist.all_reduce(one, group=group)
    return int(one.item())


@pytest.mark.timeout(300)
def test_ranks_holding_different_rows_raise_on_every_rank(trl_models, launched, tmp_path):
    per_rank = launched.run(_different_rows_job, trl_models, str(tmp_path), timeout=200)
    for trainer, (which, names) in enumerate(
        [("VocabParallelSFTTrainer", "input_ids"), ("VocabParallelGRPOTrainer", "completion_ids")]
    ):
        (kind, message), (_, other) = (rank[trainer] for rank in per_rank)
        assert kind == "ShardError", message
        assert message == other  # the same error on every rank
        assert message.startswith(f"{which}, step 1: the ranks of the tensor-parallel group hold different rows")
        assert f"{names}: rank 0 = " in message, message
    assert launched.run(_alive, timeout=60) == [2, 2]  # no rank left waiting in a collective
