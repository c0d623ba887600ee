"""docs/backend-authors.md opens with a whole minimal backend: short, and it runs."""

import re
from pathlib import Path

import torch

import vtp_runtime as vtp

DOC = Path(__file__).resolve().parents[1] / "docs" / "backend-authors.md"


def _minimal_backend() -> str:
    text = DOC.read_text()
    section = text[text.index("## The minimal backend") :]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None
    return found.group(1)


def test_the_minimal_backend_is_one_screen():
    code = [line for line in _minimal_backend().splitlines() if line.strip() and not line.strip().startswith("#")]
    assert len(code) <= 60, len(code)


def test_the_minimal_backend_runs_and_matches_eager():
    namespace: dict = {"__name__": "__doc_example__"}
    exec(compile(_minimal_backend(), "<docs/backend-authors.md: the minimal backend>", "exec"), namespace)
    logits = torch.randn(5, 33, dtype=torch.float32, requires_grad=True)
    with vtp.registry.registered(namespace["MyPlugin"](), name="minimal"):
        mine = vtp.entropy(logits, temperature=1.3, reduction="sum", backend="my_entropy")
        (grad,) = torch.autograd.grad(mine, logits)
    want = vtp.entropy(logits, temperature=1.3, reduction="sum", backend="eager")
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(mine, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-5, rtol=1e-5)
    assert "my_entropy" not in vtp.registry.REGISTRY.backends()
