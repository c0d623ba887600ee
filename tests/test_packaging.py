"""The distributions users install: the wheel holds every package of the source tree (every
folder with an ``__init__.py`` under ``vtp_runtime/`` and ``backends/``, the latter installed as
``vtp_runtime.backends``), ``py.typed`` and the LICENSE, and nothing else (no tests, benchmarks
or example plugins); the wheel built from the sdist is the same wheel.

Both are built from a copy of the tree (a stale ``build/`` folder cannot leak into them), with
the ``build`` and ``setuptools`` of this environment (the test extra), without isolation.
.ci/run builds them again with isolation and installs the wheel in a fresh virtualenv.
"""

from __future__ import annotations

import email
import hashlib
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

# what a build writes, and what is not the project's (ignored by git)
NOT_SOURCE = shutil.ignore_patterns(
    ".git", "__pycache__", "*.egg-info", "build", "dist", ".venv", ".whl", "out", ".*_cache"
)
# source folder -> the installed package it is
PACKAGE_ROOTS = {"vtp_runtime": "vtp_runtime", "backends": "vtp_runtime/backends"}


def source_files() -> dict[str, Path]:
    """The installed path of every file in a package folder of the source tree (a folder with an
    ``__init__.py``, as setuptools finds packages), by the path the wheel must hold it at."""
    out = {}
    for folder, installed in PACKAGE_ROOTS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            package = init.parent
            for f in package.iterdir():
                if f.suffix in (".py", ".typed"):
                    out[f"{installed}/{f.relative_to(ROOT / folder).as_posix()}"] = f
    return out


def source_packages() -> set[str]:
    return {name.rsplit("/", 1)[0] for name in source_files() if name.endswith("/__init__.py")}


def contents(wheel: Path) -> dict[str, str]:
    """Each file of ``wheel`` and the sha256 of its bytes."""
    with zipfile.ZipFile(wheel) as z:
        return {n: hashlib.sha256(z.read(n)).hexdigest() for n in z.namelist() if not n.endswith("/")}


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """The wheel built from the tree, the sdist, and the wheel built from that sdist."""
    tmp = tmp_path_factory.mktemp("dists")
    tree = tmp / "tree"
    shutil.copytree(ROOT, tree, ignore=NOT_SOURCE)

    def build(*args: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "build", "--no-isolation", *args],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    build("--wheel", "--outdir", str(tmp / "direct"))
    build("--outdir", str(tmp / "via_sdist"))  # the sdist, then a wheel from it
    (wheel,) = (tmp / "direct").glob("*.whl")
    (sdist,) = (tmp / "via_sdist").glob("*.tar.gz")
    (from_sdist,) = (tmp / "via_sdist").glob("*.whl")
    return {"wheel": wheel, "sdist": sdist, "from_sdist": from_sdist}


def test_source_tree_has_the_packages_the_cli_needs():
    # the scan itself finds the subpackages (a wrong ROOT or pattern would find nothing to miss)
    assert {"vtp_runtime", "vtp_runtime/tools", "vtp_runtime/testing", "vtp_runtime/backends/triton"} <= (
        source_packages()
    )


def test_wheel_holds_every_package_and_nothing_else(dists):
    names = set(contents(dists["wheel"]))
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert packages == source_packages(), (
        f"missing from the wheel: {sorted(source_packages() - packages)}; "
        f"not in the source tree: {sorted(packages - source_packages())}"
    )
    # every module of every package, byte for byte, and py.typed (PEP 561)
    with zipfile.ZipFile(dists["wheel"]) as z:
        for name, path in source_files().items():
            assert name in names, f"{name} is missing from the wheel"
            assert z.read(name) == path.read_bytes(), f"{name} differs from {path}"
    assert "vtp_runtime/py.typed" in names
    (dist_info,) = {n.split("/", 1)[0] for n in names if ".dist-info/" in n}
    code = {n for n in names if not n.startswith(f"{dist_info}/")}
    assert code == set(source_files()), f"not from a package folder: {sorted(code - set(source_files()))}"


def test_wheel_metadata(dists):
    with zipfile.ZipFile(dists["wheel"]) as z:
        dist_info = next(n.split("/", 1)[0] for n in z.namelist() if ".dist-info/" in n)
        meta = email.message_from_bytes(z.read(f"{dist_info}/METADATA"))
        license_text = z.read(f"{dist_info}/licenses/LICENSE")
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
    assert license_text == (ROOT / "LICENSE").read_bytes()
    assert meta["License-Expression"] == "Apache-2.0" and meta.get_all("License-File") == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in meta.get_all("Classifier", []))
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL", []))
    assert set(urls) == {"Homepage", "Documentation", "Changelog", "Issues"}
    assert all(u.startswith("https://github.com/vtp-runtime/vtp-runtime") for u in urls.values())
    assert "Typing :: Typed" in meta.get_all("Classifier", [])
    assert meta["Keywords"] and meta["Requires-Python"] == ">=3.10"
    assert "vtp-runtime = vtp_runtime.cli:main" in entry_points


def test_wheel_from_the_sdist_is_the_same_wheel(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        top = {m.name.split("/")[1] for m in sdist.getmembers() if "/" in m.name}
    assert {"LICENSE", "README.md", "pyproject.toml", "setup.py", "vtp_runtime", "backends"} <= top
    assert not top & {"plugins", "tests", "benchmarks"}  # other distributions; the suite runs from a clone
    assert dists["from_sdist"].name == dists["wheel"].name
    direct, via_sdist = contents(dists["wheel"]), contents(dists["from_sdist"])
    differ = sorted(n for n in direct.keys() | via_sdist.keys() if direct.get(n) != via_sdist.get(n))
    assert not differ, f"the wheel from the sdist differs in {differ}"
