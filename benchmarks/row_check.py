"""What the TRL trainers' per-step row check costs: ``check_same_rows`` on a GRPO-like batch
(prompt and completion ids and masks, int64 and int32) over a TP group, timed per call.

    torchrun --nproc-per-node 2 benchmarks/row_check.py            # NCCL on 2 GPUs (gloo on CPU)
    torchrun --nproc-per-node 2 benchmarks/row_check.py --rows 64 --tokens 8192

Prints the median and the 10th-90th percentiles over ``--calls`` calls (after 20 warm-up
calls) on rank 0: wall time per call, including the host's wait for the device that reading
the gathered table needs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from vtp_runtime.integrations.trl import check_same_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16, help="rows of the batch")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt + completion tokens per row")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    g = torch.Generator().manual_seed(0)  # the same batch on every rank
    prompt, completion = args.tokens // 4, args.tokens - args.tokens // 4
    batch = {
        "prompt_ids": torch.randint(0, 151936, (args.rows, prompt), generator=g),
        "prompt_mask": torch.ones(args.rows, prompt, dtype=torch.int32),
        "completion_ids": torch.randint(0, 151936, (args.rows, completion), generator=g),
        "completion_mask": torch.ones(args.rows, completion, dtype=torch.int32),
    }
    batch = {k: v.to(device) for k, v in batch.items()}
    group = dist.group.WORLD
    times = []
    for i in range(20 + args.calls):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        check_same_rows(batch, group, "row_check")
        if i >= 20:
            times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        q = statistics.quantiles(times, n=10)
        print(
            f"check_same_rows, TP={dist.get_world_size()}, {args.rows} rows x {args.tokens} tokens, {device.type}: "
            f"median {statistics.median(times) * 1e6:.0f} us (p10 {q[0] * 1e6:.0f}, p90 {q[-1] * 1e6:.0f})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
