"""The vtp-runtime command line: demo, info, bench.

Each subcommand lives in its own module with ``add_arguments(parser)`` and ``run(args) -> int``,
imported only when that subcommand is asked for (``--help`` tries each, to show why one cannot
load): a subcommand whose module or dependencies are missing fails alone, with the reason, and
``info`` never imports the benchmark tools.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

COMMANDS = {
    "demo": (
        "vtp_runtime.tools.demo",
        "train a small vocabulary-sharded student on 2 ranks and check it against float64",
    ),
    "info": ("vtp_runtime.info", "versions, devices, plugins and which backend can run which op"),
    "bench": ("vtp_runtime.tools.bench", "benchmark ops x backends x shard sizes against peers"),
}


DESCRIPTION = (
    "Exact vocabulary-parallel losses on vocabulary-sharded logits. "
    "Run 'vtp-runtime COMMAND --help' for a command's options."
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # the first positional argument names the subcommand (the top level has no option taking a
    # value): only its module is imported; without one (--help, a typo) each is tried
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="vtp-runtime", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if chosen in COMMANDS and name != chosen:
            sub.add_parser(name, help=help_text)
            continue
        loaded = load(module)
        if isinstance(loaded, str):
            if name == chosen:
                print(f"vtp-runtime: {name} is unavailable: {loaded}", file=sys.stderr)
                return 2
            sub.add_parser(name, help=f"{help_text} [unavailable: {loaded}]".replace("%", "%%"))
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        loaded.add_arguments(p)
        p.set_defaults(run=loaded.run)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


def load(module: str) -> ModuleType | str:
    """The subcommand's module, or why it cannot be imported."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = exc.name or ""
        if missing == "vtp_runtime" or missing.startswith("vtp_runtime."):
            return f"{exc} (an incomplete installation of vtp-runtime: reinstall it)"
        return str(exc)


if __name__ == "__main__":
    sys.exit(main())
