"""Every backend at TP = 2 and 3 with all ranks on ONE device: the ranks are processes joined
in a gloo group, and with ``device="cuda"`` they all put their tensors on cuda:0 (gloo moves
CUDA tensors for the all-reduce and all-gather the ops issue; NCCL refuses two ranks on one
GPU). Real vocabulary sizes (151936, 128256, 50257) with 128 tokens, uneven, explicit and
empty shards, every op each backend declares at that TP size with representative options;
values and every rank's gradient slice against the float64 reference (computed on the
case's device), on every rank (``cases.run_case``).

``test_tp_on_one_gpu`` is marked ``gpu``; run it on the GPU machine with

    TRITON_INTERPRET=0 python -m pytest -m gpu tests/test_tp_one_device.py

``test_tp_same_path_on_cpu`` runs the very same cases with ``device="cpu"`` and small
vocabularies in the normal suite (Triton through its interpreter), so this path is tested
by CI and cannot rot between GPU runs.
"""

import os

import pytest
import torch

from vtp_runtime.ops import get_spec
from vtp_runtime.registry import REGISTRY
from vtp_runtime.testing.cases import Case, run_case

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

BACKENDS = ("eager", "triton", "liger")
WORLDS = (2, 3)
REAL_VOCABS = (151936, 128256, 50257)
SMALL_VOCABS = {151936: 61, 128256: 47, 50257: 37}  # the CPU twin: odd sizes, uneven at TP 2 and 3

# representative option sets per op; each case takes the next vocabulary, shard layout and dtype
OPTION_SETS = {
    "cross_entropy": [
        {},
        {"options": (("label_smoothing", 0.1), ("z_loss", 1e-4))},
        {"masked": "labels"},
        {"options": (("temperature", 0.7), ("reduction", "mean")), "masked": "labels", "strided": True},
    ],
    "logprobs": [{}, {"topk": 4, "masked": "labels"}, {"options": (("temperature", 1.3),), "strided": True}],
    "entropy": [{}, {"masked": "mask", "options": (("temperature", 0.5),)}, {"view": "permuted"}],
    "kl": [
        {},
        {"options": (("reverse", True),), "masked": "mask", "grads": (True, True)},
        {"options": (("temperature", 2.0),), "view": "transposed"},
    ],
    "jsd": [
        {"options": (("beta", 0.5),)},
        {"options": (("beta", 0.1), ("temperature", 2.0)), "grads": (True, True)},
        {"options": (("beta", 0.0),), "masked": "labels", "strided": True},
    ],
}
LAYOUTS = ("uneven", "empty", "explicit")
DTYPES = ("bfloat16", "float32")


def _features(case: Case) -> set[str]:
    """The features (vtp.FEATURES) the case uses, to match against a backend's declaration."""
    spec = get_spec(case.op)
    opts = dict(case.options)
    used = {f for f in ("label_smoothing", "z_loss", "reverse") if opts.get(f)}
    if opts.get("temperature", 1.0) != 1.0:
        used.add("temperature")
    if case.topk:
        used.add("topk")
    if case.masked and not spec.index:
        used.add("mask")
    if len(spec.inputs) == 2 and case.grads[1]:
        used.add("teacher_grad")
    return used


def tp_cases(device: str) -> list[tuple[int, Case]]:
    """(world, case) for every backend, TP size and op the backend declares there; real
    vocabularies and 128 tokens on ``"cuda"``, small ones and 6 tokens on ``"cpu"``."""
    out = []
    for backend in BACKENDS:
        ops = REGISTRY.get(backend).ops
        for world in WORLDS:
            i = 0
            for op, sets in OPTION_SETS.items():
                cap = ops.get(op)
                if cap is None or (cap.tp_sizes is not None and world not in cap.tp_sizes):
                    continue
                for fields in sets:
                    two = len(get_spec(op).inputs) == 2
                    fields = {"grads": (True, False) if two else (True, True), **fields}
                    layout = "even" if cap.even_shards_only else LAYOUTS[i % len(LAYOUTS)]
                    if layout == "empty" and not cap.empty_shards:
                        layout = "uneven"
                    vocab = REAL_VOCABS[i % len(REAL_VOCABS)]
                    strided = fields.get("strided", False)
                    if device == "cuda":
                        shape = (4, 33) if strided else (4, 32)  # 128 tokens
                    else:
                        vocab, shape = SMALL_VOCABS[vocab], (2, 4) if strided else (2, 3)
                    case = Case(
                        op,
                        dtype=DTYPES[i % len(DTYPES)],
                        shape=shape,
                        vocab=vocab,
                        layout=layout,
                        backend=backend,
                        device=device,
                        seed=100 + i,
                        **fields,
                    )
                    i += 1
                    if _features(case) <= cap.features:
                        out.append((world, case))
    return out


def _id(item) -> str:
    world, case = item
    return f"tp{world}-{case.backend}-{case.id}-V{case.vocab}"


GPU_CASES = tp_cases("cuda")
CPU_CASES = tp_cases("cpu")


def _run(ranks, world: int, case: Case) -> None:
    if case.backend == "liger":
        pytest.importorskip("liger_kernel")
    ranks(world, run_case, case, timeout=300)


@pytest.mark.gpu
@pytest.mark.parametrize("item", GPU_CASES, ids=_id)
def test_tp_on_one_gpu(ranks, item):
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with compiled Triton: TRITON_INTERPRET=0 python -m pytest -m gpu")
    _run(ranks, *item)


@pytest.mark.parametrize("item", CPU_CASES, ids=_id)
def test_tp_same_path_on_cpu(ranks, item):
    _run(ranks, *item)


def _cuda_collectives(rank, world, group):
    """Each rank's device, and a gloo all-reduce and all-gather of CUDA tensors on it."""
    from vtp_runtime.comm import all_gather_stack, all_reduce

    dev = torch.device("cuda", torch.cuda.current_device())
    summed = all_reduce(torch.full((3,), float(rank + 1), device=dev), group, "sum")
    gathered = all_gather_stack(torch.full((2,), float(rank), device=dev), group)
    return str(dev), str(summed.device), summed.tolist(), gathered.tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
def test_ranks_share_cuda0_over_gloo(ranks, world):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    total = float(sum(range(1, world + 1)))
    expected = [[float(r)] * 2 for r in range(world)]
    for dev, out_dev, summed, gathered in ranks(world, _cuda_collectives, timeout=120):
        assert dev == out_dev == "cuda:0"
        assert summed == [total] * 3 and gathered == expected


def test_every_backend_and_world_has_cases():
    """The declarations give every backend cases at every TP size it supports here."""
    for cases in (GPU_CASES, CPU_CASES):
        got = {(case.backend, world) for world, case in cases}
        assert got == {(b, w) for b in BACKENDS for w in WORLDS}
        ops = {(case.backend, case.op) for _, case in cases}
        assert {("eager", op) for op in OPTION_SETS} <= ops and {("triton", op) for op in OPTION_SETS} <= ops
        assert {case.layout for _, case in cases} >= {"uneven", "empty", "explicit", "even"}
