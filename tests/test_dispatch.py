"""Backend selection and forcing: canonical order, same choice on every rank, no silent fallback."""

import threading

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime.backend import ALL_DTYPES, OpCapability
from vtp_runtime.backends.eager import EagerBackend
from vtp_runtime.registry import REGISTRY, hookimpl

CALLS: list[str] = []


def _fake(name, priority, features=frozenset({"temperature", "label_smoothing", "z_loss"}), probe_reason=None):
    """A backend computing like eager but recording that it ran."""

    class Fake(EagerBackend):
        ops = {
            "cross_entropy": OpCapability(device_types=None, dtypes=ALL_DTYPES, features=features),
            "entropy": OpCapability(device_types=None, dtypes=ALL_DTYPES, features=frozenset({"temperature"})),
        }

        def probe(self, device_type):
            return [probe_reason] if probe_reason else []

        def forward(self, call, inputs, index, mask):
            CALLS.append(self.name)
            return super().forward(call, inputs, index, mask)

    Fake.name, Fake.priority = name, priority
    return Fake()


class _Plugin:
    def __init__(self, *backends):
        self.backends = backends

    @hookimpl
    def vtp_runtime_register_backends(self, register):
        for b in self.backends:
            register(b)


@pytest.fixture
def fakes():
    added: list[str] = []

    def add(*backends):
        vtp.register(_Plugin(*backends), name="test-fakes-" + "-".join(b.name for b in backends))
        added.extend(b.name for b in backends)

    yield add
    for name in added:
        REGISTRY.unregister(name)
    CALLS.clear()


def _ce():
    return torch.randn(4, 7), torch.randint(0, 7, (4,))


def test_highest_priority_wins_then_name(fakes):
    fakes(_fake("zz_fake", 1000), _fake("aa_fake", 1000), _fake("low_fake", -5))
    assert vtp.explain("cross_entropy", *_ce()).backend == "aa_fake"
    vtp.cross_entropy(*_ce())
    assert CALLS == ["aa_fake"]


def test_capabilities_exclude_a_backend(fakes):
    fakes(_fake("plain_fake", 1000, features=frozenset()))
    ex = vtp.explain("cross_entropy", *_ce(), z_loss=1e-3)
    assert ex.backend != "plain_fake"
    assert ex.reasons["plain_fake"] == ["does not support z_loss"]
    assert "`plain_fake` is not supported because:\n    does not support z_loss" in str(ex)


def test_forced_backend_never_falls_back(fakes):
    fakes(_fake("plain_fake", -1, features=frozenset()))
    with pytest.raises(vtp.BackendUnavailable) as info:
        vtp.cross_entropy(*_ce(), z_loss=1e-3, backend="plain_fake")
    msg = str(info.value)
    assert "backend 'plain_fake' was forced by the backend= argument" in msg
    assert "does not support z_loss" in msg and "does not fall back" in msg
    assert CALLS == []


def test_probe_failure_is_a_reason(fakes):
    fakes(_fake("broken_env_fake", 1000, probe_reason="libfoo is not installed"))
    ex = vtp.explain("cross_entropy", *_ce())
    assert ex.backend != "broken_env_fake"
    assert ex.reasons["broken_env_fake"] == ["libfoo is not installed"]


def test_unknown_name_lists_registered(monkeypatch):
    with pytest.raises(vtp.UnknownBackend, match="unknown backend 'nope'.*registered backends: .*eager"):
        vtp.cross_entropy(*_ce(), backend="nope")
    monkeypatch.setenv("VTP_BACKEND", "nope2")
    with pytest.raises(vtp.UnknownBackend, match="nope2.*from VTP_BACKEND"):
        vtp.entropy(torch.randn(2, 3))
    with pytest.raises(vtp.UnknownBackend, match="registered backends"):
        with vtp.use_backend("nope3"):
            pass


def test_forcing_precedence(fakes, monkeypatch):
    fakes(_fake("env_fake", -1), _fake("op_env_fake", -2), _fake("ctx_fake", -3), _fake("arg_fake", -4))
    x = torch.randn(3, 5)
    monkeypatch.setenv("VTP_BACKEND", "env_fake")
    vtp.entropy(x)
    monkeypatch.setenv("VTP_BACKEND_ENTROPY", "op_env_fake")
    vtp.entropy(x)
    with vtp.use_backend("ctx_fake"):
        vtp.entropy(x)
        vtp.entropy(x, backend="arg_fake")
        with vtp.use_backend("env_fake", op="cross_entropy"):  # another op: no effect here
            vtp.entropy(x)
    vtp.entropy(x)
    assert CALLS == ["env_fake", "op_env_fake", "ctx_fake", "arg_fake", "ctx_fake", "op_env_fake"]


def test_use_backend_is_per_thread(fakes):
    fakes(_fake("ctx_fake", -3))
    seen = []
    with vtp.use_backend("ctx_fake"):
        t = threading.Thread(target=lambda: seen.append(vtp.explain("entropy", torch.randn(2, 3)).forced))
        t.start()
        t.join()
        assert vtp.explain("entropy", torch.randn(2, 3)).forced == "ctx_fake"
    assert seen == [None]


# -- heterogeneous ranks -------------------------------------------------------------------


def hetero_auto(rank, world, group):
    """Only rank 0 has the fastest backend: every rank must choose the same other one."""
    name = "rank0_only_fake"
    if rank == 0:
        vtp.register(_Plugin(_fake(name, 1000)), name="rank0-fakes")
    try:
        logits, labels = torch.randn(4, 5), torch.zeros(4, dtype=torch.long)
        ex = vtp.explain("cross_entropy", logits, labels, tp_group=group, gather=True)
        vtp.cross_entropy(logits, labels, tp_group=group).sum()
        return ex.backend, list(ex.reasons.get(name, ["not registered here"]))
    finally:
        REGISTRY.unregister(name)


def test_rank_lacking_a_backend_makes_every_rank_pick_another(ranks):
    (b0, why0), (b1, _) = ranks(2, hetero_auto, timeout=60)
    assert b0 == b1 and b0 != "rank0_only_fake"
    assert why0 == ["not available on rank 1 (not installed there, or its environment probe failed)"]


def hetero_forced(rank, world, group, probe_fails_on_1):
    name = "forced_fake"
    if rank == 0 or probe_fails_on_1:
        reason = "no frobnicator on this host" if rank == 1 else None
        vtp.register(_Plugin(_fake(name, 1000, probe_reason=reason)), name="forced-fakes")
    try:
        vtp.cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long), tp_group=group, backend=name)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", "\n".join(getattr(exc, "__notes__", []))
    finally:
        REGISTRY.unregister(name)
    return "no error", ""


def test_forced_backend_missing_on_one_rank(ranks):
    (e0, _), (e1, _) = ranks(2, hetero_forced, False, timeout=60)
    assert e1.startswith("UnknownBackend: unknown backend 'forced_fake' (from the backend= argument)")
    assert (
        e0 == f"ShardError: the call failed on rank 1 of tp_group before the metadata gather, so every "
        f"rank raises; fix it there:\n  rank 1: {e1}"
    )


def test_forced_backend_unavailable_on_one_rank(ranks):
    (e0, n0), (e1, n1) = ranks(2, hetero_forced, True, timeout=60)
    assert e0 == e1 and e0.startswith("BackendUnavailable: backend 'forced_fake' was forced")
    assert "not available on rank 1" in e0
    assert "no frobnicator on this host" in n1 and n0 == ""
