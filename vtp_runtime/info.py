"""``vtp-runtime info``: versions, devices, plugins, and which backend can run which op.

    vtp-runtime info                     # everything, as tables
    vtp-runtime info --json              # the same, for machines
    vtp-runtime info --explain jsd --dtype bf16 --vocab 151936 --tp 2 [--uneven]

``--explain`` builds the ``Request`` such a call would make on this machine (every rank
assumed to look like this one) and prints the verdict with every backend's reasons, without
needing a cluster. Exit status: 0, also with a broken plugin installed; with ``--explain``,
1 when no backend can run the call.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import warnings
from importlib import metadata
from typing import Any

import torch

from . import dispatch
from .backend import Backend, Request, TakesHead, compiles, head_support
from .cli_flags import non_negative_int, positive_int
from .errors import PluginError, VtpError
from .ops import FEATURES, OPS, dtype_name
from .registry import REGISTRY, PluginLoadWarning

DISTRIBUTIONS = ("vtp-runtime", "torch", "triton", "liger-kernel", "intel-extension-for-pytorch", "pluggy")
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--explain",
        metavar="OP",
        choices=list(OPS),
        help=f"explain the backend choice for a call of OP ({', '.join(OPS)})",
    )
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="logits dtype (--explain)")
    parser.add_argument("--vocab", type=positive_int, default=151936, help="global vocabulary size (--explain)")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (--explain)")
    parser.add_argument("--tokens", type=non_negative_int, default=1024, help="tokens per rank (--explain)")
    parser.add_argument("--uneven", action="store_true", help="uneven vocabulary shards (--explain)")
    parser.add_argument("--empty-shard", action="store_true", help="one rank holds V_local = 0 (--explain)")
    parser.add_argument(
        "--feature",
        action="append",
        default=[],
        choices=FEATURES,
        help="a feature the call uses, e.g. temperature (repeatable; --explain)",
    )
    parser.add_argument("--device", default=None, help="device type (--explain; default: this machine's)")
    parser.add_argument("--backend", default=None, help="explain a call forced to this backend (--explain)")
    parser.add_argument(
        "--head",
        nargs="?",
        const="scalar",
        default=None,
        choices=("scalar", "per-token", "sequence-parallel"),
        help="inputs are vtp.Head (--explain): scalar = reduction sum/mean (default), per-token = reduction none, "
        "sequence-parallel = Head(sequence_parallel=True) with reduction sum/mean (at --tp > 1)",
    )


# -- facts ---------------------------------------------------------------------------------


def default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cpu"


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def devices() -> list[dict[str, Any]]:
    listed = [
        {
            "type": "cpu",
            "count": 1,
            "names": [platform.processor() or platform.machine()],
            "threads": torch.get_num_threads(),
        }
    ]
    if torch.cuda.is_available():
        names = [
            f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
            for i in range(torch.cuda.device_count())
        ]
        listed.append({"type": "cuda", "count": len(names), "names": names})
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        names = [torch.xpu.get_device_name(i) for i in range(torch.xpu.device_count())]
        listed.append({"type": "xpu", "count": len(names), "names": names})
    return listed


def op_reasons(backend: Backend, op: str, device_type: str) -> list[str] | None:
    """Why ``backend`` cannot run ``op`` on ``device_type`` at all; None: not implemented."""
    cap = backend.ops.get(op)
    if cap is None:
        return None
    out = list(backend.probe_reasons(device_type))
    if cap.device_types is not None and device_type not in cap.device_types:
        out.append(f"device type {device_type!r} not supported (supports {', '.join(sorted(cap.device_types))})")
    return out


def simulated_request(
    op: str,
    dtype: torch.dtype,
    vocab: int,
    tp: int,
    tokens: int = 1024,
    uneven: bool = False,
    device_type: str = "cpu",
    empty_shard: bool = False,
    features: frozenset[str] = frozenset(),
    head: str | None = None,
) -> Request:
    """The Request every rank of a ``tp``-way call would build, without a process group.
    ``head``: None (logits), "scalar" (vtp.Head inputs, sum/mean), "per-token" (Head, "none") or
    "sequence-parallel" (``Head(sequence_parallel=True)``, sum/mean; at ``tp`` > 1)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; the ops are: {', '.join(OPS)}")
    if vocab < 1 or tp < 1 or tokens < 0:
        raise ValueError("vocab and tp must be >= 1 and tokens >= 0")
    even = not uneven and not empty_shard and vocab % tp == 0
    return Request(
        op=op,
        device_type=device_type,
        dtype=dtype,
        tp_size=tp,
        vocab_size=vocab,
        num_tokens=tokens,
        even_shards=even,
        empty_shard=empty_shard,
        features=frozenset(features),
        head_inputs=head is not None,
        head_per_token=head == "per-token",
        head_sequence_parallel=head == "sequence-parallel" and tp > 1,
    )


def collect() -> dict[str, Any]:
    """Everything ``info`` shows, as plain data (the ``--json`` output)."""
    error = None
    try:
        REGISTRY.ensure_loaded()
    except PluginError as exc:  # VTP_STRICT_PLUGINS=1 with a failed plugin: still report
        error = str(exc)
    device = default_device()
    backends = {}
    for name, b in REGISTRY.backends(strict=False).items():
        owner = REGISTRY.owner(name)
        ops = {}
        for op in OPS:
            why = op_reasons(b, op, device)
            cap = b.ops.get(op)
            head = head_support(b, op)
            ops[op] = (
                {"implemented": False, "available": False, "reasons": [f"does not implement {op}"]}
                if why is None or cap is None
                else {
                    "implemented": True,
                    "available": not why,
                    "reasons": why,
                    "dtypes": sorted(dtype_name(d) for d in cap.dtypes),
                    "features": sorted(cap.features),
                    "devices": None if cap.device_types is None else sorted(cap.device_types),
                    "tp_sizes": None if cap.tp_sizes is None else sorted(cap.tp_sizes),
                    "even_shards_only": cap.even_shards_only,
                    "head_inputs": head is not None,
                    "head_per_token": head is not None and head.per_token,
                    "head_sequence_parallel": head is not None and head.sequence_parallel,
                    "compiled": compiles(b, op),
                }
            )
        backends[name] = {
            "priority": b.priority,
            "plugin": owner.name if owner else "",
            "source": owner.source if owner else "",
            "ops": ops,
            # how the fused head's logits are computed on this device (None: no Head inputs)
            "head_logits": b.head_logits_route(device) if isinstance(b, TakesHead) else None,
        }
    plugins = [
        {
            "name": r.name,
            "distribution": r.dist,
            "version": r.version,
            "status": r.status,
            "backends": list(r.backends),
            "error": r.error,
            "target": r.value,
        }
        for r in REGISTRY.plugins
    ]
    env = {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith("VTP_") or k in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")
    }
    return {
        "versions": versions(),
        "devices": devices(),
        "device_type": device,
        "environment": env,
        "plugins": plugins,
        "plugin_error": error,
        "backends": backends,
    }


# -- rendering -----------------------------------------------------------------------------


def _cell(entry: dict) -> str:
    return "yes" if entry["available"] else ("-" if not entry["implemented"] else "no")


def render_plain(data: dict[str, Any]) -> str:
    lines = ["versions:"]
    lines += [f"  {k:<30} {v or 'not installed'}" for k, v in data["versions"].items()]
    lines.append("devices:")
    for d in data["devices"]:
        lines.append(f"  {d['type']:<6} x{d['count']}  {', '.join(d['names'])}")
    if data["environment"]:
        lines.append("environment:")
        lines += [f"  {k}={v}" for k, v in data["environment"].items()]
    lines.append("plugins:")
    for p in data["plugins"]:
        src = f"{p['distribution']} {p['version']}".strip() or "in-process"
        what = ", ".join(p["backends"]) if p["status"] == "loaded" else p["error"]
        lines.append(
            f"  {p['status'].upper() if p['status'] == 'failed' else p['status']:<8} {p['name']:<32} {src:<28} {what}"
        )
    if data["plugin_error"]:
        lines.append(f"  error: {data['plugin_error']}")
    ops = list(OPS)
    lines.append(
        f"backends on {data['device_type']} (priority order; yes = can run, no = see below, - = not implemented):"
    )
    lines.append(f"  {'backend':<20} {'prio':>4}  " + "  ".join(f"{op:<13}" for op in ops))
    for name, b in data["backends"].items():
        lines.append(f"  {name:<20} {b['priority']:>4}  " + "  ".join(f"{_cell(b['ops'][op]):<13}" for op in ops))
    lines += _head_lines(data)
    blocks = []
    for name, b in data["backends"].items():
        why = sorted({r for e in b["ops"].values() if e["implemented"] for r in e["reasons"]})
        if why:
            blocks.append(f"  `{name}` is not available on {data['device_type']} because:")
            blocks += [f"      {r}" for r in why]
    if blocks:
        lines.append("why not:")
        lines += blocks
    return "\n".join(lines)


def _head_lines(data: dict[str, Any]) -> list[str]:
    """Which ops each backend takes vtp.Head inputs for, and how."""
    lines = []
    for name, b in data["backends"].items():
        groups: dict[str, list[str]] = {}
        for op, e in b["ops"].items():
            if e.get("head_inputs"):
                how = ["per-token" if e["head_per_token"] else "sum/mean only"]
                how += ["sequence-parallel"] if e["head_sequence_parallel"] else []
                groups.setdefault(", ".join(how), []).append(op)
        if groups:
            lines.append(f"  {name + ':':<20} " + "; ".join(f"{', '.join(ops)} ({how})" for how, ops in groups.items()))
            if b.get("head_logits"):
                lines.append(f"  {'':<20} head logits: {b['head_logits']}")
    if not lines:
        return []
    return ["vtp.Head inputs (per-token: reduction='none'; sequence-parallel: Head(sequence_parallel=True)):", *lines]


def render_rich(data: dict[str, Any], console) -> None:
    from rich.table import Table

    t = Table(title="versions", show_header=False)
    for k, v in data["versions"].items():
        t.add_row(k, v or "[dim]not installed[/dim]")
    console.print(t)
    t = Table(title="devices")
    for col in ("type", "count", "names"):
        t.add_column(col)
    for d in data["devices"]:
        t.add_row(d["type"], str(d["count"]), ", ".join(d["names"]))
    console.print(t)
    t = Table(title="plugins")
    for col in ("status", "plugin", "distribution", "backends / error"):
        t.add_column(col)
    style = {"loaded": "green", "failed": "bold red", "skipped": "yellow", "disabled": "yellow"}
    for p in data["plugins"]:
        what = ", ".join(p["backends"]) if p["status"] == "loaded" else p["error"]
        t.add_row(
            f"[{style[p['status']]}]{p['status']}[/]",
            p["name"],
            f"{p['distribution']} {p['version']}".strip() or "in-process",
            what,
        )
    console.print(t)
    if data["plugin_error"]:
        console.print(f"[bold red]{data['plugin_error']}[/]", markup=False)
    t = Table(title=f"backends x ops on {data['device_type']}")
    t.add_column("backend")
    t.add_column("prio", justify="right")
    for op in OPS:
        t.add_column(op)
    colour = {"yes": "[green]yes[/]", "no": "[red]no[/]", "-": "[dim]-[/]"}
    for name, b in data["backends"].items():
        t.add_row(name, str(b["priority"]), *(colour[_cell(b["ops"][op])] for op in OPS))
    console.print(t)
    for line in _head_lines(data):
        console.print(line, markup=False, highlight=False)
    for name, b in data["backends"].items():
        why = sorted({r for e in b["ops"].values() if e["implemented"] for r in e["reasons"]})
        if why:
            console.print(f"`{name}` is not available on {data['device_type']} because:", markup=False)
            for r in why:
                console.print(f"    {r}", markup=False, highlight=False)


def explain_data(ex: dispatch.Explanation) -> dict[str, Any]:
    r = ex.request
    return {
        "request": {
            "op": r.op,
            "device_type": r.device_type,
            "dtype": dtype_name(r.dtype),
            "tp_size": r.tp_size,
            "vocab_size": r.vocab_size,
            "num_tokens": r.num_tokens,
            "even_shards": r.even_shards,
            "empty_shard": r.empty_shard,
            "features": sorted(r.features),
            "head_inputs": r.head_inputs,
            "head_per_token": r.head_per_token,
            "head_sequence_parallel": r.head_sequence_parallel,
        },
        "selected": ex.backend,
        "forced": ex.forced,
        "forced_by": ex.forced_by,
        "reasons": {name: list(why) for name, why in ex.reasons.items()},
        "head_logits": ex.head_logits,
    }


# -- command -------------------------------------------------------------------------------


def _use_rich(args) -> bool:
    if args.json or not sys.stdout.isatty():
        return False
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    with warnings.catch_warnings():  # info reports failed plugins itself
        warnings.simplefilter("ignore", PluginLoadWarning)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.explain:
        return _explain(args)
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
    elif _use_rich(args):
        from rich.console import Console

        render_rich(data, Console())
    else:
        print(render_plain(data))
    return 0


def _explain(args) -> int:
    try:
        REGISTRY.ensure_loaded()
        request = simulated_request(
            args.explain,
            DTYPES[args.dtype],
            args.vocab,
            args.tp,
            args.tokens,
            args.uneven,
            args.device or default_device(),
            args.empty_shard,
            frozenset(args.feature),
            args.head,
        )
        forced, forced_by = dispatch.forced_backend(args.explain, args.backend)
        ex = dispatch.explain_request(request, shards=None, forced=forced, forced_by=forced_by or "--backend")
        ex = dispatch.with_head_logits(ex)
    except (VtpError, ValueError) as exc:
        print(f"vtp-runtime info: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(explain_data(ex), indent=2))
    else:
        print(ex)
        print(
            "(every rank assumed to be like this machine; on a cluster, vtp.explain(..., gather=True) "
            "on every rank checks the real ranks)"
        )
    return 0 if ex.backend else 1
