"""Sequence parallelism: ranks that hold different tokens of one batch.

``sp_group=`` (DeepSpeed Ulysses, context parallel): the ranks of ``sp_group`` hold
different tokens, each result exact against the concatenated batch.
``vtp_runtime.outputs`` sums a ``"sum"``/``"mean"`` result over them (one all-reduce of a few
float64 numbers); this module makes the ranks of ``sp_group`` agree on the call first
(``agree``). Megatron's sequence parallelism (``Head(..., sequence_parallel=True)``: token
shards inside ``tp_group``) is the Head's own layout: ``vtp_runtime.head_gather``.

**Agreement over sp_group.** The ranks of ``sp_group`` sit in different TP groups, and each
TP group has its own plan cache (``vtp_runtime.plans``): whether a call's plan is found
differs between them (their token shards differ, and so their signatures), so no collective
over ``sp_group`` may depend on it. ``agree`` therefore runs after the TP plan, whatever it
found, and carries a failure of the TP step (every rank of a TP group raises together) to
the other TP groups: the ranks of ``sp_group`` gather a row of a few int64 -- an error flag,
a hash of the call's options (``checks.fingerprint``), the normalizer -- and raise the same
error on every rank when any rank failed or the hashes differ, naming each rank's value
(texts are exchanged on that error path only). When it gathers follows the metadata modes:
on every call where ``sp_group`` has a CPU transport (gloo, ``cpu:gloo,cuda:nccl``: no
device sync), or under ``VTP_CHECK=1``; on a device-only group (plain NCCL) on the first
call of each distinct row only (a per-group cache, the same on every rank while they agree),
later calls trusting the ranks to agree as planned TP calls do.
"""

from __future__ import annotations

import struct
from typing import Any, NoReturn

import torch

from . import env, metadata
from .comm import all_gather_stack, group_rank, group_size, is_group
from .errors import ShardError, add_note
from .weak import IdentityMap

Tensor = torch.Tensor

MAGIC = 0x7674_7053  # "vtpS": the row of the agreement over sp_group
MAX_ROWS = 2048  # per generation, per group; two generations are kept


def active(group: Any) -> bool:
    """Whether ``group`` is an ``sp_group`` with more than one rank."""
    return is_group(group) and group_size(group) > 1


class _Seen:
    """The calls a device-only ``sp_group`` has agreed on (two generations, by count)."""

    def __init__(self) -> None:
        self.rows: set[tuple[int, ...]] = set()
        self.previous: set[tuple[int, ...]] = set()

    def __contains__(self, row: tuple[int, ...]) -> bool:
        if row in self.rows:
            return True
        if row in self.previous:
            self.add(row)
            return True
        return False

    def add(self, row: tuple[int, ...]) -> None:
        if len(self.rows) >= MAX_ROWS:
            self.previous, self.rows = self.rows, set()
        self.rows.add(row)


_SEEN: IdentityMap[_Seen] = IdentityMap()


def seen_calls(group: Any) -> int:
    """How many agreed calls are kept for ``group`` (device-only groups only)."""
    seen = _SEEN.get(group)
    return 0 if seen is None else len(seen.rows | seen.previous)


def call_text(fingerprint: str, options: Any, extra: str = "") -> str:
    """What the ranks of ``sp_group`` must agree on, as ``name=value|...``: the plan's
    fingerprint of the call (``checks.fingerprint`` without per-call values), the kind of
    normalizer, and ``extra`` (a composite op's own options). A number normalizer's value is
    compared apart (``agree``): it changes from step to step."""
    normalizer = options.get("normalizer")
    kind = "None" if normalizer is None else "<tensor>" if isinstance(normalizer, Tensor) else "<number>"
    return f"{fingerprint}|normalizer={kind}{'|' + extra if extra else ''}"


def _number(value: Any) -> float | None:
    """A number normalizer as a float (numpy scalars too); None for none, or a tensor (never
    read on the host)."""
    if value is None or isinstance(value, (Tensor, bool)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _bits(value: Any) -> int:
    """A number normalizer as the int64 of its float64 bits (0 where it is not a number)."""
    number = _number(value)
    return 0 if number is None else struct.unpack("<q", struct.pack("<d", number))[0] or 1


def agree(
    group: Any,
    text: str | None,
    normalizer: Any,
    failure: BaseException | None,
    device: torch.device | None,
    every_call: bool = False,
) -> None:
    """Make the ranks of ``sp_group`` agree on a call, or raise on every one of them.

    ``text``: this rank's ``call_text`` (None when it failed); ``normalizer``: this call's;
    ``failure``: this rank's exception from before (the TP step's, raised on every rank of its
    TP group alike), raised here once the others know of it; ``every_call``: gather on every
    call whatever the group's transport (a call whose per-call checks may fail on some ranks
    only). Returns only when no rank failed and every rank's text and normalizer agree."""
    failed = failure is not None or text is None
    row = (MAGIC, 1, 0, 0) if failed else (MAGIC, 0, metadata.stable_hash(str(text)), _bits(normalizer))
    mode = env.check_mode() or ("gather" if metadata.host_transport(group) else "once")  # as plans.metadata_mode
    if every_call and mode == "once":
        mode = "gather"
    seen = _SEEN.setdefault(group, _Seen) if mode == "once" else None
    key = row[:3]  # a number normalizer that changes every step is not gathered for again
    if seen is not None and not failed and key in seen:
        return
    where = metadata.gather_device(group, device)
    table = all_gather_stack(torch.tensor(row, dtype=torch.int64, device=where), group).cpu().tolist()
    _check(table, text, normalizer, failure, group, where)
    if seen is not None:
        seen.add(key)


def _check(table, text: str | None, normalizer: Any, failure: BaseException | None, group, device) -> None:
    rank = group_rank(group)
    failed = [r for r, row in enumerate(table) if row[1]]
    if failed:
        texts = metadata.gather_texts("" if failure is None else f"{type(failure).__name__}: {failure}", group, device)
        if failure is not None:
            others = [r for r in failed if r != rank]
            if others:
                note = "; ".join(f"rank {r}: {texts[r]}" for r in others)
                add_note(failure, f"the call failed on other ranks of sp_group too: {note}")
            raise failure
        raise ShardError(
            f"the call failed on {metadata.ranks_text(failed)} of sp_group (there, or on a rank of its "
            f"tp_group), so every rank of sp_group raises; fix it there:\n"
            + "\n".join(f"  rank {r}: {texts[r]}" for r in failed)
        )
    if len({tuple(row) for row in table}) > 1:
        assert text is not None  # a rank without a text failed, and raised above
        number = _number(normalizer)
        shown = text.replace("normalizer=<number>", f"normalizer={number!r}")
        diff = metadata.differences(metadata.gather_texts(shown, group, device))
        what = "; ".join(f"{k}: {v}" for k, v in diff.items()) or "the call"
        raise ShardError(
            f"the ranks of sp_group disagree on op options: {what}; every rank of sp_group must make the "
            f"same call (only their tokens differ)"
        )


def fail(exc: BaseException, group: Any, device: torch.device | None) -> NoReturn:
    """Raise ``exc``, met on this rank before a call, on every rank of ``sp_group``."""
    if active(group):
        agree(group, None, None, exc, device)
    raise exc


__all__ = ["agree", "active", "call_text", "fail", "seen_calls"]
