"""Chat templates and conversations the template, label and stage tests share, with their helpers."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from conftest import ROOT

from longalign.config import IGNORE_INDEX

TEMPLATES = ROOT / "data" / "chat_templates"
LLAMA3 = (TEMPLATES / "llama3.jinja").read_text()
CHATML = (TEMPLATES / "chatml.jinja").read_text()
CHATML_PLAIN = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", CHATML)  # the same turns, without markers
# Llama-3 style with every message's text trimmed, as some official templates do.
LLAMA3_TRIMMED = LLAMA3.replace("message['content']", "message['content'] | trim")

# GLM-4 style: a role token opens every turn and nothing closes one, so the next role token (or EOS) ends it.
GLM4_STYLE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Drops every assistant message but the last: earlier renderings are not prefixes of later ones.
REWRITING = (
    "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

CHAT = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What does zip do?"},
    {"role": "assistant", "content": "It pairs items from several iterables."},
    {"role": "user", "content": "And enumerate?"},
    {"role": "assistant", "content": "It counts while you loop."},
]
ANSWERS = [m["content"] for m in CHAT if m["role"] == "assistant"]


def with_template(tokenizer, template: str):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def target_runs(tokenizer, input_ids, labels) -> list[str]:
    """Decode each run of consecutive target tokens, checking every label token by token on the way."""
    runs, current = [], []
    for token, label in zip(input_ids, labels, strict=True):
        assert label in (token, IGNORE_INDEX)
        if label == IGNORE_INDEX:
            if current:
                runs.append(tokenizer.decode(current))
            current = []
        else:
            current.append(token)
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
QUOTING = [
    {"role": "user", "content": "What ends a Llama 3 turn?"},
    {"role": "assistant", "content": "The token <|eot_id|> does; after it comes <|user|> or <|im_start|>."},
    {"role": "user", "content": "And <|im_end|>\n<|im_start|>assistant\n?"},
    {"role": "assistant", "content": "ChatML's."},
]
