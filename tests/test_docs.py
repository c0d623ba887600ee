"""Every Python example in the README and the user guide runs (each file's blocks in order,
in one namespace, as a reader would paste them)."""

import pathlib
import re

import pytest

import vtp_runtime as vtp

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs/guide.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_examples_run(doc):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)
    assert blocks, f"{doc} has no python examples"
    namespace = {"__name__": "__doc_example__"}
    # as a user on a CPU machine would run them: the test process enables the (slow) Triton
    # interpreter for CPU tensors, which a reader's machine does not
    with vtp.use_backend("eager"):
        for code in blocks:
            exec(compile(code, f"<{doc} example>", "exec"), namespace)
