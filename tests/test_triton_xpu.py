"""The ``triton_xpu`` backend without XPU hardware: its probe and dispatch on simulated device
metadata, and its launch configuration run through the Triton kernels under
TRITON_INTERPRET=1 on CPU (TP 1 and 2) against the float64 reference."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from vtp_runtime import dispatch
from vtp_runtime.backend import Request
from vtp_runtime.metadata import Shards as Layout
from vtp_runtime.metadata import backend_key
from vtp_runtime.registry import REGISTRY, register
from vtp_runtime.testing.cases import Case, run_case

pytest.importorskip("triton")

from vtp_runtime.backends import triton_xpu as xpu_mod  # noqa: E402
from vtp_runtime.backends.triton.backend import TritonBackend, capabilities  # noqa: E402
from vtp_runtime.backends.triton_xpu import XPU_CONFIG, TritonXPUBackend  # noqa: E402

# -- probe -----------------------------------------------------------------------------------


@pytest.fixture
def xpu_env(monkeypatch):
    """A simulated healthy XPU environment; tests break one piece at a time."""
    monkeypatch.setattr(xpu_mod, "load_ipex", lambda: ("native torch.xpu", None))
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(xpu_mod, "triton_target_backend", lambda: ("xpu", None))
    return monkeypatch


def test_probe_passes_in_a_simulated_xpu_environment(xpu_env):
    assert TritonXPUBackend().probe("xpu") == []


def test_other_device_types_are_refused_by_capabilities_not_the_probe():
    backend = TritonXPUBackend()
    for device in ("cuda", "cpu"):
        assert backend.probe(device) == []
        req = Request("jsd", device, torch.float32, 1, 8, 3, True, False)
        assert backend.capability_reasons(req) == [f"device type {device!r} not supported (supports xpu)"]


def test_probe_no_torch_xpu(xpu_env):
    xpu_env.delattr(torch, "xpu")
    (why,) = TritonXPUBackend().probe("xpu")
    assert "has no torch.xpu" in why


def test_probe_no_xpu_device(xpu_env):
    xpu_env.setattr(torch.xpu, "is_available", lambda: False)
    (why,) = TritonXPUBackend().probe("xpu")
    assert why.startswith("no XPU device: torch.xpu.is_available() is False")


def test_probe_triton_backend_is_not_intels(xpu_env):
    xpu_env.setattr(xpu_mod, "triton_target_backend", lambda: ("cuda", None))
    (why,) = TritonXPUBackend().probe("xpu")
    assert why.startswith("Triton's active backend is 'cuda', not Intel's 'xpu'")


def test_probe_triton_without_active_driver(xpu_env):
    xpu_env.undo()  # the real query: this machine has no GPU, so Triton has no active driver
    xpu_env.setattr(xpu_mod, "load_ipex", lambda: ("native torch.xpu", None))
    xpu_env.setattr(torch.xpu, "is_available", lambda: True)
    backend, why = xpu_mod.triton_target_backend()
    if torch.cuda.is_available():
        pytest.skip("this machine has an active Triton driver")
    assert backend is None and "Triton has no usable active backend" in why
    assert TritonXPUBackend().probe("xpu") == [why]


def test_real_target_query_uses_get_current_target(monkeypatch):
    import triton.runtime

    fake = types.SimpleNamespace(
        active=types.SimpleNamespace(
            get_current_target=lambda: types.SimpleNamespace(backend="xpu", arch={}, warp_size=32)
        )
    )
    monkeypatch.setattr(triton.runtime, "driver", fake)
    assert xpu_mod.triton_target_backend() == ("xpu", None)


def test_ipex_imported_when_installed(monkeypatch):
    imported = []

    def import_module(name):
        imported.append(name)
        return types.SimpleNamespace(__version__="2.8.10")

    monkeypatch.setattr(xpu_mod.importlib.util, "find_spec", lambda name: object() if name == xpu_mod.IPEX else None)
    monkeypatch.setattr(xpu_mod.importlib, "import_module", import_module)
    assert xpu_mod.load_ipex() == ("intel-extension-for-pytorch 2.8.10", None)
    assert imported == [xpu_mod.IPEX]


def test_ipex_broken_install_is_a_reason(xpu_env, monkeypatch):
    monkeypatch.undo()
    monkeypatch.setattr(xpu_mod.importlib.util, "find_spec", lambda name: object())

    def boom(name):
        raise ImportError("libsycl.so: cannot open shared object file")

    monkeypatch.setattr(xpu_mod.importlib, "import_module", boom)
    (why,) = TritonXPUBackend().probe("xpu")
    assert "intel-extension-for-pytorch is installed but fails to import" in why and "libsycl" in why


def test_native_xpu_without_ipex(monkeypatch):
    monkeypatch.setattr(xpu_mod.importlib.util, "find_spec", lambda name: None)
    assert xpu_mod.load_ipex() == ("native torch.xpu", None)


# -- dispatch on simulated metadata -----------------------------------------------------------


def _request(op="jsd", dtype=torch.bfloat16, tp=1, features=frozenset()):
    return Request(
        op=op,
        device_type="xpu",
        dtype=dtype,
        tp_size=tp,
        vocab_size=151936,
        num_tokens=1024,
        even_shards=tp == 1,
        empty_shard=False,
        features=features,
    )


@pytest.fixture
def registered_xpu(monkeypatch):
    backend = REGISTRY.get("triton_xpu")
    backend.clear_probe_cache()
    dispatch.clear_selections()
    yield backend
    backend.clear_probe_cache()
    dispatch.clear_selections()


def test_selected_for_xpu_calls_when_the_probe_passes(xpu_env, registered_xpu):
    for op, feats in [
        ("jsd", frozenset({"teacher_grad", "mask"})),
        ("cross_entropy", frozenset({"z_loss"})),
        ("logprobs", frozenset({"topk"})),
        ("kl", frozenset({"reverse"})),
        ("entropy", frozenset()),
    ]:
        ex = dispatch.explain_request(_request(op, features=feats), None)
        assert ex.backend == "triton_xpu", str(ex)
    # never for cuda/cpu calls, and not for fp64 (the kernels are fp32/bf16/fp16)
    ex = dispatch.explain_request(_request().__class__(**{**_request().__dict__, "device_type": "cuda"}), None)
    assert ex.backend != "triton_xpu"
    ex = dispatch.explain_request(_request(dtype=torch.float64), None)
    assert ex.backend == "eager" and "dtype float64 not supported" in " ".join(ex.reasons["triton_xpu"])


def test_falls_back_to_eager_with_the_reason_when_the_probe_fails(xpu_env, registered_xpu):
    xpu_env.setattr(xpu_mod, "triton_target_backend", lambda: ("cuda", None))
    ex = dispatch.explain_request(_request(), None)
    assert ex.backend == "eager"
    assert ex.reasons["triton_xpu"][0].startswith("Triton's active backend is 'cuda', not Intel's 'xpu'")


def test_tp2_needs_the_backend_on_every_rank(registered_xpu):
    key = backend_key("triton_xpu", 20)
    eager = backend_key("eager", 0)
    per_rank = (frozenset({key, eager}), frozenset({eager}))  # rank 1's probe failed
    layout = Layout(
        rank=0,
        tp_size=2,
        vocab_start=0,
        vocab_end=75968,
        vocab_size=151936,
        sizes=(75968, 75968),
        num_tokens=1024,
        even_shards=True,
        available=frozenset.intersection(*per_rank),
        available_per_rank=per_rank,
    )
    ex = dispatch.explain_request(_request(tp=2), layout)
    assert ex.backend == "eager"
    assert ex.reasons["triton_xpu"][0].startswith("not available on rank 1")
    everywhere = (frozenset({key, eager}),) * 2
    layout = Layout(**{**layout.__dict__, "available": frozenset({key, eager}), "available_per_rank": everywhere})
    assert dispatch.explain_request(_request(tp=2), layout).backend == "triton_xpu"


# -- the XPU launch configuration through the kernels, on CPU under TRITON_INTERPRET=1 --------


class XpuConfigOnCpu(TritonXPUBackend):
    """The triton_xpu class with its XPU launch configuration, declared for CPU tensors so
    Triton's interpreter can run it here."""

    name = "xpu_config_on_cpu"
    priority = -100  # never auto-selected; the tests force it
    ops = capabilities(frozenset({"cpu"}))
    probe = TritonBackend.probe  # cpu needs TRITON_INTERPRET=1


class _Plugin:
    @staticmethod
    def vtp_runtime_register_backends(register):
        register(XpuConfigOnCpu())


def _xpu_case(rank, world, group, case):
    from vtp_runtime.registry import hookimpl

    if "xpu_config_on_cpu" not in REGISTRY.backends():
        plugin = types.SimpleNamespace(vtp_runtime_register_backends=hookimpl(_Plugin.vtp_runtime_register_backends))
        register(plugin, name="xpu_config_on_cpu")
    backend = REGISTRY.get("xpu_config_on_cpu")
    assert isinstance(backend, XpuConfigOnCpu) and backend.config_for(torch.device("cpu")) is XPU_CONFIG
    return run_case(rank, world, group, case.with_(backend="xpu_config_on_cpu"))


# V = 2600 on one rank: three 1024-column statistics tiles, six 512-column divergence tiles
BIG: dict[str, Any] = {"vocab": 2600, "shape": (2, 2)}
XPU_CASES_TP1 = [
    Case("jsd", **BIG, options=(("beta", 0.3),)),
    Case("jsd", **BIG, options=(("beta", 0.0),), masked="mask", dtype="bfloat16"),
    Case("kl", **BIG, options=(("reverse", True), ("temperature", 2.0))),
    Case("cross_entropy", **BIG, options=(("label_smoothing", 0.1), ("z_loss", 1e-3))),
    Case("logprobs", **BIG, topk=3, dtype="float16"),
    Case("entropy", **BIG, edge="neg_inf"),
    Case("jsd", vocab=37, shape=(2, 3), edge="offset", strided=True),
]
XPU_CASES_TP2 = [
    Case("jsd", **BIG, layout="uneven", options=(("beta", 0.7),)),
    Case("cross_entropy", **BIG, layout="empty", masked="labels", options=(("label_smoothing", 0.2),)),
    Case("kl", vocab=37, shape=(2, 3), layout="explicit", edge="disjoint", dtype="bfloat16"),
]


@pytest.mark.parametrize("case", XPU_CASES_TP1, ids=lambda c: c.id)
def test_xpu_config_tp1_matches_reference(case):
    try:
        _xpu_case(0, 1, None, case)
    finally:
        REGISTRY.unregister("xpu_config_on_cpu")
        dispatch.clear_selections()


def _xpu_case_and_unregister(rank, world, group, case):
    try:
        return _xpu_case(rank, world, group, case)
    finally:
        REGISTRY.unregister("xpu_config_on_cpu")


@pytest.mark.parametrize("case", XPU_CASES_TP2, ids=lambda c: c.id)
def test_xpu_config_tp2_matches_reference(ranks, case):
    ranks(2, _xpu_case_and_unregister, case, timeout=180)
