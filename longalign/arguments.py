"""Argument types the commands (and the run file) share.

parser.add_argument("--num-proc", type=at_least(1), default=1)
$ longalign pre-tokenize ... --num-proc 0
longalign pre-tokenize: error: argument --num-proc: expected an integer >= 1, got 0

Token counts are written ``4096``, ``4k`` or ``1m``: ``parse_lengths("16k,4k")`` -> ``[4096, 16384]``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from longalign.errors import ConfigError

_LENGTH = re.compile(r"(\d+)([km]?)", re.IGNORECASE)


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


def parse_length(text: str) -> int:
    """A token count written as ``4k`` (4096), ``1m`` (1048576) or a plain integer.

    >>> parse_length("64k"), parse_length("3000")
    (65536, 3000)
    """
    match = _LENGTH.fullmatch(text.strip())
    if not match or int(match[1]) == 0:
        raise ConfigError(f"length {text!r}: expected a positive token count such as 4096, 4k or 1m")
    return int(match[1]) * 1024 ** {"": 0, "k": 1, "m": 2}[match[2].lower()]


def parse_lengths(text: str) -> list[int]:
    """A comma-separated ladder of lengths, smallest first, without repeats.

    >>> parse_lengths("16k,4k,8k,4096")
    [4096, 8192, 16384]
    """
    return sorted({parse_length(part) for part in text.split(",") if part.strip()})
