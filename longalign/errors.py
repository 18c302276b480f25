"""The errors longalign raises on purpose about what the user gave it.

Every command prints a ``LongAlignError`` as one line and exits with status 2; anything else (a fault in
longalign, torch or transformers, or any error once training has started) keeps its traceback::

    >>> raise ConfigError("training.lr: expected a number, got 'fast'")
    longalign train: error: training.lr: expected a number, got 'fast'

The subclasses also derive from the built-in error of the same meaning, so ``except ValueError`` and
``except OSError`` around a longalign call keep working.
"""

from __future__ import annotations

import difflib
import json
from typing import Any


class LongAlignError(Exception):
    """Base class: a problem with the user's input, settings, paths or models, said in one line."""


class ConfigError(LongAlignError, ValueError):
    """A setting, a command-line value or a combination of them that cannot run."""


class InputError(LongAlignError, ValueError):
    """Input data (a line, a record, a stage directory) that cannot be used as it is."""


class ModelError(LongAlignError, ValueError):
    """A model, checkpoint or tokenizer that longalign cannot use, or not in the way asked."""


class PathError(LongAlignError, OSError):
    """A path the user named is missing, of the wrong kind, or not writable."""


def did_you_mean(key: str, choices: list[str]) -> str:
    """The end of an error about an unknown ``key``: ``"; did you mean 'factor'?"``, or ``""``.

    >>> did_you_mean("factr", ["factor", "rope_type"])
    "; did you mean 'factor'?"
    """
    close = difflib.get_close_matches(key, choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def as_json(value: Any) -> str:
    """``value`` in an error as a ``config.json`` holds it: ``true``, ``null``, ``{"factor": 4.0}``.

    >>> as_json({"rope_type": "yarn", "original": None})
    '{"rope_type": "yarn", "original": null}'
    """
    return json.dumps(value)
