"""Built-in backends, installed as ``vtp_runtime.backends.*``.

This folder is also importable as a top-level ``backends`` package from the repository
root (pytest puts the root on ``sys.path``); importing it under that name would give a
second copy of every backend class, so it is refused.
"""

if __name__ != "vtp_runtime.backends":
    raise ImportError(
        f"import the built-in backends as vtp_runtime.backends.<name>, not as {__name__!r} "
        f"(one module, one set of classes)"
    )
