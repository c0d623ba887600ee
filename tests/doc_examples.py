"""The multi-rank examples of the docs, as written: each ``python`` block that defines
``main()`` for ``torchrun --nproc-per-node N``, and one way to run one on a rank."""

from __future__ import annotations

import inspect
import pathlib
import re
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent


def torchrun_examples(text: str) -> list[tuple[int, str]]:
    """``(N, block)`` for each ``python`` block of ``text`` defining ``main()`` for
    ``torchrun --nproc-per-node N``."""
    out = []
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        world = re.search(r"torchrun --nproc-per-node (\d+)", block)
        if "def main(" in block and world:
            out.append((int(world.group(1)), block))
    return out


def run_main(block: str, source: str, **offered: Any) -> float:
    """Define the example ``block`` (from ``source``, for tracebacks) and call its ``main``
    on the eager backend, with those of ``offered`` it takes; its loss as a float."""
    import vtp_runtime as vtp

    namespace: dict[str, Any] = {"__name__": "__doc_example__"}
    exec(compile(block, f"<{source} example>", "exec"), namespace)
    main = namespace["main"]
    taken = {k: v for k, v in offered.items() if k in inspect.signature(main).parameters}
    with vtp.use_backend("eager"):
        return float(main(**taken))
