"""The ``vtp-runtime`` command line, run as ``python -m vtp_runtime`` from outside the tree where
an installation could differ: every subcommand in ``--help``; a subcommand whose module
cannot be imported is listed with the reason and fails alone, with that reason; ``info`` and
``--help`` never need the benchmark tools."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vtp_runtime import cli
from vtp_runtime.cli import COMMANDS

# ``python -m vtp_runtime`` with vtp_runtime.tools missing, as from a wheel built without it
WITHOUT_TOOLS = """
import runpy, sys

class Missing:
    def find_spec(self, name, path=None, target=None):
        if name == "vtp_runtime.tools" or name.startswith("vtp_runtime.tools."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Missing())
runpy.run_module("vtp_runtime", run_name="__main__", alter_sys=True)
"""
TOOLS_REASON = "No module named 'vtp_runtime.tools' (an incomplete installation of vtp-runtime: reinstall it)"


def vtp_runtime(tmp_path, *argv: str, without_tools: bool = False) -> subprocess.CompletedProcess:
    command = ["-c", WITHOUT_TOOLS] if without_tools else ["-m", "vtp_runtime"]
    # from outside the tree, as a user runs it; the width keeps argparse's lines as printed here
    return subprocess.run(
        [sys.executable, *command, *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "400"},
    )


def help_lines(out: str) -> dict[str, str]:
    """Each subcommand's line in the top-level ``--help``."""
    return {line.split()[0]: line for line in out.splitlines() if line.split()[:1] and line.split()[0] in COMMANDS}


def test_help_lists_every_command(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit) as exit:
        cli.main(["--help"])
    assert exit.value.code == 0
    lines = help_lines(capsys.readouterr().out)
    assert set(lines) == set(COMMANDS)
    assert not any("unavailable" in line for line in lines.values())


def test_help_and_info_without_the_tools(tmp_path):
    done = vtp_runtime(tmp_path, "--help", without_tools=True)
    assert done.returncode == 0, done.stderr
    lines = help_lines(done.stdout)
    assert set(lines) == set(COMMANDS)
    assert f"[unavailable: {TOOLS_REASON}]" in lines["bench"] and f"[unavailable: {TOOLS_REASON}]" in lines["demo"]
    assert "unavailable" not in lines["info"]

    done = vtp_runtime(tmp_path, "info", "--json", without_tools=True)
    assert done.returncode == 0, done.stderr
    assert "eager" in json.loads(done.stdout)["backends"]


@pytest.mark.parametrize("argv", [["bench", "--ops", "jsd"], ["demo", "--help"]])
def test_a_subcommand_without_its_module_fails_alone(tmp_path, argv):
    done = vtp_runtime(tmp_path, *argv, without_tools=True)
    assert done.returncode == 2
    assert done.stderr.strip() == f"vtp-runtime: {argv[0]} is unavailable: {TOOLS_REASON}"
    assert done.stdout == ""


def test_info_does_not_import_the_tools(tmp_path):
    script = (
        "import sys\nfrom vtp_runtime.cli import main\nassert main(['info', '--json']) == 0\n"
        "print(sorted(m for m in sys.modules if m.startswith('vtp_runtime.tools')), file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "[]"


def test_unknown_command(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["infoo"])
    assert exit.value.code == 2 and "invalid choice: 'infoo'" in capsys.readouterr().err
