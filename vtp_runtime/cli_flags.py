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


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of integers >= 1, at least one."""
    items = text.split(",")
    if len(items) == 1:
        return [positive_int(text)]
    bad = [item for item in items if not item.strip().isdigit() or int(item) < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"{', '.join(map(repr, bad))} in {text!r}: each value must be an integer >= 1")
    return [int(item) for item in items]


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0")
    return value


def unit_float(text: str) -> float:
    """A number in [0, 1]."""
    value = _float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in [0, 1]")
    return value


def names(known: Iterable[str] | Callable[[], Iterable[str]], what: str, *, empty: bool = False):
    """The type of a comma-separated list of ``what`` (e.g. "op"), each one of ``known`` (or of
    what ``known()`` returns, asked while parsing: a registry loaded only when the flag is
    read). ``empty``: '' means none; else at least one name is needed."""

    def parse(text: str) -> list[str]:
        given = [item.strip() for item in text.split(",") if item.strip()]
        valid = list(known() if callable(known) else known)
        if not given and not empty:
            raise argparse.ArgumentTypeError(f"no {what} given; the {what}s are: {', '.join(valid)}")
        unknown = [name for name in given if name not in valid]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what}{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                f"the {what}s are: {', '.join(valid) or '(none)'}"
            )
        return given

    parse.__name__ = f"{what} names"  # argparse's fallback message names the type
    return parse
