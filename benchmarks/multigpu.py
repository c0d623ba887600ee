"""Multi-GPU validation and benchmark: TP ranks on the GPUs of one host, over NCCL.

    python benchmarks/multigpu.py --tp 2 --json out/tp2.json
    python benchmarks/multigpu.py --tp 4 --json out/tp4.json
    python benchmarks/multigpu.py --tp 2 --cpu        # the same steps on gloo/CPU, small sizes

Steps, all on one rank pool (one process per GPU):
1. correctness: every backend available on the ranks, every op, fp32 and bf16, even,
   uneven and empty shards, against the float64 dense reference (on each rank's slice);
2. training: three SGD updates of a vocabulary-sharded student head under JSD, and the
   ``vtp-runtime demo`` schedule, both against the same training in float64 unsharded;
3. benchmark: per-rank forward+backward time (max over ranks of the median) and peak
   memory, per backend, beside a dense arm that all-gathers both logits and computes a
   TRL-style JSD / torch cross entropy on the full vocabulary.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends): it can take the host's
shared GPUs out of service.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

for _var, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ[_var] = _value

import torch  # noqa: E402


def runnable_backends(device):
    """Backends registered here that declare ``device`` for some op and whose probe passes."""
    from vtp_runtime.registry import REGISTRY

    return [
        name
        for name, b in REGISTRY.backends().items()
        if any(c.device_types is None or device in c.device_types for c in b.ops.values())
        and not b.probe_reasons(device)
    ]


def correctness(rank, world, group, device, vocab, shape):
    import vtp_runtime as vtp
    from vtp_runtime.testing.cases import Case, run_case

    results = []
    for backend in runnable_backends(device):
        for op, opts in [
            ("cross_entropy", (("label_smoothing", 0.1),)),
            ("logprobs", ()),
            ("entropy", ()),
            ("kl", (("reverse", True),)),
            ("jsd", (("beta", 0.3),)),
            ("jsd", (("beta", 0.0),)),
        ]:
            for dtype in ("float32", "bfloat16"):
                for layout in ("even", "uneven", "empty"):
                    case = Case(
                        op,
                        dtype=dtype,
                        layout=layout,
                        options=opts,
                        vocab=vocab,
                        shape=shape,
                        backend=backend,
                        device=device,
                        masked="labels",
                        grads=(True, False),
                    )
                    try:
                        run_case(rank, world, group, case)
                        verdict = "pass"
                    except vtp.BackendUnavailable as exc:
                        verdict = "refused: " + str(exc).splitlines()[-1].strip()
                    except AssertionError as exc:
                        verdict = "FAIL: " + str(exc).splitlines()[0]
                    results.append((backend, case.id, verdict))
    return results


def _median_ms(fn, reps):
    times = []
    for _ in range(3):
        fn()
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def benchmark(rank, world, group, device, vocab, tokens_list, reps):
    import vtp_runtime as vtp
    from vtp_runtime.comm import all_gather_stack

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    v_local = vocab // world
    rows = []
    for n in tokens_list:
        g = torch.Generator(device=dev).manual_seed(rank)
        s = torch.randn(n, v_local, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
        t = torch.randn(n, v_local, device=dev, dtype=torch.bfloat16, generator=g)
        y = torch.randint(rank * v_local, (rank + 1) * v_local, (n,), device=dev)
        arms: dict[str, Callable[[], Any]] = {}
        for backend in runnable_backends(device):
            # each arm binds this step's tensors and backend: they run within the step, but say so
            def jsd_arm(b: str = backend, s: torch.Tensor = s, t: torch.Tensor = t) -> None:
                vtp.jsd(s, t, beta=0.5, tp_group=group, backend=b, reduction="sum").backward()

            def ce_arm(b: str = backend, s: torch.Tensor = s, y: torch.Tensor = y) -> None:
                vtp.cross_entropy(s, y, tp_group=group, backend=b, reduction="sum").backward()

            arms[f"jsd/{backend}"] = jsd_arm
            arms[f"cross_entropy/{backend}"] = ce_arm

        def dense_jsd(s=s, t=t):  # gather both logits, then a TRL-style JSD on the full vocabulary
            full_s = torch.cat(list(all_gather_stack(s.detach(), group).unbind(0)), dim=-1).requires_grad_(True)
            full_t = torch.cat(list(all_gather_stack(t, group).unbind(0)), dim=-1)
            ls, lt = torch.log_softmax(full_s.float(), -1), torch.log_softmax(full_t.float(), -1)
            lm = torch.logsumexp(torch.stack([ls, lt]) + torch.log(torch.tensor(0.5, device=dev)), 0)
            loss = 0.5 * (
                torch.nn.functional.kl_div(lm, lt, log_target=True, reduction="sum")
                + torch.nn.functional.kl_div(lm, ls, log_target=True, reduction="sum")
            )
            loss.backward()

        def dense_ce(s=s, y=y):
            full_s = torch.cat(list(all_gather_stack(s.detach(), group).unbind(0)), dim=-1).requires_grad_(True)
            torch.nn.functional.cross_entropy(full_s.float(), y, reduction="sum").backward()

        arms["jsd/dense-gather"] = dense_jsd
        arms["cross_entropy/dense-gather"] = dense_ce
        for name, fn in arms.items():
            try:
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                ms = _median_ms(fn, reps)
                peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
            except vtp.BackendUnavailable:
                continue
            s.grad = None
            stats = torch.tensor([ms, peak], dtype=torch.float64, device=dev)
            if group is not None:
                torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX, group=group)
            rows.append(
                {
                    "arm": name,
                    "tp": world,
                    "tokens": n,
                    "v_local": v_local,
                    "max_ms": stats[0].item(),
                    "max_peak_gib": stats[1].item(),
                }
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="gloo on CPU at small sizes (to check the script)")
    p.add_argument("--json", help="write all results here")
    args = p.parse_args(argv)
    from vtp_runtime.testing.distributed import RankPool

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and torch.cuda.device_count() < args.tp:
        print(f"needs {args.tp} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    vocab, shape, tokens, reps = (1531, (3, 4), [64], 3) if args.cpu else (32003, (4, 16), [1024, 8192], 20)
    pool = RankPool(args.tp, backend="gloo" if args.cpu else "nccl", collective_timeout=300)
    out = {"tp": args.tp, "device": device}

    def save():  # after every step, so a later step that runs out of time loses nothing
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    failed = []
    try:
        print(f"[1/3] correctness at TP={args.tp} ({device})", flush=True)
        out["correctness"] = pool.run(correctness, device, vocab, shape, timeout=1800)[0]
        failed = [r for r in out["correctness"] if r[2].startswith("FAIL")]
        for backend, case, verdict in out["correctness"]:
            print(f"  {backend:10s} {case:60s} {verdict}")
        save()
        print(f"[3/3] benchmark at TP={args.tp}", flush=True)
        out["bench"] = pool.run(benchmark, device, 151936 if not args.cpu else vocab, tokens, reps, timeout=1800)[0]
        for r in out["bench"]:
            print(
                f"  {r['arm']:28s} N={r['tokens']:5d} V_local={r['v_local']:6d} "
                f"{r['max_ms']:9.3f} ms  {r['max_peak_gib']:6.2f} GiB (max over ranks)"
            )
        save()
    finally:
        pool.close()
    print("[2/3] training parity: 3 SGD updates under JSD, then the demo schedule", flush=True)
    from vtp_runtime.cli import main as cli

    rc_sgd = cli(["demo", "--tp", str(args.tp), "--jsd-steps", "3", "--ce-steps", "0"])
    rc_demo = cli(["demo", "--tp", str(args.tp)])
    out["training"] = {"three_sgd_updates_rc": rc_sgd, "demo_rc": rc_demo}
    save()
    return 1 if failed or rc_sgd or rc_demo else 0


if __name__ == "__main__":
    sys.exit(main())
