"""What several test files share: the repository's root, the tiny transformers model the
integration tests build, the docs' multi-rank examples, and the device mesh and DTensor check
of rank jobs."""

from __future__ import annotations

import inspect
import pathlib
import re
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

ROOT = pathlib.Path(__file__).resolve().parent.parent


# -- the tiny transformers model ---------------------------------------------------------------


def tiny_llama_config(vocab_size: int, hidden_size: int = 32, **overrides: Any):
    """A ``LlamaConfig`` of one layer, 4 attention heads on 2 key-value heads, an MLP twice as
    wide as ``hidden_size``, untied embeddings (so the head can be sharded on its own);
    ``overrides`` replace any of those."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**{**fields, **overrides})


# -- the docs' multi-rank examples, as written -------------------------------------------------


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


# -- test ids ----------------------------------------------------------------------------------


def head_case_id(case) -> str:
    """A ``HeadCase``'s test id: its own id and its token shape."""
    return f"{case.id}-N{'x'.join(map(str, case.shape))}"


# -- DTensors in rank jobs ---------------------------------------------------------------------

_MESHES: dict = {}


def pool_mesh(world: int, shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    """The CPU mesh of ``shape`` (its dimensions named ``names``) over every rank of the pool,
    made once per rank process (a 2-D mesh creates process groups, a collective)."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (world, shape, names)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh("cpu", torch.arange(world).reshape(shape), mesh_dim_names=names)
    return _MESHES[key]


def as_dtensor(x: object) -> DTensor:
    """``x``, which must be a DTensor: a result of a call on DTensors, or its gradient."""
    from torch.distributed.tensor import DTensor

    assert isinstance(x, DTensor), f"a {type(x).__name__}, not a DTensor"
    return x
