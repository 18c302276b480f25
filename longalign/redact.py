"""Secrets never in clear: values redacted by the name they are stored under and by their shape.

Everything longalign prints or writes about settings and the environment (the preflight table, config
mismatch messages, the probe's JSON) goes through here::

    redact("HF_TOKEN", "hf_abc")                    -> "sha256:5e8c2f0a"  (a short hash: comparable, not readable)
    redact("HTTPS_PROXY", "http://u:pw@proxy:3128") -> "http://u:***@proxy:3128"
    redact("WANDB_PROJECT", "longalign")            -> "longalign"

A name is secret when one of its parts (split at ``_``, ``-``, ``.``) ends with TOKEN, KEY, SECRET,
PASSWORD, PASSWD, CREDENTIAL(S) or AUTH (``HF_TOKEN``, ``APIKEY``, ``OAUTH``; not ``tokenizer`` or
``max_new_tokens``), or is exactly PAT (``GITHUB_PAT``, not ``PYTHONPATH``).
"""

from __future__ import annotations

import hashlib
import re

SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "AUTH")
SECRET_PARTS = ("PAT",)  # only as a whole part: PAT is inside PATH
_PARTS = re.compile(r"[_\-.\s]+")
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.\-]*://[^/@\s:]*):(?P<password>[^/@\s]*)@", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """Whether a variable or setting called ``name`` holds a secret."""
    parts = [part for part in _PARTS.split(name.upper()) if part]
    return any(part.endswith(SECRET_WORDS) or part in SECRET_PARTS for part in parts)


def redact(name: str, value: object) -> str:
    """``value`` as it may be shown: a short hash for a secret name, else with URL passwords masked."""
    text = str(value)
    if is_secret_name(name):
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:8]
    return redact_text(text)


def redact_text(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` masked."""
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}:***@", text)


def redact_override(item: str) -> str:
    """A ``section.key=value`` command-line override with its value redacted by the key's name."""
    key, sep, value = item.partition("=")
    return f"{key}{sep}{redact(key, value)}" if sep else redact_text(item)
