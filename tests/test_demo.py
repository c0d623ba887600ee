"""The README's main job: `vtp-runtime demo` passes on CPU, and fails past its tolerance."""

import os
import shutil
import subprocess
import sys


def _demo(*args, command=(sys.executable, "-m", "vtp_runtime")):
    # the demo as a user runs it: without the Triton interpreter the test process enables
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [*command, "demo", "--jsd-steps", "3", "--ce-steps", "3", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_demo_passes():
    script = shutil.which("vtp-runtime")
    assert script, "the vtp-runtime console script is not installed"
    run = _demo(command=(script,))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 ranks over gloo on CPU" in run.stdout
    assert "-> PASS" in run.stdout
    assert run.stdout.count(" eager ") + run.stdout.count(" triton ") >= 6  # one line per step, with the backend


def test_demo_fails_past_tolerance():
    run = _demo("--tolerance", "0")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "-> FAIL" in run.stdout
