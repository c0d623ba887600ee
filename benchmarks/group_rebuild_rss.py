"""The resident set of a job that rebuilds its TP group with torch alone (no vtp_runtime
call): the control for ``soak.py``'s RSS slope, measured with its helpers.

    python benchmarks/group_rebuild_rss.py [--device cuda|cpu] [--rebuilds 200] [--every 20]

Two gloo ranks (on CUDA, both on GPU 0, as the soak runs them) repeat what the soak does at
each rebuild, with torch alone: ``new_group``, one all-reduce of a small tensor through it,
``destroy_process_group(group)``, drop it. Every ``--every`` rebuilds each rank prints its
RSS; at the end, the RSS growth per rebuild fitted over the second half (a least-squares
line), which is what a soak that rebuilds its group every 500 steps adds per 1000 steps
twice over. The object types that grew over the second half (``soak.py``'s count) are
printed too: a type the soak shows growing that grows here alike is torch's, not vtp's.
"""

from __future__ import annotations

import argparse
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from soak import grown, rss_bytes, slope_per_1000, type_counts


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    x = torch.ones(4, device=device)
    samples: list[tuple[int, float]] = []  # (rebuilds so far, RSS bytes)
    types_before = None
    for i in range(args.rebuilds + 1):
        if i == args.rebuilds // 2:
            types_before = type_counts()
        if i % args.every == 0:
            samples.append((i, rss_bytes()))
            if rank == 0:
                print(f"rebuild {i:5d}: RSS {samples[-1][1] / 2**20:.1f} MiB", flush=True)
        group = dist.new_group(list(range(world)))
        dist.all_reduce(x, group=group)
        dist.destroy_process_group(group)
        del group
    per_1000 = slope_per_1000(samples[len(samples) // 2 :])
    fitted = "too few samples" if per_1000 is None else f"{per_1000 / 1000:+.1f} KiB per rebuild"
    print(
        f"rank {rank}: RSS {samples[0][1] / 2**20:.1f} -> {samples[-1][1] / 2**20:.1f} MiB; "
        f"fitted over the second half: {fitted}",
        flush=True,
    )
    growth = ", ".join(f"{name} +{n}" for name, n in grown(types_before, type_counts()))
    print(f"rank {rank}: object types grown most over the second half: {growth or 'none'}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rebuilds", type=int, default=200)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(args.world, port, args), nprocs=args.world)


if __name__ == "__main__":
    main()
