"""Misuse that must neither hang nor desynchronize the ranks, and inputs at the edges of the
API: every test job keeps its rank processes alive after an error (as a training job
would) and then makes a normal call on every rank, checked against float64, to prove that
no rank is stuck in, or one collective ahead of, the others."""

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime import plans as plan
from vtp_runtime.backend import ALL_DTYPES, Backend, OpCapability
from vtp_runtime.errors import PluginError
from vtp_runtime.registry import REGISTRY, hookimpl, registered
from vtp_runtime.testing import reference as dense
from vtp_runtime.testing.distributed import environ, outcome
from vtp_runtime.testing.reference import values as reference

# uneven shards of the vocabulary at each TP size, one of them empty at TP 3 and 4
SIZES = {2: [4, 7], 3: [6, 0, 5], 4: [5, 0, 6, 4]}


def _shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    sizes = SIZES[world]
    start = sum(sizes[:rank])
    return full[..., start : start + sizes[rank]]


def _inputs(world: int, seed: int = 0, n: int = 5):
    g = torch.Generator().manual_seed(seed)
    v = sum(SIZES[world])
    student = torch.randn(n, v, generator=g, dtype=torch.float64)
    teacher = torch.randn(n, v, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (n,), generator=g)
    return student, teacher, labels


def _healthy(rank, world, group) -> float:
    """A valid call on every rank: its largest deviation from float64 on the full logits."""
    student, teacher, labels = _inputs(world, seed=7)
    ce = vtp.cross_entropy(_shard(student, rank, world), labels, tp_group=group)
    jsd = vtp.jsd(_shard(student, rank, world), _shard(teacher, rank, world), beta=0.3, tp_group=group)
    return max(
        (ce - reference("cross_entropy", (student,), labels)).abs().max().item(),
        (jsd - reference("jsd", (student, teacher), beta=0.3)).abs().max().item(),
    )


# -- 1. a failure on one rank before the metadata gather --------------------------------------


class _ProbeRaises(Backend):
    """A backend whose probe wrapper itself raises (not the probe: probe_reasons turns that
    into a reason), on the one rank where it is registered."""

    name, priority = "probe_raises_fake", -50
    ops = {"cross_entropy": OpCapability(device_types=None, dtypes=ALL_DTYPES)}

    def probe_reasons(self, device_type):
        raise RuntimeError("the probe of probe_raises_fake crashed")


class _Plugin:
    @hookimpl
    def vtp_runtime_register_backends(self, register):
        register(_ProbeRaises())


def _one_rank_call(case: str, bad: bool, group, student, teacher, labels):
    """The call of ``case``: the faulty variant where ``bad``, the intended one elsewhere."""
    if case == "misspelled_option":
        option: dict[str, Any] = {("label_smothing" if bad else "label_smoothing"): 0.1}
        return vtp.cross_entropy(student, labels, tp_group=group, **option)
    if case == "unknown_op":
        return vtp.loss("cross_entropyy" if bad else "cross_entropy", student, labels, tp_group=group)
    if case == "missing_teacher":
        return vtp.loss("jsd", *((student,) if bad else (student, teacher)), tp_group=group)
    if case == "backend_not_a_name":
        return vtp.cross_entropy(student, labels, tp_group=group, backend=3 if bad else None)
    if case in ("vocab_start_overflow", "global_vocab_overflow"):
        rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        if case == "global_vocab_overflow":
            return vtp.cross_entropy(
                student, labels, tp_group=group, global_vocab_size=2**70 if bad else sum(SIZES[world])
            )
        start = sum(SIZES[world][:rank]) + (2**70 if bad else 0)
        return vtp.cross_entropy(
            student, labels, tp_group=group, vocab_start=start, vocab_end=start + student.shape[-1]
        )
    if case == "strict_plugin":
        # A real strict-plugin failure is there from the registry's first load on, before any
        # call was planned; a planned call never looks at the registry again. Simulating it
        # after earlier tests planned this call needs a cold plan cache (cleared on every rank).
        plan.clear()
        REGISTRY.ensure_loaded()
        saved = REGISTRY.strict_error
        if bad:
            REGISTRY.strict_error = PluginError(
                "backend plugins failed to load (VTP_STRICT_PLUGINS=1 "
                "makes this an error):\n  broken (broken 1.0): ImportError"
            )
        try:
            return vtp.cross_entropy(student, labels, tp_group=group)
        finally:
            REGISTRY.strict_error = saved
    if case == "probe_raises":
        if not bad:
            return vtp.cross_entropy(student, labels, tp_group=group)
        with registered(_Plugin(), name="probe-raises-fakes"):
            return vtp.cross_entropy(student, labels, tp_group=group)
    raise AssertionError(case)


# case -> (exception the failing rank raises, a piece of its message)
ONE_RANK_FAILURES = {
    "misspelled_option": ("TypeError", "unknown option(s) label_smothing"),
    "unknown_op": ("ValueError", "unknown op 'cross_entropyy'"),
    "missing_teacher": ("TypeError", "jsd takes 2 tensor argument(s)"),
    "backend_not_a_name": ("TypeError", "backend must be a backend name (str), got int"),
    "vocab_start_overflow": ("ValueError", "vocab_start="),
    "global_vocab_overflow": ("ValueError", "global_vocab_size="),
    "strict_plugin": ("PluginError", "VTP_STRICT_PLUGINS=1"),
    "probe_raises": ("RuntimeError", "the probe of probe_raises_fake crashed"),
}


def fail_on_one_rank(rank, world, group, case, bad_rank):
    student, teacher, labels = _inputs(world)
    got = outcome(
        lambda: _one_rank_call(
            case, rank == bad_rank, group, _shard(student, rank, world), _shard(teacher, rank, world), labels
        )
    )
    return got, _healthy(rank, world, group)


@pytest.mark.parametrize("case", list(ONE_RANK_FAILURES))
def test_a_failure_on_one_rank_raises_on_every_rank(ranks, case):
    bad_rank = 1
    results = ranks(2, fail_on_one_rank, case, bad_rank, timeout=60)
    want_type, want_text = ONE_RANK_FAILURES[case]
    (bad_type, bad_msg), _ = results[bad_rank]
    assert bad_type == want_type and want_text in bad_msg, results[bad_rank]
    for rank, ((kind, msg), _) in enumerate(results):
        if rank != bad_rank:  # names the failing rank and what it reported, in full
            assert kind == "ShardError" and f"rank {bad_rank}" in msg and bad_msg in msg, (kind, msg)
    assert max(err for _, err in results) < 1e-12


def fail_on_several_ranks(rank, world, group):
    """At TP=4 with an empty shard: one rank fails, then two fail differently, then all fail alike."""
    student, teacher, labels = _inputs(world)
    s, t = _shard(student, rank, world), _shard(teacher, rank, world)
    out = [
        outcome(lambda: _one_rank_call("unknown_op", rank == 2, group, s, t, labels)),
        outcome(
            lambda: _one_rank_call(
                "misspelled_option" if rank == 0 else "missing_teacher", rank in (0, 3), group, s, t, labels
            )
        ),
        outcome(lambda: vtp.cross_entropy(s, labels, tp_group=group, label_smoothing=2.0)),
    ]
    return out, _healthy(rank, world, group)


def test_failures_on_several_ranks_at_tp4(ranks):
    results = ranks(4, fail_on_several_ranks, timeout=90)
    one, two, every = zip(*(out for out, _ in results))
    assert one[2][0] == "ValueError" and all(
        k == "ShardError" and "rank 2" in m and one[2][1] in m for r, (k, m) in enumerate(one) if r != 2
    )
    assert two[0][0] == "TypeError" and two[3][0] == "TypeError"
    for kind, msg in (two[1], two[2]):
        assert kind == "ShardError" and "ranks 0, 3" in msg and two[0][1] in msg and two[3][1] in msg
    assert len(set(every)) == 1 and every[0][0] == "ValueError" and "label_smoothing must be in" in every[0][1]
    assert max(err for _, err in results) < 1e-12


# -- 2. explain on some ranks only ------------------------------------------------------------


def explain_on_rank0(rank, world, group):
    student, _, labels = _inputs(world)
    text = ""
    if rank == 0:  # as in print(vtp.explain(...)) guarded by "if rank == 0"
        text = str(vtp.explain("cross_entropy", _shard(student, rank, world), labels, tp_group=group))
    return text, _healthy(rank, world, group)


def test_explain_on_one_rank_does_not_hang(ranks):
    (text, err0), (_, err1) = ranks(2, explain_on_rank0, timeout=60)
    assert "tp=2" in text and "selected: " in text and "this rank's view" in text
    assert max(err0, err1) < 1e-12


def explain_gathered(rank, world, group):
    student, _, labels = _inputs(world)
    ex = vtp.explain("cross_entropy", _shard(student, rank, world), labels, tp_group=group, gather=True)
    local = vtp.explain("cross_entropy", _shard(student, rank, world), labels, tp_group=group)
    return (
        ex.request.vocab_size,
        ex.request.even_shards,
        ex.backend,
        local.request.tp_size,
        _healthy(rank, world, group),
    )


def test_explain_gather_sees_every_rank(ranks):
    for v, even, backend, local_tp, err in ranks(2, explain_gathered, timeout=60):
        assert (v, even, local_tp) == (11, False, 2) and backend and err < 1e-12


def test_explain_without_group_is_unchanged():
    ex = vtp.explain("entropy", torch.randn(3, 5), gather=True)
    assert ex.request.tp_size == 1 and ex.backend
    assert "this rank's view" not in str(ex)


# -- 3, 4. option values across ranks ---------------------------------------------------------


def equal_values_other_types(rank, world, group):
    student, teacher, labels = _inputs(world)
    labels[1] = -100
    kw = [
        dict(temperature=2, beta=np.float64(0.25), ignore_index=np.int64(-100), normalizer=3),
        dict(temperature=2.0, beta=0.25, ignore_index=-100, normalizer=np.float32(3.0)),
    ][rank]
    got = vtp.jsd(
        _shard(student, rank, world), _shard(teacher, rank, world), labels=labels, reduction="sum", tp_group=group, **kw
    )
    want = reference("jsd", (student, teacher), temperature=2.0, beta=0.25, labels=labels).sum() / 3
    t: Any = torch.tensor(0.5) if rank == 0 else 0.5  # a 0-d CPU tensor option is read as its number
    ls = vtp.cross_entropy(_shard(student, rank, world), labels, label_smoothing=t, tp_group=group)
    want_ls = reference("cross_entropy", (student,), labels, label_smoothing=0.5)
    return max((got - want).abs().item(), (ls - want_ls).abs().max().item())


def test_equal_option_values_of_other_types_agree(ranks):
    assert max(ranks(2, equal_values_other_types, timeout=60)) < 1e-12


def options_disagree(rank, world, group):
    student, teacher, labels = _inputs(world)
    s, t = _shard(student, rank, world), _shard(teacher, rank, world)
    out = [
        outcome(lambda: vtp.jsd(s, t, beta=[0.3, 0.4][rank], temperature=2.0, tp_group=group)),
        outcome(lambda: vtp.cross_entropy(s, labels, tp_group=group, backend=["eager", None][rank])),
        outcome(lambda: vtp.cross_entropy(s.detach().clone().requires_grad_(rank == 1), labels, tp_group=group)),
    ]
    return out, _healthy(rank, world, group)


def test_disagreement_names_the_option_and_each_value(ranks):
    results = ranks(2, options_disagree, timeout=60)
    (beta, forced, grad), _ = results[0]
    assert [out for out, _ in results][0] == [out for out, _ in results][1]
    assert beta[0] == "ShardError" and "beta: rank 0 = 0.3, rank 1 = 0.4" in beta[1]
    assert "temperature" not in beta[1]  # equal on every rank: not listed
    assert forced[0] == "ShardError" and "rank 0 = 'eager' (the backend= argument), rank 1 = none" in forced[1]
    assert grad[0] == "ShardError" and "requires_grad: rank 0 = (False,), rank 1 = (True,)" in grad[1]
    assert max(err for _, err in results) < 1e-12


# -- 5. one value, many spellings: the same call on every rank ---------------------------------

OMIT = object()  # the option left out
# spellings of one value each; a rank picks a different one on each call, and ranks differ
SPELLINGS: dict[str, list[Any]] = {
    "temperature": [2.0, 2, np.float32(2.0), torch.tensor(2.0), np.float64(2.0), torch.tensor(2)],
    "default_temperature": [OMIT, 1.0, 1, np.float32(1.0), torch.tensor(1.0)],
    "beta": [0.25, np.float32(0.25), torch.tensor(0.25), np.float64(0.25)],
    "ignore_index": [OMIT, -100, np.int64(-100), torch.tensor(-100)],
    "reduction": ["sum", np.str_("sum")],
    "normalizer": [3, 3.0, np.float32(3.0), np.int32(3)],
    "label_smoothing": [OMIT, 0.0, -0.0, 0, np.float32(0.0)],
    "sample_temperature": [0.5, np.float32(0.5), torch.tensor(0.5), np.float64(0.5)],
    "top_k": [5, np.int64(5), torch.tensor(5), np.int32(5)],
    "seed": [7, np.int64(7), torch.tensor(7), np.uint64(7)],
}
SPELLING_CALLS = 6


def _spelled(i: int, rank: int, **names: str) -> dict[str, Any]:
    """Call ``i`` of ``rank``: each option in one of its spellings (``OMIT``: left out)."""
    out = {}
    for j, (option, values) in enumerate(names.items()):
        value = SPELLINGS[values][(i + rank * (j + 1)) % len(SPELLINGS[values])]
        if value is not OMIT:
            out[option] = value
    return out


def spellings(rank, world, group, mode):
    """Calls whose options every rank spells its own way, changing from call to call (each
    call must plan, reuse and agree on every rank), against float64; then a value that truly
    differs on one rank, on a signature not planned yet, which must raise on every rank."""
    student, teacher, labels = _inputs(world, seed=3)
    labels[1] = -100
    s, t = _shard(student, rank, world), _shard(teacher, rank, world)
    want_jsd = reference("jsd", (student, teacher), temperature=2.0, beta=0.25, labels=labels).sum() / 3
    want_ce = reference("cross_entropy", (student,), labels)
    full = student.float()
    want_ids = vtp.sample(full, seed=7, temperature=0.5, top_k=5)
    err, same_ids = 0.0, True
    with environ(VTP_CHECK=mode):
        for i in range(SPELLING_CALLS):
            kw = _spelled(i, rank, temperature="temperature", beta="beta", ignore_index="ignore_index")
            kw |= _spelled(i, rank, reduction="reduction", normalizer="normalizer")
            got = vtp.jsd(s, t, labels=labels, tp_group=group, **kw)
            err = max(err, (got - want_jsd).abs().item())
            kw = _spelled(i, rank, temperature="default_temperature", label_smoothing="label_smoothing")
            err = max(err, (vtp.cross_entropy(s, labels, tp_group=group, **kw) - want_ce).abs().max().item())
            kw = _spelled(i, rank, temperature="sample_temperature", top_k="top_k", seed="seed")
            same_ids &= torch.equal(vtp.sample(s.float(), tp_group=group, **kw), want_ids)
        fresh = _shard(student[:, None].expand(5, 2 + (mode == "once"), -1), rank, world)  # not planned yet
        beta: Any = [0.25, np.float32(0.5), torch.tensor(0.75)][rank]
        differs = outcome(lambda: vtp.jsd(fresh, fresh, beta=beta, tp_group=group))
    return err, same_ids, differs, _healthy(rank, world, group)


@pytest.mark.parametrize("mode", ["once", ""], ids=["VTP_CHECK=once", "default"])
@pytest.mark.parametrize("world", [2, 3])
def test_equal_values_spelled_differently_agree_on_every_call(ranks, world, mode):
    """``VTP_CHECK=once`` is the default on a device-only group (NCCL): a call that the ranks
    keyed differently would send one rank to the metadata gather and another to the backend's
    collective (a hang). Uneven shards, an empty one at TP 3."""
    results = ranks(world, spellings, mode, timeout=240)
    for err, same_ids, (kind, msg), healthy in results:
        assert err < 1e-12 and same_ids and healthy < 1e-12
        assert kind == "ShardError" and "beta: rank 0 = 0.25, rank 1 = 0.5" in msg, (kind, msg)


# -- 6. VTP_CHECK=1 on every op: token ids, and Head inputs -------------------------------------


def checked_ids_and_heads(rank, world, group):
    """Under VTP_CHECK=1: argmax and sample of logits, argmax and cross entropy of a Head,
    against one process and float64; the Head's labels differing on one rank raise on every
    rank; then a normal call."""
    student, _, labels = _inputs(world, seed=4)
    z = _shard(student, rank, world).float()
    full = student.float()
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(5, 3, generator=g, dtype=torch.float64)
    weight = torch.randn(sum(SIZES[world]), 3, generator=g, dtype=torch.float64)
    head = vtp.Head(hidden, _shard(weight.T, rank, world).T)
    logits = hidden @ weight.T
    mine = labels.clone()
    mine[0] = (mine[0] + rank) % weight.shape[0]
    with environ(VTP_CHECK="1"):
        out = {
            "argmax": torch.equal(vtp.argmax(z, tp_group=group), dense.argmax(full)),
            "sample": torch.equal(vtp.sample(z, seed=3, tp_group=group), vtp.sample(full, seed=3)),
            "top_k": torch.equal(vtp.sample(z, seed=3, top_k=4, tp_group=group), vtp.sample(full, seed=3, top_k=4)),
            "head_argmax": torch.equal(vtp.argmax(head, tp_group=group), dense.argmax(logits)),
            "head_ce": (vtp.cross_entropy(head, labels, tp_group=group) - reference("cross_entropy", (logits,), labels))
            .abs()
            .max()
            .item()
            < 1e-12,
        }
        differs = outcome(lambda: vtp.cross_entropy(head, mine, tp_group=group))
    return out, differs, _healthy(rank, world, group)


@pytest.mark.parametrize("world", [2, 3])
def test_check_runs_every_op_and_head_inputs(ranks, world):
    results = ranks(world, checked_ids_and_heads, timeout=180)
    for out, (kind, msg), healthy in results:
        assert all(out.values()), out
        assert kind == "ShardError" and "labels values, by VTP_CHECK=1 checksum" in msg, (kind, msg)
        assert healthy < 1e-12


# -- 7. a tensor normalizer -------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-2.0, 0.0, float("inf"), float("-inf"), float("nan"), 0, -3])
def test_a_non_positive_or_non_finite_tensor_normalizer_gives_nan(bad):
    logits = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 6, (4,))
    for n in (torch.tensor(bad), torch.tensor([bad])):  # int64 like num_items_in_batch, or float
        out = vtp.cross_entropy(logits, labels, reduction="sum", normalizer=n)
        assert out.shape == () and out.isnan(), (n, out)


def test_a_valid_tensor_normalizer_divides():
    logits = torch.randn(4, 6, dtype=torch.float64)
    labels = torch.randint(0, 6, (4,))
    for n in (torch.tensor(3), torch.tensor([2.5], dtype=torch.float32)):
        out = vtp.cross_entropy(logits, labels, reduction="sum", normalizer=n)
        want = reference("cross_entropy", (logits,), labels).sum() / float(n)
        assert abs(out.item() - want.item()) < 1e-12


@pytest.mark.parametrize("bad", [0, -1, 0.0, float("inf"), float("nan"), True])
def test_a_bad_number_normalizer_raises(bad):
    with pytest.raises(ValueError, match="normalizer must be a finite number > 0"):
        vtp.entropy(torch.randn(2, 3), reduction="sum", normalizer=bad)


# -- 8. 1-D logits: one token -----------------------------------------------------------------


def _one_token_calls(rank, world, group, full_s, full_t, label, topk):
    shard = (lambda z: z) if world == 1 else (lambda z: _shard(z, rank, world))
    s, t = shard(full_s), shard(full_t)
    return {
        "cross_entropy": vtp.cross_entropy(s, label, tp_group=group, label_smoothing=0.1),
        "logprobs": vtp.logprobs(s, label, tp_group=group),
        "logprobs_topk": vtp.logprobs(s, topk, tp_group=group),
        "entropy": vtp.entropy(s, mask=torch.tensor(True), tp_group=group),
        "kl": vtp.kl(s, t, reverse=True, labels=label, tp_group=group),
        "jsd": vtp.jsd(s, t, beta=0.3, tp_group=group, reduction="mean"),
    }


def _one_token_reference(full_s, full_t, label, topk):
    s, t, y = full_s[None], full_t[None], label[None]
    return {
        "cross_entropy": reference("cross_entropy", (s,), y, label_smoothing=0.1)[0],
        "logprobs": reference("logprobs", (s,), y)[0],
        "logprobs_topk": reference("logprobs", (s,), topk[None])[0],
        "entropy": reference("entropy", (s,))[0],
        "kl": reference("kl", (s, t), reverse=True, labels=y)[0],
        "jsd": reference("jsd", (s, t), beta=0.3)[0],
    }


def one_token(rank, world, group):
    g = torch.Generator().manual_seed(5)
    v = sum(SIZES[world]) if world > 1 else 9
    full_s, full_t = torch.randn(v, generator=g, dtype=torch.float64), torch.randn(v, generator=g, dtype=torch.float64)
    label, topk = torch.tensor(v - 1), torch.tensor([0, v - 1, 2])
    got = _one_token_calls(rank, world, group, full_s, full_t, label, topk)
    want = _one_token_reference(full_s, full_t, label, topk)
    return {k: (tuple(got[k].shape), tuple(want[k].shape), (got[k] - want[k]).abs().max().item()) for k in got}


def test_1d_logits_are_one_token():
    for op, (shape, want_shape, err) in one_token(0, 1, None).items():
        assert shape == want_shape == ((3,) if op == "logprobs_topk" else ()), op
        assert err < 1e-12, op
    z = torch.randn(7, dtype=torch.float64, requires_grad=True)
    vtp.cross_entropy(z, torch.tensor(3)).backward()
    want = torch.softmax(z.detach(), -1) - torch.nn.functional.one_hot(torch.tensor(3), 7)
    assert z.grad is not None and (z.grad - want).abs().max() < 1e-12


def test_1d_logits_are_one_token_sharded(ranks):
    for result in ranks(2, one_token, timeout=60):
        for op, (shape, want_shape, err) in result.items():
            assert shape == want_shape and err < 1e-12, op


# -- 9. VTP_CHECK=1 ---------------------------------------------------------------------------


def check_inputs(rank, world, group, check_on):
    student, teacher, labels = _inputs(world)
    s, t = _shard(student, rank, world), _shard(teacher, rank, world)
    mine = labels.clone()
    if rank == 1:
        mine[2] = (mine[2] + 1) % sum(SIZES[world])
    mask = torch.arange(5) != (2 if rank == 0 else 3)
    saved = os.environ.get("VTP_CHECK")
    os.environ["VTP_CHECK"] = "1" if check_on == "all" or (check_on == "rank0" and rank == 0) else "0"
    try:
        out = [
            outcome(lambda: vtp.cross_entropy(s, mine, tp_group=group)),
            outcome(lambda: vtp.logprobs(s, mine[:, None].expand(5, 2), tp_group=group)),
            outcome(lambda: vtp.entropy(s, mask=mask, tp_group=group)),
            outcome(
                lambda: vtp.jsd(
                    s, t, labels=labels, reduction="sum", tp_group=group, normalizer=torch.tensor(2.0 + rank)
                )
            ),
            outcome(lambda: vtp.cross_entropy(s, labels, tp_group=group)),
        ]
    finally:
        if saved is None:
            os.environ.pop("VTP_CHECK")
        else:
            os.environ["VTP_CHECK"] = saved
    return out, _healthy(rank, world, group)


@pytest.mark.parametrize("world", [2, 3])
def test_check_catches_inputs_that_differ_between_ranks(ranks, world):
    results = ranks(world, check_inputs, "all", timeout=90)
    (ce, lp, ent, jsd, same), _ = results[0]
    assert [out for out, _ in results][0] == [out for out, _ in results][1]
    assert ce[0] == "ShardError" and "labels" in ce[1] and "VTP_CHECK" in ce[1]
    assert lp[0] == "ShardError" and "index" in lp[1]
    assert ent[0] == "ShardError" and "mask" in ent[1]
    assert jsd[0] == "ShardError" and "normalizer" in jsd[1]
    assert same == ("no error", "")
    assert max(err for _, err in results) < 1e-12


def test_without_check_differing_inputs_are_not_detected(ranks):
    results = ranks(2, check_inputs, "none", timeout=60)
    assert all(kind == "no error" for out, _ in results for kind, _ in out)


def test_check_on_some_ranks_only_raises_on_every_rank(ranks):
    results = ranks(2, check_inputs, "rank0", timeout=60)
    for out, err in results:
        assert out[-1][0] == "ShardError" and "VTP_CHECK" in out[-1][1] and "rank 0" in out[-1][1]
        assert err < 1e-12


# -- 11, 12. the command line -----------------------------------------------------------------

HELP = """
import contextlib, io
from vtp_runtime import cli
for argv in ([], ["demo"], ["info"], ["bench"]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main([*argv, "--help"])
    print(out.getvalue() + "<end>")
"""


def test_help_reads_cleanly():
    done = subprocess.run([sys.executable, "-c", HELP], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr  # no warnings (e.g. torch's NumPy one)
    pages = done.stdout.split("<end>")[:-1]
    assert len(pages) == 4 and all("usage: vtp-runtime" in page for page in pages)
    assert "``" not in done.stdout and ":func:" not in done.stdout


def test_every_bench_option_has_help():
    import argparse

    from vtp_runtime.tools import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    missing = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert missing == []


# -- the same on a GPU: two gloo ranks sharing one CUDA device --------------------------------


def on_gpu(rank, world, group, device="cuda"):
    """A failure on one rank, VTP_CHECK, a zero tensor normalizer and 1-D logits, with CUDA
    fp32 tensors (the triton backend where it is available), then a valid call."""
    student, _, labels = (t.to(device) for t in _inputs(world))
    z = _shard(student, rank, world).float()
    out = [outcome(lambda: _one_rank_call("misspelled_option", rank == 1, group, z, None, labels))]
    os.environ["VTP_CHECK"] = "1"
    try:
        out.append(outcome(lambda: vtp.cross_entropy(z, labels + rank, tp_group=group)))
    finally:
        os.environ.pop("VTP_CHECK")
    nan = vtp.cross_entropy(z, labels, reduction="sum", normalizer=torch.tensor(0, device=device), tp_group=group)
    one = vtp.cross_entropy(z[0], labels[0], tp_group=group)
    want = reference("cross_entropy", (student,), labels)
    err = max((vtp.cross_entropy(z, labels, tp_group=group) - want).abs().max().item(), (one - want[0]).abs().item())
    return out, bool(nan.isnan()), tuple(one.shape), err


@pytest.mark.gpu
def test_misuse_on_gpu(ranks):
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run on the GPU machine: TRITON_INTERPRET=0 pytest -m gpu")
    results = ranks(2, on_gpu, timeout=120)
    (fail0, check0), nan0, shape0, err0 = results[0]
    (fail1, check1), _, _, _ = results[1]
    assert fail1[0] == "TypeError" and fail0[0] == "ShardError" and fail1[1] in fail0[1]
    assert check0 == check1 and check0[0] == "ShardError" and "VTP_CHECK" in check0[1]
    assert all(r[1] for r in results) and shape0 == ()
    assert max(r[3] for r in results) < 1e-4
