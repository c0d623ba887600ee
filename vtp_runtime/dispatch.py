"""Choosing a backend: a pure function of the gathered table, so every rank picks the same.

Rule, in full:

1. The forced name, if any, is taken from (first match wins) the ``backend=`` argument, the
   innermost ``use_backend(name, op)`` for this op or for every op, ``VTP_BACKEND_<OP>``,
   ``VTP_BACKEND``. A forced backend that cannot run the call raises with its reasons; it
   never falls back. An unknown name raises and lists the registered ones.
2. Otherwise the first backend in canonical order (priority descending, then name) that is
   available on **every** rank and whose declared capabilities cover the call.
3. Nothing fits: raise, with one block per backend and one line per reason.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

from . import env
from .backend import Backend, Request, TakesHead
from .errors import BackendUnavailable, add_note
from .metadata import Shards, backend_key
from .ops import dtype_name
from .registry import REGISTRY

log = logging.getLogger("vtp_runtime")

_OVERRIDES: ContextVar[tuple[tuple[str | None, str], ...]] = ContextVar("vtp_backend_overrides", default=())


@contextlib.contextmanager
def use_backend(name: str, op: str | None = None) -> Iterator[None]:
    """Force backend ``name`` for ``op`` (or every op) inside the block. Thread- and
    task-safe (a ContextVar), nests, and restores the previous choice on exit."""
    REGISTRY.get(name)  # unknown names fail here, listing the registered ones
    if op is not None:
        from .ops import get_spec

        get_spec(op)
    token = _OVERRIDES.set(_OVERRIDES.get() + ((op, name),))
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def forced_backend(op: str, argument: str | None) -> tuple[str | None, str]:
    """The forced backend name for this call and where it came from."""
    if argument:
        return argument, "the backend= argument"
    for scoped_op, name in reversed(_OVERRIDES.get()):
        if scoped_op is None or scoped_op == op:
            return name, "use_backend()"
    for var in (f"VTP_BACKEND_{op.upper()}", "VTP_BACKEND"):
        value = env.text(var)
        if value:
            return value, var
    return None, ""


def local_availability(device_type: str) -> tuple[int, ...]:
    """Keys of the backends registered here whose environment probe passes."""
    return tuple(
        backend_key(b.name, b.priority) for b in REGISTRY.backends().values() if not b.probe_reasons(device_type)
    )


@dataclass
class Explanation:
    """Which backend runs a call, and why every other one does not."""

    request: Request
    backend: str | None
    forced: str | None = None
    forced_by: str = ""
    reasons: Mapping[str, list[str]] = field(default_factory=dict)
    local_notes: Mapping[str, list[str]] = field(default_factory=dict)
    view: str = ""  # set when only this rank was consulted (explain without gather=True)
    head_logits: str = ""  # with Head inputs: how the selected backend computes their logits

    def __str__(self) -> str:
        r = self.request
        lines = [
            f"vtp_runtime: op={r.op} device={r.device_type} dtype={dtype_name(r.dtype)} "
            f"tp={r.tp_size} V={r.vocab_size} tokens={r.num_tokens} "
            f"shards={'even' if r.even_shards else 'uneven'}{', one empty' if r.empty_shard else ''} "
            f"features={','.join(sorted(r.features)) or '-'}{_inputs(r)}"
        ]
        if self.view:
            lines.append(f"({self.view})")
        if self.forced:
            lines.append(f"forced: {self.forced} (by {self.forced_by})")
        lines.append(f"selected: {self.backend or 'none'}")
        if self.head_logits:
            lines.append(f"head logits: {self.head_logits}")
        for name, why in self.reasons.items():
            if name == self.backend:
                lines.append(f"`{name}`: selected")
            elif not why:
                lines.append(f"`{name}`: could run (lower in priority order)")
            else:
                lines.append(f"`{name}` is not supported because:")
                lines.extend(f"    {reason}" for reason in why)
            lines.extend(f"    (this rank) {note}" for note in self.local_notes.get(name, ()))
        return "\n".join(lines)


def _inputs(r: Request) -> str:
    if r.head_sequence_parallel:
        return " inputs=sequence-parallel head"
    return " inputs=head" if r.head_inputs else ""


def _reasons(backend: Backend, request: Request, shards: Shards | None) -> tuple[list[str], list[str]]:
    """(reasons every rank agrees on, reasons only this rank knows)."""
    if shards is None or shards.tp_size == 1:  # single process: the probe is the whole truth
        return backend.reasons(request), []
    key = backend_key(backend.name, backend.priority)
    out = []
    if key not in shards.available:
        missing = [r for r, keys in enumerate(shards.available_per_rank) if key not in keys]
        out.append(
            f"not available on rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
            f"(not installed there, or its environment probe failed)"
        )
    return out + backend.capability_reasons(request), backend.probe_reasons(request.device_type)


def explain_request(
    request: Request, shards: Shards | None, forced: str | None = None, forced_by: str = ""
) -> Explanation:
    """Pure selection: the same inputs give the same answer on every rank."""
    backends = REGISTRY.backends()
    if forced is not None:
        REGISTRY.get(forced)
    reasons, notes, chosen = {}, {}, None
    for name, backend in backends.items():
        why, local = _reasons(backend, request, shards)
        reasons[name] = why
        if local:
            notes[name] = local
        if chosen is None and not why and (forced is None or forced == name):
            chosen = name
    return Explanation(request, chosen, forced, forced_by, reasons, notes)


def with_head_logits(
    ex: Explanation,
    options: Mapping[str, Any] | None = None,
    parts: Sequence[tuple[Any, Any, Any]] = (),
) -> Explanation:
    """``ex`` with the selected backend's ``head_logits_route`` where the call has Head
    inputs (``parts``: this rank's ``(hidden, weight, bias)`` of each, where known)."""
    if ex.request.head_inputs and ex.backend is not None:
        backend = REGISTRY.backends().get(ex.backend)
        if isinstance(backend, TakesHead):
            ex.head_logits = backend.head_logits_route(ex.request.device_type, ex.request, options, parts)
    return ex


# selections already made, by everything they depend on (no tensors, no groups; of the token
# count only whether there is any: no capability reads it); cleared past MAX_SELECTIONS entries
_CACHE: dict = {}
MAX_SELECTIONS = 4096


def select(request: Request, shards: Shards | None, forced: str | None, forced_by: str) -> Backend:
    """The backend for this call, or the same BackendUnavailable on every rank."""
    key = (
        replace(request, num_tokens=min(request.num_tokens, 1)),
        None if shards is None or shards.tp_size == 1 else (shards.available, shards.available_per_rank),
        forced,
        REGISTRY.version,
    )
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    ex = explain_request(request, shards, forced, forced_by)
    if ex.backend is None:
        err = BackendUnavailable(_unavailable_message(ex))
        for name, local in ex.local_notes.items():
            add_note(err, f"on this rank, `{name}`: " + "; ".join(local))
        raise err
    _debug_log(ex, shards)
    backend = REGISTRY.get(ex.backend)
    if len(_CACHE) >= MAX_SELECTIONS:
        _CACHE.clear()
    _CACHE[key] = backend
    return backend


_LOGGED: set = set()  # selections logged under VTP_DEBUG=1; cleared past MAX_SELECTIONS


def _debug_log(ex: Explanation, shards: Shards | None) -> None:
    """With VTP_DEBUG=1, log a selection (chosen backend, every candidate and its reasons)
    once per call signature: the request up to its token count (only zero/non-zero matters),
    the forced backend and the choice. At WARNING level, so it shows without logging setup."""
    if env.text("VTP_DEBUG") in ("", "0"):
        return
    r = ex.request
    signature = (replace(r, num_tokens=min(r.num_tokens, 1)), ex.forced, ex.backend, REGISTRY.version)
    if signature in _LOGGED:
        return
    if len(_LOGGED) >= MAX_SELECTIONS:
        _LOGGED.clear()
    _LOGGED.add(signature)
    where = f" (rank {shards.rank} of {shards.tp_size})" if shards is not None and shards.tp_size > 1 else ""
    log.warning("vtp_runtime selected %s for %s%s [VTP_DEBUG]\n%s", ex.backend, r.op, where, ex)


def clear_selections() -> None:
    """Forget the selections made and logged so far: the next call of each request selects
    (and, under VTP_DEBUG=1, logs) anew. For a backend whose availability changed without a
    registration (a probe forgotten), and for tests."""
    _CACHE.clear()
    _LOGGED.clear()


def _unavailable_message(ex: Explanation) -> str:
    if ex.forced:
        why = ex.reasons.get(ex.forced, [])
        head = (
            f"backend {ex.forced!r} was forced by {ex.forced_by} but cannot run this call; "
            f"it does not fall back. Remove the override or change the call."
        )
        blocks = [f"`{ex.forced}` is not supported because:"] + [f"    {r}" for r in why]
    else:
        head = "no registered backend can run this call."
        blocks = []
        for name, why in ex.reasons.items():
            blocks.append(f"`{name}` is not supported because:")
            blocks.extend(f"    {r}" for r in why)
    r = ex.request
    call = (
        f"call: op={r.op} device={r.device_type} dtype={dtype_name(r.dtype)} "
        f"tp={r.tp_size} V={r.vocab_size} tokens={r.num_tokens} "
        f"features={','.join(sorted(r.features)) or '-'}"
    )
    return "\n".join([head, call, *blocks])
