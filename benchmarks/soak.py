"""A soak: a training loop of many vtp_runtime calls on 2 ranks, checking that nothing
accumulates over a whole job (memory, tensors, open files, plans, process groups) and that
no rank is ever left waiting.

Each step, on every rank of a TP group (gloo; CPU tensors, or CUDA tensors with every rank
on one GPU, as the repository's TP-on-one-GPU tests run):

- a random token count N (the same on every rank), fresh inputs, one op forward and
  backward, then every tensor of the step dropped. The ops cycle through cross_entropy
  (label smoothing), logprobs with return_entropy (a top-k index), entropy (a mask), kl,
  jsd and kl with a ``vtp.TopK`` teacher; the input forms cycle through logits (eager),
  ``vtp.Head`` (eager; a persistent weight, as a model's output projection) and logits in
  ``torch.compile(fullgraph=True, dynamic=True)``;
- on rank 0 only, a group-less call (``tp_group=None``) of a random shape, as a local
  metric would be;
- every ``--rebuild-every`` steps the TP group of the eager forms is rebuilt: ``new_group``
  -> used -> ``destroy_process_group(g)`` -> dropped. The compiled form runs on a TP group
  made once for the job, as a compiled model's is, and is compiled once per shape family
  (dynamo's dynamic-shape graphs). With ``--recompile-on-rebuild`` it runs on the rebuilt
  group too and is compiled again at every rebuild (``torch._dynamo.reset()``): a group is
  a constant of the graph (its name), so a new group is a new graph, and torch keeps part of
  every dropped compilation; the run then measures what torch itself retains per rebuild.

On CUDA the ranks load every kernel module of the process when they start
(``CUDA_MODULE_LOADING=EAGER``; ``--cuda-module-loading lazy`` keeps the driver's default,
which loads a kernel's module into host memory the first time the kernel runs: megabytes of
RSS whenever a shape first picks a new cuBLAS or torch kernel, late in a run as often as
early).

``VTP_CHECK`` is ``once`` by default, the runtime's mode on a device-only group such as
NCCL (gloo's default, a host gather per call, would hide a plan cache that drifts between
ranks). Every ``--report-every`` steps each rank reports: allocated and reserved CUDA memory
(on the CPU: the bytes of live tensors' storages, and the RSS), the RSS slope since warm-up
so far, live tensors, open file descriptors, Triton kernels compiled, plans held (in all, and per cache: the eager
forms' group, the compiled form's group, calls without a group), and destroyed groups
still alive; a float64 check of two small
calls through the current group. At the end the targets are checked and the exit status is
1 when one is missed:

- allocated memory after the loop within ``--memory-slack`` MiB of before it (64; 1 on the
  CPU, whose sizes are a thousandth of the GPU's);
- the resident set's slope after warm-up (``--warmup-steps``: caches filling, first
  compilations; ``--max-plans`` lowers every runtime cache's bound so that they fill and turn
  over within it, as a long job's do: rank 0's group-less call of a random shape makes a
  new signature at most steps) at most ``--rss-slope-bound`` KiB per 1000 steps (256): a least-squares line
  through RSS samples taken every ``--sample-every`` steps; on CUDA the same for allocated
  memory (not checked with ``--recompile-on-rebuild``, whose growth is torch's); every rise
  of 1 MiB or more between two samples after warm-up is listed with the call of its last
  step (with ``--sample-every 1``: the call that made it);
- live tensors after the loop at most ``--tensor-slack`` (16) more than before it;
- plans held at most the runtime's bound;
- no destroyed group alive;
- no hang: every step within ``--step-timeout`` s (a watchdog ends a rank that waits longer);
- every float64 check within 1e-6.

Where memory grows, the report says what: the object types (``gc.get_objects()`` grouped by
type) whose counts grew most between the end of warm-up and the end, and with
``--tracemalloc`` the source lines whose allocations since warm-up grew most. ``--malloc-trim``
returns the C heap's free pages to the system before each RSS sample, which tells memory in
use from pages the allocator keeps for reuse (glibc's arenas grow in steps and keep them).

The output is Markdown (tables, with the command and setup on top): it can be saved under
``benchmarks/results/`` as it is and its tables pasted into ``docs/benchmarks.md``.

    # one GPU, two gloo ranks sharing it (TRITON_INTERPRET unset)
    python benchmarks/soak.py --device cuda --steps 10000 | tee benchmarks/results/h200_soak.md
    # the CPU, 100,000 steps (benchmarks/soak_cpu.sh)
    # the CPU, briefly (tests/test_long_jobs.py runs this)
    python benchmarks/soak.py --device cpu --steps 200 --rebuild-every 100 --report-every 100 \
        --backend eager --compile-backend eager --step-timeout 30

Rank 0's stdout is the report; the ranks' errors and a hang's step go to stderr.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import math
import multiprocessing as mp
import os
import queue
import random
import sys
import threading
import time
import traceback
import tracemalloc
import weakref

from vtp_runtime.cli_flags import non_negative_int, positive_int

OPS = ("cross_entropy", "logprobs", "entropy", "kl", "jsd", "kl_topk")
FORMS = ("logits", "head", "compiled")
TOPK = 4
RISE_BYTES = 2**20  # an RSS rise between two samples after warm-up this large is listed with its step
CHECK_TOL = 1e-6


# -- runtime internals: the one place this script reads them -------------------------------


def drop_compiled(compiled: dict) -> None:
    """Forget the compiled functions of the last group, as a job recompiling for a new group
    does. torch keeps each compiled function among the globals of the module that defined the
    compiled code (``__compiled_fn_*``), and its traced graph holds the group it was called
    with as an input's example value: those globals go too, else torch itself would keep every
    destroyed group alive."""
    import torch

    compiled.clear()
    torch._dynamo.reset()
    for name in [k for k in globals() if k.startswith("__compiled_fn")]:
        globals()[name] = None  # torch's own cleanup deletes the name later


def graphs_compiled() -> int:
    """Graphs dynamo compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def runtime_plans() -> tuple[int, int]:
    """(plans this rank holds, the most the runtime may hold: two generations per cache, one
    cache per live group and one for calls without a group)."""
    from vtp_runtime import plans

    return plans.size(), 2 * plans.MAX_PLANS * (plans.groups() + 1)


def plans_per_cache(group, compiled_group) -> tuple[int, int, int]:
    """Plans this rank holds for the eager forms' group, for the compiled form's group and for
    calls without a group (0 for a group not made, or dropped)."""
    from vtp_runtime import plans

    return (
        0 if group is None else plans.size(group),
        0 if compiled_group is None else plans.size(compiled_group),
        plans.size(None),
    )


# -- measurements ----------------------------------------------------------------------------


def live_tensors() -> tuple[int, int]:
    """(real tensors alive in this process, bytes of their distinct storages); the fake and
    meta tensors torch.compile keeps aside."""
    import warnings

    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    count, storages = 0, {}
    with warnings.catch_warnings():  # isinstance on some torch.distributed names warns
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor) and not o.is_meta:
                count += 1
                try:
                    s = o.untyped_storage()
                    storages[(s.device.type, s.data_ptr())] = s.nbytes()
                except (RuntimeError, NotImplementedError):  # a tensor without storage
                    pass
    return count, sum(storages.values())


def type_counts() -> collections.Counter:
    """Live objects the garbage collector tracks, by type."""
    gc.collect()
    return collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())


def compiled_kernels() -> int:
    """Triton kernels compiled and held in this process (each keeps its binary, a launcher
    and a metadata class in host memory): a count that grows after warm-up is the JIT
    compiling new specializations."""
    return sum(type(o).__name__ == "CompiledKernel" for o in gc.get_objects())


def grown(before: collections.Counter, after: collections.Counter, top: int = 8) -> list[tuple[str, int]]:
    """The ``top`` types whose counts grew most, with the growth."""
    return [(name, n) for name, n in (after - before).most_common(top)]


def grown_lines(before, after, top: int = 8) -> list[tuple[str, float]]:
    """The ``top`` source lines whose traced allocations grew most between two tracemalloc
    snapshots, in KiB."""
    stats = after.compare_to(before, "lineno")
    return [(f"{st.traceback[0].filename}:{st.traceback[0].lineno}", st.size_diff / 1024) for st in stats[:top]]


def slope_per_1000(points: list[tuple[int, float]]) -> float | None:
    """The least-squares slope of ``(step, bytes)`` points in KiB per 1000 steps (None for
    fewer than 3 points)."""
    if len(points) < 3:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / sxx * 1000 / 1024


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pinned_host_bytes() -> int | None:
    """Pinned host memory held by torch's CUDA caching host allocator (in use and cached),
    which gloo's collectives on CUDA tensors stage through: part of the RSS that the
    allocator keeps for reuse. None without CUDA or where torch has no such count."""
    import torch

    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "reserved_bytes.current"):  # newer torch, older torch
        if key in stats:
            return int(stats[key])
    return None


def malloc_trim() -> None:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim(0)``), so that the
    RSS counts what is in use rather than what the allocator keeps for reuse; nothing where
    there is no glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def snapshot(device: str, destroyed: list, groups: tuple = (None, None)) -> dict:
    """What is alive now; ``groups``: the eager forms' and the compiled form's groups."""
    import torch

    gc.collect()
    tensors, tensor_bytes = live_tensors()
    plans, bound = runtime_plans()
    out: dict[str, object] = {
        "live_tensors": tensors,
        "open_fds": len(os.listdir("/proc/self/fd")),
        "plans": plans,
        "plan_caches": plans_per_cache(*groups),
        "plan_bound": bound,
        "groups_destroyed": len(destroyed),
        "groups_alive": sum(ref() is not None for ref in destroyed),
        "rss_mib": rss_bytes() / 2**20,
        "compiled_kernels": compiled_kernels(),
    }
    if device == "cuda":
        torch.cuda.synchronize()
        out["allocated_mib"] = torch.cuda.memory_allocated() / 2**20
        out["reserved_mib"] = torch.cuda.memory_reserved() / 2**20
        pinned = pinned_host_bytes()
        out["pinned_mib"] = None if pinned is None else pinned / 2**20
    else:
        out["allocated_mib"] = tensor_bytes / 2**20
        out["reserved_mib"] = None
    return out


# -- one step --------------------------------------------------------------------------------


class Model:
    """What persists over the job on this rank: the output projections' vocabulary shards."""

    def __init__(self, args, rank: int, world: int, device, dtype):
        import torch

        self.v_local = args.vocab // world + (1 if rank < args.vocab % world else 0)
        self.vocab_start = sum(args.vocab // world + (1 if r < args.vocab % world else 0) for r in range(rank))
        g = torch.Generator(device=device).manual_seed(1000 + rank)
        scale = args.hidden**-0.5
        self.weight = (torch.randn(self.v_local, args.hidden, generator=g, device=device) * scale).to(dtype)
        self.weight.requires_grad_(True)
        self.teacher_weight = (torch.randn(self.v_local, args.hidden, generator=g, device=device) * scale).to(dtype)


def _op(op: str, student, teacher, labels, index, mask, topk_lp, topk_ids, group, backend):
    import vtp_runtime as vtp

    common = {"tp_group": group, "backend": backend}
    if op == "cross_entropy":
        return vtp.cross_entropy(student, labels, label_smoothing=0.1, **common)
    if op == "logprobs":
        lp, ent = vtp.logprobs(student, index, return_entropy=True, **common)
        return lp.sum(-1) + ent
    if op == "entropy":
        return vtp.entropy(student, mask=mask, **common)
    if op == "kl":
        return vtp.kl(student, teacher, **common)
    if op == "jsd":
        return vtp.jsd(student, teacher, beta=0.5, **common)
    return vtp.kl(student, vtp.TopK(topk_lp, topk_ids), tail=True, **common)


def step(args, s: int, rank: int, model: Model, group, compiled_group, compiled: dict, device, dtype) -> str:
    """Step ``s``: its op, form and token count (the same on every rank), fresh inputs,
    forward and backward (the compiled form on ``compiled_group``); nothing of it outlives
    the call. Returns what it ran, in words."""
    import torch

    import vtp_runtime as vtp

    op, form = OPS[s % len(OPS)], FORMS[(s // len(OPS)) % len(FORMS)]
    shared = random.Random(f"{args.seed}:{s}")
    n = shared.randint(args.tokens[0], args.tokens[1])
    g = torch.Generator(device=device).manual_seed(args.seed * 100_003 + s)  # the same on every rank
    labels = torch.randint(0, args.vocab, (n,), generator=g, device=device)
    labels[:: max(1, n // 7)] = -100
    index = torch.randint(0, args.vocab, (n, TOPK), generator=g, device=device)
    mask = torch.rand(n, generator=g, device=device) > 0.2
    topk_lp = torch.log_softmax(torch.randn(n, TOPK + 1, generator=g, device=device), -1)[:, :TOPK].contiguous()
    topk_ids = torch.randint(0, args.vocab - TOPK, (n, 1), generator=g, device=device) + torch.arange(
        TOPK, device=device
    )
    mine = torch.Generator(device=device).manual_seed(args.seed * 7919 + s * 2 + rank)  # this rank's shard
    student: vtp.Head | torch.Tensor
    teacher: vtp.Head | torch.Tensor
    if form == "head":
        hidden = torch.randn(n, args.hidden, generator=g, device=device).to(dtype).requires_grad_(True)
        student = vtp.Head(hidden, model.weight)
        teacher = vtp.Head(hidden.detach(), model.teacher_weight)
    else:
        student = (torch.randn(n, model.v_local, generator=mine, device=device) * 2).to(dtype).requires_grad_(True)
        teacher = (torch.randn(n, model.v_local, generator=mine, device=device) * 2).to(dtype)
    fn = _op
    if form == "compiled":  # one graph per op (the op name is a constant to dynamo)
        if "fn" not in compiled:
            compiled["fn"] = torch.compile(_op, backend=args.compile_backend, fullgraph=args.fullgraph, dynamic=True)
        fn = compiled["fn"]
        group = compiled_group
    out = fn(op, student, teacher, labels, index, mask, topk_lp, topk_ids, group, args.backend)
    out.sum().backward()
    if not bool(torch.isfinite(out.detach()).all()):
        raise RuntimeError(f"step {s}: {op} on {form} inputs, N={n}: a result that is not finite")
    model.weight.grad = None
    return f"{op} on {form} inputs, N={n}"


def local_call(args, s: int, device, dtype) -> None:
    """A group-less call of a random shape (rank 0 only): a local metric."""
    import torch

    import vtp_runtime as vtp

    r = random.Random(f"local:{args.seed}:{s}")
    n, v = r.randint(1, args.tokens[1]), r.randint(2, max(3, args.vocab // 64))
    z = torch.randn(n, v, device=device).to(dtype)
    if s % 2:
        vtp.entropy(z, backend=args.backend)
    else:
        vtp.cross_entropy(z, torch.randint(0, v, (n,), device=device), backend=args.backend)


def float64_check(args, rank: int, world: int, model: Model, group, device) -> float:
    """Two small calls through ``group`` on float64 logits that every rank generates in
    full: the largest deviation from the float64 reference."""
    import torch

    import vtp_runtime as vtp
    from vtp_runtime.testing.reference import values as reference

    g = torch.Generator(device=device).manual_seed(12345)
    z = torch.randn(3, args.vocab, generator=g, device=device, dtype=torch.float64) * 2
    t = torch.randn(3, args.vocab, generator=g, device=device, dtype=torch.float64) * 2
    y = torch.randint(0, args.vocab, (3,), generator=g, device=device)
    part = slice(model.vocab_start, model.vocab_start + model.v_local)
    ce = vtp.cross_entropy(z[:, part], y, label_smoothing=0.1, tp_group=group)
    jsd = vtp.jsd(z[:, part], t[:, part], beta=0.3, tp_group=group)
    want_ce = reference("cross_entropy", (z,), y, label_smoothing=0.1)
    want_jsd = reference("jsd", (z, t), beta=0.3)
    return max((ce - want_ce).abs().max().item(), (jsd - want_jsd).abs().max().item())


# -- a rank ----------------------------------------------------------------------------------


class Watchdog:
    """Ends this process when a step takes longer than ``timeout`` s: a hang."""

    def __init__(self, rank: int, timeout: float):
        self.rank, self.timeout, self.step, self.since = rank, timeout, -1, time.monotonic()
        threading.Thread(target=self._watch, daemon=True).start()

    def beat(self, step: int) -> None:
        self.step, self.since = step, time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 10))
            if time.monotonic() - self.since > self.timeout:
                print(
                    f"rank {self.rank}: step {self.step + 1} did not finish within {self.timeout:.0f} s (a hang)",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(3)


def rank_main(rank: int, world: int, port: int, args, results) -> None:
    import torch
    import torch.distributed as dist

    if args.check:
        os.environ["VTP_CHECK"] = args.check
    if args.max_plans:
        from vtp_runtime import dispatch, plans
        from vtp_runtime.backends.triton import backend as triton_backend

        # every cache of the runtime, so that all of them fill and turn over in the warm-up
        plans.MAX_PLANS = plans.MAX_PLAIN_OPTIONS = plans.MAX_DIRECT = args.max_plans
        dispatch.MAX_SELECTIONS = args.max_plans
        triton_backend.MAX_CALL_PLANS = args.max_plans
    if args.device == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(0)  # every rank on one GPU
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=args.step_timeout),
    )
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    watchdog = Watchdog(rank, args.step_timeout + 30)  # the gloo timeout is seen first
    model = Model(args, rank, world, device, dtype)
    destroyed: list = []
    group = None
    compiled: dict = {}
    rows, checks = [], []
    # (step, RSS, allocated CUDA memory, pinned host memory)
    samples: list[tuple[int, int, int | None, int | None]] = []
    rises: list[tuple[int, int, str]] = []  # (step, RSS rise since the last sample, the step's call)
    types_warm: collections.Counter = collections.Counter()
    traced_warm = None
    started = time.monotonic()
    s = 0
    try:
        # graphs per op and group, and the token count's 0/1 specializations: past dynamo's default limit
        cfg = torch._dynamo.config
        limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # older torch
        setattr(cfg, limit, max(64, getattr(cfg, limit)))
        rows.append({"step": 0, **snapshot(args.device, destroyed), "s_per_step": None})
        before = rows[0]
        table: list = [None] * world
        dist.all_gather_object(table, before)
        if rank == 0:
            print_rows(table, first=True)
        last = time.monotonic()
        timeout = datetime.timedelta(seconds=args.step_timeout)
        # the compiled form's group: made once for the job (rebuilt with the others under
        # --recompile-on-rebuild)
        compiled_group = None if args.recompile_on_rebuild else dist.new_group(list(range(world)), timeout=timeout)
        for s in range(args.steps):
            if s % args.rebuild_every == 0:
                if group is not None:
                    dist.destroy_process_group(group)
                    destroyed.append(weakref.ref(group))
                    group = None
                if args.recompile_on_rebuild:
                    drop_compiled(compiled)
                group = dist.new_group(list(range(world)), timeout=timeout)
            ran = step(args, s, rank, model, group, compiled_group or group, compiled, device, dtype)
            if rank == 0 and s % args.local_every == 0:
                local_call(args, s, device, dtype)
            watchdog.beat(s)
            done = s + 1
            if done == args.warmup_steps:  # what is alive once warm, to compare with the end;
                # before the RSS sample: the census's own memory is not the loop's growth
                types_warm = type_counts()
                if args.tracemalloc:
                    tracemalloc.start(1)
                    traced_warm = tracemalloc.take_snapshot()
            if done % args.sample_every == 0:
                if args.malloc_trim:
                    malloc_trim()
                allocated = torch.cuda.memory_allocated() if args.device == "cuda" else None
                samples.append((done, rss_bytes(), allocated, pinned_host_bytes()))
                rise = samples[-1][1] - samples[-2][1] if len(samples) > 1 else 0
                if done > args.warmup_steps and rise >= RISE_BYTES:
                    rises.append((done, rise, ran))
            if done % args.report_every == 0 or done == args.steps:
                checks.append(float64_check(args, rank, world, model, group, device))
                now = time.monotonic()
                rows.append(
                    {
                        "step": done,
                        **snapshot(args.device, destroyed, (group, compiled_group)),
                        "s_per_step": (now - last) / (done - rows[-1]["step"]),
                        "rss_slope": slope_per_1000([(x, rss) for x, rss, _, _ in samples if x >= args.warmup_steps]),
                    }
                )
                last = now
                table = [None] * world
                dist.all_gather_object(table, rows[-1])
                if rank == 0:
                    print_rows(table, first=False)
        seconds = time.monotonic() - started
        growth = grown(types_warm, type_counts())
        lines = grown_lines(traced_warm, tracemalloc.take_snapshot()) if traced_warm is not None else []
        tracemalloc.stop()
        warm = [sample for sample in samples if sample[0] >= args.warmup_steps]
        graphs = graphs_compiled()
        for last_group in (group, compiled_group):
            if last_group is not None:
                dist.destroy_process_group(last_group)
                destroyed.append(weakref.ref(last_group))
        group = compiled_group = last_group = None
        drop_compiled(compiled)
        after = {"step": args.steps, **snapshot(args.device, destroyed)}
        summary = {
            "rank": rank,
            "before": before,
            "after": after,
            "worst_check": max(checks) if checks else math.nan,
            "seconds": seconds,
            "rss_slope": slope_per_1000([(x, rss) for x, rss, _, _ in warm]),
            "allocated_slope": slope_per_1000([(x, a) for x, _, a, _ in warm if a is not None]),
            # reported beside the RSS target, not instead of it: how much of the RSS slope is
            # torch's pinned host cache
            "pinned_slope": slope_per_1000([(x, p) for x, _, _, p in warm if p is not None]),
            "rss_less_pinned_slope": slope_per_1000([(x, rss - p) for x, rss, _, p in warm if p is not None]),
            "samples": len(warm),
            "graphs": graphs,
            "plan_caches": rows[-1]["plan_caches"],
            "grown_types": growth,
            "grown_lines": lines,
            "rises": rises,
        }
        table = [None] * world
        dist.all_gather_object(table, summary)
        if rank == 0:
            results.put(table)
        dist.destroy_process_group()
    except BaseException as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"rank {rank}: failed at step {s}: {type(exc).__name__}: {first}", file=sys.stderr, flush=True)
        traceback.print_exc(limit=-8)
        sys.stderr.flush()
        os._exit(1)


# -- output ----------------------------------------------------------------------------------

COLUMNS = (
    ("step", "step", "{:d}"),
    ("rank", "rank", "{:d}"),
    ("allocated_mib", "allocated MiB", "{:.1f}"),
    ("reserved_mib", "reserved MiB", "{:.1f}"),
    ("rss_mib", "RSS MiB", "{:.0f}"),
    ("rss_slope", "RSS slope since warm-up, KiB / 1000 steps", "{:+.1f}"),
    ("pinned_mib", "pinned host MiB", "{:.1f}"),
    ("live_tensors", "live tensors", "{:d}"),
    ("open_fds", "open fds", "{:d}"),
    ("compiled_kernels", "Triton kernels compiled", "{:d}"),
    ("plans", "plans", "{:d}"),
    ("plan_caches", "plans: group / compiled form's group / no group", "{}"),
    ("groups_alive", "destroyed groups alive", "{}"),
    ("s_per_step", "ms/step", "{:.1f}"),
)


def _cell(key: str, fmt: str, row: dict) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if key == "groups_alive":
        return f"{value} of {row['groups_destroyed']}"
    if key == "s_per_step":
        return fmt.format(value * 1e3)
    if key == "plan_caches":
        return " / ".join(map(str, value))
    return fmt.format(value)


def print_rows(table: list[dict], first: bool) -> None:
    if first:
        print("| " + " | ".join(title for _, title, _ in COLUMNS) + " |")
        print("|" + "|".join("---:" for _ in COLUMNS) + "|")
    for rank, row in enumerate(table):
        row = {**row, "rank": rank}
        print("| " + " | ".join(_cell(key, fmt, row) for key, _, fmt in COLUMNS) + " |", flush=True)


def targets(args, summaries: list[dict]) -> list[tuple[str, list[str], bool]]:
    """(target, per-rank value, met) for each target."""
    out = []
    grown = [s["after"]["allocated_mib"] - s["before"]["allocated_mib"] for s in summaries]
    what = "allocated CUDA memory" if args.device == "cuda" else "live tensor storage (CPU)"
    out.append(
        (
            f"{what} after the loop within {args.memory_slack:g} MiB of before it",
            [
                f"{g:+.1f} MiB ({s['before']['allocated_mib']:.1f} -> {s['after']['allocated_mib']:.1f})"
                for g, s in zip(grown, summaries)
            ],
            all(g <= args.memory_slack for g in grown),
        )
    )
    out.append(
        (
            f"live tensors after the loop at most {args.tensor_slack} more than before it",
            [f"{s['before']['live_tensors']} -> {s['after']['live_tensors']}" for s in summaries],
            all(s["after"]["live_tensors"] <= s["before"]["live_tensors"] + args.tensor_slack for s in summaries),
        )
    )
    out.append(
        (
            "plans held at most the runtime's bound",
            [f"{s['after']['plans']} (bound {s['after']['plan_bound']})" for s in summaries],
            all(s["after"]["plans"] <= s["after"]["plan_bound"] for s in summaries),
        )
    )
    out.append(
        (
            "no process group alive after its destroy_process_group",
            [f"{s['after']['groups_alive']} of {s['after']['groups_destroyed']}" for s in summaries],
            all(s["after"]["groups_alive"] == 0 for s in summaries),
        )
    )
    unchecked = " (not checked with --recompile-on-rebuild: torch's growth)" if args.recompile_on_rebuild else ""
    slopes = [("rss_slope", "the resident set (RSS)")]
    if args.device == "cuda":
        slopes.append(("allocated_slope", "allocated CUDA memory"))
    for key, what in slopes:
        out.append(
            (
                f"{what} after step {args.warmup_steps}: slope at most {args.rss_slope_bound:g} KiB per 1000 steps"
                + unchecked,
                [
                    "-" if s[key] is None else f"{s[key]:+.1f} KiB / 1000 steps ({s['samples']} samples)"
                    for s in summaries
                ],
                bool(unchecked) or all(s[key] is not None and s[key] <= args.rss_slope_bound for s in summaries),
            )
        )
    out.append(
        (
            f"no hang: every step within {args.step_timeout:g} s",
            [f"{args.steps} steps in {s['seconds']:.0f} s" for s in summaries],
            True,  # a hang ends the run before the summary (see Watchdog)
        )
    )
    out.append(
        (
            f"float64 checks through the current group within {CHECK_TOL:g}",
            [f"{s['worst_check']:.2e}" for s in summaries],
            all(s["worst_check"] <= CHECK_TOL for s in summaries),
        )
    )
    return out


def print_header(args, argv: list[str]) -> None:
    import torch

    import vtp_runtime as vtp

    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"# vtp_runtime soak: {args.steps} steps on {args.world} ranks ({device})")
    print()
    print(f"- command: `python benchmarks/soak.py {' '.join(argv)}`")
    print(
        f"- vtp_runtime {vtp.__version__}, torch {torch.__version__}, {datetime.date.today().isoformat()}; gloo ranks, "
        f"{args.device} tensors{' on one GPU' if args.device == 'cuda' else ''}; VTP_CHECK={args.check or '(unset)'}"
        + (f"; CUDA_MODULE_LOADING={args.cuda_module_loading.upper()}" if args.device == "cuda" else "")
    )
    print(
        f"- per step: one op of {', '.join(OPS)} (in turn) on {', '.join(FORMS)} inputs (in turn; compiled: "
        f"torch.compile(backend={args.compile_backend!r}, fullgraph={args.fullgraph}, dynamic=True)), forward + "
        f"backward; N random in {args.tokens[0]}..{args.tokens[1]}; V={args.vocab}, H={args.hidden}, {args.dtype}, "
        f"backend={args.backend or 'dispatch'}"
    )
    print(
        f"- the TP group rebuilt every {args.rebuild_every} steps (new_group, use, destroy_process_group, drop); "
        f"rank 0 makes a group-less call every {args.local_every} step(s)"
    )
    print(
        "- the compiled form "
        + (
            "on the rebuilt group, compiled again at every rebuild (--recompile-on-rebuild)"
            if args.recompile_on_rebuild
            else "on a group made once for the job, compiled once per shape family"
        )
        + f"; RSS sampled every {args.sample_every} steps"
        + (", each sample after malloc_trim(0)" if args.malloc_trim else "")
        + f", its slope fitted from step {args.warmup_steps} on"
    )
    if args.device == "cpu":
        print('- on the CPU, "allocated" is the bytes of the live tensors\' storages')
    print()


def print_targets(args, summaries: list[dict]) -> bool:
    rows = targets(args, summaries)
    print()
    print("| target | " + " | ".join(f"rank {r}" for r in range(len(summaries))) + " | verdict |")
    print("|---|" + "---|" * len(summaries) + "---|")
    for what, values, met in rows:
        print(f"| {what} | " + " | ".join(values) + f" | {'met' if met else '**missed**'} |")
    missed = [what for what, _, met in rows if not met]
    print()
    print(
        "graphs compiled: "
        + ", ".join(f"rank {r}: {s['graphs']}" for r, s in enumerate(summaries))
        + f"; plans held at the end of the loop: see the last table row (bound {summaries[0]['after']['plan_bound']})"
    )
    print(
        "plans per cache at the end of the loop (the eager forms' group / the compiled form's group / no group): "
        + "; ".join(f"rank {r}: {' / '.join(map(str, s['plan_caches']))}" for r, s in enumerate(summaries))
    )
    if any(s["pinned_slope"] is not None for s in summaries):
        kib = "{:+.1f}".format
        print(
            "pinned host memory (torch's CUDA caching host allocator) after warm-up, KiB / 1000 steps: "
            + "; ".join(
                f"rank {r}: pinned {kib(s['pinned_slope'])}, the RSS less it {kib(s['rss_less_pinned_slope'])}"
                for r, s in enumerate(summaries)
                if s["pinned_slope"] is not None
            )
        )
    for r, s in enumerate(summaries):
        growth = ", ".join(f"{name} +{n}" for name, n in s["grown_types"]) or "none"
        print(f"\nrank {r}: object types grown most from step {args.warmup_steps} to the end: {growth}")
        for where, kib in s["grown_lines"]:
            print(f"- {where}: {kib:+.1f} KiB")
        for at, rise, ran in s["rises"]:
            print(f"- RSS +{rise / 2**20:.1f} MiB by step {at} (its last call: {ran})")
    print()
    print("result: all targets met" if not missed else "result: MISSED: " + "; ".join(missed), flush=True)
    return not missed


# -- the driver ------------------------------------------------------------------------------


def parse(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda", help="tensors' device (default cuda)")
    p.add_argument("--steps", type=positive_int, default=10_000, help="steps of the loop (default 10000)")
    p.add_argument("--world", type=positive_int, default=2, help="ranks (default 2)")
    p.add_argument("--tokens", default=None, help="LO,HI of the random token count (default 1,8192; CPU 1,48)")
    p.add_argument("--vocab", type=int, default=None, help="global vocabulary (default 151936; CPU 384)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size of the Head inputs (default 1024; CPU 32)")
    p.add_argument("--dtype", default=None, help="logits and Head dtype (default bfloat16; CPU float32)")
    p.add_argument(
        "--rebuild-every", type=positive_int, default=500, help="steps between TP group rebuilds (default 500)"
    )
    p.add_argument("--report-every", type=positive_int, default=1000, help="steps between reports (default 1000)")
    p.add_argument(
        "--local-every", type=positive_int, default=1, help="steps between rank 0's group-less calls (default 1)"
    )
    p.add_argument(
        "--recompile-on-rebuild",
        action="store_true",
        help="run the compiled form on the rebuilt group, compiling it again at every rebuild\n"
        "(measures what torch retains of dropped compilations; the slope targets are then not checked)",
    )
    p.add_argument("--sample-every", type=positive_int, default=50, help="steps between RSS samples (default 50)")
    p.add_argument(
        "--warmup-steps",
        type=non_negative_int,
        default=None,
        help="steps before the slopes are fit (default steps/5)",
    )
    p.add_argument(
        "--rss-slope-bound",
        type=float,
        default=256.0,
        help="KiB per 1000 steps the RSS (and on CUDA allocated memory) may grow after warm-up (default 256)",
    )
    p.add_argument(
        "--tracemalloc", action="store_true", help="trace allocations after warm-up: report the lines that grew most"
    )
    p.add_argument("--backend", default=None, help="force a vtp backend (default: dispatch chooses)")
    p.add_argument("--compile-backend", default="aot_eager", help="torch.compile backend (default aot_eager)")
    p.add_argument("--no-fullgraph", dest="fullgraph", action="store_false", help="compile with graph breaks allowed")
    p.add_argument("--check", default="once", help="VTP_CHECK on every rank (default once; '' leaves it unset)")
    p.add_argument("--step-timeout", type=float, default=120.0, help="seconds a step may take (default 120)")
    p.add_argument("--memory-slack", type=float, default=None, help="MiB allocated memory may grow (default 64; CPU 1)")
    p.add_argument("--tensor-slack", type=int, default=16, help="how many live tensors may be added (default 16)")
    p.add_argument(
        "--max-plans",
        type=positive_int,
        default=None,
        help="bound of every runtime cache (plans per generation, direct plans, plain option forms, dispatch's "
        "selections; default the runtime's): a lower bound makes the caches fill and turn over within the "
        "warm-up, so the RSS slope after it measures a job whose caches are full",
    )
    p.add_argument(
        "--malloc-trim",
        action="store_true",
        help="before each RSS sample, return the C heap's free pages to the system (glibc malloc_trim): "
        "the slope then counts memory in use, not pages the allocator keeps for reuse",
    )
    p.add_argument(
        "--cuda-module-loading",
        choices=("eager", "lazy"),
        default="eager",
        help="CUDA_MODULE_LOADING of the ranks (default eager): lazily, the driver loads a kernel's module into "
        "host memory the first time the kernel runs, which can fall after warm-up (a shape that picks a new "
        "cuBLAS kernel) and steps the RSS by megabytes that are the driver's, bounded by the libraries' kernels",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    args.tokens = tuple(int(x) for x in (args.tokens or ("1,48" if cpu else "1,8192")).split(","))
    args.vocab = args.vocab or (384 if cpu else 151936)
    args.hidden = args.hidden or (32 if cpu else 1024)
    args.dtype = args.dtype or ("float32" if cpu else "bfloat16")
    if args.memory_slack is None:  # the CPU's sizes are a thousandth of the GPU's
        args.memory_slack = 1.0 if cpu else 64.0
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 5
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("soak.py --device cuda needs a CUDA GPU; pass --device cpu", file=sys.stderr)
            return 2
        if os.environ.get("TRITON_INTERPRET") == "1":
            print(
                "soak.py --device cuda: unset TRITON_INTERPRET (the Triton interpreter is for CPU tensors)",
                file=sys.stderr,
            )
            return 2
    if args.device == "cuda":  # read by each rank's driver when it starts (the ranks are spawned)
        os.environ["CUDA_MODULE_LOADING"] = args.cuda_module_loading.upper()
    print_header(args, argv)
    from vtp_runtime.testing.distributed import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, args.world, port, args, results)) for r in range(args.world)]
    for p in procs:
        p.start()
    summaries = None
    while summaries is None:
        try:
            summaries = results.get(timeout=1.0)
        except queue.Empty:  # did a rank end without a summary?
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed or all(p.exitcode is not None for p in procs):
                break
    if summaries is None:  # a rank failed or hung: end the others
        time.sleep(2.0)
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        print(f"\nresult: MISSED: a rank ended before the loop did (exit codes {codes}; see stderr)", flush=True)
        return 1
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return 0 if print_targets(args, summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
