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


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``: a rank-local detail under the message every rank shares.
    Python 3.10 has no ``add_note``: the note goes to ``__notes__`` all the same, which
    tracebacks print from 3.11 on."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]  # 3.11+
