"""The multi-rank examples of docs/integrations.md, as written: each ``python`` block that
defines ``main()`` for ``torchrun --nproc-per-node N`` runs on N gloo ranks here (the test
suite's own process runs every block too, defining ``main`` without calling it:
tests/test_docs.py)."""

import importlib.util
import pathlib
import re
from typing import Any

import pytest

from vtp_runtime.testing.distributed import RankPool

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install -e '.[integrations]')",
)


def _examples():
    text = (ROOT / "docs/integrations.md").read_text()
    out = []
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        ranks = re.search(r"torchrun --nproc-per-node (\d+)", block)
        if "def main(" in block and ranks:
            out.append((int(ranks.group(1)), block))
    return out


def _run_example(rank, world, group, block, path):
    import inspect

    import vtp_runtime as vtp

    namespace: dict[str, Any] = {"__name__": "__doc_example__"}
    exec(compile(block, "<docs/integrations.md example>", "exec"), namespace)
    main = namespace["main"]
    kwargs = {"path": path} if "path" in inspect.signature(main).parameters else {}  # where it saves a model
    with vtp.use_backend("eager"):
        loss = main(**kwargs)
    return float(loss)


def test_the_docs_have_multi_rank_examples():
    assert sorted(world for world, _ in _examples()) == [2, 4]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("index", range(len(_examples())))
def test_multi_rank_example_runs(index, tmp_path):
    world, block = _examples()[index]
    pool = RankPool(world, env={"VTP_BACKEND": "eager"})
    try:
        losses = pool.run(_run_example, block, str(tmp_path / "model"), timeout=300)
    finally:
        pool.close()
    assert 0 < losses[0] < 20
    if "fsdp" not in block.lower():  # tensor parallel only: every rank holds the same loss
        assert len(set(losses)) == 1, losses
