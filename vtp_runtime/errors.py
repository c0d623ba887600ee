"""Exceptions raised by vtp_runtime.

Bad input or an impossible request is a ``ValueError``; a problem with the environment
(a plugin, a device, a library) is a ``RuntimeError``. Every message says what to do next.
"""


class VtpError(Exception):
    """Base class of every vtp_runtime error."""


class ShardError(VtpError, ValueError):
    """The ranks of a TP group disagree, or a shard layout is invalid.

    Raised with the same message on every rank of the group.
    """


class BackendUnavailable(VtpError, ValueError):
    """No backend can run the call, or the forced backend cannot."""


class UnknownBackend(VtpError, ValueError):
    """A backend name that is not registered."""


class PluginError(VtpError, RuntimeError):
    """A backend plugin failed to load or registered something invalid."""
