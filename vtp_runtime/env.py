"""The environment variables vtp_runtime reads, through one reader.

Values only select among names the code knows (a registered backend, a check mode, a plugin
on the allowlist); nothing imports a module named by an environment variable.
"""

from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")


def text(name: str) -> str:
    """The variable's value, stripped ("" when unset)."""
    return os.environ.get(name, "").strip()


def flag(name: str) -> bool:
    """Whether the variable is set to a true value: 1, true, yes or on (any case)."""
    return text(name).lower() in _TRUE


def check_mode() -> str:
    """``VTP_CHECK``: "check" (1/true/yes/on: every call in full, with checksums of the
    integer inputs), "once" (the metadata gathered once per signature) or "" (the default:
    decided by the group's transport; see ``vtp_runtime.plans.metadata_mode``)."""
    value = text("VTP_CHECK").lower()
    if value in _TRUE:
        return "check"
    return "once" if value == "once" else ""


def triton_interpret() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs kernels on CPU tensors through its interpreter."""
    return text("TRITON_INTERPRET") == "1"


def head_gemm() -> str:
    """``VTP_HEAD_GEMM``: "cublas" forces the fused head's logits through ``torch.mm``
    (cuBLAS chunks) on a backend that has a GEMM of its own (the triton backend's epilogue
    GEMM); "triton" takes that GEMM wherever it can run, also where cuBLAS chunks were
    measured faster; "" (unset, or any other value) lets the backend choose."""
    value = text("VTP_HEAD_GEMM").lower()
    return value if value in ("cublas", "triton") else ""
