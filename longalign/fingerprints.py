"""Short content digests that say whether two things are the same: settings, tokenizers, cache keys.

``digest({"max_seq_len": 4096, "strategy": "bfd"})`` is ``"ddf6e215df21"``: 12 hex digits of SHA-256 over
the value written as JSON with sorted keys.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def digest(value: Any) -> str:
    """12 hex digits of SHA-256 over ``value`` written as JSON with sorted keys (anything else as ``str``)."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def tokenizer_digests(tokenizer: Any) -> dict[str, str]:
    """What decides a tokenization, digested apart so a difference can be named: vocabulary, chat template.

    The vocabulary includes the added tokens.
    """
    return {
        "vocabulary": digest(sorted(tokenizer.get_vocab().items())),
        "chat template": digest(tokenizer.chat_template),
    }
