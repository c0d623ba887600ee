"""The sequence-parallel head (Megatron SP) against gathering the hidden states by hand.

    python benchmarks/sequence_parallel.py --json $OUT/sp_gloo.json   # TP=2: two processes on one GPU, gloo
    python benchmarks/sequence_parallel.py --nccl --json $OUT/sp_nccl.json   # TP=2 over NCCL, two GPUs
    python benchmarks/sequence_parallel.py --cpu                      # the same steps, tiny, gloo on CPU

Each TP rank holds N / TP of the N tokens of its TP group (``[N / TP, H]`` hidden states, as
Megatron's sequence parallelism leaves them) and its vocabulary shard of the head. One step
is a forward + backward of the op (bf16, reduction "mean") with gradients to this rank's
hidden rows and its weight shard:

- ``sp_head``: ``vtp.cross_entropy(vtp.Head(h, W, sequence_parallel=True), labels,
  tp_group=g)``: each token chunk's hidden rows all-gathered as it goes (the next chunk's
  gather in flight during this one's matmuls), their gradient reduce-scattered chunk by chunk.
- ``gather_by_hand``: what a Megatron-SP user writes today: all-gather the ``[N, H]``
  hidden states (Megatron's ``gather_from_sequence_parallel_region``, whose backward
  reduce-scatters the gradient), then ``vtp.Head(full, W, reduce_hidden_grad=False)``.

``--op jsd`` runs the JSD against a frozen teacher head instead (sequence-parallel in the
first arm, gathered by hand in the second). Reported per arm: the median time of ``--reps``
steps and the peak memory allocated during a step above what it starts with (the inputs),
both the maximum over the ranks, and the largest difference of the loss and gradients
between the arms. With two processes on one GPU (the default) both ranks' kernels share the
device and gloo stages every collective through the host: the arms compare with each
other, not with NCCL numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

for _var, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ[_var] = _value

import torch  # noqa: E402

ARMS = ("sp_head", "gather_by_hand")


class _GatherTokens(torch.autograd.Function):
    """Megatron's gather_from_sequence_parallel_region: all-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, local, group):
        import torch.distributed as dist

        ctx.group = group
        out = local.new_empty(dist.get_world_size(group) * local.shape[0], *local.shape[1:])
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13: *_single
        gather(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        out = grad.new_empty(grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:])
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


def step(arm, op, h, w, y, ht, wt, group):
    """One forward + backward; returns (loss, grad of h, grad of w)."""
    import vtp_runtime as vtp

    if arm == "sp_head":
        student = vtp.Head(h, w, sequence_parallel=True)
        teacher = None if ht is None else vtp.Head(ht, wt, sequence_parallel=True)
    else:
        student = vtp.Head(_GatherTokens.apply(h, group), w, reduce_hidden_grad=False)
        teacher = None if ht is None else vtp.Head(_GatherTokens.apply(ht, group), wt)
    if op == "cross_entropy":
        loss = vtp.cross_entropy(student, y, reduction="mean", tp_group=group)
    else:
        assert teacher is not None, "jsd needs the teacher's hidden states and weight"
        loss = vtp.jsd(student, teacher, beta=0.5, reduction="mean", tp_group=group)
    gh, gw = torch.autograd.grad(loss, (h, w))
    return loss.detach(), gh, gw


def bench(rank, world, group, op, n, hidden, vocab, reps, warmup, device):
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)  # the same full tensors on every rank
    full_h = torch.randn(n, hidden, device=dev, generator=g, dtype=torch.float32).to(dtype)
    v_local = -(-vocab // world)
    start, end = min(rank * v_local, vocab), min((rank + 1) * v_local, vocab)
    full_w = torch.randn(vocab, hidden, device=dev, generator=g, dtype=torch.float32) * hidden**-0.5
    w = full_w[start:end].to(dtype).contiguous().requires_grad_(True)
    y = torch.randint(0, vocab, (n,), device=dev, generator=g)
    ht = wt = None
    if op == "jsd":
        full_t = (torch.randn(vocab, hidden, device=dev, generator=g, dtype=torch.float32) * hidden**-0.5).to(dtype)
        wt = full_t[start:end].contiguous()
        ht = torch.randn(n, hidden, device=dev, generator=g, dtype=torch.float32).to(dtype)
    del full_w
    rows = n // world
    h = full_h[rank * rows : (rank + 1) * rows].contiguous().requires_grad_(True)
    if ht is not None:
        ht = ht[rank * rows : (rank + 1) * rows].contiguous()
    del full_h

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    out, results = {}, {}
    for arm in ARMS:
        for _ in range(warmup):
            step(arm, op, h, w, y, ht, wt, group)
        sync()
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            step(arm, op, h, w, y, ht, wt, group)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        peak = float("nan")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            results[arm] = step(arm, op, h, w, y, ht, wt, group)
            sync()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        else:
            results[arm] = step(arm, op, h, w, y, ht, wt, group)
        stats = torch.tensor([statistics.median(times), peak], dtype=torch.float64, device=dev)
        torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX, group=group)
        out[arm] = {"ms": stats[0].item(), "peak_gib": stats[1].item()}
    a, b = results["sp_head"], results["gather_by_hand"]
    diff = torch.tensor(
        [((x.float() - z.float()).abs().max() / z.float().abs().max().clamp(min=1e-30)).item() for x, z in zip(a, b)],
        dtype=torch.float64,
        device=dev,
    )
    torch.distributed.all_reduce(diff, op=torch.distributed.ReduceOp.MAX, group=group)
    out["relative_difference"] = dict(zip(("loss", "hidden_grad", "weight_grad"), diff.tolist()))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", default="cross_entropy", choices=("cross_entropy", "jsd"))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8192, help="N: tokens per TP group (default 8192)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nccl", action="store_true", help="one GPU per rank over NCCL (default: one GPU, gloo)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU at tiny sizes, to check the script")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    from vtp_runtime.testing.distributed import RankPool

    device = "cpu" if args.cpu else "cuda"
    if args.cpu:
        args.tokens, args.hidden, args.vocab, args.reps, args.warmup = 96, 32, 301, 2, 1
    elif not torch.cuda.is_available() or (args.nccl and torch.cuda.device_count() < args.tp):
        print(f"needs {f'{args.tp} GPUs' if args.nccl else 'a GPU'}", file=sys.stderr)
        return 2
    backend = "nccl" if args.nccl else "gloo"
    pool = RankPool(args.tp, backend=backend, collective_timeout=300)
    try:
        out = pool.run(
            bench, args.op, args.tokens, args.hidden, args.vocab, args.reps, args.warmup, device, timeout=900
        )[0]
    finally:
        pool.close()
    where = f"TP={args.tp} over {backend} on {'CPU' if args.cpu else 'one GPU' if backend == 'gloo' else 'two GPUs'}"
    print(f"{args.op}, N={args.tokens} per TP group, H={args.hidden}, V={args.vocab}, bf16, {where}")
    print(f"  {'arm':<16} {'ms':>9} {'peak GiB':>9}   (max over ranks)")
    for arm in ARMS:
        print(f"  {arm:<16} {out[arm]['ms']:9.2f} {out[arm]['peak_gib']:9.3f}")
    rel = out["relative_difference"]
    shown = ", ".join(f"{k} {v:.2e}" for k, v in rel.items())
    print(f"  sp_head vs gather_by_hand, largest relative difference: {shown}")
    if args.json:
        record = {"args": vars(args), "torch": torch.__version__, **out}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
