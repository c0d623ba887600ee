"""vtp_runtime/backend.py: the saved state a backend's forward hands to its backward."""

from dataclasses import dataclass
from typing import Any

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime.backend import ALL_DTYPES, OpCapability, SavedState
from vtp_runtime.backends.eager import EagerBackend, EntropyState
from vtp_runtime.registry import hookimpl, registered

SEEN: list[tuple[str, Any]] = []


class Recording(EagerBackend):
    """eager's entropy, recording the state each backward receives."""

    name = "state_recording"
    priority = -50
    ops = {"entropy": OpCapability(device_types=None, dtypes=ALL_DTYPES, features=frozenset({"mask"}))}

    def forward(self, call, inputs, index, mask):
        values, state = super().forward(call, inputs, index, mask)
        SEEN.append(("forward", state))
        return values, state

    def backward(self, call, state, grad):
        SEEN.append(("backward", state))
        return super().backward(call, state, grad)


class TupleState(EagerBackend):
    """Returns a plain tuple where a SavedState belongs."""

    name = "state_tuple"
    priority = -50
    ops = Recording.ops

    def forward(self, call, inputs, index, mask):
        values, state = super().forward(call, inputs, index, mask)
        return values, tuple(state.tensors())


class _Plugin:
    @hookimpl
    def vtp_runtime_register_backends(self, register):
        register(Recording())
        register(TupleState())


@pytest.fixture(autouse=True)
def plugin():
    SEEN.clear()
    with registered(_Plugin(), name="test-saved-state"):
        yield


@pytest.mark.parametrize("masked", [False, True])
def test_backward_gets_the_state_forward_returned_rebuilt(masked):
    z = torch.randn(3, 9, requires_grad=True)
    mask = torch.tensor([True, False, True]) if masked else None
    vtp.entropy(z, mask=mask, backend="state_recording").sum().backward()
    (_, sent), (_, got) = SEEN
    assert type(got) is EntropyState and got is not sent
    for a, b in zip(sent.tensors(), got.tensors()):
        assert (a is None and b is None) or (a.data_ptr() == b.data_ptr() and torch.equal(a, b))
    assert (got.mask is None) == (not masked)
    assert got.logits.data_ptr() == z.data_ptr()  # the input itself, not a copy


def test_an_input_modified_in_place_before_backward_is_an_error():
    """The state's tensors go through ctx.save_for_backward, so autograd's version check holds."""
    w = torch.randn(3, 9, requires_grad=True)
    z = w * 1.0  # a non-leaf: modifying it in place is allowed, and must invalidate backward
    out = vtp.entropy(z, backend="state_recording").sum()
    z.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_a_state_that_is_not_a_saved_state_is_refused():
    with pytest.raises(TypeError, match="state_tuple.*SavedState dataclass or None, got tuple"):
        vtp.entropy(torch.randn(3, 9), backend="state_tuple")


def test_tensors_and_from_tensors_round_trip():
    @dataclass
    class One(SavedState):
        x: torch.Tensor

    @dataclass
    class Three(SavedState):
        a: torch.Tensor
        b: torch.Tensor | None
        c: torch.Tensor

    t = torch.arange(3)
    assert One(t).tensors() == (t,) and One.from_tensors((t,)).x is t
    three = Three(t, None, t + 1)
    assert three.tensors()[1] is None and Three.from_tensors(three.tensors()) == three
