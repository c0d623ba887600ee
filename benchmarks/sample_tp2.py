"""Decode-time sampling at TP = 2: two processes sharing one GPU over a gloo group (CUDA
tensors), each holding half of the vocabulary; wall µs per call, back to back, beside torch's
draws on the full logits in the same run.

    python benchmarks/sample_tp2.py                       # N = 1, 8, 64, V = 151936, bf16
    python benchmarks/sample_tp2.py --device cpu --vocab 64 --reps 3 --warmup 1   # a smoke run

Each vtp arm runs on both ranks at once (the time is rank 0's; the ranks wait for each other
in every call's collectives); the torch arms run on rank 0 alone on the full logits (rank 1
waits at a barrier), as ``python -m vtp_runtime.tools.bench_sample`` times them at TP = 1.
The ``gloo all-gather`` arm is the floor of any draw at TP > 1 here: one bare all-gather of a
decode-sized payload (``N`` rows of four float32 fields) over the same group, the one
collective an argmax or a plain draw makes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vtp_runtime.comm import all_gather_stack
from vtp_runtime.tools.bench_sample import decode_arms, decode_logits, decode_table, peer_decode_arms, wall_us


def _rank(rank: int, args: argparse.Namespace, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.group.WORLD
        tokens = [int(t) for t in args.tokens.split(",") if t]
        half = args.vocab // 2
        bounds = (0, half) if rank == 0 else (half, args.vocab)
        times: dict[tuple[int, str], float] = {}
        for n in tokens:
            x = decode_logits(n, args.vocab, args.device, getattr(torch, args.dtype))
            z = x[:, bounds[0] : bounds[1]].contiguous()
            for name, fn in decode_arms(z, group, bounds).items():
                times[(n, name)] = wall_us(fn, args.warmup, args.reps)
            payload = torch.zeros(n * 4, dtype=torch.float32, device=z.device)
            floor = lambda p=payload: all_gather_stack(p, group)  # noqa: E731
            times[(n, "gloo all-gather")] = wall_us(floor, args.warmup, args.reps)
            if rank == 0:
                for name, fn in peer_decode_arms(x).items():
                    times[(n, name)] = wall_us(fn, args.warmup, args.reps)
            dist.barrier()
        if rank == 0:
            out.update({f"{n}|{a}": t for (n, a), t in times.items()})
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("sample_tp2.py needs a CUDA GPU; --device cpu runs a smoke run", file=sys.stderr)
        return 2
    if args.device == "cpu":  # before the ranks import triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(args, args.port, out), nprocs=2, join=True)
        found = dict(out)
    times = {(int(key.split("|")[0]), key.split("|")[1]): t for key, t in found.items()}
    tokens = [int(t) for t in args.tokens.split(",") if t]
    print(decode_table(times, tokens, f"TP=2 (two processes, one {args.device}, gloo), V={args.vocab}, {args.dtype}"))
    if args.json:
        with open(args.json, "w") as f:
            rows = [{"tokens": n, "arm": a, "us": t} for (n, a), t in times.items()]
            json.dump({"mode": "decode", "tp": 2, "argv": sys.argv, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
