"""transformers' ``generate()`` with and without vtp's sampling hook: milliseconds per decode step.

The model is a transformers ``LlamaForCausalLM`` built from a config (no downloads, random
weights of seed 0) of the sizes ``benchmarks/step.py`` uses: d=1024, 8 layers, 16 heads,
SwiGLU 2752, V=151936, untied head, SDPA attention, bf16. Its config has no EOS id, so every
run decodes all its tokens (``min_new_tokens = max_new_tokens`` says the same to
transformers; with an EOS id it would also add a processor that runs on every step).

Rows: cache x batch B (1, 16, 64) x mode. Modes, as a user passes them to ``generate()``:
``greedy``; ``sample``, temperature 0.8; ``top_p``, top_p 0.9 -- both also under
transformers' default top_k=50, which applies wherever a call or the model's generation
config does not set top_k -- and ``sample_no_top_k`` / ``top_p_no_top_k``, the same with
``top_k=0`` (the draw over the whole vocabulary, and top-p alone). Caches: ``dynamic``
(transformers' default, the forward eager; every mode) and ``static``
(``cache_implementation="static"``; greedy, sample, top_p): on CUDA transformers then runs
the decoding forward through ``torch.compile``, its default ``CompileConfig`` (inductor,
mode "reduce-overhead": CUDA graphs). Each row times two arms on one model: ``torch``,
transformers' own warpers and draw, and ``vtp``, the same ``generate()`` inside
``vocab_parallel_sampling(model)`` (TP=1: ``vtp.argmax`` / ``vtp.sample`` on the whole
logits, one processor in place of the warpers). ``--batches``, ``--modes`` and ``--caches``
choose the rows instead (every combination).

Method. ms per decode step = (T(n) - T(1)) / (n - 1), where T(k) is the wall time of one
``generate()`` call making k new tokens from the same prompt (32 random tokens per row),
synchronized before and after: ``max_new_tokens=1`` is the prefill and the first token, so
the difference is n - 1 decode steps, each a one-token forward on the cache, the selection
and transformers' loop (whose stop check waits for the device every step on CUDA, so a
step costs the host's time plus the device's). Per repetition the arms are interleaved
(torch T(n), torch T(1), vtp T(n), vtp T(1)), each call after ``torch.manual_seed(seed +
repetition)``; a row reports each arm's median over the repetitions and their ratio (the
JSON also has the median of the repetitions' own ratios, ``ratio_paired``). Before
timing, each arm makes ``--warmup`` calls of each length (at least 2 with the static cache:
the first compiles, the next records the CUDA graphs). Greedy rows also say whether both
arms decoded the same ids.

Capturable? For each arm of a row the script counts, from ``torch._dynamo``'s counters,
the frames compiled (a first compile or a recompile) during its warm-up and during its
timed calls, the graph breaks and inductor's skipped CUDA graphs, and whether every timed
call decoded through transformers' compiled forward (``get_compiled_call``). The hook runs
between forwards, outside the compiled region, so with it the same compiled forward and
CUDA graphs must serve: no frame compiled in the vtp arm that the torch arm did not
compile, no break, no skip. ``--log-compile`` prints dynamo's reasons for recompiles and
breaks (stderr).

On the GPU (one H200; estimated 4-5 minutes, most of it compiling, ``--quick`` 1-2):

    python benchmarks/generate.py --json generate.json
    python benchmarks/generate.py --quick --json generate_quick.json

Without a GPU, at tiny sizes (a smoke run, times meaningless; the static cache is not
compiled there unless ``--compile-backend eager`` asks for it):

    python benchmarks/generate.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections import Counter
from typing import Any

import torch

MODES: dict[str, dict[str, Any]] = {
    "greedy": {"do_sample": False},
    "sample": {"do_sample": True, "temperature": 0.8},
    "top_p": {"do_sample": True, "top_p": 0.9},
    "sample_no_top_k": {"do_sample": True, "temperature": 0.8, "top_k": 0},
    "top_p_no_top_k": {"do_sample": True, "top_p": 0.9, "top_k": 0},
}
CACHES = ("dynamic", "static")
ARMS = ("torch", "vtp")
STATIC_MODES = ("greedy", "sample", "top_p")  # the default rows of the static cache
QUICK = [
    ("dynamic", 1, "greedy"),
    ("dynamic", 16, "sample"),
    ("dynamic", 16, "sample_no_top_k"),
    ("dynamic", 64, "top_p"),
    ("static", 16, "sample"),
]
TINY: dict[str, Any] = {
    "dim": 64,
    "layers": 1,
    "heads": 4,
    "vocab": 512,
    "new_tokens": 8,
    "prompt": 8,
    "batches": "1,4",
    "reps": 2,
}


def build_model(args):
    """A ``LlamaForCausalLM`` of the given sizes, random weights of seed 0, on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(2048, args.prompt + args.new_tokens),
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
        # transformers' generated signature omits the keyword arguments every config takes
        attn_implementation="sdpa",  # type: ignore[call-arg]
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config)
    return model.to(getattr(torch, args.dtype)).eval()


class CompiledCalls:
    """Counts the ``generate()`` calls that decode through transformers' compiled forward
    (it asks ``get_compiled_call`` for it once per call, where it compiles)."""

    def __init__(self, model) -> None:
        self.count = 0
        original = model.get_compiled_call

        def counted(*args: Any, **kwargs: Any):
            self.count += 1
            return original(*args, **kwargs)

        model.get_compiled_call = counted


def dynamo_state() -> Counter:
    """The dynamo and inductor counters this script reports, now."""
    from torch._dynamo.utils import counters

    return Counter(
        frames=counters["frames"]["total"],
        graph_breaks=sum(counters["graph_break"].values()),
        cudagraph_skips=counters["inductor"]["cudagraph_skips"],
    )


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Arm:
    """One arm of a row: its ``generate()`` calls, their times and what they compiled."""

    def __init__(self, name: str, model, prompt, kwargs: dict[str, Any], args, compiled: CompiledCalls) -> None:
        self.name, self.model, self.prompt, self.kwargs, self.args = name, model, prompt, kwargs, args
        self.compiled = compiled
        self.steps: list[float] = []
        self.calls: dict[int, list[float]] = {}
        self.ids: torch.Tensor | None = None
        self.short = False
        self.warmup: Counter = Counter()
        self.timed: Counter = Counter()
        self.timed_calls = self.compiled_calls = 0

    def call(self, new_tokens: int, seed: int) -> float:
        """Seconds of one ``generate()`` making ``new_tokens`` tokens."""
        from vtp_runtime.integrations.generation import vocab_parallel_sampling

        kw = {**self.kwargs, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
        torch.manual_seed(seed)
        sync(self.args.device)
        start = time.perf_counter()
        if self.name == "vtp":
            with vocab_parallel_sampling(self.model):
                out = self.model.generate(self.prompt, **kw)
        else:
            out = self.model.generate(self.prompt, **kw)
        sync(self.args.device)
        seconds = time.perf_counter() - start
        if out.shape[1] != self.prompt.shape[1] + new_tokens:
            self.short = True
        if new_tokens > 1 and self.ids is None:
            self.ids = out
        return seconds

    def warm(self, calls: int) -> None:
        before = dynamo_state()
        for i in range(calls):
            self.call(self.args.new_tokens, self.args.seed + i)
            self.call(1, self.args.seed + i)
        self.warmup = dynamo_state() - before
        self.ids = None  # the first timed call's ids

    def rep(self, seed: int) -> None:
        before, compiled = dynamo_state(), self.compiled.count
        long = self.call(self.args.new_tokens, seed)
        short = self.call(1, seed)
        self.calls.setdefault(self.args.new_tokens, []).append(long * 1e3)
        self.calls.setdefault(1, []).append(short * 1e3)
        self.timed += dynamo_state() - before
        self.timed_calls += 2
        self.compiled_calls += self.compiled.count - compiled
        self.steps.append((long - short) / (self.args.new_tokens - 1) * 1e3)

    def report(self) -> dict[str, Any]:
        compiled = "yes" if self.compiled_calls == self.timed_calls else "no" if not self.compiled_calls else "partly"
        return {
            "ms": statistics.median(self.steps),
            "ms_all": self.steps,
            "call_ms": {k: statistics.median(v) for k, v in self.calls.items()},  # whole generate() calls
            "compiled": compiled,
            "frames_warmup": self.warmup["frames"],
            "frames_timed": self.timed["frames"],
            "graph_breaks": self.warmup["graph_breaks"] + self.timed["graph_breaks"],
            "cudagraph_skips": self.warmup["cudagraph_skips"] + self.timed["cudagraph_skips"],
        }


def run_row(model, args, cache: str, batch: int, mode: str, compiled: CompiledCalls) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1000 + batch)
    prompt = torch.randint(3, args.vocab, (batch, args.prompt), generator=gen).to(args.device)
    kwargs: dict[str, Any] = dict(MODES[mode])
    if cache == "static":
        kwargs["cache_implementation"] = "static"
        kwargs["max_cache_len"] = args.prompt + args.new_tokens  # one cache size for both lengths
        if args.compile_backend:
            from transformers import CompileConfig

            config = CompileConfig(backend=args.compile_backend)  # mode "reduce-overhead" (inductor's CUDA graphs)
            config._compile_all_devices = True  # type: ignore[assignment]  # transformers compiles on CUDA only unless told
            kwargs["compile_config"] = config
    arms = [Arm(name, model, prompt, kwargs, args, compiled) for name in ARMS]
    warmup = max(args.warmup, 2 if cache == "static" else 1)
    for arm in arms:
        arm.warm(warmup)
    for rep in range(args.reps):
        for arm in arms:
            arm.rep(args.seed + 100 + rep)
    row: dict[str, Any] = {"cache": cache, "batch": batch, "mode": mode, "note": ""}
    for arm in arms:
        row[arm.name] = arm.report()
    torch_arm, vtp_arm = arms
    row["ratio"] = row["vtp"]["ms"] / row["torch"]["ms"] if row["torch"]["ms"] > 0 else None
    paired = [v / t for t, v in zip(torch_arm.steps, vtp_arm.steps) if t > 0]
    row["ratio_paired"] = statistics.median(paired) if paired else None
    row["same_ids"] = None
    if mode == "greedy" and torch_arm.ids is not None and vtp_arm.ids is not None:
        row["same_ids"] = torch.equal(torch_arm.ids, vtp_arm.ids)
    if torch_arm.short or vtp_arm.short:
        row["note"] = "a call decoded fewer tokens than asked"
    return row


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (with --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes for a smoke run: d=64, 1 layer, V=512, 8 tokens")
    p.add_argument("--quick", action="store_true", help=f"3 repetitions, and unless rows are chosen only {QUICK}")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16,64)")
    p.add_argument("--modes", default=None, help=f"from {', '.join(MODES)} (default: all; {STATIC_MODES} static)")
    p.add_argument("--caches", default=None, help=f"comma-separated, from {', '.join(CACHES)} (default both)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per timed call (default 128)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens per row (default 32)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per arm (default 5; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up calls of each length per arm (static: at least 2)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None, help="SwiGLU width (default 2752 * dim / 1024, a multiple of 64)")
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend for the static-cache rows, on any device (default: transformers' own choice, "
        "inductor with CUDA graphs on CUDA and no compile on CPU)",
    )
    p.add_argument("--log-compile", action="store_true", help="print dynamo's recompile and graph-break reasons")
    p.add_argument("--json", help="write the setup and the rows to this file")
    args = p.parse_args(argv)
    chosen = any(x is not None for x in (args.batches, args.modes, args.caches))
    sizes: dict[str, Any] = {"dim": 1024, "layers": 8, "heads": 16, "vocab": 151936, "new_tokens": 128, "prompt": 32}
    sizes.update(batches="1,16,64", reps=3 if args.quick else 5)
    if args.tiny:
        sizes.update(TINY)
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.ffn = args.ffn or 64 * max(1, round(2752 * args.dim / 1024 / 64))
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (a decode step is the difference of n tokens and 1)")
    if args.quick and not chosen:
        args.rows = list(QUICK)
        return args
    caches = (args.caches or ",".join(CACHES)).split(",")
    modes = (args.modes or ",".join(MODES)).split(",")
    bad = [c for c in caches if c not in CACHES] + [m for m in modes if m not in MODES]
    if bad:
        p.error(f"no such cache or mode: {', '.join(bad)}")
    batches = [int(b) for b in args.batches.split(",") if b]
    args.rows = [
        (cache, batch, mode)
        for cache, batch, mode in itertools.product(caches, batches, modes)
        if args.modes or cache == "dynamic" or mode in STATIC_MODES
    ]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/generate.py needs a CUDA GPU; pass --device cpu --tiny for a smoke run", file=sys.stderr)
        return 2
    if args.log_compile:
        torch._logging.set_logs(recompiles=True, graph_breaks=True)
    model = build_model(args)
    compiled = CompiledCalls(model)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"LlamaForCausalLM: {params / 1e6:.1f}M parameters (d={args.dim}, {args.layers} layers, {args.heads} heads, "
        f"ffn {args.ffn}, V={args.vocab}, {args.dtype}, {args.device}); prompt {args.prompt}, "
        f"{args.new_tokens} new tokens, {args.reps} repetitions",
        file=sys.stderr,
    )
    rows: list[dict[str, Any]] = []
    for cache, batch, mode in args.rows:
        start = time.perf_counter()
        try:
            row = run_row(model, args, cache, batch, mode, compiled)
        except Exception as exc:  # a failing row is a result; the next row runs
            row = {"cache": cache, "batch": batch, "mode": mode, "note": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append(row)
        seconds = time.perf_counter() - start
        if "ratio" in row:
            done = f"{row['torch']['ms']:.3f} / {row['vtp']['ms']:.3f} ms per step, {row['ratio'] or 0:.3f}x"
        else:
            done = row["note"]
        print(f"{cache} B={batch} {mode}: {done} ({seconds:.1f} s)", file=sys.stderr, flush=True)
        if args.json:  # after every row: a run cut short keeps what it measured
            write_json(args.json, args, params, rows)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print_table(rows)
    return 0


def write_json(path: str, args, params: int, rows: list[dict[str, Any]]) -> None:
    import transformers

    setup = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "parameters": params,
        **{k: getattr(args, k) for k in ("dim", "layers", "heads", "ffn", "vocab", "dtype", "prompt")},
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "argv": sys.argv,
    }
    with open(path, "w") as f:
        json.dump({**setup, "rows": rows}, f, indent=1)


def print_table(rows: list[dict]) -> None:
    def ms(r, arm):
        return f"{r[arm]['ms']:8.3f}" if arm in r else f"{'-':>8s}"

    head = (
        f"{'cache':7s} {'B':>3s} {'mode':15s} {'torch ms':>8s} {'vtp ms':>8s} {'vtp/torch':>9s} {'same ids':>8s}  "
        f"{'compiled':8s} {'frames warm/timed':>17s} {'breaks':>6s} {'cg skips':>8s}  note"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = f"{r['ratio']:9.3f}" if r.get("ratio") is not None else f"{'-':>9s}"
        same = {True: "yes", False: "NO", None: "-"}[r.get("same_ids")]
        if "vtp" in r:
            t, v = r["torch"], r["vtp"]
            compiled = f"{t['compiled']}/{v['compiled']}"
            frames = f"{t['frames_warmup']}/{t['frames_timed']} | {v['frames_warmup']}/{v['frames_timed']}"
            breaks = f"{t['graph_breaks']}/{v['graph_breaks']}"
            skips = f"{t['cudagraph_skips']}/{v['cudagraph_skips']}"
        else:
            compiled = frames = breaks = skips = "-"
        print(
            f"{r['cache']:7s} {r['batch']:3d} {r['mode']:15s} {ms(r, 'torch')} {ms(r, 'vtp')} {ratio} {same:>8s}  "
            f"{compiled:8s} {frames:>17s} {breaks:>6s} {skips:>8s}  {r['note']}"
        )
    print("(compiled, frames, breaks, cg skips: torch arm / vtp arm; frames: compiled in warm-up / in timed calls)")


if __name__ == "__main__":
    sys.exit(main())
