"""One op call in flight: what the caller passed, carried as one record from the face
(``vtp_runtime.pipeline``, or ``vtp_runtime.library`` inside a ``torch.compile``'d graph) to
the plan of the call (``vtp_runtime.plans``) and this rank's checks (``vtp_runtime.checks``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Check = Callable[[], None]  # a check of per-call data; raises what is wrong


@dataclass(eq=False, slots=True)
class Invocation:
    """An op call as this rank's caller made it.

    - ``tensors``: the op's tensor arguments (local tensors or ``Head``\\ s, after
      ``inputs.normalize``); ``options``: the options as passed (no defaults filled in).
    - ``check``: per-call data checks of a composite op (``vtp_runtime.topk``), run before
      any collective, on every call; ``failure``: an error the caller met on this rank before
      the call, raised on every rank through the metadata gather.
    - ``traced_needs_grad``, ``traced_backend``: a call made from a ``torch.compile``'d graph
      (``vtp_runtime.library``) has them fixed when it was traced: which inputs need
      gradients (inside the op nothing requires grad) and the forced backend with where it
      was forced. None for an eager call, which reads them from its tensors and options.

    Made for every call (cheaply: this is on every call's path); never modified.
    """

    op: str
    tensors: tuple
    options: Mapping[str, Any]
    check: Check | None = None
    failure: Exception | None = None
    traced_needs_grad: tuple[bool, ...] | None = None
    traced_backend: tuple[str | None, str] | None = None

    @property
    def group(self) -> Any:
        """The call's ``tp_group`` (None: no group)."""
        return self.options.get("tp_group")

    @property
    def compiled(self) -> bool:
        """Made from a ``torch.compile``'d graph."""
        return self.traced_needs_grad is not None


__all__ = ["Check", "Invocation"]
