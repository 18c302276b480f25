"""RULER: RULER's sizing with several tokenizers, references a solver finds in the prompt, seeds, scoring, the
effective length, servers that solve or half-read (raw completions and chats), instances held against RULER's
own, teacher-forced scoring; all with the network blocked."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import socket
import string
from collections import Counter
from pathlib import Path

import pytest
from conftest import TOKENIZER, assert_packed_scoring_is_exact, save_tiny_model
from openai_stub import OpenAIStub
from templates import CHATML, with_template
from transformers import AutoTokenizer

from longalign.cli import main
from longalign.errors import ConfigError, InputError, PathError
from longalign.eval import needle as nd
from longalign.eval import ruler
from longalign.eval.models import Reply, chat_frame, check_fits
from longalign.labels import tokenize_conversation

KEY = "sk-ruler-test-77c1"
REFERENCE = Path(__file__).parent / "data" / "ruler"  # stand-in inputs and RULER's own instances on them
SYNTHETIC = [t for t, task in ruler.TASKS.items() if task.family != "qa"]


@pytest.fixture(autouse=True)
def offline(no_network, monkeypatch):
    """Only 127.0.0.1 can be reached: a download (a haystack, a dataset, an NLTK model) fails the test."""
    monkeypatch.setenv("OPENAI_API_KEY", KEY)


def test_the_network_is_blocked():
    with pytest.raises(OSError, match="network blocked"), socket.socket() as s:
        s.connect(("93.184.215.14", 80))


# --- tokenizers ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A SentencePiece-style BPE (Metaspace pre-tokenizer, as Llama 2's) trained here, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = [json.loads(line) for line in (TOKENIZER.parent / "sample.jsonl").read_text().splitlines()]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=list(string.printable.strip()),  # every character a prompt holds, no <unk>
    )
    backend.train_from_iterator((m["content"] for row in lines for m in row["messages"]), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def tokenizers(tokenizer, glm_tokenizer, metaspace_tokenizer):
    return {
        "llama3": tokenizer,  # byte-level BPE, Llama-3 template
        "glm4": glm_tokenizer,  # the same vocabulary, GLM-4 template and role tokens
        "chatml": with_template(tokenizer, CHATML),
        "metaspace": metaspace_tokenizer,
    }


# --- QA files in the datasets' own formats ------------------------------------------------------------------


def vault(n: int) -> tuple[str, str]:
    return f"The passcode of vault {n} is {n * 7919 % 100000:05d}.", f"{n * 7919 % 100000:05d}"


@pytest.fixture(scope="module")
def qa_files(tmp_path_factory) -> dict[str, Path]:
    """SQuAD 2.0 and HotpotQA (distractor) JSON whose answers a reader finds by the vault number."""
    root = tmp_path_factory.mktemp("qa")
    articles = []
    for a in range(6):
        paragraphs = []
        for p in range(4):
            n = 10 * a + p
            text, code = vault(n)
            qas = [{"id": f"q{n}", "question": f"What is the passcode of vault {n}?", "is_impossible": False,
                    "answers": [{"text": code, "answer_start": text.index(code)}, {"text": f"{code}.", "answer_start": 0}]},
                   {"id": f"x{n}", "question": "What is the passcode of the moon?", "is_impossible": True,
                    "answers": [], "plausible_answers": []}]  # fmt: skip
            paragraphs.append(
                {"context": f"Vault {n} sits in hall {a}. {text} It opens at noon.", "qas": qas}
            )
        articles.append({"title": f"Hall {a}", "paragraphs": paragraphs})
    (root / "squad.json").write_text(json.dumps({"version": "v2.0", "data": articles}))
    rows = []
    for q in range(8):
        first, second = 100 + 2 * q, 101 + 2 * q
        context = [[f"Vault {first}", [f"Vault {first} is kept by vault {second}'s keeper. ", "It is old."]],
                   [f"Vault {second}", [vault(second)[0] + " ", "It is new."]],
                   [f"Hall {q}", ["A quiet hall. ", "Nothing is kept here."]]]  # fmt: skip
        rows.append({"_id": f"h{q}", "question": f"What is the passcode of the vault that keeps vault {first}?",
                     "answer": vault(second)[1], "context": context, "type": "bridge", "level": "easy",
                     "supporting_facts": [[f"Vault {first}", 0], [f"Vault {second}", 0]]})  # fmt: skip
    (root / "hotpot.json").write_text(json.dumps(rows))
    return {"squad": root / "squad.json", "hotpot": root / "hotpot.json"}


@pytest.fixture(scope="module")
def qa_data(qa_files):
    return {"squad": ruler.read_squad(qa_files["squad"]), "hotpot": ruler.read_hotpot(qa_files["hotpot"])}


def build(tokenizer, qa_data, **settings):
    defaults = dict(tasks=list(ruler.TASKS), lengths=[2000, 3000], samples_per_task=2, seed=0)
    return ruler.build_instances(
        tokenizer, squad=qa_data["squad"], hotpot=qa_data["hotpot"], **{**defaults, **settings}
    )


def one(tokenizer, task: str, length: int, **settings) -> ruler.RulerCase:
    """The first instance of ``task`` at ``length``, seed 0."""
    return ruler.build_instances(
        tokenizer, tasks=[task], lengths=[length], samples_per_task=1, seed=0, **settings
    )[0]


# --- solvers: each family read back out of the prompt's text ------------------------------------------------

NEEDLE = re.compile(r"One of the special magic (?:numbers|uuids) for (\S+) is: (\S+)\.")
QUERY = re.compile(
    r"What (?:is|are all) the special magic (?:number|uuid)s? for (.+?) mentioned in the provided text\?"
)


def solve_niah(text: str, question: str) -> str:
    keys = re.split(r", and |, | and ", QUERY.search(question)[1])
    values = [v for key in keys for k, v in NEEDLE.findall(text) if k == key]
    return ", ".join(values)


def solve_vt(text: str, question: str) -> str:
    value = re.search(r"assigned the value (\d+) in the text above", question)[1]
    names = re.findall(rf"VAR (\w+) = {value}\b", text)
    while names and (
        found := [n for n in re.findall(rf"VAR (\w+) = VAR {names[-1]}\b", text) if n not in names]
    ):
        names += found
    return " ".join(names)


def solve_cwe(text: str, question: str) -> str:
    counts = Counter(re.findall(r"\d+\. (\S+)", text))
    return " ".join(f"{i + 1}. {w}" for i, (w, _) in enumerate(counts.most_common(10)))


def solve_fwe(text: str, question: str) -> str:
    counts = Counter(w for w in text.split() if re.fullmatch(r"[a-z]{6}", w))
    return ", ".join(w for w, _ in counts.most_common(3))


def solve_qa(text: str, question: str) -> str:
    wanted = re.search(r"vault (\d+)\?", question)[1]
    if "keeps vault" in question:  # two hops: the keeper first
        wanted = re.search(rf"Vault {wanted} is kept by vault (\d+)", text)[1]
    found = re.search(rf"The passcode of vault {wanted} is (\d+)", text)
    return found[1] if found else "unknown"


SOLVERS = {"niah": solve_niah, "vt": solve_vt, "cwe": solve_cwe, "fwe": solve_fwe, "qa": solve_qa}
INTROS = ["Memorize and track the chain", "Below is a numbered list", "Read the following coded text",
          "The following are given documents", "A special magic", "Some special magic"]  # fmt: skip


def parts(content: str) -> tuple[str, str]:
    """The task's text (after the worked example, if any) and its question."""
    start = max(content.rfind(intro) for intro in INTROS)
    cut = max(content.rfind("\nQuestion:"), content.rfind("\nWhat "))
    return content[start:cut], content[cut:]


def family_of(content: str) -> str:
    text, question = parts(content)
    if "assigned the value" in question:
        return "vt"
    if "numbered list" in text[:100]:
        return "cwe"
    if "coded text" in question:
        return "fwe"
    return "qa" if "documents" in text[:100] else "niah"


def solve(content: str, *, first_half: bool = False) -> str:
    text, question = parts(content)
    return SOLVERS[family_of(content)](text[: len(text) // 2] if first_half else text, question)


def prompt_of(body: dict) -> str:
    """What a request asks: a raw completion's prompt, or a chat's last user message."""
    return body["prompt"] if "prompt" in body else body["messages"][-1]["content"]


# --- instances ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama3", "glm4", "chatml", "metaspace"])
def test_every_prompt_and_its_budget_fit_the_length_and_the_chat_is_encoded_once(tokenizers, qa_data, name):
    tok = tokenizers[name]
    frame = chat_frame(tok)
    for prefix_in in (
        ("assistant", "user") if name == "llama3" else ("user" if name == "glm4" else "assistant",)
    ):
        cases = build(tok, qa_data, samples_per_task=1, prefix_in=prefix_in)
        assert len(cases) == 2 * len(ruler.TASKS)
        for case in cases:
            assert len(case.prompt.input_ids) + case.new_tokens <= case.length, (name, case.task)
        assert [c.new_tokens for c in cases[::2]] == [t.new_tokens for t in ruler.TASKS.values()]
        for case in cases:
            content = case.prompt.messages[-1]["content"]
            assert content.endswith(case.answer_prefix) == (prefix_in == "user"), (name, case.task)
            rendered = tok.apply_chat_template(
                case.prompt.messages, tokenize=False, add_generation_prompt=True
            )
            if prefix_in == "user":  # a chat: the server renders it
                assert case.prompt.text is None
                assert case.prompt.input_ids == tok(rendered, add_special_tokens=False).input_ids
                continue
            # RULER's raw prompt: the template's text with the prefix after the generation prompt, encoded once
            assert case.prompt.input_ids == tok(case.prompt.text, add_special_tokens=False).input_ids
            assert case.prompt.text.startswith(frame.before) and case.prompt.text.endswith(
                rendered + case.answer_prefix
            )
            if case.task != "cwe":  # cwe: RULER's example is a whole templated prompt before it
                assert case.prompt.text == rendered + case.answer_prefix, (name, case.task)


def test_sizes_are_rulers_search_and_step_back(tokenizer, qa_data):
    """One size per task and length from RULER's search; a sample steps back whole steps from it, never over."""
    assert ruler._search(lambda n: 10 + 7 * n, 1000, 5, 5, 3) == 141  # the largest n with 10 + 7n <= 1000
    # RULER's upper bound: 3 x the size that a draw of one step (5 units, 135 tokens) suggests, 111 < 128
    assert ruler._search(lambda n: 100 + 7 * n, 1000, 5, 5, 3) == 111
    assert ruler._search(lambda n: 2000 + n, 1000, 5, 5, 3) == 5  # none fits: the step (the sample says why)
    cases = build(tokenizer, qa_data, lengths=[4096], samples_per_task=5)
    for task, spec in ruler.TASKS.items():
        mine = [c for c in cases if c.task == task]
        step = ruler.step(spec, 4096, spec.new_tokens)
        top = max(c.units for c in mine)
        assert all((top - c.units) % step == 0 for c in mine), (task, [c.units for c in mine])
        assert all(len(c.prompt.input_ids) + c.new_tokens <= 4096 for c in mine), task
    essays = [c.units for c in cases if c.task == "niah_single_2"]
    assert ruler.step(ruler.TASKS["niah_single_2"], 4096, 128) == 500 and min(essays) >= 500
    assert ruler.step(ruler.TASKS["niah_single_1"], 2048, 128) == 5  # under 4096: RULER's smaller line step


@pytest.mark.parametrize("name", ["llama3", "glm4"])
def test_local_prompts_are_the_ids_pre_tokenize_gives_the_same_chat(tokenizers, name):
    """needle, ruler and chat prompts (and [eval_tasks], built by the same functions) begin the token
    sequence that pre-tokenize makes of the chat they ask for, answered (cwe is left out: RULER's prompt
    holds a whole templated example before the chat)."""
    tok = tokenizers[name]
    needles = nd.build_cases(tok, nd.haystack_pool(tok, None, seed=0), lengths=[300], depths=[0, 50], samples=1,
                             seed=0)  # fmt: skip
    tasks = ["niah_single_1", "niah_multiquery", "vt", "fwe"]
    rulers = ruler.build_instances(tok, tasks=tasks, lengths=[2000], samples_per_task=1, seed=0)
    chat = chat_frame(tok).prompt("What does zip do?\n\nAnswer in one line.")
    asked = [(c.prompt, "", c.answer) for c in needles]  # (prompt, its answer prefix, a reply)
    asked += [(c.prompt, c.answer_prefix, f"{c.answer_prefix} {', '.join(c.references)}") for c in rulers]
    asked += [(chat, "", "It pairs items.")]
    for prompt, after, reply in asked:
        ids = prompt.input_ids
        text = tok.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True) + after
        assert ids == tok(text, add_special_tokens=False).input_ids  # the rendered chat, encoded once
        chat_ids, _ = tokenize_conversation(tok, [*prompt.messages, {"role": "assistant", "content": reply}])
        # pre-tokenize's ids of the answered chat: the same, but the last token, which training can merge
        # with the answer ('\n\n' + 'The' is '\n', '\n', 'The' to the shipped tokenizer)
        assert chat_ids[: len(ids) - 1] == ids[:-1], prompt.messages[0]["content"][:60]


def test_the_references_are_found_in_the_prompt_and_the_needles_where_the_offsets_say(tokenizers, qa_data):
    for name, tok in tokenizers.items():
        for case in build(tok, qa_data, samples_per_task=1):
            content = case.prompt.messages[-1]["content"]
            assert ruler.score_output(case.task, case.references, solve(content)) == 100.0, (name, case.task)
            ids = case.prompt.input_ids
            for offset, reference in zip(case.needle_offsets, case.references, strict=False):
                shown = tok.decode(ids[offset : offset + 120])
                if ruler.TASKS[case.task].family == "niah":  # the needle starts in the first token shown
                    found = NEEDLE.search(shown)
                    assert found and found.start() <= 3 and reference in shown, (name, case.task, shown)
                elif case.task == "vt":
                    assert shown.strip().startswith(f"VAR {reference} ="), (name, shown)
                else:
                    assert shown.startswith("Document "), (name, case.task, shown)


# NVIDIA/RULER's task templates and answer prefixes (scripts/data/synthetic/constants.py, Apache-2.0), as
# its generators fill them. The reference generators themselves cannot run in this suite: lm-eval 0.4.13's
# RULER tasks pull 38 more packages (scipy, scikit-learn, nltk among them) into the test environment, and
# both it and RULER's scripts download NLTK's punkt model and the essays at run time.
RULER_TEXT = {
    "niah": "Some special magic {v} are hidden within the following text. Make sure to memorize it. I will quiz "
    "you about the {v} afterwards.\n{context}\nWhat are all the special magic {v} for {query} mentioned in the "
    "provided text? The special magic {v} for {query} mentioned in the provided text are",
    "vt": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above. Answer: According to "
    "the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, "
    "they are: ",
    "cwe": "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
    "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list? "
    "Answer: The top 10 words that appear most often in the list are:",
    "fwe": "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the "
    "dots '....'. What are the three most frequently appeared words in the above coded text? Answer: According "
    "to the coded text above, the three most frequently appeared words are:",
    "qa": "Answer the question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
    "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query} Answer:",
}


def ruler_pattern(task: str) -> re.Pattern:
    """RULER's text of ``task`` with its slots open: ``context`` (the haystack), ``query``, ``num_v``."""
    family = ruler.TASKS[task].family
    text = RULER_TEXT[family]
    if family == "niah":
        kind = ruler.TASKS[task].value
        if ruler.TASKS[task].values * ruler.TASKS[task].queries == 1:  # RULER's own edits for one value
            text = text.replace("Some", "A").replace("are all", "is").replace("are", "is")
            kind = kind[:-1]
        text = text.replace("{v}", kind)
    slots = {"{context}": "(?P<context>.+)", "{query}": "(?P<query>.+?)", "{num_v}": "5"}
    pattern = re.escape(text)
    for slot, group in slots.items():
        pattern = pattern.replace(re.escape(slot), group, 1).replace(re.escape(slot), "(?P=query)")
    return re.compile(pattern + "$", re.S)


def test_each_task_is_rulers_text_around_a_haystack_of_rulers_units(tokenizer, qa_data):
    """Task by task: RULER's template and answer prefix as RULER sends API models; its haystack units; vt's
    example and a blank line before the task; cwe's example, its answer and a line break before it."""
    cases = build(tokenizer, qa_data, lengths=[2000], samples_per_task=1, prefix_in="user")
    for case in cases:
        content, family = case.prompt.messages[-1]["content"], ruler.TASKS[case.task].family
        assert len(case.prompt.messages) == 1
        if family == "vt":  # RULER's worked example, answered after its prefix, then a blank line
            cut = content.rindex("Memorize and track")
            assert content[:cut].startswith(RULER_TEXT["vt"][:60])
            shot, content = content[:cut], content[cut:]
            assert re.search(r"they are:  [A-Z]{3}( [A-Z]{3}){4}\n\n$", shot), shot[-80:]
        if family == "cwe":  # RULER's worked example and its answer, then a line break, in the same message
            cut = content.rindex("Below is a numbered list")
            shot = re.escape(RULER_TEXT["cwe"]).replace(
                re.escape("{context}"), r"1\. \S+( \d+\. \S+){39}"
            )  # 20 words: 3 and 1 times
            assert re.fullmatch(shot + r" 1\. \S+( \d+\. \S+){9}\n", content[:cut]), content[:cut][-200:]
            content = content[cut:]
        found = ruler_pattern(case.task).match(content)
        assert found, (case.task, content[-300:])
        context = found["context"]
        if family == "niah":
            needles = NEEDLE.findall(context)
            assert sorted(v for k, v in needles if k in found["query"]) == sorted(case.references), case.task
            haystack = ruler.TASKS[case.task].haystack
            if haystack == "noise":  # every line RULER's noise sentence but the needle's
                assert sum(line != ruler.NOISE for line in context.split("\n")) == 1, case.task
            elif haystack == "needles":
                lines = context.split("\n")
                assert len(lines) == case.units + 1 and all(NEEDLE.fullmatch(line) for line in lines)
        elif family == "vt":
            assert re.search(rf"^VAR {case.references[0]} = {found['query']}$", context, re.M)
            for a, b in zip(case.references, case.references[1:], strict=False):
                assert f"\nVAR {b} = VAR {a} \n" in context + "\n"  # RULER's space after each hop
            assert context.count("\n") + 1 == case.units + 5
        elif family == "cwe":
            assert re.match(r"1\. \S+ 2\. \S+ 3\. ", context)
        elif family == "fwe":
            assert set(context.split()) >= {"...", *case.references}
        else:
            assert re.match(r"Document 1:\n", context) and found["query"].endswith("?")


def test_needles_sit_at_rulers_depths_and_distractors_never_carry_the_asked_key(tokenizer, qa_data):
    cases = build(
        tokenizer, qa_data, tasks=["niah_single_2", "niah_multikey_1", "niah_multikey_2"], samples_per_task=6
    )
    depths = set()
    for case in cases:
        content = case.prompt.messages[-1]["content"]
        text, question = parts(content)
        key = QUERY.search(question)[1]
        assert [v for k, v in NEEDLE.findall(text) if k == key] == case.references
        if case.task == "niah_multikey_1":
            assert len(NEEDLE.findall(text)) == 4  # the asked key's needle and 3 of other keys
        depths.add(round(100 * case.needle_offsets[0] / case.length, -1))
    assert len(depths) >= 5  # spread over the haystack, not one place


def test_cwe_and_fwe_counts_are_rulers(tokenizer):
    for length, common, rare in ((2000, 6, 1), (4096, 30, 3)):
        case = one(tokenizer, "cwe", length)
        text, _ = parts(case.prompt.messages[-1]["content"])
        counts = Counter(re.findall(r"\d+\. (\S+)", text))
        assert all(counts[w] == common for w in case.references)
        rest = Counter(c for w, c in counts.items() if w not in case.references)
        assert set(rest) == {rare} and rest[rare] == case.units - 10  # RULER's list: whole words only
    case = one(tokenizer, "fwe", 3000)
    text, _ = parts(case.prompt.messages[-1]["content"])
    ranked = Counter(w for w in text.split() if re.fullmatch(r"[a-z]{6}|\.\.\.", w)).most_common()
    assert [w for w, _ in ranked[1:4]] == case.references and ranked[0][0] == "..."
    # RULER's Zipf law: rank k appears int(N k^-2 / zeta(2)) times, N the words RULER's sizing found
    assert [c for _, c in ranked[:4]] == ruler._zipf_counts(case.units, 4)


def test_the_same_seed_gives_the_same_instances_and_another_seed_others(tokenizer, qa_data):
    first = build(tokenizer, qa_data, seed=5)
    again = build(AutoTokenizer.from_pretrained(TOKENIZER), qa_data, seed=5)
    other = build(tokenizer, qa_data, seed=6)
    assert first == again
    differ = [a.prompt.input_ids != b.prompt.input_ids for a, b in zip(first, other, strict=True)]
    # QA differs only where it draws distractors: here every document fits, in RULER's fixed order
    assert all(d for d, c in zip(differ, first, strict=True) if not c.task.startswith("qa"))
    for task in ("vt", "niah_single_2"):  # niah_single_2 hides its needle in the essay haystack
        alone = ruler.build_instances(tokenizer, tasks=[task], lengths=[2000], samples_per_task=2, seed=5)
        assert alone == [c for c in first if c.task == task and c.length == 2000]  # whatever else is asked


def test_a_length_too_short_for_a_task_is_one_line(tokenizer):
    with pytest.raises(
        ConfigError,
        match=r"--lengths 300: too short for niah_single_1 \(with its smallest haystack, 5 noise lines",
    ):
        ruler.build_instances(
            tokenizer, tasks=["niah_single_1", "vt"], lengths=[300], samples_per_task=1, seed=0
        )


# --- scoring and the summary --------------------------------------------------------------------------------


def test_scores_are_rulers_recall_and_qas_best_match():
    assert ruler.score_output("niah_multivalue", ["11", "22", "33", "44"], "22 and 44") == 50.0
    assert ruler.score_output("cwe", ["Apple", "pear"], "APPLE, PEAR") == 100.0  # case-insensitive
    assert ruler.score_output("qa_squad", ["Denver Broncos", "Broncos"], "the broncos") == 100.0
    assert ruler.score_output("qa_hotpot", ["yes"], "no") == 0.0


def test_the_effective_length_is_the_longest_length_up_to_which_the_average_holds():
    averages = {4096: 95.0, 8192: 86.0, 16384: 80.0, 32768: 99.0}
    assert ruler.effective_length(averages, 85.6) == 8192  # 32k does not count: 16k fell below
    assert ruler.effective_length(averages, 80.0) == 32768
    assert ruler.effective_length(averages, 90.0) == 4096
    assert ruler.effective_length(averages, 96.0) is None  # even the shortest is under


def row(task, length, score):
    return {"task": task, "length": length, "score": score}


def test_a_partial_run_has_no_average_and_says_why_and_a_complete_one_has_rulers():
    rows = [row("vt", 1000, 100.0), row("vt", 1000, 0.0), row("cwe", 1000, 90.0), row("vt", 2000, 50.0),
            {**row("cwe", 2000, 0.0), "error": "500 from the server"}]  # fmt: skip
    summary = ruler.summary(rows, threshold=60.0)
    assert summary["by_task_length"] == {
        "vt": {"1000": 50.0, "2000": 50.0},
        "cwe": {"1000": 90.0, "2000": 0.0},
    }
    assert (summary["average_by_length"], summary["effective_length"], summary["comparable"]) == (
        None,
        None,
        False,
    )
    assert summary["partial_average_by_length"] == {"1000": 70.0, "2000": 25.0}  # a failed request scores 0
    assert summary["not_comparable_because"] == [
        "tasks not run: niah_single_1, niah_single_2, niah_single_3, niah_multikey_1, niah_multikey_2, "
        "niah_multikey_3, niah_multivalue, niah_multiquery, fwe, qa_squad, qa_hotpot (--squad, --hotpot)",
        "lengths not run: 4096, 8192, 16384, 32768, 65536, 131072 (RULER's table: 4k to 128k)",
        "samples per task and length: 1, indicative only (RULER's table: 500; 100 or more to compare, with the "
        "confidence intervals)",
    ]
    assert summary["indicative"] and summary["samples_per_task"] == 1
    assert summary["ci95_by_task_length"]["vt"]["1000"] == [9.5, 90.5]  # 1 of 2: Wilson's 95% interval
    assert (summary["n"], summary["failed"]) == (5, 1)
    assert ruler.summary_csv(summary).splitlines() == [
        "task,length,score", "vt,1000,50", "vt,2000,50", "cwe,1000,90", "cwe,2000,0",
        "partial average (not comparable),1000,70", "partial average (not comparable),2000,25"]  # fmt: skip
    lengths = ruler.PUBLISHED_LENGTHS
    every = [row(t, n, 100.0 if n == 4096 or t != "vt" else 0.0) for t in ruler.TASKS for n in lengths for _ in range(100)]  # fmt: skip
    filler = ruler.summary(every)  # all 13 tasks at RULER's lengths, 100 samples, not on RULER's files
    assert filler["not_comparable_because"] == [
        "essay haystack: not RULER's essays file (--haystack PaulGrahamEssays.json, whose text has the "
        "published SHA-256)",
        "qa_squad: --squad is not SQuAD 2.0's dev-v2.0.json (by SHA-256)",
        "qa_hotpot: --hotpot is not HotpotQA's hotpot_dev_distractor_v1.json (by SHA-256)",
    ]
    published = ruler.ReferenceInputs(essays=True, squad=True, hotpot=True)
    complete = ruler.summary(every, inputs=published, threshold=95.0)
    assert complete["comparable"] and complete["not_comparable_because"] == [] and not complete["indicative"]
    assert complete["average_by_length"]["4096"] == 100.0
    assert complete["average_by_length"]["8192"] == pytest.approx(1200 / 13)
    assert complete["effective_length"] == 4096 and complete["partial_average_by_length"] is None
    assert ruler.summary(every, inputs=published, threshold=90.0)["effective_length"] == 131072
    assert ruler.summary_csv(complete).splitlines()[-6:-4] == ["average,4096,100", "average,8192,92.3077"]
    assert complete["ci95_by_task_length"]["vt"]["8192"] == [0.0, 3.7]
    pairs = [{**r, "cwe_words": "adjective-noun pairs"} if r["task"] == "cwe" and r["length"] == 131072 else r for r in every]  # fmt: skip
    assert ruler.summary(pairs, inputs=published)["not_comparable_because"] == [
        "cwe at 131072: adjective-noun pairs past wonderwords' words, not RULER's english_words.json "
        "(--english-words)"
    ]


def test_the_essays_and_qa_files_are_rulers_by_their_sha256_not_their_names(tmp_path, monkeypatch):
    essays = tmp_path / "PaulGrahamEssays.json"
    essays.write_text(json.dumps({"text": "Not the essays. Only named so."}))
    squad = tmp_path / "dev-v2.0.json"
    squad.write_text("{}")
    assert ruler.reference_inputs(essays, squad, None) == ruler.ReferenceInputs()
    digest = hashlib.sha256(b"Not the essays. Only named so.").hexdigest()
    monkeypatch.setattr(ruler, "ESSAYS_TEXT_SHA256", frozenset({digest}))
    monkeypatch.setattr(ruler, "SQUAD_SHA256", frozenset({hashlib.sha256(b"{}").hexdigest()}))
    moved = tmp_path / "any-name.json"
    moved.write_text(
        json.dumps({"text": "Not the essays. Only named so."}, indent=2)
    )  # other JSON, same text
    assert ruler.reference_inputs(moved, squad, None) == ruler.ReferenceInputs(essays=True, squad=True)


def test_a_failed_request_scores_0_and_keeps_its_error(tokenizer):
    case = one(tokenizer, "vt", 1500)
    failed = ruler.generation_row(case, Reply("", error="400 from the server: too long"))
    assert (failed["score"], failed["error"]) == (0.0, "400 from the server: too long")


def test_scores_fold_case_as_rulers_lower_does():
    # str.casefold would match "STRASSE" to "straße"; RULER's str.lower does not
    assert ruler.score_output("qa_squad", ["straße"], "STRASSE") == 0.0
    assert ruler.score_output("vt", ["ABCDE"], "abcde") == 100.0


# --- against servers ----------------------------------------------------------------------------------------


def served(server: OpenAIStub) -> list[str]:
    return ["--backend", "openai", "--base-url", server.base_url, "--served-model", server.model,
            "--tokenizer", str(TOKENIZER), "--max-retries", "0"]  # fmt: skip


def run_served(reply, out: Path, *extra: str, qa_files=None) -> tuple[list[dict], dict, list[dict]]:
    files = ["--squad", str(qa_files["squad"]), "--hotpot", str(qa_files["hotpot"])] if qa_files else []
    with OpenAIStub(reply, key=KEY) as server:
        status = main(["eval", "ruler", *served(server), *files, "--output", str(out), *extra])
        requests = server.requests
    assert status == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return rows, json.loads((out / "summary.json").read_text()), requests


def test_a_chat_server_that_solves_each_task_scores_100_everywhere(tmp_path, qa_files, capsys):
    """--served-endpoint chat, RULER's path for API models: a chat whose user message ends with the prefix."""
    reader = lambda body: solve(prompt_of(body))  # noqa: E731
    out = tmp_path / "ruler"
    rows, summary, requests = run_served(reader, out, "--lengths", "2000,3000", "--samples-per-task", "3",
                                         "--served-endpoint", "chat", qa_files=qa_files)  # fmt: skip
    assert len(rows) == len(requests) == len(ruler.TASKS) * 2 * 3
    assert {r["task"] for r in rows} == set(ruler.TASKS)
    assert all(r["score"] == 100.0 for r in rows)
    assert all(r["prompt_tokens"] + r["new_tokens"] <= r["length"] for r in rows)
    assert set(rows[0]) >= {"task", "length", "prompt_tokens", "units", "needle_offsets", "references", "output",
                            "score"}  # fmt: skip
    assert all("prompt" not in q and len(q["messages"]) == 1 for q in requests)
    assert all(any(prompt_of(q).endswith(r["answer_prefix"]) for q in requests) for r in rows)
    assert summary["by_task_length"] == {t: {"2000": 100.0, "3000": 100.0} for t in ruler.TASKS}
    assert summary["partial_average_by_length"] == {"2000": 100.0, "3000": 100.0}  # generated essays
    assert (summary["effective_length"], summary["n"], summary["failed"]) == (None, 78, 0)
    assert summary["prompt_path"].startswith("served, /v1/chat/completions")
    budgets = {ruler.TASKS[t].new_tokens for t in ruler.TASKS}
    assert {r["max_tokens"] for r in requests} == budgets  # RULER's budget per task family
    assert {p.name for p in out.iterdir()} >= {"results.jsonl", "summary.json", "summary.csv", "ruler.png",
                                               "run_config.json"}  # fmt: skip
    record = json.loads((out / "run_config.json").read_text())
    assert (
        record["qa_skipped"] == {"squad": 24, "hotpot": 0} and record["prompt_path"] == summary["prompt_path"]
    )
    assert KEY not in (out / "run_config.json").read_text()
    assert (
        "not comparable with RULER's table: essay haystack: not RULER's essays file"
        in capsys.readouterr().out
    )


def test_a_completions_server_that_echoes_its_prompt_gets_rulers_raw_prompts_and_no_comparable_label(
    tmp_path, qa_files, tokenizer, capsys
):
    """The default for a served model is RULER's path for open models: /v1/completions with the chat template
    applied here and the answer prefix inside the assistant's turn. A 3-sample, 2-length run on an essays
    file that is not RULER's (whatever its name) is labelled not comparable, with each reason."""
    essays = tmp_path / "PaulGrahamEssays.json"
    essays.write_text(
        json.dumps({"text": "I wrote essays once.  They were short.\n\nNow they are long! " * 300})
    )
    out = tmp_path / "echo"
    with OpenAIStub(key=KEY, cut_to_max_tokens=False) as server:  # echo: the prompt
        status = main(["eval", "ruler", *served(server), "--squad", str(qa_files["squad"]), "--hotpot",
                       str(qa_files["hotpot"]), "--haystack", str(essays), "--lengths", "2k,4k",
                       "--samples-per-task", "3", "--output", str(out)])  # fmt: skip
        requests = server.requests
    assert status == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["task"] for r in rows][::6] == list(ruler.TASKS) and all(r["score"] == 100.0 for r in rows)
    cases = ruler.build_instances(tokenizer, tasks=list(ruler.TASKS), lengths=[2048, 4096], samples_per_task=3,
                                  seed=0, haystack=essays, squad=ruler.read_squad(qa_files["squad"]),
                                  hotpot=ruler.read_hotpot(qa_files["hotpot"]))  # fmt: skip
    assert sorted(r["prompt"] for r in requests) == sorted(c.prompt.text for c in cases)
    frame = chat_frame(tokenizer)
    assert frame.before.startswith("<|begin_of_text|>") and frame.after.endswith(
        "assistant<|end_header_id|>\n\n"
    )
    for (
        request
    ) in requests:  # every request: the template around the task, the prefix in the assistant's turn
        assert "messages" not in request and request["prompt"].startswith(frame.before)
        assert any(request["prompt"].endswith(frame.after + r["answer_prefix"]) for r in rows)
    shots = [q["prompt"] for q in requests if q["prompt"].count(frame.before) == 2]  # cwe: RULER's example
    assert len(shots) == 6 and all(f"{frame.after} Answer: The top 10 words" in q for q in shots)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["prompt_path"].startswith("served, /v1/completions: chat template applied here")
    assert not summary["comparable"] and summary["indicative"] and summary["average_by_length"] is None
    assert summary["not_comparable_because"] == [
        "essay haystack: not RULER's essays file (--haystack PaulGrahamEssays.json, whose text has the "
        "published SHA-256)",
        "qa_squad: --squad is not SQuAD 2.0's dev-v2.0.json (by SHA-256)",
        "qa_hotpot: --hotpot is not HotpotQA's hotpot_dev_distractor_v1.json (by SHA-256)",
        "lengths not run: 8192, 16384, 32768, 65536, 131072 (RULER's table: 4k to 128k)",
        "samples per task and length: 3, indicative only (RULER's table: 500; 100 or more to compare, with the "
        "confidence intervals)",
    ]
    assert set(summary["ci95_by_task_length"]) == set(ruler.TASKS)
    printed = capsys.readouterr().out
    assert "partial average by length" in printed and "lengths not run: 8192" in printed
    assert "effective length" not in printed


def test_by_default_every_task_that_needs_no_file_runs_and_without_qa_files_there_is_no_average(tmp_path):
    reader = lambda body: solve(prompt_of(body))  # noqa: E731
    rows, summary, _ = run_served(reader, tmp_path / "o", "--lengths", "2000", "--samples-per-task", "1")
    assert [r["task"] for r in rows] == SYNTHETIC and summary["tasks"] == SYNTHETIC
    assert (summary["average_by_length"], summary["effective_length"]) == (None, None)
    assert summary["partial_average_by_length"] == {"2000": 100.0} and not summary["comparable"]
    assert summary["not_comparable_because"][0] == "tasks not run: qa_squad, qa_hotpot (--squad, --hotpot)"


def test_a_server_that_reads_only_the_first_half_loses_the_needles_of_the_second(tmp_path):
    half = lambda body: solve(prompt_of(body), first_half=True)  # noqa: E731
    single = "niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3"
    rows, summary, _ = run_served(half, tmp_path / "half", "--lengths", "2000,3000", "--samples-per-task", "12",
                                  "--tasks", f"{single},niah_multiquery,vt")  # fmt: skip
    by_depth: dict[int, list[float]] = {}
    for r in rows:
        if r["task"] in single:
            depth = r["needle_offsets"][0] / r["prompt_tokens"]
            by_depth.setdefault(min(int(10 * depth), 9), []).append(r["score"])
            if depth < 0.3:
                assert r["score"] == 100.0, r
            elif depth > 0.7:
                assert r["score"] == 0.0, r
    means = [sum(by_depth[d]) / len(by_depth[d]) for d in sorted(by_depth)]
    assert means[0] == 100.0 and means[-1] < 30.0
    assert sum(means[:3]) / 3 > sum(means[-3:]) / 3 + 50  # falls with depth
    multi = [r["score"] for r in rows if r["task"] == "niah_multiquery"]
    assert 0 < sum(multi) / len(multi) < 100  # partial recall: the needles of the first half
    assert all(v < 85.6 for v in summary["partial_average_by_length"].values())


def test_a_partial_run_prints_and_plots_its_partial_average_as_not_comparable(tmp_path, capsys):
    def reader(body):  # a model that solves short prompts and reads half of longer ones
        content = prompt_of(body)
        return solve(content) if len(content) < 9000 else solve(content, first_half=True)

    rows, summary, _ = run_served(reader, tmp_path / "o", "--lengths", "2000,4000", "--samples-per-task", "2",
                                  "--tasks", "niah_single_1,vt")  # fmt: skip
    averages = summary["partial_average_by_length"]
    assert averages["2000"] == 100.0 and averages["4000"] < 100.0 and summary["average_by_length"] is None
    out = capsys.readouterr().out
    assert (
        "partial average by length: 2000 100.0" in out
        and "not comparable with RULER's table: tasks not run" in out
    )
    assert (
        (tmp_path / "o" / "summary.csv")
        .read_text()
        .splitlines()[-1]
        .startswith("partial average (not comparable),4000,")
    )


def test_the_same_seed_writes_the_same_file_and_another_seed_another(tmp_path):
    reader = lambda body: solve(prompt_of(body), first_half=True)  # noqa: E731
    settings = [
        "--lengths",
        "2000",
        "--samples-per-task",
        "2",
        "--tasks",
        "niah_single_2,niah_multikey_3,vt,fwe",
    ]
    outputs = {}
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        run_served(reader, tmp_path / name, *settings, "--seed", seed)
        outputs[name] = (tmp_path / name / "results.jsonl").read_bytes()
    assert outputs["a"] == outputs["b"] and outputs["a"] != outputs["c"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--tasks", "niah_single_9"],
            "--tasks 'niah_single_9': unknown task niah_single_9; known: niah_single_1",
        ),
        (["--tasks", "qa_squad"], "--tasks qa_squad: needs the dataset's file, --squad FILE"),
        (["--lengths", "200", "--tasks", "cwe"], "--lengths 200: too short for cwe"),
        (["--score", "logprob"], "--score logprob: needs the model's weights"),
        (["--squad", "missing.json"], "missing.json: no SQuAD file there"),
    ],
)
def test_bad_ruler_settings_are_one_line_before_any_request(tmp_path, capsys, extra, message):
    with OpenAIStub(key=KEY) as server:
        status = main(["eval", "ruler", *served(server), "--output", str(tmp_path / "o"), *extra])
        calls = server.calls
    assert status == 2 and calls == 0
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_qa_files_in_other_shapes_are_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"data": [{"paragraphs": [{"context": "C", "qas": [{"answers": []}]}]}]}))
    with pytest.raises(
        InputError, match=r"bad.json: data\[0\]\.paragraphs\[0\]\.qas\[0\]: missing field 'question'"
    ):
        ruler.read_squad(bad)
    bad.write_text(json.dumps([{"question": "Q", "answer": "A", "context": [["title only"]]}]))
    with pytest.raises(
        InputError, match=r"bad.json: \[0\]\.context\[0\]: expected \[title, \[sentence, \.\.\.\]\]"
    ):
        ruler.read_hotpot(bad)
    bad.write_text(json.dumps({"data": []}))
    with pytest.raises(InputError, match="bad.json: expected HotpotQA's JSON"):
        ruler.read_hotpot(bad)
    with pytest.raises(InputError, match="bad.json: no question with an answer in it"):
        ruler.read_squad(bad)


def test_an_essays_file_in_another_shape_is_named(tmp_path):
    essays = tmp_path / "PaulGrahamEssays.json"
    essays.write_text(json.dumps({"essays": ["A text."]}))
    with pytest.raises(
        InputError, match=r'PaulGrahamEssays.json: expected \{"text": "..."\}.*no "text" string'
    ):
        nd.read_haystack(essays)
    essays.write_text("{not json")
    with pytest.raises(InputError, match="PaulGrahamEssays.json: not a JSON file"):
        nd.read_haystack(essays)
    essays.write_text(json.dumps({"text": "One essay. Its second sentence!"}))
    assert nd.read_haystack(essays) == ["One essay.", "Its second sentence!"]
    assert ruler.read_essays(essays) == "One essay. Its second sentence!"
    essays.write_text(json.dumps({"text": "  \n"}))
    with pytest.raises(InputError, match="PaulGrahamEssays.json: the haystack text is empty"):
        ruler.read_essays(essays)
    with pytest.raises(PathError, match="a.txt: no haystack file or directory there"):
        ruler.read_essays(tmp_path / "a.txt")


def test_hotpot_gold_documents_are_the_supporting_facts_paragraphs(tokenizer):
    hotpot = ruler.read_hotpot(REFERENCE / "hotpot.json")  # 400 documents: the prompt holds some of them
    case = ruler.build_instances(tokenizer, tasks=["qa_hotpot"], lengths=[4096], samples_per_task=1, seed=0,
                                 hotpot=hotpot)[0]  # fmt: skip
    golds = [tokenizer.decode(case.prompt.input_ids[o : o + 12]) for o in case.needle_offsets]
    assert len(golds) == 2 and all(re.match(r"Document \d+:\nVault \d+", g) for g in golds)
    assert len(hotpot.questions[0].own) == 10 and len(hotpot.questions[0].gold) == 2  # the halls are no gold


# --- teacher-forced scoring ---------------------------------------------------------------------------------


def test_only_tasks_whose_answer_has_one_order_are_teacher_forced(tokenizer, qa_data):
    ordered = [t for t, task in ruler.TASKS.items() if task.one_order]
    assert set(ruler.TASKS) - set(ordered) == {"niah_multivalue", "cwe", "qa_squad"}
    assert ruler.select_tasks(None, logprob=True) == [t for t in ordered if t != "qa_hotpot"]
    with pytest.raises(ConfigError, match="cwe: the answer has no one order to teacher-force"):
        ruler.select_tasks("vt,cwe", logprob=True)
    for case in build(tokenizer, qa_data, prefix_in="assistant"):
        assert (case.answer_ids is None) == (case.task not in ordered)
        if case.answer_ids is not None:  # each reference's tokens, where the spans say
            for (a, b), reference in zip(case.reference_spans, case.references, strict=True):
                assert tokenizer.decode(case.answer_ids[a:b]).strip(" ,") == reference


def test_a_reference_counts_when_each_of_its_tokens_is_the_most_likely(tokenizer):
    case = one(tokenizer, "niah_multiquery", 2000, prefix_in="assistant")
    predicted = list(case.answer_ids)
    a, _ = case.reference_spans[2]
    predicted[a] = (predicted[a] + 1) % 4096
    row = ruler.logprob_row(case, nd.AnswerScore(-1.5, False, predicted), tokenizer)
    assert (row["score"], row["logprob"]) == (75.0, -1.5)


def test_packed_scoring_equals_one_prompt_at_a_time_and_the_plain_model(tokenizer, qa_data):
    tasks = [
        t for t in ruler.select_tasks(None, hotpot=qa_data["hotpot"], logprob=True) if t != "vt"
    ]  # vt: > 600
    cases = build(tokenizer, qa_data, tasks=tasks, lengths=[1500], samples_per_task=1, prefix_in="assistant")
    sequences = [(c.prompt.input_ids, c.answer_ids) for c in cases]
    assert len(nd.pack_rows([len(p) + len(a) - 1 for p, a in sequences], 3200)) == 5  # 9 prompts in 5 rows
    assert_packed_scoring_is_exact(sequences, pack_tokens=3200)


def test_a_131072_position_model_takes_the_128k_column_with_room_to_answer(tmp_path, monkeypatch):
    """RULER's length is the prompt and its generation budget: 128k fits a 131,072-position model exactly."""
    from longalign.eval.models import LocalGenerator

    model = save_tiny_model(tmp_path / "model", max_position_embeddings=131072)
    asked = []

    def generate(self, prompts, *, progress=None):  # the 128k forward is not this test's business
        asked.extend((len(p.input_ids), self.max_new_tokens) for p in prompts)
        return [Reply("no idea") for _ in prompts]

    monkeypatch.setattr(LocalGenerator, "generate", generate)
    out = tmp_path / "o"
    assert main(["eval", "ruler", "--model", str(model), "--lengths", "128k", "--tasks", "niah_single_1,vt",
                 "--samples-per-task", "1", "--output", str(out)]) == 0  # fmt: skip
    assert [budget for _, budget in sorted(asked, key=lambda a: a[1])] == [30, 128]
    assert all(
        131072 - 1000 < tokens <= 131072 - budget for tokens, budget in asked
    )  # RULER's sizing: near it
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert all(r["prompt_tokens"] + r["new_tokens"] <= 131072 for r in rows)
    with pytest.raises(
        ConfigError, match=r"a prompt of 131043 tokens \+ 30 new tokens is over the model's limit"
    ):
        check_fits([131072 - 128, 131072 - 29], 131072, new_tokens=[128, 30])


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model"), max_position_embeddings=1024)


def test_logprob_scores_from_the_command_line_equal_scoring_the_instances(saved_model, tokenizer, tmp_path):
    out = tmp_path / "lp"
    tasks = ["niah_single_1", "niah_multikey_3", "vt", "fwe"]
    args = ["eval", "ruler", "--model", str(saved_model), "--score", "logprob", "--lengths", "1000,1020", "--tasks",
            ",".join(tasks), "--samples-per-task", "1", "--attn-backend", "sdpa_segments", "--pack-tokens", "2100",
            "--output", str(out)]  # fmt: skip
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["task"] for r in rows][::2] == tasks and len(rows) == 2 * len(tasks)
    cases = ruler.build_instances(tokenizer, tasks=tasks, lengths=[1000, 1020], samples_per_task=1, seed=0,
                                  prefix_in="assistant")  # fmt: skip
    from longalign.eval.models import load_model

    model = load_model(str(saved_model), packed=True, attn_backend="sdpa_segments")
    scores = nd.score_answers(model, [(c.prompt.input_ids, c.answer_ids) for c in cases], pack_tokens=2100)
    assert [r["logprob"] for r in rows] == pytest.approx([s.logprob for s in scores], rel=1e-10)
    assert [r["score"] for r in rows] == [ruler.logprob_row(c, s, tokenizer)["score"] for c, s in zip(cases, scores, strict=True)]  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["score"] == "logprob" and set(summary["logprob_by_task_length"]) == set(tasks)
    assert (out / "summary.csv").read_text().splitlines()[0] == "task,length,score,logprob"
    assert (out / "ruler.png").stat().st_size > 0


def test_local_generation_ends_each_prompt_with_the_answer_prefix(saved_model, tmp_path):
    out = tmp_path / "gen"
    args = ["eval", "ruler", "--model", str(saved_model), "--lengths", "1000", "--samples-per-task", "1",
            "--tasks", "niah_single_1,vt", "--max-new-tokens", "3", "--output", str(out)]  # fmt: skip
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["task"] for r in rows] == ["niah_single_1", "vt"] and all(
        r["prompt_tokens"] <= 997 for r in rows
    )
    assert all(r["output"] and r["score"] in (0.0, 100.0) for r in rows)
    record = json.loads((out / "run_config.json").read_text())
    assert record["prompt_path"].startswith("local model") and record["new_tokens"] == {
        "niah_single_1": 3,
        "vt": 3,
    }


# --- against RULER's own instances --------------------------------------------------------------------------
# tests/data/ruler/reference: NVIDIA/RULER's prepare.py run on the stand-in inputs of tests/data/ruler with the
# shipped tokenizer and its template (how: tests/data/ruler/README.md). Ours are built from the same inputs.

CONTEXT = {  # the text just before each family's haystack, and just after it
    "niah": ("afterwards.\n", "\nWhat "),
    "vt": ("hidden in the following text.\n\n", "\nQuestion: Find all variables"),
    "cwe": ("appear most often.\n", "\nQuestion: What are the 10"),
    "fwe": ("most frequently appeared coded words. ", "\nQuestion: Do not provide"),
    "qa": ("The following are given documents.\n\n", "\n\nAnswer the question based on the given documents."),
}
MASKS = [  # what each instance draws for itself
    (r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "<uuid>"),
    (r"\b\d{7}\b", "<7 digits>"),
    (r"\b\d{5}\b", "<5 digits>"),
    (r"\b(?!VAR\b)[A-Z]{3}(?:[A-Z]{2})?\b", "<name>"),
    (r"\b[a-z]+(?:-[a-z]+)+\b", "<key>"),
    (r"\d+\. \S+(?: \d+\. \S+)*", "<numbered list>"),
    (r"(?:(?:The grass is green\.[^\n]*|VAR [^\n]*)\n)+", "<lines>\n"),
]


@pytest.fixture(scope="module")
def reference_inputs():
    return {
        "haystack": REFERENCE / "essays.json",
        "squad": ruler.read_squad(REFERENCE / "squad.json"),
        "hotpot": ruler.read_hotpot(REFERENCE / "hotpot.json"),
    }


def rulers_instances(task: str, length: int) -> list[dict]:
    with gzip.open(REFERENCE / "reference" / f"{task}-{length}.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


def split_context(task: str, text: str) -> tuple[str, str, str]:
    """An instance's text before its haystack, the haystack, and the text after it."""
    before, after = CONTEXT[ruler.TASKS[task].family]
    start, end = text.rindex(before) + len(before), text.rindex(after)
    return text[:start], text[start:end], text[end:]


def masked(text: str) -> str:
    for pattern, mask in MASKS:
        text = re.sub(pattern, mask, text)
    return text


def units_in(task: str, context: str, essay_words: list[str]) -> int:
    """The haystack's size in RULER's units, read from its text (fwe: its words); checks each unit's text."""
    spec = ruler.TASKS[task]
    if spec.family == "niah" and spec.haystack == "essay":
        needle = r"One of the special magic \w+ for \S+ is: \S+\."
        assert len(re.findall(needle, context)) == spec.keys * spec.values
        words = re.sub(needle, " ", context).split()
        taken = []  # the essays' first words, from the first again when they run out, as RULER counts them
        while sum(map(bool, taken)) < len(words):
            taken.append(essay_words[len(taken) % len(essay_words)])
        assert words == [w for w in taken if w]
        return len(taken)
    if spec.family in ("niah", "vt"):
        lines = context.split("\n")
        pieces = [line for line in lines if line != ruler.NOISE]
        if spec.family == "vt":
            assert len(pieces) == 5 and all(
                re.fullmatch(r"VAR [A-Z]{5} = (\d{5}|VAR [A-Z]{5} )", p) for p in pieces
            )
            return len(lines) - 5
        # RULER's keys: any of wonderwords' adjectives, "ad hoc" among them
        assert all(
            re.fullmatch(r"One of the special magic (numbers|uuids) for .+ is: \S+\.", p) for p in pieces
        )
        assert len(pieces) == spec.keys * spec.values if spec.haystack == "noise" else len(lines)
        return len(lines) - spec.keys * spec.values
    if spec.family == "cwe":
        items = re.findall(r"(\d+)\. (\S+)", context)
        assert [int(n) for n, _ in items] == list(range(1, len(items) + 1))
        return len({w for _, w in items})
    if spec.family == "fwe":
        return len(context.split(" "))
    documents = re.split(r"\n\n(?=Document \d+:\n)", context)
    assert all(d.startswith(f"Document {i + 1}:\n") for i, d in enumerate(documents))
    return len(documents)


def answers_hold(task: str, context: str, question: str, answers: list[str]) -> None:
    """The gold answers are what RULER's task asks of its haystack."""
    family = ruler.TASKS[task].family
    if family == "niah":
        keys = re.split(r", and |, ", QUERY.search(question)[1])
        assert sorted(v for k, v in NEEDLE.findall(context) if k in keys) == sorted(answers)
        kind = r"\d{7}" if ruler.TASKS[task].value == "numbers" else r"[0-9a-f-]{36}"
        assert len(answers) == ruler.TASKS[task].values * ruler.TASKS[task].queries
        assert all(re.fullmatch(kind, a) for a in answers)
    elif family == "vt":
        assert solve_vt(context, question).split() == answers and len(answers) == 5
    elif family == "cwe":
        counts = Counter(re.findall(r"\d+\. (\S+)", context))
        assert {w for w, c in counts.items() if c == max(counts.values())} == set(answers) and len(
            answers
        ) == 10
    elif family == "fwe":
        ranked = Counter(context.split(" ")).most_common(4)
        assert ranked[0][0] == "..." and [w for w, _ in ranked[1:]] == answers


def gold_slots(task: str, context: str, question: ruler.Question, data: ruler.QAData) -> list[int]:
    """The ``Document i`` numbers that hold the question's own documents."""
    documents = re.split(r"\n\n(?=Document \d+:\n)", context)
    own = {data.documents[d] for d in question.own}
    return [i + 1 for i, d in enumerate(documents) if d.split(":\n", 1)[1] in own]


@pytest.mark.parametrize("length", [4096, 16384])
@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_instances_are_rulers_own_text_sizes_answers_and_qa_slots(tokenizer, reference_inputs, task, length):
    """Held against RULER's prepare.py output on the same inputs, tokenizer and template: the same text
    around the haystack (what each instance draws masked), the same units in it, sizes within one of RULER's
    steps, the same gold answers, the gold documents in the same slots, and RULER's token count."""
    theirs = rulers_instances(task, length)
    ours = ruler.build_instances(tokenizer, tasks=[task], lengths=[length], samples_per_task=len(theirs), seed=0,
                                 **reference_inputs)  # fmt: skip
    spec = ruler.TASKS[task]
    essay_words = re.sub(r"\s+", " ", ruler.read_essays(REFERENCE / "essays.json")).split(" ")
    sizes = {"ours": [], "theirs": []}
    for sample, (line, case) in enumerate(zip(theirs, ours, strict=True)):
        text = line["input"] + line["answer_prefix"]
        assert line["answer_prefix"] == case.answer_prefix or spec.family in ("niah", "vt")
        assert len(tokenizer(text, add_special_tokens=False).input_ids) + spec.new_tokens == line["length"]
        assert line["length"] <= length and len(case.prompt.input_ids) + case.new_tokens <= length
        for who, full, answers in (
            ("theirs", text, line["outputs"]),
            ("ours", case.prompt.text, case.references),
        ):
            before, context, after = split_context(task, full)
            sizes[who].append(units_in(task, context, essay_words))
            answers_hold(task, context, after, answers)
        (our_before, our_context, our_after), (before, context, after) = (
            split_context(task, case.prompt.text),
            split_context(task, text),
        )
        assert masked(our_before) == masked(before) and masked(our_after) == masked(after)
        if spec.family == "qa":
            data = reference_inputs[spec.source]
            question = data.questions[sample]
            assert case.references == line["outputs"]  # the same answers, unstripped
            slots = gold_slots(task, context, question, data)
            rulers_rule = [ruler.fixed_shuffle(range(sizes["theirs"][-1])).index(j) + 1 for j in range(len(question.own))]  # fmt: skip
            assert sorted(slots) == sorted(rulers_rule)  # RULER's fixed shuffle, our function
            ours_rule = [ruler.fixed_shuffle(range(sizes["ours"][-1])).index(j) + 1 for j in range(len(question.own))]  # fmt: skip
            assert sorted(gold_slots(task, our_context, question, data)) == sorted(ours_rule)
            if sizes["ours"][-1] == sizes["theirs"][-1]:
                assert gold_slots(task, our_context, question, data) == slots
    if spec.family != "fwe":
        assert sizes["ours"] == [c.units for c in ours]
    step = ruler.step(spec, length, spec.new_tokens)
    assert abs(max(sizes["ours"]) - max(sizes["theirs"])) <= step, sizes
