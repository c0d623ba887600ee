"""The registry, in process: entry points found through real ``importlib.metadata`` from
distributions written to a temporary directory, loaded into a fresh ``Registry``.

(tests/test_plugins.py does the same with pip-installed packages, in subprocesses.)
"""

import itertools
import sys
import textwrap
import threading
import warnings

import pytest
from pluggy import PluginValidationError

import vtp_runtime as vtp
from vtp_runtime import registry as reg
from vtp_runtime.backend import Backend, OpCapability
from vtp_runtime.errors import PluginError

_ids = itertools.count()

GOOD = """
from vtp_runtime import Backend, OpCapability, hookimpl

class B(Backend):
    name = {backend!r}
    priority = {priority}
    ops = {{"entropy": OpCapability(device_types=None)}}

@hookimpl
def vtp_runtime_register_backends(register):
    register(B())
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """``make(dist, {entry point: module source})`` writes an installed distribution."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    for var in ("VTP_PLUGINS", "VTP_DISABLE_PLUGIN_AUTOLOAD", "VTP_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(reg, "BUILTIN_MODULES", ("vtp_runtime.backends.eager",))
    made: list[str] = []

    def make(dist: str, entry_points: dict[str, str], version: str = "1.0") -> dict[str, str]:
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines, modules = ["[vtp_runtime.backends]"], {}
        for ep, source in entry_points.items():
            module = f"vtp_test_plugin_{next(_ids)}"
            (root / f"{module}.py").write_text(textwrap.dedent(source))
            lines.append(f"{ep} = {module}")
            modules[ep] = module
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        made.extend(modules.values())
        return modules

    yield make
    for module in made:
        sys.modules.pop(module, None)


def records(r: reg.Registry) -> dict[str, reg.PluginRecord]:
    return {p.name: p for p in r.plugins}


def load(r: reg.Registry):
    """(backends, the PluginLoadWarnings raised while loading)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backends = r.backends()
    return backends, [w for w in caught if issubclass(w.category, reg.PluginLoadWarning)]


def test_lazy_builtins_and_a_plugin(site, monkeypatch):
    site("vtp-good", {"good": GOOD.format(backend="good_one", priority=3)}, version="2.5")
    monkeypatch.setenv("VTP_PLUGINS", "vtp-good")  # ignore whatever else is installed
    r = reg.Registry()
    assert not r.loaded and r.plugins == []  # nothing imported before the first lookup
    backends, warned = load(r)
    assert list(backends)[:2] == ["good_one", "eager"]  # canonical order: priority, then name
    assert warned == []
    rec, eager = r.owner("good_one"), r.owner("eager")
    assert rec is not None and eager is not None
    assert (rec.name, rec.dist, rec.version, rec.status) == ("good", "vtp-good", "2.5", "loaded")
    assert eager.dist == "vtp-runtime"


def test_each_failure_isolated_with_one_warning(site, monkeypatch):
    site(
        "vtp-a",
        {
            "a_import": "raise ImportError('needs libfoo')",
            "a_raises": """
            from vtp_runtime import hookimpl
            @hookimpl
            def vtp_runtime_register_backends(register):
                raise RuntimeError('boom')
            """,
            "a_ok": GOOD.format(backend="a_ok", priority=1),
        },
    )
    site("vtp-b", {"b_nohook": "x = 1", "b_ok": GOOD.format(backend="b_ok", priority=2)}, version="0.3")
    monkeypatch.setenv("VTP_PLUGINS", "vtp-a,vtp-b")
    r = reg.Registry()
    backends, warned = load(r)
    assert {"a_ok", "b_ok", "eager"} <= set(backends)
    rec = records(r)
    assert [rec[n].status for n in ("a_import", "a_raises", "b_nohook")] == ["failed"] * 3
    assert rec["a_import"].error == "ImportError: needs libfoo" and rec["a_import"].dist == "vtp-a"
    assert rec["a_raises"].error == "RuntimeError: boom"
    assert "no vtp_runtime_register_backends hook" in rec["b_nohook"].error and rec["b_nohook"].version == "0.3"
    assert len(warned) == 3  # one per failed plugin
    assert all("Other backends are unaffected" in str(w.message) for w in warned)
    load(r)  # loading happens once: no second round of warnings
    assert len(r.plugins) == len(rec)


def test_half_way_registration_leaves_registry_unchanged(site, monkeypatch):
    site(
        "vtp-half",
        {
            "half": """
        from vtp_runtime import Backend, OpCapability, hookimpl
        class Ok(Backend):
            name = "half_ok"
            ops = {"entropy": OpCapability(device_types=None)}
        class Bad(Backend):
            name = "Bad-Name"
            ops = {"entropy": OpCapability(device_types=None)}
        @hookimpl
        def vtp_runtime_register_backends(register):
            register(Ok())
            register(Bad())
        """
        },
    )
    monkeypatch.setenv("VTP_PLUGINS", "half")  # by entry-point name
    r = reg.Registry()
    backends, warned = load(r)
    assert "half_ok" not in backends and len(warned) == 1
    assert "lowercase identifier" in records(r)["half"].error
    # the same, registering directly: everything stays as it was, version included
    before = (dict(r.backends()), list(r.plugins), r.version)

    class Plugin:
        @reg.hookimpl
        def vtp_runtime_register_backends(self, register):
            register(_backend("direct_ok")())
            register(_backend("direct_ok")())  # twice in one plugin

    with pytest.raises(PluginError, match="twice"):
        r.register_plugin(Plugin(), reg.PluginRecord("direct"))
    assert (dict(r.backends()), list(r.plugins), r.version) == before


def test_duplicate_name_names_both_distributions(site, monkeypatch):
    site("vtp-first", {"aaa": GOOD.format(backend="shared", priority=1)}, version="1.1")
    site("vtp-second", {"bbb": GOOD.format(backend="shared", priority=9)}, version="2.2")
    monkeypatch.setenv("VTP_PLUGINS", "vtp-first,vtp-second")
    r = reg.Registry()
    backends, warned = load(r)
    assert backends["shared"].priority == 1  # the first in canonical (entry-point name) order wins
    err = records(r)["bbb"].error
    assert "'shared' is registered twice" in err and "vtp-first 1.1" in err and "vtp-second 2.2" in err
    assert len(warned) == 1


def test_duplicate_of_a_builtin(site, monkeypatch):
    site("vtp-clash", {"clash": GOOD.format(backend="eager", priority=50)})
    monkeypatch.setenv("VTP_PLUGINS", "clash")
    r = reg.Registry()
    backends, _ = load(r)
    assert backends["eager"].priority == 0
    assert "vtp-runtime" in records(r)["clash"].error and "vtp-clash 1.0" in records(r)["clash"].error


def test_strict_raises_every_time(site, monkeypatch):
    site("vtp-strict", {"bad": "raise ImportError('nope')", "good": GOOD.format(backend="s_good", priority=1)})
    monkeypatch.setenv("VTP_PLUGINS", "vtp-strict")
    monkeypatch.setenv("VTP_STRICT_PLUGINS", "1")
    r = reg.Registry()
    for _ in range(2):  # not only the first call: a strict run never continues half-loaded
        with pytest.raises(PluginError, match=r"VTP_STRICT_PLUGINS=1.*\n  bad \(vtp-strict 1.0\): ImportError: nope"):
            r.backends()
    assert "s_good" in r.backends(strict=False)  # info can still report


def test_allowlist_and_disable(site, monkeypatch):
    mods = site(
        "vtp-allow", {"one": GOOD.format(backend="one", priority=1), "two": GOOD.format(backend="two", priority=1)}
    )
    monkeypatch.setenv("VTP_PLUGINS", "one, no-such-plugin")
    r = reg.Registry()
    backends, warned = load(r)
    assert "one" in backends and "two" not in backends
    assert records(r)["two"].status == "skipped" and records(r)["two"].error == "not in VTP_PLUGINS"
    assert len(warned) == 1 and "no-such-plugin" in str(warned[0].message)

    monkeypatch.setenv("VTP_DISABLE_PLUGIN_AUTOLOAD", "1")
    sys.modules.pop(mods["one"], None)
    r = reg.Registry()
    backends, warned = load(r)
    assert list(backends) == ["eager"] and warned == []
    assert records(r)["one"].status == "disabled" and mods["one"] not in sys.modules  # never imported


def _backend(name: str, **cap):
    return type(
        name.title(),
        (Backend,),
        {"name": name, "priority": -99, "ops": {"entropy": OpCapability(device_types=None, **cap)}},
    )


def test_register_callback_validation():
    cls = _backend("cb_test")
    kept = []

    class Late:
        @reg.hookimpl
        def vtp_runtime_register_backends(self, register):
            kept.append(register)

    def plugin(call):
        class P:
            @reg.hookimpl
            def vtp_runtime_register_backends(self, register):
                call(register)

        return P()

    with pytest.raises(PluginError, match=r"register\(Cb_Test\(\)\)"):
        reg.register(plugin(lambda register: register(cls)))
    with pytest.raises(PluginError, match="takes a vtp_runtime.Backend"):
        reg.register(plugin(lambda register: register("eager")))
    with pytest.raises(ValueError, match="unknown op"):
        reg.register(plugin(lambda register: register(type("X", (cls,), {"ops": {"nope": None}})())))
    reg.register(Late(), name="late")
    with pytest.raises(PluginError, match="after its hook returned"):
        kept[0](cls())
    assert "cb_test" not in reg.REGISTRY.backends()

    class Misspelled:
        @reg.hookimpl
        def vtp_runtime_register_backend(self, register):
            pass

    class WrongArgs:
        @reg.hookimpl
        def vtp_runtime_register_backends(self, register, extra):
            pass

    for bad in (Misspelled(), WrongArgs()):
        with pytest.raises(PluginValidationError):
            reg.register(bad)
    assert "cb_test" not in reg.REGISTRY.backends()


def test_registered_context_manager():
    cls = _backend("ctx_test")

    class P:
        @reg.hookimpl
        def vtp_runtime_register_backends(self, register):
            register(cls())

    version = reg.REGISTRY.version
    with reg.registered(P(), name="ctx") as record:
        assert record.backends == ("ctx_test",) and "ctx_test" in vtp.registry.backend_names()
        assert reg.REGISTRY.owner("ctx_test") is record
    assert "ctx_test" not in reg.REGISTRY.backends() and record not in reg.REGISTRY.plugins
    assert reg.REGISTRY.version > version  # dispatch caches are invalidated


def test_threads_wait_for_loading(site, monkeypatch):
    site("vtp-slow", {"slow": "import time; time.sleep(0.3)\n" + GOOD.format(backend="slow_one", priority=1)})
    monkeypatch.setenv("VTP_PLUGINS", "slow")
    r = reg.Registry()
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(set(r.backends()))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == [{"eager", "slow_one"}] * 4  # nobody saw a half-loaded registry


def test_builtin_backends_have_one_import_path():
    """The backends/ folder is vtp_runtime.backends; as a top-level package it would load every
    backend module a second time, with classes that are not the registered ones."""
    import importlib
    import sys

    import vtp_runtime.backends.eager as eager

    assert reg.REGISTRY.get("eager").__class__ is eager.EagerBackend
    with pytest.raises(ImportError, match="as vtp_runtime.backends.<name>"):
        importlib.import_module("backends.eager")
    assert "backends" not in sys.modules and "backends.eager" not in sys.modules
