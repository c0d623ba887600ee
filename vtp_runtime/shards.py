"""Cross-rank metadata: one fixed-size int64 all-gather per call, then checks every rank
runs identically on the gathered table, so every rank raises the same error or none.

Each rank describes its call in a vector of ``META_SIZE`` int64 (no pickling): local vocab
size, explicit bounds, token count, dtype, device type, op and options fingerprint, forced
backend, local validation error, and the backends that can run here. Nothing here may
raise before the gather: a rank that raised early would leave the others waiting in it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import all_gather_stack, group_rank, group_size
from .errors import ShardError
from .ops import OPS

MAGIC = 0x7674_7001  # "vtp" + layout version: ranks on different vtp_runtime layouts disagree here
MAX_BACKEND_SLOTS = 24

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "meta", "hpu", "npu")

# Fixed fields of the metadata vector, in order.
FIELDS = ("magic", "v_local", "vocab_start", "vocab_end", "global_vocab_size", "num_tokens",
          "dtype", "device_type", "op", "options", "forced", "error", "error_detail")
F = {name: i for i, name in enumerate(FIELDS)}
META_SIZE = len(FIELDS) + MAX_BACKEND_SLOTS

# Local validation errors travel as codes, so every rank can render the same message.
ERRORS = {
    1: "invalid argument value or shape",
    3: "invalid argument type",
    5: "unknown backend name",
    7: "too many backends available",
}


def stable_hash(text: str) -> int:
    """A 62-bit hash that is the same in every process (Python's hash() is salted)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def backend_key(name: str, priority: int) -> int:
    """Slot value naming a backend; priority is part of it so every rank orders it the same."""
    return stable_hash(f"backend:{name}:{priority}") or 1


@dataclass
class LocalCall:
    """What this rank knows before the gather."""

    op: str
    v_local: int
    vocab_start: int | None
    vocab_end: int | None
    global_vocab_size: int | None
    num_tokens: int
    dtype: torch.dtype
    device_type: str
    options_fingerprint: str
    forced: str | None
    available: tuple[int, ...]  # backend_key of each backend whose probe passes here
    error: int = 0
    error_detail: str = ""


@dataclass(frozen=True)
class Layout:
    """The validated shard layout and the facts every rank agrees on."""

    rank: int
    tp_size: int
    vocab_start: int
    vocab_end: int
    vocab_size: int
    sizes: tuple[int, ...]  # per rank V_local
    num_tokens: int
    even_shards: bool  # rank order with equal sizes: vocab_start = rank * V_local
    available: frozenset[int]  # backend keys available on every rank
    available_per_rank: tuple[frozenset[int], ...]


def single_rank_layout(v_local: int, vocab_start: int | None, global_vocab_size: int | None,
                       num_tokens: int) -> Layout:
    """The layout of a call without a TP group (or a group of one): no gather needed."""
    if vocab_start not in (None, 0):
        raise ShardError(f"vocab_start={vocab_start}, but a single rank must hold the whole vocabulary "
                         f"from id 0; pass tp_group for a sharded vocabulary")
    if global_vocab_size is not None and global_vocab_size != v_local:
        raise ShardError(f"global_vocab_size={global_vocab_size} but the shards add up to V={v_local} "
                         f"(a single rank); pass tp_group for a sharded vocabulary")
    if v_local == 0:
        raise ShardError("the global vocabulary is empty (V_local = 0 on every rank)")
    return Layout(rank=0, tp_size=1, vocab_start=0, vocab_end=v_local, vocab_size=v_local,
                  sizes=(v_local,), num_tokens=num_tokens, even_shards=True, available=frozenset(),
                  available_per_rank=())


def encode(local: LocalCall) -> list[int]:
    row = [0] * META_SIZE
    row[F["magic"]] = MAGIC
    row[F["v_local"]] = local.v_local
    row[F["vocab_start"]] = -1 if local.vocab_start is None else local.vocab_start
    row[F["vocab_end"]] = -1 if local.vocab_end is None else local.vocab_end
    row[F["global_vocab_size"]] = -1 if local.global_vocab_size is None else local.global_vocab_size
    row[F["num_tokens"]] = local.num_tokens
    row[F["dtype"]] = DTYPES.index(local.dtype) if local.dtype in DTYPES else 99
    row[F["device_type"]] = (DEVICE_TYPES.index(local.device_type) if local.device_type in DEVICE_TYPES
                             else 100 + stable_hash(local.device_type) % 1000)
    row[F["op"]] = list(OPS).index(local.op)
    row[F["options"]] = stable_hash(local.options_fingerprint)
    row[F["forced"]] = stable_hash(local.forced) if local.forced else 0
    if len(local.available) > MAX_BACKEND_SLOTS and not local.error:
        local.error, local.error_detail = 7, f"more than {MAX_BACKEND_SLOTS} backends are available"
    row[F["error"]] = local.error
    row[F["error_detail"]] = stable_hash(local.error_detail) if local.error else 0
    for i, key in enumerate(local.available[:MAX_BACKEND_SLOTS]):
        row[len(FIELDS) + i] = key
    return row


def _metadata_device(group, device: torch.device) -> torch.device:
    # gloo gathers CPU tensors; NCCL/XCCL need the tensor on the accelerator.
    backend = str(dist.get_backend(group)).lower()
    return torch.device("cpu") if "gloo" in backend or device.type == "meta" else device


def gather(local: LocalCall, group, device: torch.device) -> list[list[int]]:
    """The table of every rank's metadata vector, in group-rank order (one collective)."""
    row = encode(local)
    if group_size(group) == 1:
        return [row]
    mine = torch.tensor(row, dtype=torch.int64, device=_metadata_device(group, device))
    return all_gather_stack(mine, group).cpu().tolist()


def _ranks(ranks) -> str:
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _disagree(table, field: str, what: str, show=None) -> None:
    values = [row[F[field]] for row in table]
    if len(set(values)) > 1:
        groups: dict[int, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        parts = "; ".join(f"{_ranks(rs)}: {show(v) if show else v}" for v, rs in groups.items())
        raise ShardError(f"the ranks of the TP group disagree on {what} ({parts}); every rank "
                         f"of tp_group must make the same call")


def validate(table: list[list[int]], local: LocalCall, group) -> Layout:
    """Check the gathered table; raise the same ShardError on every rank, or return the layout."""
    rank, world = group_rank(group), len(table)
    _disagree(table, "magic", "vtp_runtime metadata version (install the same vtp_runtime on every rank)",
              show=hex)
    errors = [(r, row[F["error"]], row[F["error_detail"]]) for r, row in enumerate(table) if row[F["error"]]]
    if errors:
        # every rank failed the same way: every rank knows the full text, so show it
        same_detail = len(errors) == world and len({(c, d) for _, c, d in errors}) == 1
        if same_detail:  # every failing rank hit the same problem: show it in full
            msg = f"{local.error_detail} ({_ranks(r for r, _, _ in errors)})"
        else:
            msg = "invalid call on " + "; ".join(f"rank {r}: {ERRORS.get(c, c)}" for r, c, _ in errors)
        err = ShardError(msg)
        if local.error and not same_detail:
            err.add_note(f"on this rank ({rank}): {local.error_detail}")
        raise err
    _disagree(table, "op", "the op", show=lambda v: list(OPS)[v])
    _disagree(table, "num_tokens", "the number of tokens")
    _disagree(table, "dtype", "the logits dtype",
              show=lambda v: str(DTYPES[v]).replace("torch.", "") if v < len(DTYPES) else v)
    _disagree(table, "device_type", "the device type",
              show=lambda v: DEVICE_TYPES[v] if v < len(DEVICE_TYPES) else v)
    _disagree(table, "options", "op options (values, index shape, mask, which inputs require grad, Head or logits inputs)")
    _disagree(table, "forced", "the forced backend (backend=, use_backend, VTP_BACKEND*)")
    _disagree(table, "global_vocab_size", "global_vocab_size")

    sizes = tuple(row[F["v_local"]] for row in table)
    explicit = [row[F["vocab_start"]] >= 0 for row in table]
    if any(explicit) and not all(explicit):
        raise ShardError(f"vocab_start/vocab_end given on {_ranks(r for r, e in enumerate(explicit) if e)} "
                         f"but not on the others; pass them on every rank or on none")
    if all(explicit) and world > 0:
        starts = tuple(row[F["vocab_start"]] for row in table)
        order = sorted(range(world), key=lambda r: (starts[r], sizes[r]))
        expected = 0
        for r in order:
            if starts[r] != expected:
                kind = "a gap" if starts[r] > expected else "an overlap"
                raise ShardError(f"the vocabulary shards do not tile [0, V): {kind} at id {expected} "
                                 f"(rank {r} starts at {starts[r]}); shards are "
                                 + ", ".join(f"rank {q}: [{starts[q]}, {starts[q] + sizes[q]})" for q in range(world)))
            expected += sizes[r]
    else:
        starts = tuple(sum(sizes[:r]) for r in range(world))
    vocab_size = sum(sizes)
    given = table[0][F["global_vocab_size"]]
    if given >= 0 and given != vocab_size:
        raise ShardError(f"global_vocab_size={given} but the shards add up to V={vocab_size} "
                         f"(V_local per rank: {list(sizes)})")
    if vocab_size == 0:
        raise ShardError("the global vocabulary is empty (V_local = 0 on every rank)")
    per_rank = tuple(frozenset(k for k in row[len(FIELDS):] if k) for row in table)
    even = len(set(sizes)) == 1 and all(starts[r] == r * sizes[0] for r in range(world))
    return Layout(rank=rank, tp_size=world, vocab_start=starts[rank], vocab_end=starts[rank] + sizes[rank],
                  vocab_size=vocab_size, sizes=sizes, num_tokens=table[0][F["num_tokens"]],
                  even_shards=even, available=frozenset.intersection(*per_rank), available_per_rank=per_rank)
