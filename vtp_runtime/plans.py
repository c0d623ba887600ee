"""Plans: what a call signature needs, computed once and reused while the signature repeats.

A plan is everything the pipeline decides about a call -- the validated shards from the
metadata gather, the chosen backend, what its ``Call`` holds, how its outputs are shaped --
for one *signature*: the op, the option values, the shapes (less the token dims, below),
dtypes and devices of every tensor (a ``Head``'s too), which inputs require grad, grad mode,
the forced backend and the registry version. The first call of a signature takes the full
path (local checks, the metadata gather, dispatch); later calls with the same signature
reuse its plan and skip all of it, so they issue no metadata collective and read nothing
from the device.

The token count is no part of a signature: calls that differ only in their token dims (the
logits' leading dims, and with them the index's, the mask's, the labels' and a Head's hidden
rows) share one plan, so a job whose sequence length changes every step keeps one plan per
kind of call, not one per length. A signature holds each of those shapes past the token
dims, or whole where it does not start with them (a call that then fails its checks on the
full path, which raises). What depends on the token count is made per call from the plan
(``Plan.for_tokens``), without a collective, from what every rank holds alike: the
``Request``'s token count, the leading shape, a Head's chunk rows (``head_chunks.Chunking``)
and the planned metadata row; the plan kept is the last call's, so a call repeating it
makes nothing. Dispatch reads of the token count only whether there is any (no capability
reads the count), which a signature keeps, so the backend chosen for one token count is
the one for every other. One call keeps its token dims in the signature: a sequence-parallel
``Head`` on a group of several ranks, whose chunk layout comes from every rank's token count,
which only the metadata gather sees.

What a plan holds: descriptions only (shapes, dtypes, bounds, the backend, option values,
the planned metadata as integers), never a caller's tensor and never a process group: the
group comes with each call (``Plan.call(group)``).

Where plans are kept: one ``PlanCache`` per process group, keyed by the group's identity
and holding it weakly (``weak.IdentityMap``): a group's plans go when the group is
collected, and a new group, even one that reuses a destroyed group's name, starts empty.
Calls without a group (or on a single device) have a cache of their own. Each cache holds
at most ``2 * MAX_PLANS`` plans (two generations: when the current one is full it becomes
the previous one).

The cache must be symmetric across the ranks of a group: a rank that reuses a plan goes
straight to the backend's collectives, a rank that does not goes to the metadata gather,
and the two would wait for each other forever. A group's cache changes only with that
group's own calls, on a count (never time or memory), so every rank of the group holds the
same plans and turns over at the same call, whatever a rank does with other groups or with
none, as long as the ranks make the same calls (a plan replaced by one for other token dims
adds none to the count). In ``"gather"`` mode a call sends its own token count, and runs the
plan only where the gathered table is the one planned for that count: a rank whose token
count differs from the others' sends every rank to the full path, which raises on every
rank. What this cannot see is a change on some ranks only after a signature was planned
(see ``docs/guide.md``, "No host sync"); on a group with a CPU transport every call still
gathers on the host (no device sync), and ``VTP_CHECK=1`` checks every call in full.

``options_signature`` and ``plain_options_keys`` show the options' part of a signature and
what the lookup by plain options holds (the steady-state tests read them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from . import checks, dispatch, env, head_chunks, metadata
from .backend import Backend, Call, Request, meets_layout
from .comm import group_size, is_group
from .head import Head
from .head_gather import SequenceLayout
from .invocation import Invocation
from .ops import OPS, OpSpec, backend_options, dtype_name, features_of
from .outputs import head_reduction
from .registry import REGISTRY
from .weak import IdentityMap

Tensor = torch.Tensor

MAX_PLANS = 2048  # per generation, per cache; two generations are kept


@dataclass(frozen=True)
class Metadata:
    """The planned metadata of a call with a TP group: this rank's row and the gathered
    table, as integers, and whether the group gathers on the host."""

    row: tuple[int, ...]
    table: list[list[int]]
    host: bool

    def for_tokens(self, num_tokens: int) -> Metadata:
        """The planned row and table of a call of ``num_tokens`` tokens on every rank (a
        table that cannot match, under ``VTP_CHECK=1``, stays one)."""
        return Metadata(
            tuple(metadata.with_num_tokens(self.row, num_tokens)),
            [metadata.with_num_tokens(row, num_tokens) for row in self.table],
            self.host,
        )


@dataclass(frozen=True)
class Plan:
    """What every call with one signature shares: the backend, what its ``Call`` holds, how
    the per-call tensors are shaped around it; for the token dims of one call of it
    (``for_tokens`` gives it for another call's)."""

    spec: OpSpec
    backend: Backend
    request: Request
    rank: int
    vocab_start: int
    vocab_end: int
    backend_options: Mapping[str, Any]  # Call.options
    needs_grad: tuple[bool, ...]
    topk: bool  # logprobs with an [..., k] index
    lead: tuple[int, ...]  # the logits' leading (token) dims
    head_rows: int | None  # tokens per chunk where some input is a Head, else None
    metadata: Metadata | None  # None: a single rank, nothing to agree on
    # what the ranks of an sp_group compare (checks.fingerprint, without per-call values)
    fingerprint: str = ""
    sequence: SequenceLayout | None = None  # a sequence-parallel Head's chunks (TP > 1)
    chunking: head_chunks.Chunking | None = None  # what head_rows derives from besides N

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens

    def for_tokens(self, lead: tuple[int, ...]) -> Plan:
        """This plan for a call of its signature whose token dims are ``lead``: the token
        count, the chunk rows and the planned metadata made for it (every rank makes the
        same from the same ``lead``). Not for a plan with a ``sequence``, whose signature
        holds its token dims."""
        n = math.prod(lead)
        return _replaced(
            self,
            request=_replaced(self.request, num_tokens=n),
            lead=lead,
            head_rows=None if self.chunking is None else self.chunking.rows(n),
            metadata=None if self.metadata is None else self.metadata.for_tokens(n),
        )

    def call(self, group: Any, options: Mapping[str, Any] | None = None, reduction: str = "none") -> Call:
        """The ``Call`` the backend gets, for this call's ``group``; ``options``: this call's
        options as passed, whose per-call values (``sample``'s seed) the backend gets too;
        ``reduction``: what the backend reduces itself (``Call.reduction``)."""
        backend_options = self.backend_options
        if options is not None and self.spec.per_call_backend:
            spec = self.spec
            backend_options = {
                **backend_options,
                **{
                    name: spec.options[name].canonical(options[name])
                    for name in spec.per_call_backend
                    if name in options
                },
            }
        return Call(
            request=self.request,
            group=group,
            rank=self.rank,
            vocab_start=self.vocab_start,
            vocab_end=self.vocab_end,
            options=backend_options,
            needs_grad=self.needs_grad,
            topk=self.topk,
            reduction=reduction,
        )


_Frozen = TypeVar("_Frozen", Plan, Request)


def _replaced(record: _Frozen, **changes: Any) -> _Frozen:
    """``dataclasses.replace(record, **changes)`` without running the class's ``__init__``
    field by field (several µs for a ``Plan`` or a ``Request``, on the path of a call whose
    token count changed): their fields are all init fields, with no ``__post_init__``."""
    out = object.__new__(type(record))
    out.__dict__.update(record.__dict__, **changes)
    return out


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
    mode = env.check_mode()
    if mode:
        return mode
    return "gather" if host_transport else "once"


class PlanCache:
    """The plans of one process group (or of calls without one), by signature."""

    def __init__(self) -> None:
        self._plans: dict[tuple, Plan] = {}
        self._previous: dict[tuple, Plan] = {}

    def lookup(self, key: tuple) -> Plan | None:
        plan = self._plans.get(key)
        if plan is None and key in self._previous:
            plan = self._previous[key]
            self.store(key, plan)
        return plan

    def store(self, key: tuple, plan: Plan) -> None:
        # Two generations: when the current one is full it becomes the previous one, so a
        # signature used since the last turnover survives. The count of signatures is all
        # that decides (a plan replacing its signature's adds none), so ranks whose
        # signatures change together turn over together.
        if key not in self._plans and len(self._plans) >= MAX_PLANS:
            self._previous, self._plans = self._plans, {}
        self._plans[key] = plan

    def __len__(self) -> int:
        return len(self._plans.keys() | self._previous.keys())

    def clear(self) -> None:
        self._plans, self._previous = {}, {}


_LOCAL = PlanCache()  # calls without a process group
_BY_GROUP: IdentityMap[PlanCache] = IdentityMap()


def cache_for(group: Any) -> PlanCache:
    """The plans of ``group`` (None: calls without a group)."""
    if group is None:
        return _LOCAL
    return _BY_GROUP.setdefault(group, PlanCache)


def clear() -> None:
    """Forget every plan of every group (every rank of a group must clear together, like any
    collective)."""
    _LOCAL.clear()
    _DIRECT.clear()
    for cache in _BY_GROUP.values():
        cache.clear()


def size(group: Any = ...) -> int:
    """How many plans are held: for ``group`` (None: calls without a group), or in all."""
    if group is ...:
        return len(_LOCAL) + sum(len(c) for c in _BY_GROUP.values())
    found = _LOCAL if group is None else _BY_GROUP.get(group)
    return 0 if found is None else len(found)


def groups() -> int:
    """How many groups have a plan cache (a destroyed group's goes with the group)."""
    return len(_BY_GROUP)


# Canonical option values that go into a signature (anything else -- a device tensor, a
# list ... -- makes the call take the full path, which says what is wrong with it)
_PLAIN = (int, float, bool, str, type(None))
_TENSORS = (Tensor, torch.nn.Parameter)
# the tensor options shaped like the logits' tokens (their shapes past the token dims enter
# a signature); a tensor normalizer's shape enters whole
_PER_TOKEN = ("mask", "labels")
# marks a shape in a signature that does not start with the call's token dims
_NOT_TOKENS = "shape not led by the token dims"


def _past(shape: torch.Size, lead: tuple[int, ...]) -> Any:
    """``shape`` past the token dims ``lead`` where it starts with them, else whole and marked."""
    n = len(lead)
    return shape[n:] if shape[:n] == lead else (_NOT_TOKENS, shape)


def signature(
    spec: OpSpec,
    tensors: tuple,
    options: Mapping[str, Any],
    forced: tuple,
    registry_version: int,
    needs_grad: tuple[bool, ...] | None = None,
    group: Any = None,
) -> tuple | None:
    """The key of a call's plan, or None when the call cannot have one (then it takes the
    full path every time): ``signature_and_tokens``' first part."""
    return signature_and_tokens(spec, tensors, options, forced, registry_version, needs_grad, group)[0]


def signature_and_tokens(
    spec: OpSpec,
    tensors: tuple,
    options: Mapping[str, Any],
    forced: tuple,
    registry_version: int,
    needs_grad: tuple[bool, ...] | None = None,
    group: Any = None,
    whole: bool = False,
) -> tuple[tuple | None, tuple[int, ...] | None]:
    """``(key, token dims)`` of a call: the key of its plan, or None when the call cannot have
    one (then it takes the full path every time), and its token dims, the first input's
    leading dims (a Head's hidden rows), which the key leaves out of the shapes of the inputs,
    the index, the mask and the labels (it keeps how many there are and whether any is 0: a
    call without tokens is planned apart, as dispatch tells it apart). ``whole`` (None for
    the token dims): every shape whole in the key, as for a sequence-parallel Head on a
    ``group`` of several ranks, whose chunk layout comes from every rank's token count, which
    only the metadata gather sees; the group is not part of the key otherwise (each group has
    its own cache).
    ``needs_grad``: given by a call from a compiled graph (whose tensors do not require grad
    inside the op), read from the tensors otherwise. Built on every call: keep it to
    attribute reads and a tuple.

    Options enter in their canonical form (``Option.canonical``), and an option given its
    default is left out, as if not given: ranks spelling one call differently (``2`` and
    ``np.float32(2.0)``, ``temperature=1.0`` and no temperature) have one signature, so they
    plan, reuse and turn over together."""
    traced = needs_grad is not None
    key: list[Any] = [
        spec.name,
        "compiled" if traced else torch.is_grad_enabled(),
        needs_grad,
        forced,
        registry_version,
    ]
    lead: tuple[int, ...] | None = None
    n = 0
    if whole:
        lead = ()
        key.append(None)
    for t in tensors:
        head = None
        if type(t) not in _TENSORS:
            if type(t) is not Head or traced:
                return None, None
            head, t = t, t.hidden
            if head.sequence_parallel and not whole and group_size(group) > 1:
                return signature_and_tokens(spec, tensors, options, forced, registry_version, needs_grad, group, True)
            if type(t) not in _TENSORS:
                return None, None
        shape = tuple(t.shape)  # a tuple slices in a fraction of a torch.Size's time
        if lead is None:  # the first input: its leading dims are the token dims
            lead = shape[:-1]
            n = len(lead)
            key += (n, 0 in lead)  # how many, and whether there is any token (as dispatch keys it)
        past = shape[n:] if shape[:n] == lead else (_NOT_TOKENS, shape)  # _past, inline
        key += (past, t.dtype, t.device) if traced else (past, t.dtype, t.device, t.requires_grad)
        if head is not None:
            for part in (head.weight, head.bias):
                if part is None:
                    key.append(None)
                elif type(part) in _TENSORS:
                    key += (part.shape, part.dtype, part.device, part.requires_grad)
                else:
                    return None, None
            key += (head.reduce_hidden_grad, head.chunk_rows, head.sequence_parallel)
    opts = _plain_options(spec, options)
    if opts is None:
        opts = _options_part(spec, options, lead or ())
        if opts is None:
            return None, None
    return (*key, *opts), None if whole else lead


_GROUPS = ("tp_group", "sp_group")
# A call's options as passed, when every one is a plain Python value -> their part of the
# signature: repeated calls skip canonicalizing each option. Holds names, types and plain
# values only (no tensor, no group); its result is the one _options_part gives, so what it
# holds never changes a signature, only its cost.
_PLAIN_OPTIONS: dict[tuple, tuple | None] = {}
MAX_PLAIN_OPTIONS = 4096


def _as_passed(spec: OpSpec, options: Mapping[str, Any]) -> tuple | None:
    """The op and its options as passed (in the order passed), each a plain value (a per-call
    number by its type alone; a group left out); None where some option is not plain."""
    raw: list[Any] = [spec.name]
    per_call = spec.per_call
    for name, value in options.items():
        kind = type(value)
        if kind in _PLAIN:
            raw += (name, kind) if name in per_call and kind in (int, float) else (name, kind, value)
        elif name not in _GROUPS:
            return None
    return tuple(raw)


def _plain_options(spec: OpSpec, options: Mapping[str, Any]) -> tuple | None:
    """``_options_part`` looked up by the options as passed (``_as_passed``); None where some
    is not a plain value, or where the options have no signature (then ``_options_part``
    says so again)."""
    raw_key = _as_passed(spec, options)
    if raw_key is None:
        return None
    try:
        return _PLAIN_OPTIONS[raw_key]
    except KeyError:
        pass
    if len(_PLAIN_OPTIONS) >= MAX_PLAIN_OPTIONS:
        _PLAIN_OPTIONS.clear()
    part = _PLAIN_OPTIONS[raw_key] = _options_part(spec, options)
    return part


def _options_part(spec: OpSpec, options: Mapping[str, Any], lead: tuple[int, ...] = ()) -> tuple | None:
    """The options' part of a call's signature (see ``signature``), or None where the call
    cannot have one; ``lead``: the token dims left out of the mask's and the labels' shapes."""
    key: list[Any] = []
    schema = spec.options
    for name in sorted(options):
        if name in _GROUPS:
            continue  # the TP group selects the cache; the SP group's ranks agree apart (sequence.py)
        option = schema.get(name)
        if option is None:
            return None  # an unknown option: the full path says so
        value = options[name]
        if option.tensor and type(value) is Tensor:
            # tensor options (mask, labels, normalizer): their values are data of the call,
            # never read on the host; what they are is part of the signature
            shape = _past(value.shape, lead) if name in _PER_TOKEN else value.shape
            key += (name, shape, value.dtype, value.device)
            continue
        value = option.canonical(value)
        if option.per_call and type(value) in (int, float):
            key += (name, float)  # a per-call number (num_items_in_batch, seed): checked per call
        elif type(value) not in _PLAIN:
            return None
        elif not option.is_default(value):
            key += (name, type(value), value)
    return tuple(key)


def options_signature(spec: OpSpec, options: Mapping[str, Any], *, lookup: bool = False) -> tuple | None:
    """The options' part of a call's signature, each option canonicalized; with ``lookup``,
    as the lookup by the options as passed answers it (None where some option is not a plain
    value). Both give one part for one call: the lookup only skips the canonicalizing."""
    return _plain_options(spec, options) if lookup else _options_part(spec, options)


def plain_options_keys() -> list[tuple]:
    """What the lookup by plain options holds now: a key per spelling of a call's options
    (at most ``MAX_PLAIN_OPTIONS``)."""
    return list(_PLAIN_OPTIONS)


# -- direct plans: argmax and sample on one plain tensor without a group ----------------------
# A decode loop repeats one call, one token per step: its plan is found by the call as passed
# (the logits' shape, strides, dtype, device and requires_grad, the options as passed, grad
# mode, the forced backend, the registry's version), without the input forms, the signature
# and the per-group cache. Holds descriptions only (no tensor, no group: a call with one never
# gets here), at most MAX_DIRECT; ``clear`` drops them with the rest.
MAX_DIRECT = 256


@dataclass(frozen=True, slots=True)
class Direct:
    """A direct plan: the ``plan``; its ``call`` where no option of the op reaches the backend
    per call (argmax), else None (made per call: ``sample``'s seed); ``as_is``: the logits
    go to the backend as they are (``[N, V_local]`` in its layout), else through
    ``autograd.rows``."""

    plan: Plan
    call: Call | None
    as_is: bool


_DIRECT: dict[tuple, Direct] = {}


def direct_key(op: str, x: Any, options: Mapping[str, Any]) -> tuple | None:
    """The key of an ``argmax``/``sample`` call's direct plan, or None where the call has none
    (not one plain tensor, a group given, an option that is not a plain value)."""
    if type(x) not in _TENSORS or options.get("tp_group") is not None or options.get("sp_group") is not None:
        return None
    raw = _as_passed(OPS[op], options)
    if raw is None:
        return None
    forced = dispatch.forced_backend(op, options.get("backend"))
    grad = torch.is_grad_enabled()
    return (raw, x.shape, x.stride(), x.dtype, x.device, x.requires_grad, grad, forced, REGISTRY.version)


def direct_plan(key: tuple) -> Direct | None:
    """The direct plan kept for ``key`` (``direct_key``), or None."""
    return _DIRECT.get(key)


def keep_direct(key: tuple, plan: Plan, x: Tensor) -> None:
    """Keep ``plan`` for ``key``, made for logits ``x``; past ``MAX_DIRECT`` every direct plan
    is dropped first."""
    if len(_DIRECT) >= MAX_DIRECT:
        _DIRECT.clear()
    call = None if plan.spec.per_call_backend else plan.call(None)
    as_is = x.dim() == 2 and plan.num_tokens > 0 and meets_layout(x, plan.backend.input_layout)
    _DIRECT[key] = Direct(plan, call, as_is)


def direct_size() -> int:
    """How many direct plans are kept (at most ``MAX_DIRECT``)."""
    return len(_DIRECT)


# -- the plan of a call ----------------------------------------------------------------------


def plan_for(invocation: Invocation) -> Plan:
    """The plan of an invocation: the first invocation of a signature is checked and planned
    in full, later ones reuse the plan, made for their token dims. With a TP group, whether
    the metadata is gathered again depends on ``metadata_mode``."""
    op, tensors, options = invocation.op, invocation.tensors, invocation.options
    group, failure = invocation.group, invocation.failure
    forced = invocation.traced_backend or dispatch.forced_backend(op, options.get("backend"))
    spec = OPS.get(op)
    traced_grad = invocation.traced_needs_grad
    key = cache = lead = None
    plannable = group is None or is_group(group)
    if failure is None and spec is not None and type(forced[0]) in (str, type(None)) and plannable:
        key, lead = signature_and_tokens(spec, tensors, options, forced, REGISTRY.version, traced_grad, group)
        if key is not None:
            cache = cache_for(group)
    cached = None if cache is None or key is None else cache.lookup(key)
    table = None
    if cached is not None:
        assert key is not None and cache is not None  # a plan was found by its key
        tokens_changed = False
        if lead is not None and lead != cached.lead:  # the signature's plan, for this call's token dims
            cached, tokens_changed = cached.for_tokens(lead), True
        failure = checks.per_call_failure(cached.spec, options, invocation.check)
        meta = cached.metadata
        mode = "once" if meta is None else metadata_mode(meta.host)
        if mode == "once":  # a single rank, or a group whose ranks are trusted to agree
            if failure is not None:
                raise failure
            if tokens_changed:  # kept for the calls repeating these token dims
                cache.store(key, cached)
            return cached
        if mode == "gather":  # on the host: every rank gathers once per invocation, whatever it holds
            assert meta is not None  # mode is "once" without metadata
            row = metadata.pack_failure(group, None) if failure else torch.tensor(meta.row, dtype=torch.int64)
            table = metadata.gather(row, group)
            if failure is None and table == meta.table:
                if tokens_changed:
                    cache.store(key, cached)
                return cached
        if failure is not None:
            invocation = dataclasses.replace(invocation, failure=failure)
    version = REGISTRY.version
    plan = full_path(invocation, table)
    if cache is not None and key is not None:
        if REGISTRY.version != version:  # the first invocation loaded the plugins
            assert spec is not None  # a key needs a known op
            key = signature(spec, tensors, options, forced, REGISTRY.version, traced_grad, group)
        if key is not None:
            cache.store(key, plan)
    return plan


def full_path(invocation: Invocation, table: list[list[int]] | None = None) -> Plan:
    """Local checks, the metadata gather (``table``: this invocation's table, gathered already by
    a planned invocation whose table was not the planned one) and its checks, dispatch."""
    group = invocation.group
    if not is_group(group) or group_size(group) == 1:  # the hot path of one device: no gather
        if invocation.failure is not None:
            raise invocation.failure
        checked = checks.this_rank(invocation)
        if invocation.check is not None:
            invocation.check()
        n = math.prod(checked.lead)
        shards = metadata.single_rank_shards(
            checked.inputs[0].shape[-1], checked.options["vocab_start"], checked.options["global_vocab_size"], n
        )
        return _make_plan(checked, shards, None, invocation.compiled)
    checked, sent, shards, table, host = gathered(invocation, table)
    planned = tuple(metadata.encode(dataclasses.replace(sent, checksums=None)))
    # with checksums (VTP_CHECK=1) the gathered table is not the planned one: none matches it
    meta = Metadata(planned, table if sent.checksums is None else [], host)
    return _make_plan(checked, shards, meta, invocation.compiled)


def gathered(
    invocation: Invocation, table: list[list[int]] | None = None
) -> tuple[checks.CheckedCall, metadata.RankMetadata, metadata.Shards, list[list[int]], bool]:
    """This rank's checks, then the metadata gather (unless ``table`` holds it) and its
    checks: every rank raises if any rank failed before the gather. Returns this rank's
    checked invocation, what it sent to the gather, the shards, the table and whether the group
    gathers on the host."""
    group, failure = invocation.group, invocation.failure
    checked = sent = None
    try:
        if failure is not None:
            raise failure
        checked = checks.this_rank(invocation)
        if invocation.check is not None:
            invocation.check()
        sent = rank_metadata(checked, invocation.compiled)
        row = metadata.pack(sent, group, checked.inputs[0].device)
    except Exception as exc:  # whatever it is, every rank must still reach the gather
        failure, row = exc, metadata.pack_failure(group, checks.device_of(invocation.tensors))
    if table is None:
        table = metadata.gather(row, group)
    shards = metadata.validate(table, sent, group, row.device, failure)
    # validate raised on every rank if any rank failed before the gather
    assert checked is not None and sent is not None
    return checked, sent, shards, table, row.device.type == "cpu"


def rank_metadata(checked: checks.CheckedCall, compiled: bool) -> metadata.RankMetadata:
    """What this rank sends to the metadata gather."""
    first, options = checked.inputs[0], checked.options
    device = first.device
    checksums = metadata.checksums(_checked_tensors(checked), device) if metadata.check_enabled() else None
    sequence = checked.sequence
    return metadata.RankMetadata(
        op=checked.spec.name,
        v_local=first.shape[-1],
        vocab_start=options["vocab_start"],
        vocab_end=options["vocab_end"],
        global_vocab_size=options["global_vocab_size"],
        num_tokens=math.prod(checked.lead) if checked.covered else -1,  # -1: the ranks' shards say
        dtype=first.dtype,
        device_type=device.type,
        options_fingerprint=checks.fingerprint(checked, compiled),
        forced=checked.forced,
        forced_by=checked.forced_by,
        available=dispatch.local_availability(device.type),
        checksums=checksums,
        sequence_first=-1 if sequence is None else sequence[0],
        sequence_rows=-1 if sequence is None else math.prod(sequence),
    )


def _checked_tensors(checked: checks.CheckedCall) -> list[Tensor | None]:
    """The tensors ``VTP_CHECK=1`` compares across ranks, as the op declares them
    (``OpSpec.checked``): the index, then the tensor options; a number option's tensor (a
    normalizer) as float64, so that an int tensor and a float one holding one value agree."""
    spec, out = checked.spec, []
    for name in spec.checked:
        if name == spec.index:
            out.append(checked.index)
            continue
        t = checked.options[name]
        number = spec.options[name].kind is float
        out.append(None if not isinstance(t, Tensor) else t.double() if number else t)
    return out


def request_of(checked: checks.CheckedCall, shards: metadata.Shards, compiled: bool) -> Request:
    """The ``Request`` dispatch matches against capabilities."""
    logits = checked.inputs[0]
    teacher_grad = len(checked.inputs) == 2 and checked.needs_grad[1]
    return Request(
        op=checked.spec.name,
        device_type=logits.device.type,
        dtype=logits.dtype,
        tp_size=shards.tp_size,
        vocab_size=shards.vocab_size,
        num_tokens=shards.num_tokens,
        even_shards=shards.even_shards,
        empty_shard=0 in shards.sizes,
        features=features_of(checked.spec, checked.options, topk=checked.topk, teacher_grad=teacher_grad),
        head_inputs=checked.heads is not None,
        head_per_token=checked.heads is not None and head_reduction(checked.options) == "none",
        head_sequence_parallel=checked.sequence is not None,
        compiled=compiled,
    )


def _make_plan(checked: checks.CheckedCall, shards: metadata.Shards, meta: Metadata | None, compiled: bool) -> Plan:
    request = request_of(checked, shards, compiled)
    backend = dispatch.select(request, shards, checked.forced, checked.forced_by)
    options = backend_options(checked.spec, checked.options)
    lead, sequence, head_rows, chunking = checked.lead, None, None, None
    if shards.sequence is not None and shards.tp_size > 1:
        assert checked.heads is not None  # a sequence layout comes with a sequence-parallel Head
        sequence = head_chunks.sequence_layout(
            tuple(rows for _, rows in shards.sequence), shards.rank, max(shards.sizes), checked.heads
        )
        head_rows = max(1, sequence.max_chunk)
        if not checked.covered:  # no input covered every rank's tokens: their shards make the first dim
            lead = (sum(first for first, _ in shards.sequence), *checked.lead[1:])
    elif checked.heads is not None:
        chunking = head_chunks.chunking(max(shards.sizes), checked.heads)
        head_rows = chunking.rows(shards.num_tokens)
    return Plan(
        spec=checked.spec,
        backend=backend,
        request=request,
        rank=shards.rank,
        vocab_start=shards.vocab_start,
        vocab_end=shards.vocab_end,
        backend_options=options,
        needs_grad=checked.needs_grad,
        topk=checked.topk,
        lead=lead,
        head_rows=head_rows,
        metadata=meta,
        fingerprint=checks.fingerprint(checked, compiled, per_call=False)
        + f"|dtype={dtype_name(request.dtype)}|device type={request.device_type}",
        sequence=sequence,
        chunking=chunking,
    )
