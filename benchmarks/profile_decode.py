"""Where the time of one decode-time call goes, at TP = 1, layer by layer.

    python benchmarks/profile_decode.py [--tokens 1,8,64] [--vocab 151936] [--reps 2000]
        [--device cuda|cpu] [--json PATH]

For ``vtp.argmax`` and ``vtp.sample`` (plain, ``top_k=50``, ``top_p=0.9``) on bf16 logits
``[N, V]``, wall µs per call back to back (the median of five runs, each synchronized once) of:

- ``torch``: the peer (``torch.argmax``; softmax + ``torch.multinomial``; the plain draw's
  peer stands for the others here: ``bench_sample`` has the sort-based top-p);
- ``call``: the whole ``vtp`` call, as a user makes it;
- ``backend``: the backend's ``forward`` on the planned ``Call`` (what is left without the
  pipeline: the plan's key, the output's allocation, the launch);
- ``launch``: the kernel's launch alone into a preallocated output;
- ``empty``: one ``torch.empty`` of the ids (an allocation's floor on this host).

The differences are the layers' shares: ``call - backend`` is the pipeline's Python (input
forms, plan lookup, the ``Call``), ``backend - launch`` the backend's Python around the
launch. Then a cProfile of the whole call at the first row count, by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
from typing import Any

import torch

import vtp_runtime as vtp
from vtp_runtime import plans
from vtp_runtime.backends.triton import sampling as triton_sampling  # the backend's decode path
from vtp_runtime.invocation import Invocation
from vtp_runtime.registry import REGISTRY
from vtp_runtime.tools.bench_sample import decode_logits, wall_us


def median_us(fn, reps: int) -> float:
    """The median of five of ``bench_sample.wall_us``'s runs: wall µs per call back to back."""
    return statistics.median(wall_us(fn, 50, reps) for _ in range(5))


ARMS: dict[str, dict[str, Any]] = {
    "argmax": {},
    "sample": {"seed": 1},
    "top_k": {"seed": 1, "top_k": 50},
    "top_p": {"seed": 1, "top_p": 0.9},
}


def vtp_call(arm: str, x: torch.Tensor):
    """The user's call of ``arm`` on ``x`` (the triton backend)."""
    options = {**ARMS[arm], "backend": "triton"}
    if arm == "argmax":
        return lambda: vtp.argmax(x, **options)
    return lambda: vtp.sample(x, **options)


def layers(arm: str, x: torch.Tensor, reps: int) -> dict[str, float]:
    """Wall µs per call of the peer, the call, the backend's forward, the launch, an empty."""
    dev, n = x.device, x.shape[0]
    op = "argmax" if arm == "argmax" else "sample"
    options = {**ARMS[arm], "backend": "triton"}
    plan = plans.plan_for(Invocation(op, (x,), options))
    call = plan.call(None, options)
    backend: Any = REGISTRY.get("triton")  # the triton backend: its launch configuration too
    decode_plan = triton_sampling.decode_plan(backend.config_for(dev), call, x)
    out = torch.empty(n, dtype=torch.int64, device=dev)
    seed_key = 0 if op == "argmax" else 1
    if op == "argmax":
        peer = lambda: torch.argmax(x, -1)  # noqa: E731
    else:
        peer = lambda: torch.multinomial(torch.softmax(x.float(), -1), 1)  # noqa: E731
    return {
        "torch": median_us(peer, reps),
        "call": median_us(vtp_call(arm, x), reps),
        "backend": median_us(lambda: backend.forward(call, (x,), None, None), reps),
        "launch": median_us(lambda: decode_plan.launch.launch((x, out, seed_key), checked=True), reps),
        "empty": median_us(lambda: torch.empty(n, dtype=torch.int64, device=dev), reps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,8,64")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for n in map(int, args.tokens.split(",")):
        x = decode_logits(n, args.vocab, args.device, torch.bfloat16)
        for arm in ARMS:
            row: dict[str, Any] = {"tokens": n, "arm": arm, **layers(arm, x, args.reps)}
            rows.append(row)
            print(
                f"N={n:3d} {arm:7s} torch {row['torch']:7.1f}  call {row['call']:7.1f}  "
                f"backend {row['backend']:7.1f}  launch {row['launch']:7.1f}  empty {row['empty']:5.1f}  "
                f"pipeline {row['call'] - row['backend']:6.1f}  backend's Python {row['backend'] - row['launch']:6.1f}",
                flush=True,
            )
    n = int(args.tokens.split(",")[0])
    x = decode_logits(n, args.vocab, args.device, torch.bfloat16)
    for arm in ("argmax", "top_p"):
        fn = vtp_call(arm, x)
        for _ in range(50):
            fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.reps):
            fn()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        print(f"\ncProfile, {arm}, N={n}, {args.reps} calls, by own time:\n{text.getvalue()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
