"""The backend registry: one pluggy hook, built-in and third-party backends alike.

A plugin is a module (or object) with a ``vtp_runtime_register_backends(register)`` hook
implementation; it calls ``register(backend)`` once per backend, so each registration is
validated here and attributed to its plugin. Built-in backends register through the same
hook. Third-party plugins are found through the ``vtp_runtime.backends`` entry-point group,
loaded lazily at first use, one at a time, each in isolation: a plugin that fails is
recorded and warned about once, and every other backend keeps working.

The registry is the only global mutable state of vtp_runtime.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Iterable

import pluggy

from .backend import Backend, check_backend
from .errors import PluginError, UnknownBackend

PROJECT = "vtp_runtime"
ENTRY_POINT_GROUP = "vtp_runtime.backends"
BUILTIN_MODULES = (
    "vtp_runtime.backends.eager",
)

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class HookSpecs:
    @hookspec
    def vtp_runtime_register_backends(self, register: Callable[[Backend], None]) -> None:
        """Call ``register(backend)`` for each backend this plugin provides."""


@dataclass
class PluginRecord:
    """One loaded (or failed) plugin, as ``vtp-runtime info`` shows it."""

    name: str  # entry-point name or module name
    source: str  # "builtin" or the distribution "name version"
    status: str  # "loaded", "failed", "skipped"
    backends: tuple[str, ...] = ()
    error: str = ""


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class Registry:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._backends: dict[str, Backend] = {}
        self._owner: dict[str, str] = {}  # backend name -> source that registered it
        self.plugins: list[PluginRecord] = []
        self._loaded = False
        self.version = 0  # bumped on every change; caches key on it
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(HookSpecs)

    # -- registration ------------------------------------------------------------------
    def register_plugin(self, plugin: object, name: str | None = None, source: str = "local") -> PluginRecord:
        """Register a plugin object (module or instance with the hook). Raises on an invalid
        registration, leaving the registry as it was."""
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        new: list[Backend] = []

        def register(backend: Backend) -> None:
            check_backend(backend)
            taken = [b.name for b in new] + list(self._backends)
            if backend.name in taken:
                first = self._owner.get(backend.name, source)
                raise PluginError(
                    f"backend {backend.name!r} is registered twice: by {first} and by {source}; "
                    f"uninstall one of them, or allowlist one with VTP_PLUGINS")
            new.append(backend)

        with self._lock:
            # Only this plugin is registered while its hook runs, so hook order never matters.
            self._pm.register(plugin, name=f"{source}:{name}")
            try:
                if not self._pm.get_hookcallers(plugin):
                    raise PluginError(f"plugin {name!r} ({source}) has no "
                                      f"vtp_runtime_register_backends hook implementation")
                self._pm.hook.vtp_runtime_register_backends(register=register)
            finally:
                self._pm.unregister(plugin)
            for backend in new:
                self._backends[backend.name] = backend
                self._owner[backend.name] = source
            record = PluginRecord(name, source, "loaded", tuple(b.name for b in new))
            self.plugins.append(record)
            self.version += 1
            return record

    def unregister(self, name: str) -> None:
        """Remove a backend (tests use this to undo an in-process registration)."""
        with self._lock:
            self._backends.pop(name, None)
            self._owner.pop(name, None)
            self.version += 1

    # -- loading -----------------------------------------------------------------------
    def ensure_loaded(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            for module in BUILTIN_MODULES:
                self.register_plugin(importlib.import_module(module), name=module, source="builtin")
            if not _env_flag("VTP_DISABLE_PLUGIN_AUTOLOAD"):
                self._load_entry_points()

    def _load_entry_points(self) -> None:
        allow = os.environ.get("VTP_PLUGINS")
        allowed = None if allow is None else {a.strip() for a in allow.split(",") if a.strip()}
        strict = _env_flag("VTP_STRICT_PLUGINS")
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = getattr(ep, "dist", None)
            source = f"{dist.name} {dist.version}" if dist is not None else ep.value
            if allowed is not None and ep.name not in allowed:
                self.plugins.append(PluginRecord(ep.name, source, "skipped", error="not in VTP_PLUGINS"))
                continue
            try:
                self.register_plugin(ep.load(), name=ep.name, source=source)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                self.plugins.append(PluginRecord(ep.name, source, "failed", error=error))
                if strict:
                    raise PluginError(f"plugin {ep.name!r} ({source}) failed to load: {error} "
                                      f"(VTP_STRICT_PLUGINS=1 makes this an error)") from exc
                warnings.warn(f"vtp_runtime: plugin {ep.name!r} ({source}) failed to load and is "
                              f"skipped: {error}. Set VTP_STRICT_PLUGINS=1 to raise instead.",
                              RuntimeWarning, stacklevel=2)

    # -- lookup ------------------------------------------------------------------------
    def backends(self) -> dict[str, Backend]:
        """Registered backends by name, in canonical order (priority desc, then name)."""
        self.ensure_loaded()
        ordered = sorted(self._backends.values(), key=lambda b: (-b.priority, b.name))
        return {b.name: b for b in ordered}

    def get(self, name: str) -> Backend:
        backends = self.backends()
        if name not in backends:
            raise UnknownBackend(f"unknown backend {name!r}; registered backends: "
                                 f"{', '.join(sorted(backends)) or '(none)'}")
        return backends[name]

    def owner(self, name: str) -> str:
        return self._owner.get(name, "")


REGISTRY = Registry()


def register(plugin: object, name: str | None = None) -> PluginRecord:
    """Register an in-process plugin object (tests, notebooks)."""
    REGISTRY.ensure_loaded()
    return REGISTRY.register_plugin(plugin, name=name, source="local")


def backend_names() -> Iterable[str]:
    return REGISTRY.backends().keys()
