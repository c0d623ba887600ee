"""The command-line tools beside the runtime: ``vtp-runtime demo`` and ``vtp-runtime bench``
(with ``bench --head``). They use only the public API and ``vtp_runtime.testing``."""
