"""scripts/make_retrieval_data.py: retrieval chats that teach what the needle grid scores, reproducible."""

from __future__ import annotations

import json
import random
import re
import sys

import pytest
from conftest import ROOT, TOKENIZER, load_script, run_process
from transformers import AutoTokenizer

from longalign.eval.needle import INTRO, QUESTION_FORM, random_needle

make = load_script("make_retrieval_data")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def test_the_answer_is_the_needle_hidden_in_the_prompt_as_the_needle_grid_reads_it(tokenizer):
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    chats = make.generate(200, seed=0, min_sentences=0, max_sentences=8)
    for user, assistant in ((c[0]["content"], c[1]["content"]) for c in chats):
        fact = re.search(r"The special magic number for (\S+) is (\d{7})\.", user)
        assert user.count("special magic number for") == 2  # the needle, and the question about it
        assert user.startswith(INTRO) and user.endswith(
            QUESTION_FORM.format(
                question=f"What is the special magic number for {fact[1]} mentioned in the text?"
            )
        )
        assert assistant == f"The special magic number for {fact[1]} is {fact[2]}."
        # What the model learns to write is what the needle grid reads: its answer prefix, then the answer.
        prefix, answer = f"The special magic number for {fact[1]} is", f" {fact[2]}"
        assert encode(assistant) == encode(prefix) + encode(answer) + encode(".")
    sentences = [
        c[0]["content"].count(".") - 3 for c in chats
    ]  # less the intro's 2 periods and the question's
    assert min(sentences) == 1 and max(sentences) == 9  # 0 to 8 fillers, and the needle


def test_the_needles_are_drawn_as_the_needle_grid_draws_them():
    chat = make.retrieval_chat(random.Random(5), 3)
    needle = random_needle(random.Random(5))
    assert (
        needle.text in chat[0]["content"] and chat[1]["content"] == f"{needle.answer_prefix} {needle.answer}."
    )


@pytest.mark.integration
def test_the_same_seed_writes_the_same_file_and_another_seed_another(tmp_path, monkeypatch):
    script = ROOT / "scripts" / "make_retrieval_data.py"

    def written(name: str, *args: str, process: bool = False) -> bytes:
        out = tmp_path / name
        argv = [str(script), "--output", str(out), "--count", "50", *args]
        if process:  # another process draws its string hashes with another seed
            result = run_process([sys.executable, *argv], timeout=120)
            assert result.returncode == 0, result.stderr
        else:
            monkeypatch.setattr(sys, "argv", argv)
            make.main()
        return out.read_bytes()

    first, again = written("a.jsonl"), written("b.jsonl", process=True)
    other = written("c.jsonl", "--seed", "1")
    assert first == again != other
    assert [json.loads(line)["messages"][1]["role"] for line in first.splitlines()] == ["assistant"] * 50
