"""A pool of spawned CPU processes joined in a gloo group, for multi-rank tests.

Starting torch in a process takes seconds, so a pool is started once per world size and
runs many jobs. Every job has a timeout: a hang fails the job (and the pool is torn down)
instead of stalling the test run. Gloo's own collective timeout is set short as well; a job
in which it expired also tears the pool down, so that the jobs after it run on a new one.

    pool = RankPool(2)
    results = pool.run(my_fn, arg, timeout=60)   # my_fn(rank, world, group, arg) on every rank
    pool.close()

``my_fn`` must be a module-level function (it is pickled by reference). ``RankPool(2,
launched=True)`` gives each rank the environment ``torchrun`` gives it (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), which accelerate and transformers read:
a Trainer in a job then runs as it does under ``torchrun --nproc-per-node N``.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable, Iterator
from typing import Any


class RankFailure(AssertionError):
    """A job raised on one or more ranks; the message holds every rank's traceback."""


class RankTimeout(AssertionError):
    """A job did not finish on every rank in time (a hang, or a rank that died)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_broke(report: str) -> bool:
    """Whether a rank's failure report is gloo's own: a collective that timed out, or whose
    peer went away."""
    return any(s in report for s in ("gloo/transport", "pair closure", "Connection closed by peer"))


def torchrun_environ(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables ``torchrun --nproc-per-node world`` sets for ``rank`` (one node, no restarts)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "OMP_NUM_THREADS": "1",
    }


def _worker(
    rank: int, world: int, port: int, jobs, results, collective_timeout: float, backend: str, launched: bool
) -> None:
    if launched:
        os.environ.update(torchrun_environ(rank, world, port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share few cores; oversubscription makes gloo crawl
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=collective_timeout),
    )
    group = dist.group.WORLD
    while True:
        job = jobs.get()
        if job is None:
            break
        job_id, fn, args, kwargs = job
        try:
            results.put((job_id, rank, True, fn(rank, world, group, *args, **kwargs)))
        except BaseException as exc:  # report everything, including AssertionError
            results.put((job_id, rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()
    # Every result is delivered (flushed below); the interpreter's own teardown of every module
    # torch imported would take seconds of CPU per rank and leave nothing behind that a pool needs.
    results.close()
    results.join_thread()
    os._exit(0)


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` set inside the block, restored after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    """What ``fn()`` raised, as (exception type name, message), or ("no error", ""): for a
    job whose ranks must all raise the same error, each rank returning its own."""
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


class RankPool:
    """``world_size`` spawned processes in one process group (gloo on CPU; "nccl" puts rank r
    on GPU r), running jobs in lockstep. With gloo, jobs may also use CUDA tensors: every rank
    is then on cuda:0 (a fresh process's current device), so TP > 1 runs on a single GPU.
    ``launched``: each rank gets the environment torchrun would give it (``torchrun_environ``)."""

    def __init__(
        self,
        world_size: int,
        collective_timeout: float = 60.0,
        env: dict[str, str] | None = None,
        backend: str = "gloo",
        launched: bool = False,
    ):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._ids = itertools.count()
        port = free_port()
        with environ(**(env or {})):
            self._procs = [
                ctx.Process(
                    target=_worker,
                    daemon=True,
                    args=(r, world_size, port, self._jobs[r], self._results, collective_timeout, backend, launched),
                )
                for r in range(world_size)
            ]
            for p in self._procs:
                p.start()
        self.alive = True

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world, group, *args, **kwargs)`` on every rank; per-rank results in
        rank order. Raises RankFailure if any rank raised, RankTimeout past ``timeout`` s."""
        if not self.alive:
            raise RankTimeout("the rank pool was torn down by an earlier timeout")
        job_id = next(self._ids)
        for q in self._jobs:
            q.put((job_id, fn, args, kwargs))
        got: dict[int, tuple[bool, Any]] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(got) < self.world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            try:
                jid, rank, ok, value = self._results.get(timeout=max(left, 0.01))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                missing = sorted(set(range(self.world_size)) - set(got))
                self.close(force=True)
                raise RankTimeout(
                    f"{getattr(fn, '__name__', fn)} did not finish within {timeout:.0f} s on "
                    f"ranks {missing} (dead processes: {dead}); finished: "
                    + "; ".join(f"rank {r}: {'ok' if ok else v.splitlines()[0]}" for r, (ok, v) in sorted(got.items()))
                ) from None
            if jid == job_id:
                got[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in got.items() if not ok}
        if any(_collective_broke(v) for v in failed.values()):
            # a rank left waiting in a collective (another raised before it) timed out: the
            # group is out of step, so the next job gets a new pool instead of failing too
            self.close(force=True)
        if failed:
            raise RankFailure("\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(failed.items())))
        return [got[r][1] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        if not self.alive:
            return
        self.alive = False
        if not force:
            for q in self._jobs:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
