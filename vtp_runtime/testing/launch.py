"""Training scripts launched as users launch them: ``torchrun`` in a subprocess, with a
timeout, so that a test of a trainer at TP > 1 runs the real multi-process job (the
environment transformers and accelerate read: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), not one process per rank.

    out = torchrun(2, ["-m", "tests.trainer_job", path, out_dir, "tp=2"], timeout=300, cwd=root)

``accelerate_tensor_parallel_on_cpu()`` lifts the one check that keeps transformers'
``Trainer`` from a tensor-parallel model on CPU (for gloo tests).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence

from .distributed import free_port


class LaunchFailure(AssertionError):
    """A launched job exited with an error or ran past its timeout; the message holds the
    tail of its output."""


def torchrun(
    nproc: int,
    argv: Sequence[str],
    *,
    timeout: float,
    cwd: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    tail: int = 8000,
) -> str:
    """``python -m torch.distributed.run --nproc-per-node nproc ARGV`` with this interpreter
    (so the ranks import what this process imports), on a free port of 127.0.0.1; its
    output (stdout and stderr together). ``env`` is added to this process's environment.
    Raises ``LaunchFailure`` with the last ``tail`` characters of the output if the job
    fails or runs past ``timeout`` seconds (the whole process group is then killed)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        *argv,
    ]
    # one thread per rank: the ranks share the cores (torchrun sets it too, with a warning)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout kills the ranks too
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        raise LaunchFailure(f"{' '.join(command)} ran past {timeout:.0f} s:\n{output[-tail:]}") from None
    if proc.returncode != 0:
        raise LaunchFailure(f"{' '.join(command)} exited with {proc.returncode}:\n{output[-tail:]}")
    return output


@contextlib.contextmanager
def accelerate_tensor_parallel_on_cpu() -> Iterator[None]:
    """Inside the block, accelerate accepts a ``ParallelismConfig`` on CPU processes.

    transformers' ``Trainer`` hands a model loaded with ``DistributedConfig(tp_size=...)`` to
    accelerate as ``ParallelismConfig(tp_size=..., dp_shard_size=...)``, and accelerate 1.15
    validates it only for GPU-like devices, FSDP2 or DeepSpeed, refusing ``MULTI_CPU`` (gloo)
    before any step. This lifts that one check (``Accelerator.multi_device`` reads True while
    the config is validated); everything else, the data loading of each rank and the loss
    and token-count scaling by the TP size, is accelerate's and transformers' own."""
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig

    validate = ParallelismConfig._validate_accelerator

    def on_cpu_too(self, accelerator):
        saved = Accelerator.multi_device
        Accelerator.multi_device = property(lambda a: a.use_distributed)  # type: ignore[method-assign,assignment]
        try:
            return validate(self, accelerator)
        finally:
            Accelerator.multi_device = saved  # type: ignore[method-assign]

    ParallelismConfig._validate_accelerator = on_cpu_too  # type: ignore[method-assign]
    try:
        yield
    finally:
        ParallelismConfig._validate_accelerator = validate  # type: ignore[method-assign]
