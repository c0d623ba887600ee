"""What one call of the triton backend issues: kernel launches and torch ops per forward +
backward (a mean, then ``.backward()`` into an existing ``.grad``) at TP=1, pinned.

At small sizes a call costs its Python, and each launch and each torch op is a fixed
price on the host (docs/benchmarks.md, "CPU time per call"): a change that adds one shows
here first. Launches are counted by wrapping the backend's launchers (``launch`` and the
call plans' ``launch.Bound``), torch ops with a ``TorchDispatchMode`` while they are stubbed
out (the interpreter's own tensor work is not the call's). Rows split over the vocabulary
(4 rows of 64 columns under the interpreter's configuration) are merged by the last program
of each row; rows that are not split are finished by the statistics pass (16 rows). A sum
or mean is the kernels' own.
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vtp_runtime as vtp
from vtp_runtime.backends.triton import backend as triton_backend
from vtp_runtime.backends.triton.launch import Bound

V = 64


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _calls(n: int) -> dict[str, tuple[Callable[[], Any], torch.Tensor]]:
    gen = torch.Generator().manual_seed(n)
    s = torch.randn(n, V, generator=gen, requires_grad=True)
    t = torch.randn(n, V, generator=gen)
    y = torch.randint(0, V, (n,), generator=gen)
    return {
        "cross_entropy": (lambda: vtp.cross_entropy(s, y, reduction="mean", backend="triton"), s),
        "cross_entropy_sum": (lambda: vtp.cross_entropy(s, y, reduction="sum", backend="triton"), s),
        # reduced by the core (a normalizer) or by torch: the kernel reads the expanded upstream
        "cross_entropy_normalized": (
            lambda: vtp.cross_entropy(s, y, reduction="sum", normalizer=7.0, backend="triton"),
            s,
        ),
        "cross_entropy_torch_sum": (lambda: vtp.cross_entropy(s, y, backend="triton").sum(), s),
        "logprobs": (lambda: vtp.logprobs(s, y, reduction="mean", backend="triton"), s),
        "entropy": (lambda: vtp.entropy(s, reduction="mean", backend="triton"), s),
        "kl": (lambda: vtp.kl(s, t, reduction="mean", backend="triton"), s),
        "jsd": (lambda: vtp.jsd(s, t, beta=0.5, reduction="mean", backend="triton"), s),
    }


# The reduction is the kernels' own (no sum, count or division in torch ops, forward or
# backward) and the upstream gradient is read in its strides (no clone of an expanded one).
SPLIT = {  # 4 rows: every row split over the vocabulary, merged by its last program
    "cross_entropy": ("stats1 backward1", 11),
    "cross_entropy_sum": ("stats1 backward1", 11),
    "cross_entropy_normalized": ("stats1 backward1", 14),
    "cross_entropy_torch_sum": ("stats1 backward1", 12),
    "logprobs": ("stats1 backward1", 12),
    "entropy": ("stats1 backward1", 10),
    "kl": ("stats2 backward2", 11),
    "jsd": ("stats2 jsd_div backward2", 12),
}
WHOLE = {  # 16 rows: one program per row, finished where it is read
    "cross_entropy": ("stats1 backward1", 10),
    "cross_entropy_sum": ("stats1 backward1", 10),
    "cross_entropy_normalized": ("stats1 backward1", 12),
    "cross_entropy_torch_sum": ("stats1 backward1", 10),
    "logprobs": ("stats1 backward1", 11),
    "entropy": ("stats1 backward1", 9),
    "kl": ("stats2 backward2", 10),
    "jsd": ("jsd_row backward2", 10),
}


@pytest.mark.parametrize("n, pinned", [(4, SPLIT), (16, WHOLE)], ids=["split_rows", "whole_rows"])
def test_launches_and_torch_ops_per_call(monkeypatch, n, pinned):
    launched: list[str] = []
    real, real_bound = triton_backend.launch, Bound.__call__

    def name_of(kernel) -> str:
        name = getattr(kernel, "__name__", None) or kernel.fn.__name__  # an interpreted function wraps it
        return name.removesuffix("_kernel")

    def recorded(kernel, grid, fast, **args):
        launched.append(name_of(kernel))
        real(kernel, grid, fast, **args)

    def recorded_bound(bound, *values):
        launched.append(name_of(bound.kernel))
        real_bound(bound, *values)

    for op, (call, leaf) in _calls(n).items():
        call().backward()  # plans the signature; .grad exists from here on, as in training
        monkeypatch.setattr(triton_backend, "launch", recorded)
        monkeypatch.setattr(Bound, "__call__", recorded_bound)
        launched.clear()
        call().backward()
        kernels = " ".join(launched)
        monkeypatch.setattr(triton_backend, "launch", lambda kernel, grid, fast, **args: None)
        monkeypatch.setattr(Bound, "__call__", lambda bound, *values: None)
        with _Ops() as ops:
            call().backward()
        monkeypatch.setattr(triton_backend, "launch", real)
        monkeypatch.setattr(Bound, "__call__", real_bound)
        assert (kernels, len(ops.names)) == pinned[op], f"{op}: {kernels}; torch ops {ops.names}"
        assert "clone" not in ops.names, op
        assert leaf.grad is not None
