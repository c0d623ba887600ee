"""The examples of docs/integrations.md and docs/migrating.md, as written.

- Each ``python`` block of integrations.md that defines ``main()`` for ``torchrun
  --nproc-per-node N`` runs on N gloo ranks here (the test suite's own process runs every
  block too, defining ``main`` without calling it: tests/test_docs.py).
- migrating.md's ``python`` blocks run in order on one process, with ``g = None`` and small
  random tensors for the names they use.
- In both, every ``py`` block is a fragment that cannot run as it stands: an HTML comment
  right above it says why and names the tests that make its calls, which must exist.
"""

import importlib.util
import re
from typing import Any

import pytest
import torch

from tests.helpers import ROOT, run_main, torchrun_examples
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


# -- fragments, and migrating.md's blocks -------------------------------------------------------------

FRAGMENT_DOCS = ["docs/integrations.md", "docs/migrating.md"]


def _fragments(doc: str) -> list[str]:
    """The reason given above each ``py`` block of ``doc`` ("" where there is none)."""
    text = (ROOT / doc).read_text()
    return [why or "" for why in re.findall(r"(?:<!-- fragment: ([^\n]*?) -->\n)?```py\n", text)]


@pytest.mark.parametrize("doc", FRAGMENT_DOCS)
def test_every_fragment_says_why_it_cannot_run(doc):
    reasons = _fragments(doc)
    assert reasons, f"{doc} has no py fragments: drop it from FRAGMENT_DOCS"
    assert all(reasons), f"{doc}: a ```py block without '<!-- fragment: why -->' above it (run it as ```python?)"
    for why in reasons:
        for test in re.findall(r"tests/[\w/]+\.py", why):
            assert (ROOT / test).is_file(), f"{doc}: {why!r} names {test}, which does not exist"


def _migrating_names() -> dict:
    """What migrating.md's blocks take as given: the TP group of one device, and small
    random inputs under the names the page uses."""
    from transformers import LlamaForCausalLM

    from tests.helpers import tiny_llama_config

    torch.manual_seed(0)
    vocab = 1000
    logits = torch.randn(2, 8, vocab, requires_grad=True)
    teacher = torch.randn(2, 8, vocab)
    labels = torch.randint(0, vocab, (2, 8))
    labels[:, :3] = -100
    names: dict[str, Any] = {"V": vocab, "g": None, "group": None, "tp_group": None}
    names.update(vocab_start_index=0, vocab_end_index=vocab)
    names.update(logits=logits, s=logits, student_logits=logits, t=teacher, teacher_logits=teacher)
    names.update(target=labels, labels=labels, shift_labels=labels)
    names.update(beta=0.5, temperature=2.0, reduction="batchmean", num_items_in_batch=None, z=1e-4, eps=0.1, alpha=0.1)
    names["model"] = LlamaForCausalLM(tiny_llama_config(vocab))
    return names


def test_migrating_examples_run():
    missing = [m for m in ("transformers", "trl") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"docs/migrating.md's examples need {', '.join(missing)} (pip install -e '.[integrations]')")
    import vtp_runtime as vtp
    from vtp_runtime.integrations.transformers import is_fused, revert_fused_lm_head

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs/migrating.md").read_text(), re.S)
    namespace = {"__name__": "__doc_example__", "vtp": vtp, "torch": torch, **_migrating_names()}
    try:
        with vtp.use_backend("eager"):
            for code in blocks:
                exec(compile(code, "<docs/migrating.md example>", "exec"), namespace)
    finally:
        revert_fused_lm_head()  # the Liger block switches vtp on for Llama
    assert is_fused(namespace["model"])
    for name in ("loss", "log_probs", "entropy", "lp", "h", "h_all"):  # what the last blocks compute
        assert torch.isfinite(namespace[name]).all(), name
