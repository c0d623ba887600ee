"""Every relative link in README.md and docs/ leads somewhere: ``[text](path)`` to a file or
folder of the repository, ``[text](path.md#anchor)`` and ``[text](#anchor)`` to a heading of
that Markdown file, by the anchor GitHub gives it."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from tests.helpers import ROOT

DOCS = sorted({ROOT / "README.md", *ROOT.glob("docs/**/*.md")})

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)[^`].*?\1", re.S)
# [text](target) and ![alt](target), the target up to a space (a title) or the closing parenthesis
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered (code spans, links and emphasis
    reduced to their text), lowercased, every character but letters, digits, ``_``, ``-`` and
    spaces dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    kept = (c for c in text.lower() if unicodedata.category(c)[0] in "LMN" or c in "_- ")
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings; a repeated one gets -1, -2, ... as GitHub numbers them."""
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set(HTML_ANCHOR.findall(text))
    for heading in HEADING.findall(text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The relative link targets of ``path``, outside code."""
    text = CODE_SPAN.sub("", FENCE.sub("", path.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I)]


def test_slugs_as_github_makes_them():
    assert slug("Test suite (CPU)") == "test-suite-cpu"
    assert slug("The fused head: from hidden states, without the logits") == (
        "the-fused-head-from-hidden-states-without-the-logits"
    )
    assert slug("`torch.compile`") == "torchcompile"
    assert slug("TRL: every trainer that reads the LM head") == "trl-every-trainer-that-reads-the-lm-head"
    assert slug("Small shards (N=1024, TP=4): 61-81% of copy bandwidth") == (
        "small-shards-n1024-tp4-61-81-of-copy-bandwidth"
    )
    assert slug("CPU cost per call: 150 µs missed by 3x") == "cpu-cost-per-call-150-µs-missed-by-3x"
    assert slug("[Sampling](guide.md) with *top-p*") == "sampling-with-top-p"


def test_repeated_headings_are_numbered(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Setup\n\n## Setup\n\n```bash\n# Setup\n```\n\n### Setup\n")
    assert anchors(doc) == {"setup", "setup-1", "setup-2"}


def test_links_outside_code_only(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        '[a](a.md) and ![b](img/b.png) and [c](https://example.com/x) and [d](b.md#x "title")\n'
        "`[e](e.md)` and\n```md\n[f](f.md)\n```\n[g [h]](#top)\n"
    )
    assert links(doc) == ["a.md", "img/b.png", "b.md#x", "#top"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    broken = []
    for target in links(doc):
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file or folder")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: {dest.relative_to(ROOT)} has no heading with the anchor #{anchor}")
    assert not broken, f"{doc.relative_to(ROOT)}:\n  " + "\n  ".join(broken)
