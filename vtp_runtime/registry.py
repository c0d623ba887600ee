"""The backend registry: one pluggy hook, built-in and third-party backends alike.

A plugin is a module (or object) with a ``vtp_runtime_register_backends(register)`` hook
implementation; it calls ``register(backend)`` once per backend, so each registration is
validated here and attributed to its plugin. Built-in backends register through the same
hook. Third-party plugins are found through the ``vtp_runtime.backends`` entry-point group,
loaded lazily at first use, one at a time and in canonical order (entry-point name, then
distribution), each in isolation: a plugin that fails to import or registers something
invalid is recorded, warned about once, and every other backend keeps working. A plugin
is all or nothing: if any of its registrations fails, none of them is kept.

Environment, read once at first use:

- ``VTP_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points (built-ins only).
- ``VTP_PLUGINS=a,b``: load only these entry-point or distribution names.
- ``VTP_STRICT_PLUGINS=1``: a plugin that fails raises ``PluginError`` instead.

The registry is the one piece of global mutable state that decides anything. The rest is
derived from it or scoped: dispatch's selection cache and its VTP_DEBUG log-once set (keyed
on ``Registry.version``, which every change bumps), each backend's probe cache (per device
type, for the life of the process), and ``use_backend``'s overrides (a ContextVar).

``Registry.strict_error`` is the ``PluginError`` that a strict lookup raises once plugins
failed to load under ``VTP_STRICT_PLUGINS=1`` (None otherwise); tests set it to stand in
for a failed load.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib import metadata

import pluggy

from . import env
from .backend import Backend, check_backend
from .errors import PluginError, UnknownBackend

PROJECT = "vtp_runtime"
ENTRY_POINT_GROUP = "vtp_runtime.backends"
BUILTIN_MODULES = (
    "vtp_runtime.backends.eager",
    "vtp_runtime.backends.liger",
    "vtp_runtime.backends.triton",
    "vtp_runtime.backends.triton_xpu",
)

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class HookSpecs:
    @hookspec
    def vtp_runtime_register_backends(self, register: Callable[[Backend], None]) -> None:
        """Call ``register(backend)`` for each backend this plugin provides."""


class PluginLoadWarning(RuntimeWarning):
    """A backend plugin failed to load and was skipped (filterable with ``warnings``)."""


@dataclass
class PluginRecord:
    """One plugin as ``vtp-runtime info`` shows it."""

    name: str  # entry-point name, or module name for built-in and in-process plugins
    dist: str = ""  # distribution name ("" for in-process plugins)
    version: str = ""
    status: str = "loaded"  # "loaded", "failed", "skipped" (allowlist), "disabled" (autoload off)
    backends: tuple[str, ...] = ()
    error: str = ""
    value: str = ""  # what the entry point points at

    @property
    def source(self) -> str:
        """Who registered: ``"dist version"``, or the plugin name for in-process plugins."""
        return f"{self.dist} {self.version}".strip() or self.name


def _entry_points() -> list[metadata.EntryPoint]:
    """Entry points of the group in canonical order, so every machine loads them alike."""
    eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    return sorted(eps, key=lambda ep: (ep.name, ep.dist.name if ep.dist else "", ep.value))


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


class Registry:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._backends: dict[str, Backend] = {}
        self._ordered: dict[str, Backend] = {}
        self._owner: dict[str, PluginRecord] = {}  # backend name -> the plugin that registered it
        self.plugins: list[PluginRecord] = []
        self._loaded = False
        self._loading = False
        self.strict_error: PluginError | None = None  # raised by each strict lookup once plugins failed
        self.version = 0  # bumped on every change; caches key on it

    # -- registration ------------------------------------------------------------------
    def register_plugin(self, plugin: object, record: PluginRecord) -> PluginRecord:
        """Run ``plugin``'s hook and add its backends, or raise leaving the registry as it
        was (a plugin is all or nothing). ``record`` says who the plugin is."""
        new: dict[str, Backend] = {}
        open_ = True

        def register(backend: Backend) -> None:
            if not open_:
                raise PluginError(f"plugin {record.name!r} called register() after its hook returned")
            if isinstance(backend, type):
                raise PluginError(
                    f"register() takes a Backend instance, got the class "
                    f"{backend.__name__}; call register({backend.__name__}())"
                )
            if not isinstance(backend, Backend):
                raise PluginError(f"register() takes a vtp_runtime.Backend, got {type(backend).__name__}")
            check_backend(backend)
            if backend.name in new:
                raise PluginError(f"plugin {record.name!r} ({record.source}) registers backend {backend.name!r} twice")
            if backend.name in self._backends:
                first = self._owner[backend.name]
                raise PluginError(
                    f"backend {backend.name!r} is registered twice: first by {first.name!r} ({first.source}), "
                    f"then by {record.name!r} ({record.source}); the second is skipped. Uninstall one "
                    f"of them, or choose one with VTP_PLUGINS"
                )
            new[backend.name] = backend

        # A fresh manager per plugin: only this plugin's hook runs, and a plugin that fails
        # pluggy's validation leaves nothing behind.
        pm = pluggy.PluginManager(PROJECT)
        pm.add_hookspecs(HookSpecs)
        with self._lock:
            try:
                pm.register(plugin, name=record.name)
                pm.check_pending()  # a misspelled hook name fails here instead of doing nothing
                if not pm.get_hookcallers(plugin):
                    raise PluginError(
                        f"plugin {record.name!r} ({record.source}) has no "
                        f"vtp_runtime_register_backends hook implementation"
                    )
                pm.hook.vtp_runtime_register_backends(register=register)
            finally:
                open_ = False
            record.backends, record.status = tuple(new), "loaded"
            self._backends.update(new)
            self._owner.update(dict.fromkeys(new, record))
            self.plugins.append(record)
            self._changed()
            return record

    def unregister(self, name: str) -> None:
        """Remove a backend (tests use this to undo an in-process registration)."""
        with self._lock:
            self._backends.pop(name, None)
            record = self._owner.pop(name, None)
            if record is not None:
                record.backends = tuple(b for b in record.backends if b != name)
                if not record.backends and not record.dist:
                    self.plugins.remove(record)
            self._changed()

    def _changed(self) -> None:
        self._ordered = {b.name: b for b in sorted(self._backends.values(), key=lambda b: (-b.priority, b.name))}
        self.version += 1

    # -- loading -----------------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        """Whether the plugins' entry points were loaded (the first lookup loads them)."""
        return self._loaded

    def ensure_loaded(self, strict: bool = True) -> None:
        """Load built-ins and entry points once. Under VTP_STRICT_PLUGINS=1 a failed plugin
        raises here, on every call (``strict=False``: don't raise, e.g. to report it)."""
        if not self._loaded:
            with self._lock:  # other threads wait here until loading is done
                if not self._loaded and not self._loading:  # a plugin looking up backends does not recurse
                    self._loading = True
                    try:
                        self._load_all()
                    finally:
                        self._loaded = True
        if strict and self.strict_error is not None:
            raise self.strict_error

    def _load_all(self) -> None:
        failed = []
        for module in BUILTIN_MODULES:
            record = PluginRecord(module, "vtp-runtime", _version("vtp-runtime"), value=module)
            failed += self._load(functools.partial(importlib.import_module, module), record)
        allowed = {_norm(a) for a in env.text("VTP_PLUGINS").split(",") if a.strip()}
        disabled = env.flag("VTP_DISABLE_PLUGIN_AUTOLOAD")
        seen = set()
        for ep in _entry_points():
            dist = ep.dist
            record = PluginRecord(ep.name, dist.name if dist else "", dist.version if dist else "", value=ep.value)
            seen |= {_norm(ep.name), _norm(record.dist)}
            if disabled:
                self.plugins.append(_skip(record, "disabled", "VTP_DISABLE_PLUGIN_AUTOLOAD is set"))
            elif allowed and not allowed & {_norm(ep.name), _norm(record.dist)}:
                self.plugins.append(_skip(record, "skipped", "not in VTP_PLUGINS"))
            else:
                failed += self._load(ep.load, record)
        if allowed - seen and not disabled:
            warnings.warn(
                f"vtp_runtime: VTP_PLUGINS names {', '.join(sorted(allowed - seen))}, which "
                f"no installed distribution provides",
                PluginLoadWarning,
                stacklevel=4,
            )
        if failed and env.flag("VTP_STRICT_PLUGINS"):
            self.strict_error = PluginError(
                "backend plugins failed to load (VTP_STRICT_PLUGINS=1 makes this an error):\n"
                + "\n".join(f"  {r.name} ({r.source}): {r.error}" for r in failed)
            )

    def _load(self, load: Callable[[], object], record: PluginRecord) -> list[PluginRecord]:
        """Import and register one plugin in isolation; the failed record, if it fails."""
        try:
            self.register_plugin(load(), record)
            return []
        except Exception as exc:  # isolation: any failure is recorded, never propagated
            record.status, record.error, record.backends = "failed", f"{type(exc).__name__}: {exc}", ()
            self.plugins.append(record)
            if not env.flag("VTP_STRICT_PLUGINS"):
                warnings.warn(
                    f"vtp_runtime: backend plugin {record.name!r} ({record.source}) failed to "
                    f"load and is skipped: {record.error}. Other backends are unaffected; "
                    f"set VTP_STRICT_PLUGINS=1 to make this an error.",
                    PluginLoadWarning,
                    stacklevel=5,
                )
            return [record]

    # -- lookup ------------------------------------------------------------------------
    def backends(self, strict: bool = True) -> dict[str, Backend]:
        """Registered backends by name, in canonical order (priority desc, then name).
        Read-only: a snapshot replaced (never mutated) on change."""
        self.ensure_loaded(strict)
        return self._ordered

    def get(self, name: str) -> Backend:
        backends = self.backends()
        if name not in backends:
            raise UnknownBackend(
                f"unknown backend {name!r}; registered backends: {', '.join(sorted(backends)) or '(none)'}"
            )
        return backends[name]

    def owner(self, name: str) -> PluginRecord | None:
        """The plugin that registered backend ``name``."""
        return self._owner.get(name)


def _skip(record: PluginRecord, status: str, why: str) -> PluginRecord:
    record.status, record.error = status, why
    return record


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


REGISTRY = Registry()


def register(plugin: object, name: str | None = None) -> PluginRecord:
    """Register an in-process plugin object (tests, notebooks); raises ``PluginError`` or
    ``ValueError`` on an invalid registration, leaving the registry unchanged."""
    REGISTRY.ensure_loaded()
    name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
    return REGISTRY.register_plugin(plugin, PluginRecord(name, value="in-process"))


@contextlib.contextmanager
def registered(plugin: object, name: str | None = None) -> Iterator[PluginRecord]:
    """``register(plugin)`` for the duration of a block (tests): its backends are removed on exit."""
    record = register(plugin, name)
    try:
        yield record
    finally:
        for backend in record.backends:
            REGISTRY.unregister(backend)


def backend_names() -> Iterable[str]:
    return REGISTRY.backends().keys()
