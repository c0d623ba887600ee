"""The ``triton`` backend: fused vocabulary-parallel Triton kernels (CUDA; CPU under TRITON_INTERPRET=1).

``kernels.py`` holds the Triton source, ``backend.py`` the ``TritonBackend`` glue and its
``LaunchConfig``. Importing this package never imports triton: the probe reports a missing
triton as a reason instead.
"""

from vtp_runtime.registry import hookimpl

from .backend import TritonBackend, capabilities
from .config import CUDA_CONFIG, INTERPRETER_CONFIG, LaunchConfig

__all__ = ["TritonBackend", "LaunchConfig", "CUDA_CONFIG", "INTERPRETER_CONFIG", "capabilities"]


@hookimpl
def vtp_runtime_register_backends(register):
    register(TritonBackend())
