"""Every backend at TP = 2 and 3 with all ranks on ONE device: the ranks are processes joined
in a gloo group, and with ``device="cuda"`` they all put their tensors on cuda:0 (gloo moves
CUDA tensors for the all-reduce and all-gather the ops issue; NCCL refuses two ranks on one
GPU). From the conformance kit's match cases for each backend at those TP sizes: each op's
first one and those with every claimed feature on, dtypes and shard layouts taking turns
(``VTP_TEST_DEPTH=full``: one case of every check, the kit's smoke selection), moved to
real vocabulary sizes (151936, 128256, 50257) and 128 tokens; values and every rank's
gradient slice against the float64 reference (computed on the case's device), on every rank
(``cases.run_case``).

``test_tp_on_one_gpu`` is marked ``gpu``; run it on the GPU machine with

    TRITON_INTERPRET=0 python -m pytest -m gpu tests/test_tp_one_device.py

``test_tp_same_path_on_cpu`` runs the first of those cases of every backend, TP size and op
with ``device="cpu"`` at the kit's small sizes in the normal suite (Triton through its
interpreter), so this path is tested by CI and cannot rot between GPU runs (the kit's cases
themselves run at TP 1 and 2 in each backend's tests).
"""

import os

import pytest
import torch

from vtp_runtime.registry import REGISTRY
from vtp_runtime.testing import conformance
from vtp_runtime.testing.cases import Case, run_case
from vtp_runtime.testing.head_cases import HeadCase

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

BACKENDS = ("eager", "triton", "liger")
WORLDS = (2, 3)
REAL_VOCABS = (151936, 128256, 50257)
LAYOUTS = ("uneven", "empty", "explicit")
# besides each op's first case: the kit's checks with every claimed feature on
GPU_CHECKS = (
    "every claimed feature at once",
    "every claimed feature, masked, reduction=mean",
    "strided rows, masked, every claimed feature",
)


def _on_gpu(case: Case, i: int, rotate: bool) -> Case:
    """``case`` on cuda at a real vocabulary size (the next of REAL_VOCABS) with 128 tokens;
    with ``rotate``, also the next dtype and shard layout where the case is float32 on uneven
    shards (the backend allowing an empty one)."""
    shape = case.shape if case.shape == (0,) else (4, 33) if case.strided else (4, 32)
    case = case.with_(device="cuda", vocab=REAL_VOCABS[i % len(REAL_VOCABS)], shape=shape)
    if rotate and case.dtype == "float32":
        case = case.with_(dtype=("bfloat16", "float32")[i % 2])
    if rotate and case.layout == "uneven" and REGISTRY.get(case.backend or "eager").ops[case.op].empty_shards:
        case = case.with_(layout=LAYOUTS[i % len(LAYOUTS)])
    return case


def tp_cases(device: str) -> list[tuple[int, Case]]:
    """(world, case) for every backend and TP size, from the kit's match cases there (Head
    inputs aside: tests/test_head_gpu.py). On ``"cuda"``: each op's first case and its checks
    with every claimed feature on, at real sizes (at ``VTP_TEST_DEPTH=full``, one case of every
    check: the math of every case is checked on CPU, what a GPU adds is the device at real
    sizes). On ``"cpu"``: each op's first case, at the kit's sizes."""
    full = conformance.current_depth() == "full"
    out: list[tuple[int, Case]] = []
    for backend in BACKENDS:
        firsts = set()
        for cc in conformance.conformance_cases(backend, world_sizes=WORLDS, depth="smoke" if full else "fast"):
            if cc.expect != "match" or isinstance(cc.case, HeadCase):
                continue
            first = (cc.world, cc.case.op) not in firsts
            firsts.add((cc.world, cc.case.op))
            if device == "cpu" and first:
                out.append((cc.world, cc.case))
            elif device == "cuda" and (full or first or cc.why.startswith(GPU_CHECKS)):
                out.append((cc.world, _on_gpu(cc.case, len(out), rotate=not full)))
    return out


def _id(item) -> str:
    world, case = item
    extra = "" if case.shape == (3, 4) else "-shape" + "x".join(map(str, case.shape))
    return f"tp{world}-{case.backend}-{case.id}{extra}-V{case.vocab}"


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
    """The declarations give every backend cases at every TP size here, eager and triton
    every op, and the GPU cases every shard layout."""
    for cases in (GPU_CASES, CPU_CASES):
        got = {(case.backend, world) for world, case in cases}
        assert got == {(b, w) for b in BACKENDS for w in WORLDS}
        ops = {(case.backend, case.op) for _, case in cases}
        every = ("cross_entropy", "logprobs", "entropy", "kl", "jsd")
        assert {("eager", op) for op in every} <= ops and {("triton", op) for op in every} <= ops
    assert {case.layout for _, case in GPU_CASES} >= {"uneven", "empty", "explicit", "even"}
