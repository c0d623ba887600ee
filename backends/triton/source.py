"""The Triton source modules (``kernels``, ``head_kernels``, ``sampling_kernels``), imported
on first use: importing the backend never imports triton."""

from __future__ import annotations

import importlib
from typing import Any

_LOADED: dict[str, Any] = {}


def module(name: str) -> Any:
    """``backends/triton/<name>.py``, imported once."""
    found = _LOADED.get(name)
    if found is None:
        found = _LOADED[name] = importlib.import_module(f"{__package__}.{name}")
    return found
