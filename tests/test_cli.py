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


# -- bad flags: refused while parsing, naming the flag, before anything runs ------------------


def outcome(capsys, *argv: str) -> tuple[int, str]:
    """(exit status, stderr) of ``vtp-runtime ARGV`` run in this process."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exit:  # argparse's refusal
        assert isinstance(exit.code, int)
        code = exit.code
    return code, capsys.readouterr().err


# (argv, the flag the message must name); each alone is a complete command line but for it
BAD_FLAGS = [
    (["bench", "--tokens", "-1"], "--tokens"),
    (["bench", "--tokens", "abc"], "--tokens"),
    (["bench", "--tokens", "8,0"], "--tokens"),
    (["bench", "--tp", "0"], "--tp"),
    (["bench", "--tp", "1,0"], "--tp"),
    (["bench", "--tp", "1,,2"], "--tp"),
    (["bench", "--vocab", "0"], "--vocab"),
    (["bench", "--reps", "0"], "--reps"),
    (["bench", "--warmup", "-1"], "--warmup"),
    (["bench", "--beta", "1.5"], "--beta"),
    (["bench", "--beta", "nan"], "--beta"),
    (["bench", "--head", "0", "--device", "cpu"], "--head"),
    (["bench", "--head", "-5", "--device", "cpu"], "--head"),
    (["bench", "--ops", "nosuch"], "--ops"),
    (["bench", "--ops", ""], "--ops"),
    (["bench", "--peers", "nosuch"], "--peers"),
    (["bench", "--backends", "nosuch"], "--backends"),
    (["demo", "--tp", "0"], "--tp"),
    (["demo", "--vocab", "0"], "--vocab"),
    (["demo", "--hidden", "-1"], "--hidden"),
    (["demo", "--tokens", "x"], "--tokens"),
    (["demo", "--jsd-steps", "-1"], "--jsd-steps"),
    (["demo", "--lr-ce", "0"], "--lr-ce"),
    (["demo", "--tolerance", "inf"], "--tolerance"),
    (["demo", "--tolerance", "-1"], "--tolerance"),
    (["info", "--explain", "jsd", "--tp", "0"], "--tp"),
    (["info", "--explain", "jsd", "--vocab", "-3"], "--vocab"),
    (["info", "--explain", "jsd", "--tokens", "-1"], "--tokens"),
]


@pytest.mark.parametrize("argv,flag", BAD_FLAGS, ids=[" ".join(argv) for argv, _ in BAD_FLAGS])
def test_a_bad_flag_is_refused_naming_it(capsys, argv, flag):
    code, err = outcome(capsys, *argv)
    assert code == 2 and f"argument {flag}: " in err, (code, err)
    assert "Traceback" not in err and "CUDA" not in err


def test_an_unknown_op_is_named_with_the_valid_ones(capsys):
    from vtp_runtime.ops import OPS
    from vtp_runtime.tools import bench, bench_sample

    code, err = outcome(capsys, "bench", "--ops", "jsd,nosuch")
    assert code == 2 and "unknown op 'nosuch'" in err and "CUDA" not in err, err
    valid = err.split("the ops are:")[1]
    assert all(op in valid for op in (*bench.OPS, *bench_sample.SAMPLE_OPS))
    assert set(OPS) <= {*bench.OPS, *bench_sample.SAMPLE_OPS}  # every op of the registry can be timed


# flags that parse one by one but not together: refused before anything runs, naming them
CONFLICTS = [
    (["bench", "--ops", "jsd,sample", "--device", "cpu"], "--ops jsd"),
    (["bench", "--head", "8", "--ops", "kl", "--device", "cpu"], "--ops kl"),
    (["bench", "--peers", "cce"], "--peers cce"),
    (["bench", "--ops", "argmax", "--peers", "liger", "--device", "cpu"], "--peers liger"),
    (["bench", "--ops", "sample", "--vocab", "3", "--tp", "4", "--device", "cpu"], "--vocab 3"),
    (["demo", "--vocab", "1", "--tp", "2"], "--vocab 1"),
    (["demo", "--jsd-steps", "0", "--ce-steps", "0"], "--jsd-steps"),
]


@pytest.mark.parametrize("argv,named", CONFLICTS, ids=[" ".join(argv) for argv, _ in CONFLICTS])
def test_flags_that_do_not_fit_together_are_refused(capsys, argv, named):
    code, err = outcome(capsys, *argv)
    assert code == 2 and named in err and "CUDA" not in err, (code, err)


def test_no_numeric_flag_takes_a_bare_int_or_float():
    """Every number a subcommand takes goes through vtp_runtime.cli_flags: none is a bare
    ``int`` or ``float``, which would take 0 and negative counts."""
    import argparse
    import importlib

    bare = []
    for name, (module, _) in COMMANDS.items():
        parser = argparse.ArgumentParser()
        importlib.import_module(module).add_arguments(parser)
        bare += [f"{name} {a.option_strings[0]}" for a in parser._actions if a.type in (int, float)]
    assert bare == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--ops", "sample,argmax", "--peers", "torch"],
        ["--head", "8", "--peers", "torch"],
    ],
    ids=["sampling", "head"],
)
def test_a_backend_whose_every_row_fails_fails_the_run(tmp_path, argv):
    """``--backends triton`` on the CPU without the Triton interpreter: every triton row is
    unavailable, so the run exits non-zero saying so (the peer's rows ran)."""
    sizes = ["--device", "cpu", "--vocab", "32", "--tokens", "2", "--tp", "1", "--warmup", "0", "--reps", "1"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "vtp_runtime", "bench", "--backends", "triton", *argv, *sizes],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "every row of backend 'triton' failed" in done.stderr and "BackendUnavailable" in done.stderr
    assert " torch " in done.stdout  # the table is printed all the same
