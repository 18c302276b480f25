"""Argument types the commands share.

parser.add_argument("--num-proc", type=at_least(1), default=1)
$ longalign pre-tokenize ... --num-proc 0
longalign pre-tokenize: error: argument --num-proc: expected an integer >= 1, got 0
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(lowest: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``lowest`` (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lowest}, got {value}")
        return value

    return parse


def seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value
