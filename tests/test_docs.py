"""The docs against the code: every Python example in the README, the user guide and the
integrations page runs (each file's ```python blocks in order, in one namespace, as a reader
would paste them; ```py blocks are fragments that cannot run as they stand, each saying why:
tests/test_integrations_docs.py, which also runs docs/migrating.md's examples),
and every environment variable, `vtp-runtime` command line and op option the docs name exists."""

import importlib.util
import re

import pytest

import vtp_runtime as vtp
from tests.helpers import ROOT

DOCS = ["README.md", "docs/guide.md", "docs/integrations.md"]
NEEDS = {"docs/integrations.md": ("transformers", "trl", "torchtitan", "megatron.core")}


def _installed(module: str) -> bool:
    try:  # a dotted name imports its parent, which raises where the parent is not installed
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize("doc", DOCS)
def test_examples_run(doc):
    missing = [m for m in NEEDS.get(doc, ()) if not _installed(m)]
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


# -- what the docs name must exist in the code ---------------------------------------------
# Environment variables, `vtp-runtime` flags and op options named anywhere in the docs are
# checked against the code that reads them, so renaming or removing one fails here first.

DOC_FILES = sorted({ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("plugins/*/README.md")})
SOURCES = sorted({*ROOT.glob("vtp_runtime/**/*.py"), *ROOT.glob("backends/**/*.py")})


def _doc_text() -> str:
    return "\n".join(p.read_text() for p in DOC_FILES)


def _code_snippets(text: str) -> list[str]:
    """Fenced blocks (continued lines joined) and inline code spans."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [b.replace("\\\n", " ") for b in fenced] + re.findall(r"`([^`\n]+(?:\n[^`\n]+)*)`", prose)


def _env_vars_read() -> tuple[set[str], set[str]]:
    """(names, prefixes): string constants that are exactly an env var name, and the constant
    start of f-strings that build one (f"VTP_BACKEND_{op.upper()}" gives "VTP_BACKEND_")."""
    import ast

    names, prefixes = set(), set()
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(r"VTP_[A-Z0-9_]+", node.value)
            ):
                names.add(node.value)
            elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                head = str(node.values[0].value)
                if re.fullmatch(r"VTP_[A-Z0-9_]*_", head):
                    prefixes.add(head)
    return names, prefixes


def test_documented_env_vars_are_read_by_the_code():
    documented = set(re.findall(r"\bVTP_[A-Z0-9_]*[A-Z0-9](?:_<OP>)?", _doc_text()))
    assert {"VTP_BACKEND", "VTP_DEBUG", "VTP_PLUGINS"} <= documented
    names, prefixes = _env_vars_read()
    per_op = {f"{p}{op.upper()}" for p in prefixes for op in vtp.OPS} | {f"{p}<OP>" for p in prefixes}
    missing = documented - names - per_op
    assert not missing, f"documented but never read by vtp_runtime: {sorted(missing)}"


def test_per_op_backend_variables_force_their_op(monkeypatch):
    from vtp_runtime import dispatch

    for op in vtp.OPS:
        monkeypatch.setenv(f"VTP_BACKEND_{op.upper()}", "eager")
        assert dispatch.forced_backend(op, None) == ("eager", f"VTP_BACKEND_{op.upper()}")


def _parsers() -> dict:
    import argparse
    import importlib

    from vtp_runtime.cli import COMMANDS

    out = {}
    for name, (module, _) in COMMANDS.items():
        out[name] = argparse.ArgumentParser(prog=f"vtp-runtime {name}", exit_on_error=False)
        importlib.import_module(module).add_arguments(out[name])
    return out


def test_documented_command_lines_parse():
    """Every `vtp-runtime <command> ...` in the docs parses with that command's real parser
    (flags exist, values have the right type and are among the choices)."""
    import argparse
    import shlex

    parsers = _parsers()
    flags = {opt for p in parsers.values() for a in p._actions for opt in a.option_strings}
    seen, bad = 0, []
    for snippet in _code_snippets(_doc_text()):
        for line in snippet.splitlines():
            for m in re.finditer(r"vtp-runtime ([a-z]+)([^#|;&>`]*)", line):
                command, rest = m.group(1), m.group(2).replace("[", " ").replace("]", " ")
                seen += 1
                if command not in parsers:
                    bad.append(f"{m.group(0)!r}: no command {command!r}")
                    continue
                try:
                    _, unknown = parsers[command].parse_known_args(shlex.split(rest))
                except (argparse.ArgumentError, SystemExit) as exc:
                    bad.append(f"{m.group(0).strip()!r}: {exc}")
                    continue
                if unknown:
                    bad.append(f"{m.group(0).strip()!r}: vtp-runtime {command} has no {' '.join(unknown)}")
        if snippet.startswith("--"):  # a flag named in prose
            flag = snippet.split()[0]
            if flag not in flags:
                bad.append(f"`{snippet}`: no vtp-runtime command has {flag}")
    assert seen >= 5, "expected the docs to show vtp-runtime command lines"
    assert not bad, "\n".join(bad)


def _options(op: str | None) -> dict:
    """The options an op takes with their defaults; every op's for None."""
    specs = vtp.OPS.values() if op is None else [vtp.OPS[op]]
    out: dict = {}
    for spec in specs:
        for name, value in spec.defaults.items():
            out.setdefault(name, []).append(value)
    return out


def test_documented_op_options_exist():
    """Options in op calls shown in the docs (``kl(student, teacher, reverse=False)``) exist
    for that op; lists of what ops take (``takes `temperature=1.0, ...` ``) name real options
    with their real defaults."""
    import ast

    text = _doc_text()
    bad, seen = [], 0
    for snippet in _code_snippets(text):
        for m in re.finditer(
            r"(?<![\w.])(?:vtp\.)?(cross_entropy|logprobs|entropy|kl|jsd|loss|argmax|sample)\(([^()]*)\)", snippet
        ):
            op, args = m.group(1), m.group(2)
            if op == "loss":
                named = re.match(r'\s*"(\w+)"', args)
                if not named:
                    continue
                op = named.group(1)
                if op not in vtp.OPS:
                    bad.append(f"{m.group(0)}: no op {op!r}")
                    continue
            for name in re.findall(r"(\w+)=", args):
                seen += 1
                if name not in _options(op):
                    bad.append(f"{m.group(0)}: {op} takes no option {name!r}")
    for span in re.findall(r"\btakes?\s+`([^`]+)`", text):
        for name, value in re.findall(r"(\w+)=([^,]+)", span):
            seen += 1
            if name not in _options(None):
                bad.append(f"`{span}`: no op takes {name!r}")
                continue
            try:
                default = ast.literal_eval(value.strip().split("|")[0])
            except (ValueError, SyntaxError):
                continue  # a placeholder such as `label_smoothing=ε`
            if any(d != default for d in _options(None)[name]):
                bad.append(f"`{span}`: {name} defaults to {_options(None)[name][0]!r}, not {default!r}")
    assert seen >= 15, "expected the docs to show op options"
    assert not bad, "\n".join(bad)


def test_every_benchmark_result_is_indexed_and_every_cited_one_exists():
    results = ROOT / "benchmarks" / "results"
    index = (results / "README.md").read_text()
    listed = set()
    for cell in re.findall(r"^\| `([^|]+)` \|", index, re.M):  # "`a.json`, `.log`" -> a.json, a.log
        names = re.findall(r"`?([\w.]+)`?", cell)
        stem = names[0].rsplit(".", 1)[0]
        listed |= {stem + n if n.startswith(".") else n for n in names}
    present = {p.name for p in results.iterdir()} - {"README.md"}
    assert present == listed, f"not indexed: {sorted(present - listed)}; indexed but absent: {sorted(listed - present)}"
    cited = re.findall(r"results/([\w.*]+)", _doc_text() + (ROOT / "benchmarks" / "NOTES.md").read_text())
    for name in cited:
        name = name.rstrip(".")
        assert list(results.glob(name)), f"the docs cite benchmarks/results/{name}, which does not exist"
