"""The package list, found rather than kept by hand: ``vtp_runtime`` and every package under it,
and every package under ``backends/``, which installs as ``vtp_runtime.backends`` (the
package-dir in pyproject.toml, where everything else is configured). Setuptools' own discovery
in pyproject.toml cannot name a mapped folder's subpackages. plugins/, tests/ and benchmarks/
are not packages of this distribution."""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["vtp_runtime", "vtp_runtime.*"]),
        "vtp_runtime.backends",
        *(f"vtp_runtime.backends.{name}" for name in find_packages("backends")),
    ]
)
