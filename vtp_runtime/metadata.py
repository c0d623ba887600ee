"""The metadata protocol: one fixed-size int64 all-gather per call, then checks every rank
runs identically on the gathered table, so every rank raises the same error or none.

Each rank describes its call in a vector of ``META_SIZE`` int64 (no pickling): whether the
call failed locally, local vocab size, explicit bounds, token count, dtype, device type, op
and options fingerprint, forced backend, optional checksums of the integer inputs
(``VTP_CHECK=1``), and the backends that can run here. A rank whose call fails before the
gather still takes part in it, with the error flag set: a rank that raised early would leave
the others waiting in the gather forever. Error paths, which every rank takes together
because they read the same table, may spend one more collective to exchange texts (what
failed, each rank's option values).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from . import env
from .comm import all_gather_stack, group_rank, group_size, is_group
from .errors import ShardError, add_note
from .ops import DTYPES, OPS, dtype_name

MAGIC = 0x7674_7005  # "vtp" + protocol version: ranks on different vtp_runtime versions disagree here
MAX_BACKEND_SLOTS = 24

DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "meta", "hpu", "npu")

# Fixed fields of the metadata vector, in order. "error" is 1 on a rank whose call failed
# locally (every other field is then 0); the check_* fields are written on the device.
FIELDS = (
    "magic",
    "error",
    "v_local",
    "vocab_start",
    "vocab_end",
    "global_vocab_size",
    "num_tokens",
    "dtype",
    "device_type",
    "op",
    "options",
    "forced",
    "check",
    "check_0",  # checksums of the op's checked tensors (OpSpec.checked), in order
    "check_1",
    "check_2",
    "sequence_first",  # a sequence-parallel Head's tokens on this rank: hidden.shape[0] ...
    "sequence_rows",  # ... and its rows (-1 for both without one)
)
F = {name: i for i, name in enumerate(FIELDS)}
META_SIZE = len(FIELDS) + MAX_BACKEND_SLOTS
CHECKSUMS = ("check_0", "check_1", "check_2")
assert all(len(spec.checked) <= len(CHECKSUMS) for spec in OPS.values()), "a checksum slot per checked tensor"
_INT64 = range(-(2**63), 2**63)

TEXT_BYTES = 4096  # per rank, in the texts exchanged on error paths (longer ones are cut)


def stable_hash(text: str) -> int:
    """A 62-bit hash that is the same in every process (Python's hash() is salted)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def backend_key(name: str, priority: int) -> int:
    """Slot value naming a backend; priority is part of it so every rank orders it the same."""
    return stable_hash(f"backend:{name}:{priority}") or 1


def check_enabled() -> bool:
    """``VTP_CHECK=1``: compare checksums of the op's tensors other than logits (``OpSpec.checked``)."""
    return env.check_mode() == "check"


_K1, _K2 = 0x5851_F42D_4C95_7F2D, 0x1405_7B7E_F767_814F  # odd 63-bit multipliers


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """An int64 checksum of an integer tensor's values and their positions, on its device.
    Integer sums wrap and are exact, so equal tensors give equal sums on every rank."""
    x = t.reshape(-1).long()
    h = (x ^ (torch.arange(x.numel(), device=x.device) * _K2)) * _K1
    return (h ^ (h >> 29)).sum()


def checksums(tensors: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """int64 ``[len(CHECKSUMS)]`` on ``device``: a checksum of each of ``tensors`` (0 where
    absent, and in the slots past them): of an integer or bool tensor its values, of a
    floating one (a tensor normalizer) the bits of its values as float64. Device work only;
    the gather reads them."""
    zero = torch.zeros((), dtype=torch.int64, device=device)
    sums = [zero] * len(CHECKSUMS)
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if t.is_floating_point():
            t = t.to(device=device, dtype=torch.float64).reshape(-1).view(torch.int64)
        sums[i] = _checksum(t.to(device))
    return torch.stack(sums)


@dataclass
class RankMetadata:
    """What this rank knows before the gather."""

    op: str
    v_local: int
    vocab_start: int | None
    vocab_end: int | None
    global_vocab_size: int | None
    num_tokens: int
    dtype: torch.dtype
    device_type: str
    options_fingerprint: str  # "name=value|..." of everything every rank must agree on
    forced: str | None
    available: tuple[int, ...]  # backend_key of each backend whose probe passes here
    forced_by: str = ""
    checksums: torch.Tensor | None = None  # from checksums(), under VTP_CHECK=1
    sequence_first: int = -1  # a sequence-parallel Head: this rank's hidden.shape[0] (-1: none)
    sequence_rows: int = -1  # ... and its token rows


@dataclass(frozen=True)
class Shards:
    """The validated vocabulary shards of a call and the facts every rank agrees on."""

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
    # a sequence-parallel Head: per rank (hidden.shape[0], token rows); num_tokens is their sum
    sequence: tuple[tuple[int, int], ...] | None = None


def single_rank_shards(v_local: int, vocab_start: int | None, global_vocab_size: int | None, num_tokens: int) -> Shards:
    """The shards of a call without a TP group (or a group of one): no gather needed."""
    if vocab_start not in (None, 0):
        raise ShardError(
            f"vocab_start={vocab_start}, but a single rank must hold the whole vocabulary "
            f"from id 0; pass tp_group for a sharded vocabulary"
        )
    if global_vocab_size is not None and global_vocab_size != v_local:
        raise ShardError(
            f"global_vocab_size={global_vocab_size} but the shards add up to V={v_local} "
            f"(a single rank); pass tp_group for a sharded vocabulary"
        )
    if v_local == 0:
        raise ShardError("the global vocabulary is empty (V_local = 0 on every rank)")
    return Shards(
        rank=0,
        tp_size=1,
        vocab_start=0,
        vocab_end=v_local,
        vocab_size=v_local,
        sizes=(v_local,),
        num_tokens=num_tokens,
        even_shards=True,
        available=frozenset(),
        available_per_rank=(),
    )


def alike_shards(
    rank: int, world: int, v_local: int, vocab_start: int | None, global_vocab_size: int | None, num_tokens: int
) -> Shards:
    """The shards of a call as one rank of ``world`` sees them before any gather, the other
    ranks assumed alike (``vtp.explain`` without ``gather``)."""
    vocab_size = v_local * world if global_vocab_size is None else global_vocab_size
    first = rank * v_local if vocab_start is None else vocab_start
    return Shards(
        rank=rank,
        tp_size=world,
        vocab_start=first,
        vocab_end=first + v_local,
        vocab_size=vocab_size,
        sizes=(v_local,) * world,
        num_tokens=num_tokens,
        even_shards=vocab_size == v_local * world and first == rank * v_local,
        available=frozenset(),
        available_per_rank=(),
    )


def encode(mine: RankMetadata) -> list[int]:
    """This rank's metadata vector; raises ValueError for a value int64 cannot carry."""
    row = [0] * META_SIZE
    row[F["magic"]] = MAGIC
    row[F["v_local"]] = mine.v_local
    row[F["vocab_start"]] = -1 if mine.vocab_start is None else mine.vocab_start
    row[F["vocab_end"]] = -1 if mine.vocab_end is None else mine.vocab_end
    row[F["global_vocab_size"]] = -1 if mine.global_vocab_size is None else mine.global_vocab_size
    row[F["num_tokens"]] = mine.num_tokens
    row[F["sequence_first"]] = mine.sequence_first
    row[F["sequence_rows"]] = mine.sequence_rows
    for name in ("vocab_start", "vocab_end", "global_vocab_size", "num_tokens", "sequence_first", "sequence_rows"):
        if row[F[name]] not in _INT64:
            raise ValueError(
                f"{name}={getattr(mine, name)} is out of range: vocabulary ids and token counts must be below 2**63"
            )
    row[F["dtype"]] = DTYPES.index(mine.dtype) if mine.dtype in DTYPES else 99
    row[F["device_type"]] = (
        DEVICE_TYPES.index(mine.device_type)
        if mine.device_type in DEVICE_TYPES
        else 100 + stable_hash(mine.device_type) % 1000
    )
    row[F["op"]] = list(OPS).index(mine.op)
    row[F["options"]] = stable_hash(mine.options_fingerprint)
    row[F["forced"]] = stable_hash(mine.forced) if mine.forced else 0
    row[F["check"]] = int(mine.checksums is not None)
    if len(mine.available) > MAX_BACKEND_SLOTS:
        raise RuntimeError(
            f"more than {MAX_BACKEND_SLOTS} backends are available; uninstall some, or "
            f"load fewer plugins with VTP_PLUGINS"
        )
    for i, key in enumerate(mine.available):
        row[len(FIELDS) + i] = key
    return row


def with_num_tokens(row: Sequence[int], num_tokens: int) -> list[int]:
    """``row``, a metadata vector, with the token count ``num_tokens`` (what a rank sends for
    a call that differs from the planned one in its token count only)."""
    out = list(row)
    out[F["num_tokens"]] = num_tokens
    return out


def _metadata_device(group, device: torch.device | None) -> torch.device:
    # gloo gathers CPU tensors; NCCL/XCCL need the tensor on the accelerator.
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or (device is not None and device.type == "meta"):
        return torch.device("cpu")
    if device is not None:
        return device
    # a call that failed before its device was known: the device the group communicates on
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "xccl" in backend:
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def host_transport(group) -> bool:
    """Whether ``group`` gathers small metadata on the host (a CPU transport: gloo,
    ``cpu:gloo,cuda:nccl``), so that reading the gathered table waits for no device."""
    return _metadata_device(group, None).type == "cpu"


def gather_device(group, device: torch.device | None) -> torch.device:
    """Where ``group`` gathers metadata: the host where it has a CPU transport, else
    ``device`` (or the device the group communicates on)."""
    return _metadata_device(group, device)


def pack(mine: RankMetadata, group, device: torch.device) -> torch.Tensor:
    """This rank's metadata vector as an int64 tensor on the device ``group`` gathers on:
    the host where the group has a CPU transport (gloo, ``cpu:gloo,cuda:nccl``)."""
    row = torch.tensor(encode(mine), dtype=torch.int64, device=_metadata_device(group, device))
    if mine.checksums is not None:  # device to device: no host read here
        row[F[CHECKSUMS[0]] : F[CHECKSUMS[-1]] + 1] = mine.checksums.to(row.device)
    return row


def pack_failure(group, device: torch.device | None) -> torch.Tensor:
    """The metadata vector of a rank whose call failed locally."""
    row = [0] * META_SIZE
    row[F["magic"]], row[F["error"]] = MAGIC, 1
    return torch.tensor(row, dtype=torch.int64, device=_metadata_device(group, device))


def gather(row: torch.Tensor, group) -> list[list[int]]:
    """The table of every rank's metadata vector, in group-rank order (one collective). The
    host reads it: on a device tensor that waits for the device."""
    if group_size(group) == 1:
        return [row.tolist()]
    return all_gather_stack(row, group).cpu().tolist()


def gather_texts(text: str, group, device: torch.device) -> list[str]:
    """Every rank's ``text``, in rank order: one fixed-size collective. Only on error paths,
    which every rank takes together (they are decided by the gathered table)."""
    data = text.replace("\0", " ").encode("utf-8", "replace")
    if len(data) > TEXT_BYTES:
        data = data[: TEXT_BYTES - 3] + b"..."
    mine = torch.zeros(TEXT_BYTES, dtype=torch.uint8)
    mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    rows = all_gather_stack(mine.to(device), group).cpu()
    return [bytes(r.tolist()).rstrip(b"\0").decode("utf-8", "replace") for r in rows]


def _check_checksums(table) -> None:
    on = [r for r, row in enumerate(table) if row[F["check"]]]
    if not on:
        return
    if len(on) < len(table):
        raise ShardError(
            f"VTP_CHECK=1 is set on {_ranks(on)} but not on "
            f"{_ranks(r for r in range(len(table)) if r not in on)}; set it on every rank or none"
        )
    spec = OPS[list(OPS)[table[0][F["op"]]]]
    for field, name in zip(CHECKSUMS, spec.checked):
        _disagree(table, field, f"the {name} values, by VTP_CHECK=1 checksum", show=lambda v: hex(v & (2**64 - 1)))


def ranks_text(ranks) -> str:
    """``rank 1`` or ``ranks 0, 3``."""
    return _ranks(ranks)


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
        raise ShardError(
            f"the ranks of the TP group disagree on {what} ({parts}); every rank of tp_group must make the same call"
        )


def _failures(table, local_failure: Exception | None, rank: int, group, device) -> None:
    """If some rank's call failed before the gather, every rank raises: the failing ranks
    their own exception, the others a ShardError naming each failing rank and its error."""
    failed = [r for r, row in enumerate(table) if row[F["error"]]]
    if not failed:
        return
    exc = local_failure
    texts = gather_texts("" if exc is None else f"{type(exc).__name__}: {exc}", group, device)
    if exc is not None:
        others = [r for r in failed if r != rank]
        if others:
            add_note(exc, "the call failed on other ranks too: " + "; ".join(f"rank {r}: {texts[r]}" for r in others))
        raise exc
    raise ShardError(
        f"the call failed on {_ranks(failed)} of tp_group before the metadata gather, so "
        f"every rank raises; fix it there:\n" + "\n".join(f"  rank {r}: {texts[r]}" for r in failed)
    )


def _fields(text: str) -> dict[str, str]:
    return dict(part.partition("=")[::2] for part in text.split("|") if part)


def differences(texts: list[str]) -> dict[str, str]:
    """``{name: "rank 0 = a, rank 1 = b"}`` for each name whose value differs between the ranks."""
    per_rank = [_fields(t) for t in texts]
    out = {}
    for name in dict.fromkeys(k for fields in per_rank for k in fields):
        values = [fields.get(name, "(not given)") for fields in per_rank]
        if len(set(values)) > 1:
            groups: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(v, []).append(r)
            out[name] = ", ".join(f"{_ranks(rs)} = {v}" for v, rs in groups.items())
    return out


FORCED = "forced backend"


def _detail_text(mine: RankMetadata) -> str:
    forced = f"{mine.forced!r} ({mine.forced_by})" if mine.forced else "none"
    return f"{mine.options_fingerprint}|{FORCED}={forced}"


def validate(
    table: list[list[int]],
    mine: RankMetadata | None,
    group,
    device: torch.device,
    failure: Exception | None = None,
) -> Shards:
    """Check the gathered table; raise on every rank, or return the shards. ``failure``: this
    rank's mine exception (``mine`` is None then); ``device``: where the table was gathered."""
    rank, world = group_rank(group), len(table)
    _disagree(table, "magic", "vtp_runtime metadata version (install the same vtp_runtime on every rank)", show=hex)
    _failures(table, failure, rank, group, device)
    _disagree(table, "op", "the op", show=lambda v: list(OPS)[v])
    if len({row[F["sequence_rows"]] >= 0 for row in table}) == 1:  # else the options say which Heads differ
        _disagree(table, "num_tokens", "the number of tokens")
    _disagree(
        table,
        "dtype",
        "the logits dtype",
        show=lambda v: dtype_name(DTYPES[v]) if v < len(DTYPES) else v,
    )
    _disagree(table, "device_type", "the device type", show=lambda v: DEVICE_TYPES[v] if v < len(DEVICE_TYPES) else v)
    if len({row[F["options"]] for row in table}) > 1 or len({row[F["forced"]] for row in table}) > 1:
        assert mine is not None  # a rank without its RankMetadata failed, and _failures raised
        diff = differences(gather_texts(_detail_text(mine), group, device))
        forced = diff.pop(FORCED, None)
        what = (
            f"op options: {'; '.join(f'{k}: {v}' for k, v in diff.items())}"
            if diff
            else f"the forced backend (backend=, use_backend, VTP_BACKEND*): {forced}"
        )
        raise ShardError(
            f"the ranks of the TP group disagree on {what}; every rank of tp_group must make the same call"
        )
    _check_checksums(table)
    _disagree(table, "global_vocab_size", "global_vocab_size")
    num_tokens, sequence = table[0][F["num_tokens"]], None
    if table[0][F["sequence_rows"]] >= 0:  # a sequence-parallel Head on every rank (the options say)
        sequence = tuple((row[F["sequence_first"]], row[F["sequence_rows"]]) for row in table)
        total = sum(rows for _, rows in sequence)
        if num_tokens >= 0 and num_tokens != total:
            raise ShardError(
                f"the labels, index, mask or other input cover {num_tokens} tokens, but the hidden shards of the "
                f"sequence_parallel Head add up to {total} (tokens per rank: {[rows for _, rows in sequence]}); "
                f"they must cover every rank's tokens, in rank order"
            )
        num_tokens = total

    sizes = tuple(row[F["v_local"]] for row in table)
    explicit = [row[F["vocab_start"]] >= 0 for row in table]
    if any(explicit) and not all(explicit):
        raise ShardError(
            f"vocab_start/vocab_end given on {_ranks(r for r, e in enumerate(explicit) if e)} "
            f"but not on the others; pass them on every rank or on none"
        )
    if all(explicit) and world > 0:
        starts = tuple(row[F["vocab_start"]] for row in table)
        order = sorted(range(world), key=lambda r: (starts[r], sizes[r]))
        expected = 0
        for r in order:
            if starts[r] != expected:
                kind = "a gap" if starts[r] > expected else "an overlap"
                raise ShardError(
                    f"the vocabulary shards do not tile [0, V): {kind} at id {expected} "
                    f"(rank {r} starts at {starts[r]}); shards are "
                    + ", ".join(f"rank {q}: [{starts[q]}, {starts[q] + sizes[q]})" for q in range(world))
                )
            expected += sizes[r]
    else:
        starts = tuple(sum(sizes[:r]) for r in range(world))
    vocab_size = sum(sizes)
    stated = table[0][F["global_vocab_size"]]
    if stated >= 0 and stated != vocab_size:
        raise ShardError(
            f"global_vocab_size={stated} but the shards add up to V={vocab_size} (V_local per rank: {list(sizes)})"
        )
    if vocab_size == 0:
        raise ShardError("the global vocabulary is empty (V_local = 0 on every rank)")
    per_rank = tuple(frozenset(k for k in row[len(FIELDS) :] if k) for row in table)
    even = len(set(sizes)) == 1 and all(starts[r] == r * sizes[0] for r in range(world))
    return Shards(
        rank=rank,
        tp_size=world,
        vocab_start=starts[rank],
        vocab_end=starts[rank] + sizes[rank],
        vocab_size=vocab_size,
        sizes=sizes,
        num_tokens=num_tokens,
        even_shards=even,
        available=frozenset.intersection(*per_rank),
        available_per_rank=per_rank,
        sequence=sequence,
    )


def fail(exc: Exception, group: Any, device: torch.device | None) -> NoReturn:
    """Raise ``exc``, found on this rank before a call, on every rank of ``group``: this rank
    joins the call's metadata gather as a failed rank, so the others raise too instead of
    waiting there. Where they all failed alike, each raises its own error."""
    if is_group(group) and group_size(group) > 1:
        row = pack_failure(group, device)
        validate(gather(row, group), None, group, row.device, exc)
    raise exc
