"""transformers' ``Trainer`` with ``fuse_lm_head`` at TP > 1, launched as users launch it:
``python -m torch.distributed.run --nproc-per-node N`` running ``tests/trainer_job.py``, the
model loaded with transformers' own ``DistributedConfig`` (``model._tp_size`` as transformers
sets it, accelerate's ``ParallelismConfig`` built by the Trainer from it), a tiny Llama with
V=1001 (uneven vocabulary shards), two optimizer steps of two accumulated micro-batches.

With ``average_tokens_across_devices`` (the default), the loss, the gradient norm of every
step and every weight afterwards equal one process's without vtp, on every rank: at TP=2,
at TP=4, and with FSDP2 × TP (2 × 2, against one process on the two data-parallel ranks'
batches together). Without it, they equal transformers' own TP on the same launch, which
scales the loss and the gradients by the TP size at TP alone (it divides the token count
by the TP size whether or not it gathered it; docs/integrations.md says so).

One launch per world size, every run in it (each launch pays for the imports). On CPU
accelerate refuses a ``ParallelismConfig`` before any step; the job lifts that one check
(``vtp_runtime.testing.launch.accelerate_tensor_parallel_on_cpu``).
"""

import importlib.util
from typing import Any

import pytest
import torch

from tests.helpers import ROOT, tiny_llama_config
from tests.trainer_job import ARMS
from vtp_runtime.testing.launch import torchrun

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "accelerate", "datasets")),
    reason="transformers, accelerate or datasets is not installed (pip install -e '.[integrations]')",
)

V = 1001


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(V, num_key_value_heads=4)).save_pretrained(path)  # 4 KV heads: TP=4
    return str(path)


@pytest.fixture(scope="module")
def one_process(model_path, tmp_path_factory):
    """The reference: one process without vtp, on one rank's batches (TP) and on two (FSDP2 × TP)."""
    from transformers import LlamaForCausalLM

    from tests.trainer_job import BATCH, train

    out = tmp_path_factory.mktemp("one-process")
    return {
        dp: train(
            LlamaForCausalLM.from_pretrained(model_path, dtype=torch.float32), str(out / str(dp)), True, BATCH * dp
        )
        for dp in (1, 2)
    }


def _launch(nproc: int, model_path: str, out, *layouts: str) -> list[dict[str, Any]]:
    torchrun(nproc, ["-m", "tests.trainer_job", model_path, str(out), *layouts], timeout=540, cwd=ROOT)
    return [torch.load(out / f"rank{r}.pt") for r in range(nproc)]


def _assert_same(got: dict, want: dict, what: str, scale: float = 1.0) -> None:
    assert len(got["logs"]) == len(want["logs"]) == 2, what
    torch.testing.assert_close(
        torch.tensor(got["logs"]), scale * torch.tensor(want["logs"]), rtol=1e-5, atol=1e-6, msg=what
    )
    if "weights" in got and "weights" in want:
        assert got["weights"].keys() == want["weights"].keys()
        for name, w in want["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


def _check(ranks: list[dict], layout: str, reference: dict, tp: int, dp: int) -> None:
    for rank, runs in enumerate(ranks):
        for arm in ARMS:
            for average in (True, False):
                name = f"{layout} {arm} average={average}"
                _assert_same(runs[name], ranks[0][name], f"rank {rank}, {name}: rank 0's logs")  # every rank alike
        _assert_same(runs[f"{layout} vtp average=True"], reference, f"rank {rank}, {layout}, averaged: one process")
        _assert_same(runs[f"{layout} transformers average=True"], reference, "the control: transformers' own TP")
        # without averaging: transformers' own TP, whatever it does
        want = runs[f"{layout} transformers average=False"]
        _assert_same(runs[f"{layout} vtp average=False"], want, f"rank {rank}, {layout}, not averaged")
        if dp == 1:  # what the docs say transformers does there: the loss and the gradients times the TP size
            first, one = torch.tensor(want["logs"][0]), torch.tensor(reference["logs"][0])
            torch.testing.assert_close(
                first, tp * one, rtol=1e-5, atol=1e-6, msg=f"{layout}, transformers, not averaged"
            )


@pytest.mark.timeout(600)
def test_trainer_at_tp2(model_path, one_process, tmp_path):
    _check(_launch(2, model_path, tmp_path, "tp=2"), "tp=2", one_process[1], tp=2, dp=1)


@pytest.mark.timeout(600)
def test_trainer_at_tp4_and_fsdp2_by_tp2(model_path, one_process, tmp_path):
    ranks = _launch(4, model_path, tmp_path, "tp=4", "tp=2,fsdp=2")
    _check(ranks, "tp=4", one_process[1], tp=4, dp=1)
    _check(ranks, "tp=2,fsdp=2", one_process[2], tp=2, dp=2)
