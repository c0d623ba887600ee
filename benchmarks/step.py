"""One training step of a small decoder, end to end, with each way of computing its loss.

The model is defined here (no downloads): a Llama-like decoder with an untied output
projection ``W [V, d]``. At the defaults (d=1024, 8 layers, 16 heads, SwiGLU ffn 2752,
V=151936) it has 412.4M parameters, 311M of them in the embedding and ``W``.

A step is the forward pass, the loss of the last hidden states ``h [N, d]`` against labels
``y [N]`` (reduction "mean"), and ``.backward()`` through the whole model (no optimizer;
gradients are set to None between steps). Arms:

- ``torch_fp32``: ``F.cross_entropy((h @ W.T).float(), y)``
- ``vtp_triton``: ``vtp.cross_entropy(h @ W.T, y, backend="triton")`` on the bf16 logits
- ``vtp_head``: ``vtp.cross_entropy(vtp.Head(h, W), y)`` (the fused head, default backend)
- ``vtp_head_lean``: the same with ``chunk_rows=256`` (a ``[256, V]`` chunk buffer, 74 MiB at
  V=151936, for more passes over the weight gradient)
- ``cce``: cut-cross-entropy's ``linear_cross_entropy(h, W, y)`` (CUDA, if installed)
- ``liger``: Liger's ``LigerFusedLinearCrossEntropyLoss`` (CUDA, if installed)

and, on a transformers ``LlamaForCausalLM`` built from a config of the same sizes (untied head,
SDPA attention, ``model(input_ids=tokens, labels=tokens).loss.backward()``; a fresh model of
the same seed per arm), the way users train:

- ``hf_torch``: the unpatched model (transformers' own loss, on fp32 logits)
- ``hf_liger``: after Liger's ``apply_liger_kernel_to_llama(model=model)`` (its RoPE, RMSNorm,
  SwiGLU and fused linear cross entropy; CUDA, if installed)
- ``hf_vtp_loss``: after ``use_vocab_parallel_loss(model)`` (vtp's loss on the bf16 logits)
- ``hf_vtp_fused``: after ``fuse_lm_head(model)`` (the head fused into vtp's loss: no logits)
- ``hf_liger_lce``: Liger's patch with its fused linear cross entropy only (the head alone)
- ``hf_liger_vtp``: Liger's RoPE, RMSNorm and SwiGLU kernels, then ``fuse_lm_head(model)``

Per arm and token count N (``N / seq`` sequences of ``seq`` tokens): the median step time
over ``--reps`` steps after ``--warmup`` (CUDA events; wall clock on CPU), the peak memory
allocated during one step above what was held before it (weights and inputs; CUDA only),
and the loss of the first step. On the GPU:

    python benchmarks/step.py --tokens 8192,32768 --reps 10 --json step.json
    python benchmarks/step.py --tokens 8192 --seq 2048 --reps 10 --json step_hf.json \
        --arms hf_torch,hf_vtp_loss,hf_vtp_fused,hf_liger,hf_liger_lce,hf_liger_vtp
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import vtp_runtime as vtp

ARMS = (
    "torch_fp32",
    "vtp_triton",
    "vtp_head",
    "vtp_head_lean",
    "cce",
    "liger",
    "hf_torch",
    "hf_vtp_loss",
    "hf_vtp_fused",
    "hf_liger",
    "hf_liger_lce",
    "hf_liger_vtp",
)
LIGER_HF = ("hf_liger", "hf_liger_lce", "hf_liger_vtp")
HF_ARMS = tuple(a for a in ARMS if a.startswith("hf_"))
# arms that need a third-party package, and those that run on CUDA only
PACKAGES = {"cce": "cut_cross_entropy", "liger": "liger_kernel", **dict.fromkeys(LIGER_HF, "liger_kernel")}
PACKAGES.update(dict.fromkeys(("hf_torch", "hf_vtp_loss", "hf_vtp_fused"), "transformers"))
CUDA_ONLY = ("cce", "liger", *LIGER_HF)


class Block(nn.Module):
    """Pre-norm attention (causal SDPA, rotary positions) and a SwiGLU MLP."""

    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def rotate(x, cos, sin):
    """Rotary position embedding on ``x [b, heads, s, head_dim]`` (half-split convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, ffn: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Parameter(torch.randn(vocab, dim) * dim**-0.5)  # W [V, d], untied
        for p in self.parameters():
            if p.dim() == 2 and p is not self.lm_head:
                nn.init.normal_(p, std=0.02)
        self.rotary_half = dim // heads // 2

    def hidden(self, tokens):
        """The final-norm hidden states ``[batch, seq, dim]`` of ``tokens [batch, seq]``."""
        # rotary angles in fp32 (a bf16 buffer would round the frequencies), cast like the weights
        half = self.rotary_half
        inv_freq = 10000.0 ** (-torch.arange(half, device=tokens.device, dtype=torch.float32) / half)
        angles = torch.arange(tokens.shape[1], device=tokens.device, dtype=torch.float32)[:, None] * inv_freq
        cos, sin = angles.cos().to(self.lm_head.dtype), angles.sin().to(self.lm_head.dtype)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


def loss_fn(arm: str):
    """``loss(h [N, d], W [V, d], y [N]) -> scalar mean cross entropy`` for one arm."""
    if arm == "torch_fp32":
        return lambda h, w, y: F.cross_entropy((h @ w.T).float(), y)
    if arm == "vtp_triton":
        return lambda h, w, y: vtp.cross_entropy(h @ w.T, y, reduction="mean", backend="triton")
    if arm == "vtp_head":
        return lambda h, w, y: vtp.cross_entropy(vtp.Head(h, w), y, reduction="mean")
    if arm == "vtp_head_lean":
        return lambda h, w, y: vtp.cross_entropy(vtp.Head(h, w, chunk_rows=256), y, reduction="mean")
    if arm == "cce":
        from cut_cross_entropy import linear_cross_entropy

        return lambda h, w, y: linear_cross_entropy(h, w, y)
    if arm == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        return lambda h, w, y: liger(w, h, y)
    raise ValueError(f"no arm {arm!r}; arms: {', '.join(ARMS)}")


def skip_reason(arm: str, device: str) -> str:
    if arm in PACKAGES and importlib.util.find_spec(PACKAGES[arm]) is None:
        return f"skipped: {PACKAGES[arm]} is not installed"
    if arm in CUDA_ONLY and device != "cuda":
        return f"skipped: {arm} runs on CUDA only"
    return ""


def hf_model(arm: str, args, ffn: int):
    """A fresh ``LlamaForCausalLM`` of the decoder's sizes (seed 0), patched as ``arm`` says.
    Liger's patch also rebinds names in transformers' Llama module: they are restored by
    ``restore_llama``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(args.seq, 2048),
        tie_word_embeddings=False,
        # transformers' generated signature omits the keyword arguments every config takes
        attn_implementation="sdpa",  # type: ignore[call-arg]
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(args.device, getattr(torch, args.dtype)).train()
    if arm in LIGER_HF:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        if arm == "hf_liger":
            apply_liger_kernel_to_llama(model=model)
        elif arm == "hf_liger_lce":
            apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, model=model)
        else:
            apply_liger_kernel_to_llama(fused_linear_cross_entropy=False, model=model)
            from vtp_runtime.integrations.transformers import fuse_lm_head

            fuse_lm_head(model)
    elif arm == "hf_vtp_loss":
        from vtp_runtime.integrations.transformers import use_vocab_parallel_loss

        use_vocab_parallel_loss(model)
    elif arm == "hf_vtp_fused":
        from vtp_runtime.integrations.transformers import fuse_lm_head

        fuse_lm_head(model)
    return model


def llama_names():
    """What Liger's patch rebinds in transformers' Llama module, to restore after its arm."""
    from transformers.models.llama import modeling_llama

    return modeling_llama, dict(vars(modeling_llama)), modeling_llama.LlamaForCausalLM.forward


def restore_llama(saved) -> None:
    module, names, forward = saved
    vars(module).update(names)
    module.LlamaForCausalLM.forward = forward


def measure(model, arm: str, tokens, labels, warmup: int, reps: int, profile: int = 0) -> dict:
    """Median step ms, peak GiB above what was held before the step, and the first loss; with
    ``profile``, that many of one step's costliest device kernels printed to stderr."""
    cuda = tokens.device.type == "cuda"
    if arm in HF_ARMS:

        def step():
            value = model(input_ids=tokens, labels=labels).loss
            value.backward()
            return value.detach()

    else:
        loss = loss_fn(arm)
        d = model.lm_head.shape[1]

        def step():
            h = model.hidden(tokens).reshape(-1, d)
            value = loss(h, model.lm_head, labels.reshape(-1))
            value.backward()
            return value.detach()

    first = float(step())  # compiles what the arm compiles, outside the timed steps
    for _ in range(warmup - 1):
        model.zero_grad(set_to_none=True)
        step()
    times = []
    before = torch.cuda.memory_stats() if cuda and profile else {}
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    if cuda and profile:  # the caching allocator's device calls during the timed steps
        after = torch.cuda.memory_stats()
        counts = {k: v - before.get(k, 0) for k, v in after.items() if k.startswith("num_") and v != before.get(k, 0)}
        print(f"{arm}: allocator counters over {reps} steps: {counts or 'unchanged'}", file=sys.stderr)
    peak = None
    if cuda:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    if profile:
        model.zero_grad(set_to_none=True)
        kinds = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=kinds) as prof:
            step()
            if cuda:
                torch.cuda.synchronize()
        table = prof.key_averages()
        for key in ("self_device_time_total", "self_cpu_time_total")[0 if cuda else 1 :]:
            print(f"{arm}: one step, the {profile} first by {key}", file=sys.stderr)
            print(table.table(sort_by=key, row_limit=profile), file=sys.stderr)
    return {"ms": statistics.median(times), "peak_gib": peak, "loss": first}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="8192,32768", help="token counts N per step, comma-separated")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=None, help="SwiGLU width (default 2752 * dim / 1024, a multiple of 64)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--seq", type=int, default=2048, help="sequence length; N / seq sequences per step")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run at tiny sizes (no memory)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--json", help="write the rows and the setup to this file")
    p.add_argument("--profile", type=int, default=0, help="print this many of each arm's costliest kernels (stderr)")
    args = p.parse_args(argv)

    arms = [a for a in args.arms.split(",") if a]
    token_counts = [int(n) for n in args.tokens.split(",") if n]
    bad = [a for a in arms if a not in ARMS] + [f"N={n}" for n in token_counts if n % args.seq and n > args.seq]
    if bad:
        p.error(f"not an arm, or a token count that is not a multiple of --seq {args.seq}: {', '.join(bad)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/step.py needs a CUDA GPU; pass --device cpu for a smoke run at tiny sizes", file=sys.stderr)
        return 2
    ffn = args.ffn or 64 * round(2752 * args.dim / 1024 / 64)
    torch.manual_seed(0)
    if all(a in HF_ARMS for a in arms):  # only counted: each transformers arm builds its own model
        with torch.device("meta"):
            model = Decoder(args.vocab, args.dim, args.layers, args.heads, ffn)
    else:
        model = Decoder(args.vocab, args.dim, args.layers, args.heads, ffn).to(args.device, getattr(torch, args.dtype))
    params = sum(p.numel() for p in model.parameters())
    # the Liger arms rebind names in transformers' Llama module (undone after each): run them last
    arms = sorted(arms, key=lambda a: a in LIGER_HF)
    print(
        f"decoder: {params / 1e6:.1f}M parameters (d={args.dim}, {args.layers} layers, {args.heads} heads, "
        f"ffn {ffn}, V={args.vocab}, {args.dtype}, {args.device})",
        file=sys.stderr,
    )

    rows = []
    for n in token_counts:
        seq = min(args.seq, n)
        g = torch.Generator().manual_seed(n)
        tokens = torch.randint(0, args.vocab, (n // seq, seq), generator=g).to(args.device)
        labels = torch.randint(0, args.vocab, (n // seq, seq), generator=g).to(args.device)
        for arm in arms:
            row = {
                "arm": arm,
                "tokens": n,
                "batch": n // seq,
                "seq": seq,
                "ms": None,
                "peak_gib": None,
                "loss": None,
                "note": skip_reason(arm, args.device),
            }
            if not row["note"]:
                saved = llama_names() if arm in LIGER_HF else None
                subject = None
                try:
                    subject = hf_model(arm, args, ffn) if arm in HF_ARMS else model
                    row.update(measure(subject, arm, tokens, labels, max(args.warmup, 1), args.reps, args.profile))
                except Exception as exc:  # an OOM (or a failing arm) is a result; the next arm runs
                    row["note"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:100]}"
                finally:
                    if subject is not None:
                        subject.zero_grad(set_to_none=True)
                    del subject
                    if saved is not None:
                        restore_llama(saved)
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
            rows.append(row)
            print(f"N={n} {arm}: {row['note'] or 'done'}", file=sys.stderr, flush=True)

    print_table(rows)
    if args.json:
        setup = {
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__,
            "parameters": params,
            "dim": args.dim,
            "layers": args.layers,
            "heads": args.heads,
            "ffn": ffn,
            "vocab": args.vocab,
            "dtype": args.dtype,
            "argv": sys.argv,
        }
        with open(args.json, "w") as f:
            json.dump({**setup, "rows": rows}, f, indent=1)
    return 0


def print_table(rows: list[dict]) -> None:
    def cell(x, spec):
        return "-".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)

    head = f"{'arm':12s} {'N':>6s} {'batch x seq':>11s} {'step ms':>9s} {'peak GiB':>8s} {'loss':>8s}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        shape = f"{r['batch']} x {r['seq']}"
        print(
            f"{r['arm']:12s} {r['tokens']:6d} {shape:>11s} {cell(r['ms'], '9.2f')} {cell(r['peak_gib'], '8.2f')} "
            f"{cell(r['loss'], '8.4f')}  {r['note']}"
        )


if __name__ == "__main__":
    sys.exit(main())
