"""The vtp-runtime command line: demo, info, bench.

Each subcommand lives in its own module with ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

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
    parser = argparse.ArgumentParser(prog="vtp-runtime", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(module=module)
        mod = _load(module)
        if mod is not None:
            mod.add_arguments(p)
    args = parser.parse_args(argv)
    mod = _load(args.module)
    if mod is None:
        parser.error(f"{args.command} is not available in this installation")
    return int(mod.run(args) or 0)


def _load(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise


if __name__ == "__main__":
    sys.exit(main())
