"""Plans: what a call signature needs, computed once and reused while the signature repeats.

A plan is everything ``_prepare`` and dispatch decide about a call -- the validated layout
from the metadata gather, the chosen backend, the ``Call`` handed to it, how its outputs
are shaped -- for one *signature*: the op, the option values, the shapes, dtypes and
devices of every tensor, which inputs require grad, grad mode, the process group, the
forced backend and the registry version. The first call of a signature takes the full path
(local checks, the metadata gather, dispatch); later calls with the same signature reuse
its plan and skip all of it, so they issue no metadata collective and read nothing from
the device.

The cache must be symmetric across the ranks of a TP group: a rank that reuses a plan goes
straight to the backend's collectives, a rank that does not goes to the metadata gather,
and the two would wait for each other forever. Every rank holds the same number of plans
and drops them at the same moments (on a count, never on time or memory), so the ranks hit
and miss together as long as their signatures change together: in a program where every
rank makes the same calls, each rank's signature changes exactly when the call does. What
this cannot see is a change on some ranks only after a signature was planned (see
``docs/guide.md``, "No host sync"); on a group with a CPU transport every call still
gathers on the host (no device sync), and ``VTP_CHECK=1`` checks every call in full.
"""

from __future__ import annotations

import os
from typing import Any

import torch

Tensor = torch.Tensor

MAX_PLANS = 2048  # per generation; two generations are kept (see _store)

_plans: dict = {}
_previous: dict = {}

# Option values that go into a signature as they are; anything else (a numpy scalar, a
# 0-d tensor given as a number option, a list ...) makes the call take the full path.
_PLAIN = (int, float, bool, str, type(None))


def metadata_mode(host_transport: bool) -> str:
    """How a call with a TP group whose signature was planned before treats the metadata:

    - ``"check"`` (``VTP_CHECK=1``): the full path, every call: gather, checksums of the
      integer inputs, every check.
    - ``"gather"`` (the default where the group has a CPU transport: gloo,
      ``cpu:gloo,cuda:nccl``): every call gathers the planned metadata row on the host --
      no device sync -- and runs the plan only if the gathered table is the planned one;
      anything else is checked in full. Every rank gathers exactly once per call.
    - ``"once"`` (the default on a device-only group such as plain NCCL, or
      ``VTP_CHECK=once``): no gather; the plan is reused as it is.

    Every rank of a group must run in the same mode (set ``VTP_CHECK`` alike everywhere).
    """
    value = os.environ.get("VTP_CHECK", "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return "check"
    if value == "once":
        return "once"
    return "gather" if host_transport else "once"


def signature(
    op: str,
    tensors: tuple,
    given: dict[str, Any],
    forced: tuple,
    registry_version: int,
    needs_grad: tuple[bool, ...] | None = None,
) -> tuple | None:
    """The key of a call's plan, or None when the call cannot have one (then it takes the
    full path every time). ``needs_grad``: given by a call from a compiled graph (whose
    tensors do not require grad inside the op), read from the tensors otherwise. Built on
    every call: keep it to attribute reads and a tuple."""
    if needs_grad is None:
        key = [op, torch.is_grad_enabled(), forced, registry_version]
        for t in tensors:
            if type(t) is not Tensor:
                return None
            key += (t.shape, t.dtype, t.device, t.requires_grad)
    else:
        key = [op, "compiled", needs_grad, forced, registry_version]
        for t in tensors:
            key += (t.shape, t.dtype, t.device)
    for name in sorted(given):
        value = given[name]
        if type(value) is Tensor:
            # tensor options (mask, labels, normalizer): their values are data of the call,
            # never read on the host; what they are is part of the signature
            if name not in ("mask", "labels", "normalizer"):
                return None
            key += (name, value.shape, value.dtype, value.device)
        elif name == "normalizer" and type(value) in (int, float):
            key += (name, float)  # a per-call number (num_items_in_batch): checked per call
        elif name == "seed" and type(value) is int:
            # sample's seed changes every decoding step: per-call data, like a number
            # normalizer. Ranks passing different seeds are caught by the op itself (the
            # seed rides in the candidates it all-gathers; see vtp_runtime/sampling.py)
            key += (name, int)
        elif name == "tp_group":
            key += (name, value)
        elif type(value) in _PLAIN:
            key += (name, type(value), value)
        else:
            return None
    return tuple(key)


def lookup(key: tuple):
    """The plan stored under ``key``, or None."""
    plan = _plans.get(key)
    if plan is None and key in _previous:
        plan = _previous[key]
        _store(key, plan)
    return plan


def _store(key: tuple, plan) -> None:
    # Two generations: when the current one is full it becomes the previous one, so a
    # signature used since the last turnover survives. The count is all that decides, so
    # ranks whose signatures change together turn over together.
    global _plans, _previous
    if len(_plans) >= MAX_PLANS:
        _previous, _plans = _plans, {}
    _plans[key] = plan


def store(key: tuple, plan) -> None:
    """Keep ``plan`` for later calls with signature ``key``."""
    _store(key, plan)


def clear() -> None:
    """Forget every plan (every rank of a group must clear together, like any collective)."""
    global _plans, _previous
    _plans, _previous = {}, {}


def size() -> int:
    """How many plans are held (both generations, a key counted once)."""
    return len(_plans.keys() | _previous.keys())
