"""Cross-rank metadata: every disagreement raises the same error on every rank, naming the
ranks, and no rank hangs. Each case runs on gloo ranks with a timeout."""

from typing import Any

import pytest
import torch

import vtp_runtime as vtp


def _error(fn):
    try:
        fn()
    except Exception as exc:  # the test compares type and message across ranks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def ce_call(rank, world, group, variant):
    torch.manual_seed(0)
    v_local, n, dtype = 5, 4, torch.float32
    kw: dict[str, Any] = {}
    if variant == "tokens" and rank == 1:
        n = 3
    if variant == "dtype" and rank == 1:
        dtype = torch.bfloat16
    if variant == "options" and rank == 1:
        kw["label_smoothing"] = 0.1
    if variant == "forced" and rank == 0:
        kw["backend"] = "eager"
    if variant == "gap":
        kw.update(vocab_start=[0, 6][rank], vocab_end=[5, 11][rank])
    if variant == "overlap":
        kw.update(vocab_start=[0, 3][rank], vocab_end=[5, 8][rank])
    if variant == "explicit_on_one":
        if rank == 0:
            kw.update(vocab_start=0, vocab_end=5)
    if variant == "global_vocab":
        kw["global_vocab_size"] = 11
    if variant == "bad_shape" and rank == 1:
        n = 4
    if variant == "bad_option":
        kw["label_smoothing"] = 2.0
    if variant == "bad_option_one" and rank == 1:
        kw["temperature"] = 0.0
    if variant == "unknown_backend" and rank == 1:
        kw["backend"] = "no_such_backend"
    logits = torch.randn(n, v_local, dtype=dtype)
    labels = torch.zeros(n if variant != "bad_shape" or rank != 1 else n + 1, dtype=torch.long)
    return _error(lambda: vtp.cross_entropy(logits, labels, tp_group=group, **kw))


CASES = {
    "tokens": "ShardError: the ranks of the TP group disagree on the number of tokens (rank 0: 4; rank 1: 3)",
    "dtype": "ShardError: the ranks of the TP group disagree on the logits dtype (rank 0: float32; rank 1: bfloat16)",
    "options": "ShardError: the ranks of the TP group disagree on op options: label_smoothing: "
    "rank 0 = 0.0, rank 1 = 0.1; every rank",
    "forced": "ShardError: the ranks of the TP group disagree on the forced backend (backend=, use_backend, "
    "VTP_BACKEND*): rank 0 = 'eager' (the backend= argument), rank 1 = none; every rank",
    "gap": "ShardError: the vocabulary shards do not tile [0, V): a gap at id 5",
    "overlap": "ShardError: the vocabulary shards do not tile [0, V): an overlap at id 5",
    "explicit_on_one": "ShardError: vocab_start/vocab_end given on rank 0 but not on the others",
    "global_vocab": "ShardError: global_vocab_size=11 but the shards add up to V=10",
    "bad_option": "ValueError: label_smoothing must be in [0, 1], got 2.0",  # every rank's own error
}

# a call that fails on one rank before the gather: that rank raises its own error, the others
# a ShardError that names it and repeats the error
LOCAL_FAILURES = {
    "bad_shape": "ValueError: labels has shape (5,); expected logits.shape[:-1] = (4,)",
    "bad_option_one": "ValueError: temperature must be a finite number > 0, got 0.0",
    "unknown_backend": "UnknownBackend: unknown backend 'no_such_backend' (from the backend= argument)",
}


@pytest.mark.parametrize("variant", list(CASES))
def test_disagreement_raises_the_same_error_on_every_rank(ranks, variant):
    errors = ranks(2, ce_call, variant, timeout=60)
    assert errors[0] == errors[1], f"ranks raised different errors: {errors}"
    assert errors[0].startswith(CASES[variant]), errors[0]


@pytest.mark.parametrize("variant", list(LOCAL_FAILURES))
def test_a_local_failure_raises_on_every_rank(ranks, variant):
    errors = ranks(2, ce_call, variant, timeout=60)
    assert errors[1].startswith(LOCAL_FAILURES[variant]), errors[1]
    assert (
        errors[0].startswith("ShardError: the call failed on rank 1 of tp_group before the metadata gather")
        and f"\n  rank 1: {errors[1]}" in errors[0]
    ), errors[0]


def test_valid_call_after_errors_still_works(ranks):
    """A failed call leaves no rank behind in a collective: the next call runs normally."""
    assert ranks(2, ce_call, "tokens", timeout=60)[0] != "no error"
    assert ranks(2, ce_call, "none", timeout=60) == ["no error", "no error"]


def test_a_failing_rank_is_told_of_the_others(ranks):
    (e0, n0), (e1, n1) = ranks(2, note_call, timeout=60)
    assert e0.startswith("ValueError: labels has shape (5,)") and e1.startswith("ValueError: temperature")
    assert n0 == "the call failed on other ranks too: rank 1: " + e1
    assert n1 == "the call failed on other ranks too: rank 0: " + e0


def note_call(rank, world, group):
    """Both ranks fail, differently: each raises its own error, with the other's as a note."""
    labels = torch.zeros(5 if rank == 0 else 4, dtype=torch.long)
    try:
        vtp.cross_entropy(torch.randn(4, 3), labels, tp_group=group, temperature=[1.0, -1.0][rank])
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}", "\n".join(getattr(exc, "__notes__", []))
    return "no error", ""


def test_single_process_errors_are_plain():
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        vtp.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), label_smoothing=-1)
    with pytest.raises(ValueError, match=r"labels has shape \(3,\); expected logits.shape\[:-1\]"):
        vtp.cross_entropy(torch.randn(2, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="must be an integer tensor"):
        vtp.cross_entropy(torch.randn(2, 3), torch.zeros(2))
    with pytest.raises(TypeError, match="unknown option"):
        vtp.loss("entropy", torch.randn(2, 3), label_smoothing=0.1)
    with pytest.raises(ValueError, match="unknown op"):
        vtp.loss("softmax", torch.randn(2, 3))
    with pytest.raises(ValueError, match="beta must be in"):
        vtp.jsd(torch.randn(2, 3), torch.randn(2, 3), beta=1.5)
    with pytest.raises(ValueError, match="same shape"):
        vtp.kl(torch.randn(2, 3), torch.randn(2, 4))
    with pytest.raises(ValueError, match="vocab_end - vocab_start == V_local"):
        vtp.entropy(torch.randn(2, 3), vocab_start=0, vocab_end=4)
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        vtp.entropy(torch.randn(2, 3), mask=torch.ones(2))


def explicit_layout_call(rank, world, group):
    """Explicit bounds in reverse rank order: rank 0 holds the top of the vocabulary."""
    torch.manual_seed(0)
    full = torch.randn(4, 9, dtype=torch.float64)
    bounds = [(6, 9), (0, 6)][rank]
    labels = torch.tensor([0, 8, 5, 6])
    out = vtp.cross_entropy(
        full[:, bounds[0] : bounds[1]],
        labels,
        tp_group=group,
        vocab_start=bounds[0],
        vocab_end=bounds[1],
        global_vocab_size=9,
    )
    want = torch.nn.functional.cross_entropy(full, labels, reduction="none")
    return (out - want).abs().max().item()


def test_explicit_bounds_in_any_order(ranks):
    assert max(ranks(2, explicit_layout_call, timeout=60)) < 1e-12


def gather_without_all_gather_single(rank, world, group):
    """torch 2.11 (the GPU machine's) has only all_gather_into_tensor: the gather must use it."""
    import torch.distributed as dist

    saved = dist.all_gather_single
    used = []
    original = dist.all_gather_into_tensor
    del dist.all_gather_single

    def all_gather_into_tensor(*args, **kwargs):
        used.append(1)
        return original(*args, **kwargs)

    dist.all_gather_into_tensor = all_gather_into_tensor
    try:
        out = vtp.cross_entropy(torch.randn(3, 4), torch.tensor([0, 5, 7]), tp_group=group)
    finally:
        dist.all_gather_single = saved
        dist.all_gather_into_tensor = original
    return len(used), out.shape


def test_metadata_gather_falls_back_to_all_gather_into_tensor(ranks):
    for used, shape in ranks(2, gather_without_all_gather_single, timeout=60):
        assert used >= 1 and shape == (3,)  # the metadata gather, and any the backend makes
