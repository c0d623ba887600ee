"""The one-launch decode kernel (TP = 1 argmax / sample) under launch configurations: its tile
(``LaunchConfig.decode_block``), warps and rows per program, µs per call of the kernel alone
(wall, back to back, the launch included), at decode sizes. A configuration ``BLOCKxWARPSxROWS``
sets both tiles: the plain draw's (``decode_block``) and the bisecting draws' (top-k, top-p:
``decode_bisect_block``).

    python benchmarks/decode_tiles.py                                   # N = 1, 8, 64, V = 151936
    python benchmarks/decode_tiles.py --device cpu --vocab 64 --tokens 1 --reps 2 --configs 16x1x1

Each program walks its rows' whole vocabulary once per pass (the row max, each bisection step
of top-k and top-p, the draw), so at N <= 8 a pass is bound by one program's latency per tile:
fewer, larger tiles are the lever, until the registers spill.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--configs", default="4096x8x1,8192x8x1,8192x16x1,16384x16x1,16384x32x1,4096x4x2")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("decode_tiles.py needs a CUDA GPU; --device cpu runs a smoke run", file=sys.stderr)
        return 2
    from vtp_runtime import plans
    from vtp_runtime.backends.triton import sampling as triton_sampling
    from vtp_runtime.backends.triton.backend import TritonBackend
    from vtp_runtime.invocation import Invocation
    from vtp_runtime.tools.bench_sample import TOP_K, TOP_P, decode_logits, wall_us

    arms: dict[str, tuple[str, dict[str, Any]]] = {
        "argmax": ("argmax", {}),
        "sample": ("sample", {"seed": 1}),
        "top_k": ("sample", {"seed": 1, "top_k": TOP_K}),
        "top_p": ("sample", {"seed": 1, "top_p": TOP_P}),
    }
    rows = []
    for n in [int(t) for t in args.tokens.split(",")]:
        x = decode_logits(n, args.vocab, args.device, torch.bfloat16)
        base = TritonBackend().config_for(x.device)
        for name, (op, options) in arms.items():
            given = {"backend": "triton", **options}
            call = plans.plan_for(Invocation(op, (x,), given)).call(None, given)
            expected = None
            for spec in args.configs.split(","):
                block, warps, per_program = (int(v) for v in spec.split("x"))
                cfg = dataclasses.replace(
                    base,
                    decode_block=block,
                    decode_warps=warps,
                    decode_bisect_block=block,
                    decode_bisect_warps=warps,
                    decode_rows=per_program,
                )
                ids = triton_sampling.decode(cfg, call, x)
                expected = ids if expected is None else expected
                same = bool(torch.equal(ids, expected))
                us = wall_us(lambda c=cfg, k=call, z=x: triton_sampling.decode(c, k, z), args.warmup, args.reps)
                rows.append({"tokens": n, "arm": name, "config": spec, "us": us, "same_ids": same})
                print(f"N={n:<3d} {name:7s} {spec:>12s} {us:9.1f} µs{'' if same else '  IDS DIFFER'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
