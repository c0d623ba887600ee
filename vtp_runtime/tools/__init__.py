"""The command-line tools beside the runtime: ``vtp-runtime demo`` and ``vtp-runtime bench``
(with ``bench --head``). They use only the public API, ``vtp_runtime.testing`` and the
flag types of ``vtp_runtime.cli_flags``."""
