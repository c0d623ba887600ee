"""Argument types of the ``vtp-runtime`` subcommands: each refuses a bad value while the
command line is parsed, so that argparse exits with status 2 and a message naming the flag
(``argument --tokens: ...``) before anything runs.

Every subcommand (``vtp_runtime.info``, ``vtp_runtime.tools.*``) takes its numeric and
name-list flags from here (``type=positive_int``, ``type=names(...)``). Outside
``vtp_runtime.tools`` and needing only the standard library: ``info`` works without the tools.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable
from typing import TypeVar

N = TypeVar("N", int, float)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _bounded(parse: Callable[[str], N], within: Callable[[N], bool], what: str) -> Callable[[str], N]:
    """The type of a value that ``parse`` reads and ``within`` accepts; ``what`` says which
    (e.g. "an integer >= 1")."""

    def check(text: str) -> N:
        value = parse(text)
        if not within(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    check.__name__ = check.__doc__ = what
    return check


positive_int = _bounded(_int, lambda v: v >= 1, "an integer >= 1")
non_negative_int = _bounded(_int, lambda v: v >= 0, "an integer >= 0")
positive_float = _bounded(_float, lambda v: v > 0, "a number > 0")
non_negative_float = _bounded(_float, lambda v: v >= 0, "a number >= 0")
unit_float = _bounded(_float, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of integers >= 1, at least one."""
    items = text.split(",")
    if len(items) == 1:
        return [positive_int(text)]
    bad = [item for item in items if not item.strip().isdigit() or int(item) < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"{', '.join(map(repr, bad))} in {text!r}: each value must be an integer >= 1")
    return [int(item) for item in items]


def names(known: Iterable[str] | Callable[[], Iterable[str]], what: str, *, empty: bool = False):
    """The type of a comma-separated list of ``what`` (e.g. "op"), each one of ``known`` (or of
    what ``known()`` returns, asked while parsing: a registry loaded only when the flag is
    read). ``empty``: '' means none; else at least one name is needed."""

    def parse(text: str) -> list[str]:
        listed = [item.strip() for item in text.split(",") if item.strip()]
        valid = list(known() if callable(known) else known)
        if not listed and not empty:
            raise argparse.ArgumentTypeError(f"no {what} given; the {what}s are: {', '.join(valid)}")
        unknown = [name for name in listed if name not in valid]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what}{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                f"the {what}s are: {', '.join(valid) or '(none)'}"
            )
        return listed

    parse.__name__ = f"{what} names"  # argparse's fallback message names the type
    return parse
