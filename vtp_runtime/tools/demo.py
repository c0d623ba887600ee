"""``vtp-runtime demo``: distil, then fine-tune, a vocabulary-sharded student LM head.

Spawns TP ranks (gloo on CPU; NCCL when there are at least as many GPUs), shards a small
student output head over the vocabulary as a ``VocabParallelHead`` (torch.chunk's split:
uneven when V is not a multiple of TP) and a frozen teacher head the same way, trains the
student with vocabulary-parallel JSD and then cross entropy (label smoothing, ignored
labels) straight from the hidden states through the fused head (``vtp.Head``: the logits
never exist in full), and checks every step's loss, weight gradient and hidden gradient
(complete on every rank) against a float64 dense computation on the full, unsharded head,
and the weights against the same SGD run in float64. Exits non-zero when a deviation
passes the tolerance.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from vtp_runtime.cli_flags import non_negative_float, non_negative_int, positive_float, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=positive_int, default=2, help="tensor-parallel ranks to spawn (default 2)")
    parser.add_argument("--vocab", type=positive_int, default=1531, help="global vocabulary size (default 1531)")
    parser.add_argument("--hidden", type=positive_int, default=64, help="hidden size of the head (default 64)")
    parser.add_argument("--tokens", type=positive_int, default=384, help="tokens per step (default 384)")
    parser.add_argument("--jsd-steps", type=non_negative_int, default=20, help="distillation steps (default 20)")
    parser.add_argument("--ce-steps", type=non_negative_int, default=20, help="cross-entropy steps (default 20)")
    parser.add_argument(
        "--lr-jsd", type=positive_float, default=100.0, help="SGD learning rate while distilling (default 100)"
    )
    parser.add_argument(
        "--lr-ce", type=positive_float, default=2.0, help="SGD learning rate for cross entropy (default 2)"
    )
    parser.add_argument(
        "--tolerance",
        type=non_negative_float,
        default=1e-4,
        help="largest relative deviation from float64 allowed (default 1e-4)",
    )


def shard_sizes(vocab: int, world: int) -> list[int]:
    """V_local per rank under VocabParallelHead's split (torch.chunk's)."""
    from vtp_runtime.nn import shard_bounds

    return [end - start for start, end in (shard_bounds(vocab, world, r) for r in range(world))]


def _train(rank: int, world: int, group, cfg: dict) -> dict:
    import vtp_runtime as vtp
    from vtp_runtime.comm import all_gather_stack
    from vtp_runtime.testing.reference import values_and_grads

    device = torch.device(f"cuda:{rank}") if cfg["nccl"] else torch.device("cpu")
    group = group if world > 1 else None
    vocab, d, n = cfg["vocab"], cfg["hidden"], cfg["tokens"]
    sizes = shard_sizes(vocab, world)
    g = torch.Generator().manual_seed(1234)  # same full tensors on every rank
    teacher_full = torch.randn(vocab, d, generator=g) * (3 / math.sqrt(d))
    student_full = torch.randn(vocab, d, generator=g) * (1 / math.sqrt(d))
    hidden = torch.randn(n, d, generator=g)
    with torch.no_grad():
        labels = torch.multinomial(torch.softmax(hidden @ teacher_full.T, -1), 1, generator=g).squeeze(1)
    labels[torch.rand(n, generator=g) < 0.1] = -100  # padding / prompt tokens

    dense = student_full.double().clone()  # the same training, float64, unsharded
    worst_weight = 0.0
    lm_head = vtp.VocabParallelHead.from_full(student_full.to(device), tp_group=group)  # this rank's shard
    start, end = lm_head.vocab_start, lm_head.vocab_end
    student = lm_head.weight
    teacher = teacher_full[start:end].to(device)
    h, y = hidden.to(device, copy=True).requires_grad_(True), labels.to(device)
    steps = [("jsd", dict(beta=0.5))] * cfg["jsd_steps"] + [("cross_entropy", dict(label_smoothing=0.1))] * cfg[
        "ce_steps"
    ]
    worst_loss = worst_grad = 0.0
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    backend_of: dict[str, str] = {}
    for step, (op, opts) in enumerate(steps, 1):
        # the fused head: no [n, V_local] logits tensor; the teacher is a frozen Head
        args = (lm_head(h), vtp.Head(h.detach(), teacher)) if op == "jsd" else (lm_head(h), y)
        if op not in backend_of:
            backend_of[op] = (
                vtp.explain(op, *args, tp_group=group, reduction="mean", gather=True, **opts).backend or "-"
            )
        loss = vtp.loss(op, *args, tp_group=group, reduction="mean", **opts)
        grad, h_grad = torch.autograd.grad(loss, [student, h])

        # float64 dense reference on the full head, at the same weights
        rows = max(sizes)
        padded = torch.zeros(rows, d, device=device)
        padded[: end - start] = student.detach()
        gathered = all_gather_stack(padded, group).cpu().double()
        w_full = torch.cat([gathered[r, : sizes[r]] for r in range(world)])
        h64 = hidden.double()
        full = (h64 @ w_full.T,) + ((h64 @ teacher_full.double().T,) if op == "jsd" else ())
        count = int((labels != -100).sum()) if op == "cross_entropy" else n
        index = labels if op == "cross_entropy" else None
        ref_vals, (ref_dlogits, *_) = values_and_grads(
            op,
            full,
            index,
            torch.full((n,), 1.0 / count, dtype=torch.float64),
            needs_grad=(True,) + ((False,) if op == "jsd" else ()),
            **opts,
        )
        assert ref_dlogits is not None  # needs_grad[0] is True
        ref_loss = ref_vals.sum() / count
        ref_grad = (ref_dlogits.T @ h64)[start:end]
        ref_h_grad = ref_dlogits @ w_full  # over the whole vocabulary: complete on every rank
        dev_loss = abs(loss.item() - ref_loss.item()) / max(1.0, abs(ref_loss.item()))
        dev_grad = max(
            ((got.cpu().double() - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()
            for got, want in ((grad, ref_grad), (h_grad, ref_h_grad))
        )
        dev = torch.tensor([dev_loss, dev_grad], dtype=torch.float64, device=device)
        if group is not None:
            torch.distributed.all_reduce(dev, op=torch.distributed.ReduceOp.MAX, group=group)
        worst_loss, worst_grad = max(worst_loss, dev[0].item()), max(worst_grad, dev[1].item())
        first.setdefault(op, loss.item())
        last[op] = loss.item()
        lr = cfg["lr_jsd" if op == "jsd" else "lr_ce"]
        with torch.no_grad():
            student.sub_(lr * grad)
        # the dense float64 run takes its own step: the trajectories must stay together
        d_vals, (d_dlogits, *_) = values_and_grads(
            op,
            (h64 @ dense.T,) + full[1:],
            index,
            torch.full((n,), 1.0 / count, dtype=torch.float64),
            needs_grad=(True,) + ((False,) if op == "jsd" else ()),
            **opts,
        )
        assert d_dlogits is not None
        dense -= lr * (d_dlogits.T @ h64)
        mine = student.detach().cpu().double()
        wdev = torch.tensor(
            (mine - dense[start:end]).abs().max().item() / dense.abs().max().item(), dtype=torch.float64, device=device
        )
        if group is not None:
            torch.distributed.all_reduce(wdev, op=torch.distributed.ReduceOp.MAX, group=group)
        worst_weight = max(worst_weight, wdev.item())
        if rank == 0:
            print(
                f"{step:5d}  {op:14s} {loss.item():10.6f}  {backend_of[op]:8s} "
                f"{dev[0].item():10.2e} {dev[1].item():10.2e}",
                flush=True,
            )
    return {
        "loss": worst_loss,
        "grad": worst_grad,
        "weight": worst_weight,
        "first": first,
        "last": last,
        "backends": backend_of,
    }


def run(args: argparse.Namespace) -> int:
    from vtp_runtime.testing.distributed import RankPool

    if args.vocab < args.tp:
        print(f"vtp-runtime demo: --vocab {args.vocab} is smaller than --tp {args.tp}", file=sys.stderr)
        return 2
    if args.jsd_steps + args.ce_steps == 0:
        print("vtp-runtime demo: --jsd-steps and --ce-steps are both 0: nothing to check", file=sys.stderr)
        return 2
    nccl = args.tp > 1 and torch.cuda.is_available() and torch.cuda.device_count() >= args.tp
    sizes = shard_sizes(args.vocab, args.tp)
    transport = "NCCL on GPUs" if nccl else "gloo on CPU"
    print(
        f"vtp-runtime demo: {args.tp} ranks over {transport}; vocabulary {args.vocab} split by VocabParallelHead "
        f"(torch.chunk's split) as {sizes}; hidden {args.hidden}; {args.tokens} tokens per step"
    )
    print(
        f"{args.jsd_steps} steps of vocabulary-parallel JSD (beta=0.5) against a frozen teacher head, then "
        f"{args.ce_steps} of cross entropy (label smoothing 0.1, 10% ignored labels), straight from the hidden "
        f"states (vtp.Head); each step's loss and weight and hidden gradients checked against float64 on the "
        f"unsharded head\n"
    )
    print(f"{'step':>5s}  {'op':14s} {'loss':>10s}  {'backend':8s} {'dev loss':>10s} {'dev grad':>10s}", flush=True)
    cfg = dict(
        vocab=args.vocab,
        hidden=args.hidden,
        tokens=args.tokens,
        jsd_steps=args.jsd_steps,
        ce_steps=args.ce_steps,
        lr_jsd=args.lr_jsd,
        lr_ce=args.lr_ce,
        nccl=nccl,
    )
    started = time.perf_counter()
    pool = RankPool(args.tp, backend="nccl" if nccl else "gloo")
    try:
        results = pool.run(_train, cfg, timeout=600)
    finally:
        pool.close()
    r = results[0]
    worst = max(r["loss"], r["grad"], r["weight"])
    print()
    for op in r["first"]:
        print(f"{op}: loss {r['first'][op]:.4f} -> {r['last'][op]:.4f} (backend {r['backends'][op]})")
    verdict = "PASS" if worst <= args.tolerance else "FAIL"
    print(
        f"largest deviation from the float64 dense reference over all steps and ranks: loss {r['loss']:.2e}, "
        f"weight and hidden gradients {r['grad']:.2e}; weights after SGD vs the same training in float64 on the "
        f"unsharded head {r['weight']:.2e} (relative; tolerance {args.tolerance:g}) -> {verdict} "
        f"in {time.perf_counter() - started:.1f} s"
    )
    return 0 if verdict == "PASS" else 1
