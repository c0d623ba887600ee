"""Tests of the example backend: the conformance kit does the heavy lifting.

Run them with the plugin installed (``pip install -e .``), from this directory:
``python -m pytest -q``. The kit derives its cases from what the backend declares, runs
each on 1 and 2 gloo ranks against vtp_runtime's float64 reference, and checks that
everything it does not declare is refused by dispatch.
"""

import pytest
import torch

import vtp_example_backend
import vtp_runtime as vtp
from vtp_runtime.registry import REGISTRY
from vtp_runtime.testing import conformance
from vtp_runtime.testing.cases import Case, run_case


def test_found_through_its_entry_point():
    record = REGISTRY.owner("example_blockwise")
    assert record is not None, "is the package installed? (pip install -e .)"
    assert record.dist == "vtp-example-backend" and record.status == "loaded"


@conformance.parametrize("example_blockwise")
def test_conformance(conformance_case):
    conformance.check(conformance_case)


@pytest.mark.parametrize("op", ["entropy", "kl"])
def test_many_small_blocks(monkeypatch, op):
    """The streaming rescale across blocks (the part eager does not have), at TP=1."""
    monkeypatch.setattr(vtp_example_backend, "BLOCK", 5)
    for edge in ("", "neg_inf", "offset"):
        run_case(0, 1, None, Case(op, backend="example_blockwise", vocab=53, edge=edge, masked="mask"))


def test_unclaimed_dtype_is_refused():
    with pytest.raises(vtp.BackendUnavailable, match="dtype float16 not supported"):
        vtp.entropy(torch.randn(2, 8, dtype=torch.float16), backend="example_blockwise")
