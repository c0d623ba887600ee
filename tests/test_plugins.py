"""Real plugin packages: ``plugins/vtp-example-backend`` and ``plugins/vtp-broken-plugin``
are pip-installed (into a temporary directory put on PYTHONPATH, so the test environment
is never changed) and discovered through their ``vtp_runtime.backends`` entry points in
fresh interpreters with the environment variables under test.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT

PLUGINS = ("vtp-example-backend", "vtp-broken-plugin")
BROKEN = {"broken_import", "broken_half", "broken_duplicate", "broken_hookname"}


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> Path:
    """Both plugin packages, built and installed with pip from a copy of their sources."""
    tmp = tmp_path_factory.mktemp("plugins")
    site = tmp / "site"
    sources = [shutil.copytree(ROOT / "plugins" / name, tmp / "src" / name) for name in PLUGINS]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--disable-pip-version-check",
        "--no-warn-script-location",
        "--target",
        str(site),
        *map(str, sources),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"pip install of the plugin packages failed:\n{done.stdout}\n{done.stderr}"
    assert (site / "vtp_example_backend-0.1.0.dist-info" / "entry_points.txt").exists()
    return site


def run(site: Path, args: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("VTP_")}
    full["PYTHONPATH"] = os.pathsep.join([str(site), full.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full.update(env)
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=full, cwd=site.parent)


# One interpreter for every loading scenario (torch takes seconds to import): each scenario
# sets the environment variables and loads a fresh Registry from the real entry points. The
# first goes through the global registry, the way user code meets it: a first dispatch.
SCENARIOS = textwrap.dedent("""
    import json, os, sys, warnings
    import torch
    import vtp_runtime as vtp
    from vtp_runtime import registry
    from vtp_runtime.errors import PluginError

    def state(r, caught, before):
        return {"backends": {n: b.priority for n, b in r.backends(strict=False).items()},
                "warnings": [str(w.message) for w in caught if w.category is registry.PluginLoadWarning],
                "plugins": {p.name: [p.status, p.dist, p.version, p.error, list(p.backends)] for p in r.plugins},
                "imported": sorted(m for m in set(sys.modules) - before if m.startswith(("vtp_example", "vtp_broken")))}

    out = {}
    lazy = not registry.REGISTRY.loaded and "vtp_example_backend" not in sys.modules
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.randn(5, 33, dtype=torch.float64)
        auto = vtp.entropy(x)  # first dispatch: plugins load here
        out["default"] = state(registry.REGISTRY, caught, set())
    d = out["default"]
    d["lazy"], d["chosen"] = lazy, vtp.explain("entropy", x).backend
    d["example_error"] = (vtp.entropy(x, backend="example_blockwise") - auto).abs().max().item()
    os.environ["VTP_BACKEND"] = "example_blockwise"  # unchanged user code, another backend
    d["chosen_by_env"] = vtp.explain("entropy", x).backend
    del os.environ["VTP_BACKEND"]

    for name, env in json.loads(sys.argv[1]).items():
        os.environ.update(env)
        r, before = registry.Registry(), set(sys.modules)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                r.backends()
                error = None
            except PluginError as exc:
                error = str(exc)
        out[name] = {**state(r, caught, before), "error": error}
        for k in env:
            del os.environ[k]
    print(json.dumps(out))
""")


@pytest.fixture(scope="session")
def scenarios(plugin_site) -> dict:
    envs = {
        "disabled": {"VTP_DISABLE_PLUGIN_AUTOLOAD": "1"},
        "allow_dist": {"VTP_PLUGINS": "vtp-example-backend"},
        "allow_ep": {"VTP_PLUGINS": "broken_import"},
        "strict": {"VTP_STRICT_PLUGINS": "1"},
        "strict_allowed": {"VTP_STRICT_PLUGINS": "1", "VTP_PLUGINS": "example_blockwise"},
    }
    done = run(plugin_site, [sys.executable, "-c", SCENARIOS, json.dumps(envs)])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_discovery_and_isolation(scenarios):
    out = scenarios["default"]
    assert out["lazy"], "plugins must load at the first dispatch, not at import"
    plugins = out["plugins"]
    assert plugins["example_blockwise"][:3] == ["loaded", "vtp-example-backend", "0.1.0"]
    assert out["example_error"] < 1e-12  # the plugin's own algorithm agrees with eager
    for name in BROKEN:
        status, dist, version, error, backends = plugins[name]
        assert (status, dist, version, backends) == ("failed", "vtp-broken-plugin", "0.0.1", []), name
    assert "ImportError" in plugins["broken_import"][3]
    assert "unknown op 'no_such_op'" in plugins["broken_half"][3]
    assert (
        "vtp-runtime 0.1.0" in plugins["broken_duplicate"][3]
        and "vtp-broken-plugin 0.0.1" in plugins["broken_duplicate"][3]
    )
    assert "unknown hook 'vtp_runtime_register_backend'" in plugins["broken_hookname"][3]
    # one warning per broken plugin, nothing half-registered, the real eager kept
    assert sorted(w.split("'")[1] for w in out["warnings"]) == sorted(BROKEN)
    assert "broken_half_ok" not in out["backends"] and out["backends"]["eager"] == 0


def test_used_without_changing_user_code(scenarios):
    out = scenarios["default"]
    assert out["chosen"] == "eager"  # installed, but below eager: auto-selection unchanged
    assert out["chosen_by_env"] == "example_blockwise"  # VTP_BACKEND picks it, no code change


def test_allowlist(scenarios):
    out = scenarios["allow_dist"]  # a distribution name
    assert out["warnings"] == [] and "example_blockwise" in out["backends"]
    assert {out["plugins"][n][0] for n in BROKEN} == {"skipped"}
    out = scenarios["allow_ep"]  # an entry-point name
    assert out["plugins"]["broken_import"][0] == "failed" and len(out["warnings"]) == 1
    assert out["plugins"]["example_blockwise"][0] == "skipped" and "example_blockwise" not in out["backends"]


def test_disable_autoload(scenarios):
    out = scenarios["disabled"]
    assert out["warnings"] == [] and out["error"] is None
    assert "example_blockwise" not in out["backends"]
    assert {s[0] for n, s in out["plugins"].items() if not n.startswith("vtp_runtime.")} == {"disabled"}


def test_skipped_plugins_are_never_imported(plugin_site):
    done = run(
        plugin_site,
        [
            sys.executable,
            "-c",
            "import sys, vtp_runtime as v; v.registry.backend_names(); "
            "print(sorted(m for m in sys.modules if m.startswith('vtp_')))",
        ],
        VTP_PLUGINS="vtp-example-backend",
    )
    assert done.returncode == 0, done.stderr
    assert "vtp_broken" not in done.stdout and "vtp_example_backend" in done.stdout


def test_strict(scenarios):
    out = scenarios["strict"]
    assert out["error"].startswith("backend plugins failed to load (VTP_STRICT_PLUGINS=1")
    assert all(f"{n} (vtp-broken-plugin 0.0.1)" in out["error"] for n in BROKEN)
    assert out["warnings"] == []  # the error replaces the warnings
    assert scenarios["strict_allowed"]["error"] is None
    assert scenarios["strict_allowed"]["plugins"]["example_blockwise"][0] == "loaded"


def test_info_with_a_broken_plugin(plugin_site):
    done = run(plugin_site, [sys.executable, "-m", "vtp_runtime", "info"])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(ln.split()[:2] == ["FAILED", "broken_import"] and "ImportError" in ln for ln in lines)
    assert any(ln.split()[:2] == ["loaded", "example_blockwise"] for ln in lines)
    assert "PluginLoadWarning" not in done.stderr  # info reports failures itself, once

    script = shutil.which("vtp-runtime") or pytest.skip("the vtp-runtime script is not on PATH")
    done = run(plugin_site, [script, "info", "--json"], VTP_STRICT_PLUGINS="1")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert {p["name"]: p["status"] for p in data["plugins"]}["broken_half"] == "failed"
    assert "VTP_STRICT_PLUGINS=1" in data["plugin_error"]
    assert data["backends"]["example_blockwise"]["ops"]["kl"]["available"] is True
    assert data["backends"]["example_blockwise"]["ops"]["jsd"]["implemented"] is False


def test_example_plugin_own_tests(plugin_site):
    """The template's own tests pass against the installed package."""
    tests = plugin_site.parent / "src" / "vtp-example-backend" / "tests"
    # the conformance part runs in tests/test_conformance.py on the shared rank pools
    done = run(
        plugin_site,
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), "-k", "not test_conformance"],
        timeout=400,
        VTP_PLUGINS="example_blockwise",
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
