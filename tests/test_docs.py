"""Every Python example in the README, the user guide and the integrations page runs (each
file's ```python blocks in order, in one namespace, as a reader would paste them; ```py
blocks need a launcher and several ranks and are shown, not run)."""

import importlib.util
import pathlib
import re

import pytest

import vtp_runtime as vtp

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs/guide.md", "docs/integrations.md"]
NEEDS = {"docs/integrations.md": ("transformers", "trl")}


@pytest.mark.parametrize("doc", DOCS)
def test_examples_run(doc):
    missing = [m for m in NEEDS.get(doc, ()) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{doc}'s examples need {', '.join(missing)} (pip install -e '.[integrations]')")
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)
    assert blocks, f"{doc} has no python examples"
    namespace = {"__name__": "__doc_example__"}
    # as a user on a CPU machine would run them: the test process enables the (slow) Triton
    # interpreter for CPU tensors, which a reader's machine does not
    with vtp.use_backend("eager"):
        for code in blocks:
            exec(compile(code, f"<{doc} example>", "exec"), namespace)
