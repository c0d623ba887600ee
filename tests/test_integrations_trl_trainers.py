"""TRL's trainers through vtp with one changed line: ``VocabParallel<X>Trainer`` logs what TRL's
own ``<X>Trainer`` logs -- every loss and metric of every step (SFT's entropy and token
accuracy, DPO's log-prob sums, mean logits and WPO weights, KTO's KL, GRPO's and RLOO's
importance ratios, KL and entropy, GKD's generalized JSD) -- on the same seed and data.

At TP=1, in this process (this file), each trainer is built with every option the docs list
for it, and those options reach ``vtp.Head``. At TP=2 (test_integrations_trl_launched.py) the
trainers run as ``torchrun --nproc-per-node 2``
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
from typing import Any

import pytest
import torch

from tests.trl_job import (
    KINDS,
    OPTIONS,
    SAMPLERS,
    WORDS,
    Generation,
    assert_same_generations,
    assert_same_logs,
    documented_options,
    run_ours,
    run_stock,
    train,
    trl_class,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("trl") is None, reason="trl is not installed (pip install -e '.[integrations]')"
)


# -- TP=1, in this process ---------------------------------------------------------------------


def test_the_docs_list_the_trainer_options():
    documented = documented_options()
    assert documented, "docs/integrations.md lists no vtp_* trainer option"
    assert documented.keys() <= OPTIONS.keys(), f"documented options this test does not pass: {documented.keys()}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_tp1_trainer_with_every_documented_option_logs_what_trl_logs(kind, trl_models, tmp_path):
    options = {name: OPTIONS[name] for name, trainers in documented_options().items() if kind in trainers}
    assert options, f"the docs list no option for {kind}"
    stock, want = run_stock(kind, trl_models, str(tmp_path / "stock"))
    generated: list[Generation] = []
    ours, heads = run_ours(kind, trl_models, str(tmp_path / "vtp"), options=options, generated=generated)
    assert len(heads) >= 2, f"{kind}: vtp's fused head ran {len(heads)} times"
    for chunk_rows, layout in heads:  # every option reached vtp.Head
        assert chunk_rows == options.get("vtp_chunk_rows"), chunk_rows
        assert (layout.get("vocab_start"), layout.get("vocab_end")) == (0, len(WORDS)), layout
    assert assert_same_logs(ours, stock) >= 8
    if kind in SAMPLERS:
        assert_same_generations(generated, want)


@pytest.mark.timeout(300)
def test_use_vtp_makes_trls_own_trainers_vocabulary_parallel(trl_models, tmp_path):
    import vtp_runtime.integrations.trl as vtp_trl

    sft, gkd = trl_class("SFT"), trl_class("GKD")
    inits = sft.__init__, gkd.__init__
    stock, _ = run_stock("SFT", trl_models, str(tmp_path / "stock"))
    ours, heads = run_ours("SFT", trl_models, str(tmp_path / "vtp"), switch=True)  # TRL's SFTTrainer, switched
    assert len(heads) >= 2, f"vtp's fused head ran {len(heads)} times"
    assert_same_logs(ours, stock)
    assert (sft.__init__, gkd.__init__) == inits  # use_vtp(False) restored TRL's classes

    MySFTTrainer = type("MySFTTrainer", (sft,), {})  # a subclass, built while the switch is on

    vtp_trl.use_vtp()
    vtp_trl.use_vtp()  # idempotent
    try:
        built = _built("SFT", MySFTTrainer, trl_models, str(tmp_path / "sub"), vtp_chunk_rows=2)  # takes the options
        assert vtp_trl.uses_vtp(built) and isinstance(built, MySFTTrainer) and type(built).__name__ == "MySFTTrainer"
        assert vtp_trl.uses_vtp(_built("GKD", gkd, trl_models, str(tmp_path / "gkd")))
    finally:
        vtp_trl.use_vtp(False)
    assert not vtp_trl.uses_vtp(_built("SFT", sft, trl_models, str(tmp_path / "off")))


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_liger_layer_kernels_compose_with_vtp(trl_models, tmp_path):
    """``use_liger_kernel=True``: TRL keeps Liger's layer kernels (its fused linear cross
    entropy is refused in these trainers), which do not touch the head; vtp's fused head
    runs on top, and the run logs what the stock trainer with Liger logs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    liger = {"use_liger_kernel": True, "use_cpu": False}
    stock, _ = run_stock("SFT", trl_models, str(tmp_path / "stock"), **liger)
    ours, heads = run_ours("SFT", trl_models, str(tmp_path / "vtp"), **liger)
    assert len(heads) >= 2, f"vtp's fused head ran {len(heads)} times"
    assert_same_logs(ours, stock)


def _built(kind, trainer_class, path, out, **options):
    """A trainer built as ``_train`` builds it, not trained."""
    built: list[Any] = []

    class Stop(Exception):
        pass

    def stop(trainer):
        built.append(trainer)
        raise Stop

    with contextlib.suppress(Stop):
        train(kind, trainer_class, path, out, options=options, after_init=stop)
    return built[0]
