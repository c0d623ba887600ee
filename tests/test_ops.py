"""vtp_runtime/ops.py: which features a call uses, as dispatch sees them through ``explain``."""

from typing import Any

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime.ops import FEATURES, LOSSES, OPS

V = 8


def _tensors(op, teacher_grad=False, topk=False):
    logits = torch.randn(3, V, requires_grad=True)
    if op == "cross_entropy":
        return (logits, torch.randint(0, V, (3,)))
    if op == "logprobs":
        return (logits, torch.randint(0, V, (3, 2) if topk else (3,)))
    if op in ("entropy", "argmax", "sample"):
        return (logits,)
    return (logits, torch.randn(3, V, requires_grad=teacher_grad))


# one way to turn each feature on: (options, teacher requires grad, top-k index)
TURN_ON: dict[str, tuple[dict[str, Any], bool, bool]] = {
    "label_smoothing": ({"label_smoothing": 0.1}, False, False),
    "z_loss": ({"z_loss": 1e-3}, False, False),
    "temperature": ({"temperature": 2.0}, False, False),
    "topk": ({}, False, True),
    "mask": ({"mask": torch.tensor([True, False, True])}, False, False),
    "reverse": ({"reverse": True}, False, False),
    "teacher_grad": ({}, True, False),
    "return_entropy": ({"return_entropy": True}, False, False),
    "row_offset": ({"row_offset": 3}, False, False),
}


def test_every_feature_has_a_way_to_turn_it_on():
    assert set(TURN_ON) == set(FEATURES)
    assert all(set(spec.features) <= set(FEATURES) for spec in OPS.values())


@pytest.mark.parametrize("op", list(LOSSES))
def test_a_call_uses_exactly_the_features_it_turns_on(op):
    assert vtp.explain(op, *_tensors(op)).request.features == frozenset()
    for feature in OPS[op].features:
        options, teacher_grad, topk = TURN_ON[feature]
        request = vtp.explain(op, *_tensors(op, teacher_grad, topk), **options).request
        assert request.features == {feature}, (op, feature)
    if "mask" in OPS[op].features:  # labels= with ignore_index masks too
        labels = torch.tensor([1, -100, 2])
        assert vtp.explain(op, *_tensors(op), labels=labels).request.features == {"mask"}


def test_defaults_turn_nothing_on():
    """Options at their default values use no feature, even when passed explicitly."""
    for op, spec in OPS.items():
        defaults = {
            o.name: o.default for o in spec.own if o.default is not None and o.name not in ("reduction", "temperature")
        }
        if op == "sample":
            defaults["seed"] = 0
        assert vtp.explain(op, *_tensors(op), temperature=1.0, **defaults).request.features == frozenset()


def test_sampling_ops_take_one_feature():
    """argmax and sample: every backend that runs them runs every option they have, but for
    sample's row_offset (a backend written before it would draw every call from row 0)."""
    request = vtp.explain("sample", *_tensors("sample"), seed=1, top_k=3, top_p=0.5, min_p=0.1, temperature=2.0).request
    assert request.features == frozenset()
    assert vtp.explain("sample", *_tensors("sample"), seed=1, row_offset=4).request.features == {"row_offset"}
