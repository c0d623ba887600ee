"""Checks an installed vtp-runtime as a user gets it: .ci/run runs this in a fresh virtualenv
holding torch and the wheel only, from outside the source tree.

- ``vtp_runtime`` is the installed copy (in this environment's site-packages), not the tree;
- every public module imports, or fails only for an optional package that an extra or a
  framework brings (and says which);
- ``vtp-runtime --help`` lists every subcommand, none unavailable;
- ``vtp-runtime info --json`` lists the built-in backends (eager, triton, liger, triton_xpu),
  each able to run its ops here or saying why not; eager runs every op.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sysconfig
from pathlib import Path

BUILTIN = ("eager", "triton", "liger", "triton_xpu")
# the packages a module may import that the wheel's own dependencies do not bring: the extras
# (triton, liger, bench, integrations) and the frameworks vtp_runtime.integrations adapts
OPTIONAL = {
    *("triton", "liger_kernel", "rich", "matplotlib"),
    *("transformers", "trl", "megatron", "deepspeed", "torchtitan"),
}


def public_modules(package: Path) -> list[str]:
    names = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(p.startswith("_") for p in parts[1:]):
            names.append(".".join(parts))
    return names


def check_imports() -> None:
    import vtp_runtime

    package = Path(vtp_runtime.__file__).parent
    site = Path(sysconfig.get_paths()["purelib"])
    assert package == site / "vtp_runtime", f"vtp_runtime is imported from {package}, not from {site}"
    failed, optional = [], []
    for name in public_modules(package):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            top = (exc.name or "").split(".")[0]
            if top in OPTIONAL:
                optional.append(f"{name} (needs {exc.name})")
            else:
                failed.append(f"{name}: {exc}")
        except Exception as exc:
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    print(
        f"imported {len(public_modules(package)) - len(optional) - len(failed)} modules of vtp-runtime "
        f"{vtp_runtime.__version__} from {package}"
    )
    for line in optional:
        print(f"  not imported, an optional package missing: {line}")
    assert not failed, "modules that fail to import:\n  " + "\n  ".join(failed)


def vtp_runtime_cli(*argv: str) -> str:
    done = subprocess.run(["vtp-runtime", *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"vtp-runtime {' '.join(argv)}: exit {done.returncode}\n{done.stderr}"
    return done.stdout


def check_cli() -> None:
    listed = vtp_runtime_cli("--help")
    for command in ("demo", "info", "bench"):
        assert f"    {command} " in listed, f"--help does not list {command}:\n{listed}"
    assert "unavailable" not in listed, listed
    data = json.loads(vtp_runtime_cli("info", "--json"))
    for name in BUILTIN:
        assert name in data["backends"], f"info lists no {name} backend: {sorted(data['backends'])}"
        for op, entry in data["backends"][name]["ops"].items():
            assert entry["available"] or entry["reasons"], f"{name} cannot run {op} and gives no reason"
    assert all(e["available"] for e in data["backends"]["eager"]["ops"].values())
    for name in BUILTIN:
        reasons = sorted({r for e in data["backends"][name]["ops"].values() if e["implemented"] for r in e["reasons"]})
        print(f"backend {name}: " + ("available" if not reasons else "not available: " + "; ".join(reasons)))


if __name__ == "__main__":
    check_imports()
    check_cli()
