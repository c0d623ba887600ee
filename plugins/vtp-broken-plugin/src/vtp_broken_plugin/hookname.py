"""A plugin with a misspelled hook name (``backend`` instead of ``backends``)."""

from vtp_runtime import hookimpl


@hookimpl
def vtp_runtime_register_backend(register):
    raise AssertionError("never called")
