"""The multi-rank examples of docs/integrations.md, as written: each ``python`` block that
defines ``main()`` for ``torchrun --nproc-per-node N`` runs on N gloo ranks here (the test
suite's own process runs every block too, defining ``main`` without calling it:
tests/test_docs.py)."""

import importlib.util

import pytest

from tests.doc_examples import ROOT, run_main, torchrun_examples
from vtp_runtime.testing.distributed import RankPool

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install -e '.[integrations]')",
)


def _examples():
    return torchrun_examples((ROOT / "docs/integrations.md").read_text())


def _run_example(rank, world, group, block, path):
    return run_main(block, "docs/integrations.md", path=path)  # ``path``: where it saves a model


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
