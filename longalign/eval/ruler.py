"""RULER's long-context tasks (NVIDIA/RULER), built as RULER builds them, and their scores.

An instance is RULER's text: the task's template (its instructions, the haystack with its needles, the
question), the chat template around it and the task's answer prefix after the generation prompt, as RULER
gives an open model its raw prompt; for a chat server (RULER's path for API models) the prefix ends the
user's message instead. vt's worked example opens the user's message; cwe's is a whole templated prompt
with its answer before the task's, as RULER writes it::

    [chat template][(vt: example + "\n\n")template head][haystack with needles][question][generation prompt][prefix]
                                                              ^ needle_offsets

A length is RULER's: the prompt plus the task's generation budget is at most the length, and it is sized
as RULER sizes it, in whole units of the haystack (essay words, noise lines, needle lines, cwe's words,
fwe's words, QA documents). Per task and length one binary search on random draws finds the largest
count that fits (fwe: RULER's walk up in steps of length/32 words); each sample starts from that count and
steps back a whole step (``step``) while its own draw overflows. So prompts are often shorter than the
length, by RULER's rule::

    cases = build_instances(tokenizer, tasks=["niah_single_1", "vt"], lengths=[4096, 8192],
                            samples_per_task=20, seed=0)
    cases[0].units, len(cases[0].prompt.input_ids) + cases[0].new_tokens   -> (98, 4063)   # shipped tokenizer
    replies = generator.generate([case.prompt for case in cases])
    rows = [generation_row(case, reply) for case, reply in zip(cases, replies)]
    summary(rows)  -> {'by_task_length': {'niah_single_1': {'4096': 100.0, ...}, ...}, 'comparable': False,
                       'not_comparable_because': ['tasks not run: niah_single_2, ...', ...], ...}

RULER shuffles some lists with one fixed seed (``RULER_SEED``), and so do these instances: the order of
the needles, cwe's numbered list, fwe's coded text and the QA documents (the gold document sits in the
same slot for every sample with the same number of documents). Everything else is drawn from
``(seed, task, length, sample)``: the same seed gives the same prompts whatever else is asked.

Scores are RULER's: the share of the references found in the output (``str.lower`` on both) x 100, or for
the QA tasks 100 when any reference is found; a failed request scores 0. The average over RULER's 13 tasks
and the effective length are given only when the run stands next to RULER's table
(``missing_for_comparison``). The teacher-forced alternative (``--score logprob``) reads ``answer_ids``
after the prompt with ``longalign.eval.needle.score_answers``; ``logprob_row`` scores it.

Where this differs from RULER's generators: sentences are split by ``longalign.eval.needle.split_sentences``
(RULER uses NLTK's punkt); keys and cwe's words come from wonderwords' lists with its profanity list left
out; the distractor needles never carry an asked key; past wonderwords' words cwe reads RULER's
``english_words.json`` only when it is given (``english_words``), else it draws adjective-noun pairs and
the summary says so.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import random
import re
import string
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from longalign.errors import ConfigError, InputError, PathError
from longalign.eval import needle as nd
from longalign.eval.models import Prompt, Reply, chat_frame

THRESHOLD = 85.6  # RULER's: Llama-2-7B's average at 4k, the bar for the effective length
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's needle depths: 40 from 0% to 100%
RULER_SEED = 42  # RULER's --random_seed: the seed of its fixed shuffles
PUBLISHED_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)  # the columns of RULER's table
RULER_SAMPLES = 500  # samples per task and length in RULER's table
MIN_SAMPLES = 100  # fewer per task and length: the scores are indicative only
# SHA-256 of the published inputs: the essays' text (the "text" string of PaulGrahamEssays.json, as RULER's
# download script writes it; 3,048,867 characters), and the QA files' bytes as RULER's download fetches them
ESSAYS_TEXT_SHA256 = frozenset({"dcd06b190977b2a7916bb3f3ab33ef7f901543547aa60940524d33fc79d199be"})
SQUAD_SHA256 = frozenset(
    {"80a5225e94905956a6446d296ca1093975c4d3b3260f1d6c8f68bc2ab77182d8"}
)  # dev-v2.0.json
HOTPOT_SHA256 = frozenset(
    {"4e9ecb5c8d3b719f624d66b60f8d56bf227f03914f5f0753d6fa1b359d7104ea"}
)  # distractor dev

PROMPT_PATHS = {  # how a run's prompts reach the model, as the summary labels it
    "local": "local model: chat template applied here, answer prefix in the assistant's turn",
    "completions": "served, /v1/completions: chat template applied here, answer prefix in the assistant's turn "
    "(RULER's path for open models)",
    "chat": "served, /v1/chat/completions: the server's chat template, answer prefix ending the user's message "
    "(RULER's path for API models)",
}


@dataclass(frozen=True)
class Task:
    """One task: its family, RULER's generation budget, and the family's settings."""

    family: str  # niah | vt | cwe | fwe | qa
    new_tokens: int  # RULER's generation budget
    one_order: bool  # its answer has one order: --score logprob can teacher-force it
    haystack: str = ""  # niah: noise (one line repeated), essay (the essays' words), needles (distractors)
    key: str = "words"  # niah: the keys, words (adjective-noun) or uuids
    value: str = "numbers"  # niah: the values, numbers (7 digits) or uuids
    keys: int = 1  # niah: keys with needles (the asked ones and distractors)
    values: int = 1  # niah: values per key
    queries: int = 1  # niah: keys asked
    source: str = ""  # qa: squad | hotpot


TASKS: dict[str, Task] = {
    "niah_single_1": Task("niah", 128, True, haystack="noise"),  # one needle among noise lines
    "niah_single_2": Task("niah", 128, True, haystack="essay"),  # one needle in essay text
    "niah_single_3": Task("niah", 128, True, haystack="essay", value="uuids"),  # a UUID value
    "niah_multikey_1": Task("niah", 128, True, haystack="essay", keys=4),  # 3 needles of other keys
    "niah_multikey_2": Task("niah", 128, True, haystack="needles"),  # a haystack of other keys' needles
    "niah_multikey_3": Task("niah", 128, True, haystack="needles", key="uuids", value="uuids"),  # of UUIDs
    "niah_multivalue": Task("niah", 128, False, haystack="essay", values=4),  # all 4 values of one key
    "niah_multiquery": Task("niah", 128, True, haystack="essay", keys=4, queries=4),  # 4 keys asked at once
    "vt": Task("vt", 30, True),  # the variables bound to a value through a chain of 4 assignments
    "cwe": Task("cwe", 120, False),  # the 10 most common words of a numbered list
    "fwe": Task("fwe", 50, True),  # the 3 most frequent words of a Zipf-distributed coded text
    "qa_squad": Task("qa", 32, False, source="squad"),  # a SQuAD question, its paragraph among others
    "qa_hotpot": Task("qa", 32, True, source="hotpot"),  # a HotpotQA question, its paragraphs among others
}


def step(task: Task, length: int, new_tokens: int) -> int:
    """RULER's step of a task's haystack, in its units (``units``): what a sample that overflows gives back.

    >>> step(TASKS["niah_single_2"], 4096, 128), step(TASKS["niah_single_1"], 2048, 128), step(TASKS["fwe"], 4096, 50)
    (500, 5, 126)
    """
    if task.family == "fwe":
        return max((length - new_tokens) // 32, 1)
    if task.family in ("cwe", "qa"):
        return 10
    if task.haystack == "essay":
        return 500
    short = length < 4096
    return (5 if short else 10) if task.family == "vt" else (5 if short else 25)


def units(task: Task) -> str:
    """What a task's haystack is counted in."""
    if task.family == "niah":
        return {"essay": "essay words", "noise": "noise lines", "needles": "needle lines"}[task.haystack]
    return {"vt": "noise lines", "cwe": "words", "fwe": "words", "qa": "documents"}[task.family]


@dataclass(frozen=True)
class RulerCase:
    """One instance: the prompt, where its needles went, the references that score, the teacher-forced answer."""

    task: str
    length: int  # RULER's length: the prompt and new_tokens are at most this
    sample: int
    new_tokens: int  # the tokens a reply may have (RULER's budget of the task, unless set)
    units: int  # the haystack's size in RULER's units (``units(task)``)
    prompt: Prompt
    needle_offsets: list[int]  # where each needle, chain assignment or gold document starts; [] for cwe/fwe
    references: list[str]  # the strings a reply is scored on
    answer_prefix: str  # how the answer begins (the prompt ends with it)
    answer_ids: list[int] | None  # the answer's tokens after the prompt (tasks whose answer has one order)
    reference_spans: list[tuple[int, int]] | None  # where each reference's tokens are in answer_ids
    english_words: bool = True  # False: cwe needed words past wonderwords' and had no english_words.json


def select_tasks(
    given: str | Sequence[str] | None,
    *,
    squad: QAData | None = None,
    hotpot: QAData | None = None,
    logprob: bool = False,
) -> list[str]:
    """The tasks of ``--tasks`` (a comma-separated string or a list) in RULER's order; by default every task
    whose data is given (QA: its file), and with ``logprob`` those of them whose answer has one order.

    >>> select_tasks("vt,cwe,vt")
    ['vt', 'cwe']
    """
    files = {"squad": squad, "hotpot": hotpot}
    if given is None:
        chosen = [n for n, t in TASKS.items() if t.family != "qa" or files[t.source] is not None]
        return [n for n in chosen if TASKS[n].one_order] if logprob else chosen
    text = given if isinstance(given, str) else ",".join(given)
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise ConfigError(
            f"--tasks {text!r}: unknown task {', '.join(unknown) or '(none)'}; known: {', '.join(TASKS)}"
        )
    for name in names:
        if TASKS[name].family == "qa" and files[TASKS[name].source] is None:
            raise ConfigError(f"--tasks {name}: needs the dataset's file, --{TASKS[name].source} FILE")
    unordered = [n for n in names if logprob and not TASKS[n].one_order]
    if unordered:
        ordered = ", ".join(n for n, t in TASKS.items() if t.one_order)
        raise ConfigError(
            f"--score logprob: {', '.join(unordered)}: the answer has no one order to teacher-force; "
            f"tasks it can score: {ordered}"
        )
    return [n for n in TASKS if n in names]


def build_instances(
    tokenizer,
    *,
    tasks: Sequence[str],
    lengths: Sequence[int],
    samples_per_task: int,
    seed: int,
    haystack: Path | None = None,
    squad: QAData | None = None,
    hotpot: QAData | None = None,
    english_words: Path | None = None,
    new_tokens: Mapping[str, int] | None = None,
    prefix_in: str = "assistant",
    lengths_setting: str = "--lengths",
) -> list[RulerCase]:
    """``samples_per_task`` instances of each task at each length, in that order; no model needed.

    A length is RULER's: the prompt and the tokens it may generate (``new_tokens``, by task; RULER's
    budgets when None) are at most the length, sized in the haystack's units as RULER sizes them.
    ``haystack``: the essays (RULER's ``PaulGrahamEssays.json``, a ``.txt`` file or a directory of them;
    generated filler sentences when None). ``squad`` / ``hotpot``: ``read_squad`` / ``read_hotpot`` of the
    datasets' files, for ``qa_squad`` / ``qa_hotpot``. ``english_words``: RULER's ``english_words.json``,
    which cwe draws from past wonderwords' words.
    ``prefix_in``: where the task's answer prefix goes: ``"assistant"`` after the generation prompt (a local
    model, or a raw completion request: RULER's path for open models), ``"user"`` at the end of the user's
    message (a chat server, which writes the generation prompt: RULER's path for API models).
    Raises ``ConfigError`` naming ``lengths_setting`` when a length cannot hold a task's smallest haystack.
    """
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ConfigError(f"unknown RULER task {', '.join(unknown)}; known: {', '.join(TASKS)}")
    missing = [t for t in tasks if TASKS[t].family == "qa" and {"squad": squad, "hotpot": hotpot}[TASKS[t].source] is None]  # fmt: skip
    if missing:
        raise ConfigError(f"{', '.join(missing)}: needs the dataset (--{TASKS[missing[0]].source} FILE)")
    if prefix_in not in ("assistant", "user"):
        raise ValueError(f"prefix_in: expected 'assistant' or 'user', got {prefix_in!r}")
    budgets = {t: (new_tokens or {}).get(t, TASKS[t].new_tokens) for t in tasks}
    builder = _Builder(tokenizer, haystack=haystack, squad=squad, hotpot=hotpot, english_words=english_words,
                       seed=seed, new_tokens=budgets, prefix_in=prefix_in, lengths_setting=lengths_setting)  # fmt: skip
    return [
        builder.build(task, length, sample)
        for task in tasks
        for length in lengths
        for sample in range(samples_per_task)
    ]


def read_essays(source: Path | None, *, seed: int = 0) -> str:
    """The essays' text: the ``text`` of RULER's ``PaulGrahamEssays.json`` (``{"text": "..."}``), a ``.txt``
    file, the ``.txt`` files of a directory (sorted by name, one after the other), or, when ``source`` is
    None, the needle's generated filler sentences."""
    if source is None:
        return " ".join(nd.filler_sentences(random.Random(f"haystack:{seed}"), nd.FILLER_SENTENCES))
    return "\n".join(nd.haystack_texts(source))


@dataclass(frozen=True)
class ReferenceInputs:
    """Which of a run's input files are the ones RULER's table was made from (by SHA-256, not by name)."""

    essays: bool = False  # --haystack's text is the published PaulGrahamEssays.json's
    squad: bool = False  # --squad is SQuAD 2.0's dev-v2.0.json
    hotpot: bool = False  # --hotpot is HotpotQA's hotpot_dev_distractor_v1.json
    english_words: bool = False  # --english-words was given (cwe past wonderwords' words)


def reference_inputs(
    haystack: Path | None = None,
    squad: Path | None = None,
    hotpot: Path | None = None,
    english_words: Path | None = None,
) -> ReferenceInputs:
    """``ReferenceInputs`` of the files given: each one's SHA-256 against the published file's."""

    def digest(path: Path | None) -> str | None:
        return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None and path.is_file() else None

    essays = False
    if haystack is not None and haystack.suffix == ".json" and haystack.is_file():
        text = read_essays(haystack)
        essays = hashlib.sha256(text.encode("utf-8")).hexdigest() in ESSAYS_TEXT_SHA256
    return ReferenceInputs(
        essays=essays,
        squad=digest(squad) in SQUAD_SHA256,
        hotpot=digest(hotpot) in HOTPOT_SHA256,
        english_words=english_words is not None,
    )


# --- words, values, documents ------------------------------------------------------------------------------


@functools.cache
def word_lists() -> tuple[list[str], list[str], list[str]]:
    """wonderwords' nouns, adjectives and verbs: single lowercase words, its profanity list left out."""
    from wonderwords import RandomWord, filter_profanity

    lists = RandomWord(enhanced_prefixes=False)
    return tuple(
        sorted(
            filter_profanity(w for w in lists.filter(include_categories=[c]) if w.isalpha() and w.islower())
        )
        for c in ("noun", "adjective", "verb")
    )


@functools.cache
def _cwe_pool() -> list[str]:
    nouns, adjectives, verbs = word_lists()
    return sorted({*nouns, *adjectives, *verbs})


@functools.cache
def read_english_words(path: Path) -> list[str]:
    """RULER's ``english_words.json`` (a JSON object whose values are the words), in its order."""
    data = _load_json(path, "english_words.json")
    if not isinstance(data, dict) or not all(isinstance(w, str) for w in data.values()):
        raise InputError(f"{path}: expected RULER's english_words.json, an object whose values are words")
    return list(data.values())


def random_key(rng: random.Random, kind: str) -> str:
    """A needle key: ``'brave-lantern'`` (an adjective and a noun) or a UUID."""
    if kind == "uuids":
        return random_value(rng, kind)
    nouns, adjectives, _ = word_lists()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


def random_value(rng: random.Random, kind: str) -> str:
    """A needle value: a 7-digit number, or a UUID (version 4, from ``rng``)."""
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return str(rng.randint(1_000_000, 9_999_999))


def fixed_shuffle(items: Sequence) -> list:
    """``items`` in the order of RULER's fixed-seed shuffle: the same permutation for every list of a length.

    >>> fixed_shuffle(range(5))
    [3, 1, 2, 4, 0]
    """
    shuffled = list(items)
    random.Random(RULER_SEED).shuffle(shuffled)
    return shuffled


@dataclass(frozen=True)
class Question:
    """One QA question: its answers, and its documents by index into ``QAData.documents``."""

    question: str
    answers: list[str]  # as the file writes them, unstripped (RULER scores "France " against the reply)
    own: list[int]  # the documents that come with the question (SQuAD: its paragraph; HotpotQA: all ten)
    gold: list[int]  # those that hold the answer (HotpotQA: the supporting facts' paragraphs)
    related: list[int]  # the first distractors (SQuAD: the other paragraphs of its article)


@dataclass(frozen=True)
class QAData:
    """A QA file: every distinct document, the questions that can be asked, the ones left out."""

    documents: list[str]
    questions: list[Question]
    skipped: int  # questions without an answer (SQuAD 2.0's is_impossible) or without documents


def _load_json(path: Path, what: str):
    if not path.is_file():
        raise PathError(f"{path}: no {what} file there")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not a JSON file ({err})") from None


def _field(row, key: str, where: str, kind: type):
    if not isinstance(row, dict) or key not in row:
        raise InputError(f"{where}: missing field {key!r}")
    if not isinstance(row[key], kind):
        raise InputError(f"{where}.{key}: expected a {kind.__name__}, got {type(row[key]).__name__}")
    return row[key]


def read_squad(path: Path) -> QAData:
    """SQuAD's own JSON (v1.1 or v2.0): ``{"data": [{"paragraphs": [{"context", "qas": [...]}]}]}``."""
    data = _load_json(path, "SQuAD")
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected SQuAD's JSON, an object with a 'data' list")
    articles = []
    for i, article in enumerate(_field(data, "data", str(path), list)):
        paragraphs = _field(article, "paragraphs", f"{path}: data[{i}]", list)
        articles.append([(f"{path}: data[{i}].paragraphs[{j}]", p) for j, p in enumerate(paragraphs)])
    documents = sorted({_field(p, "context", where, str) for article in articles for where, p in article})
    index = {d: i for i, d in enumerate(documents)}
    questions, skipped = [], 0
    for article in articles:
        mine = [index[p["context"]] for _, p in article]
        for where, paragraph in article:
            doc = index[paragraph["context"]]
            for k, qa in enumerate(_field(paragraph, "qas", where, list)):
                at = f"{where}.qas[{k}]"
                text = _field(qa, "question", at, str)
                answers = []
                for n, answer in enumerate(_field(qa, "answers", at, list)):
                    answers += [_field(answer, "text", f"{at}.answers[{n}]", str)]  # as written, as RULER
                if qa.get("is_impossible") or not any(a.strip() for a in answers):
                    skipped += 1
                    continue
                related = [d for d in dict.fromkeys(mine) if d != doc]
                questions.append(Question(text, answers, [doc], [doc], related))
    return _checked(path, QAData(documents, questions, skipped))


def read_hotpot(path: Path) -> QAData:
    """HotpotQA's own JSON: ``[{"question", "answer", "context": [[title, [sentence, ...]], ...],
    "supporting_facts": [[title, sentence index], ...]}, ...]`` (the distractor setting's dev file)."""
    rows = _load_json(path, "HotpotQA")
    if not isinstance(rows, list):
        raise InputError(f"{path}: expected HotpotQA's JSON, a list of questions")
    parsed = []
    for i, row in enumerate(rows):
        where = f"{path}: [{i}]"
        paragraphs = []
        for j, pair in enumerate(_field(row, "context", where, list)):
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], list)):
                raise InputError(f"{where}.context[{j}]: expected [title, [sentence, ...]]")
            title = str(pair[0])
            paragraphs.append((title, f"{title}\n{''.join(str(s) for s in pair[1])}"))
        facts = {f[0] for f in row.get("supporting_facts") or [] if isinstance(f, list) and f}
        question, answer = _field(row, "question", where, str), _field(row, "answer", where, str)
        parsed.append((question, answer, paragraphs, facts))
    documents = sorted({text for _, _, paragraphs, _ in parsed for _, text in paragraphs})
    index = {d: i for i, d in enumerate(documents)}
    questions = []
    for question, answer, paragraphs, facts in parsed:
        if not answer.strip() or not paragraphs:
            continue
        own = list(dict.fromkeys(index[text] for _, text in paragraphs))
        gold = list(dict.fromkeys(index[text] for title, text in paragraphs if title in facts)) or own
        questions.append(Question(question, [answer], own, gold, []))
    return _checked(path, QAData(documents, questions, len(parsed) - len(questions)))


def _checked(path: Path, data: QAData) -> QAData:
    if not data.questions:
        raise InputError(f"{path}: no question with an answer in it")
    return data


# --- prompts -----------------------------------------------------------------------------------------------

# The benchmark's text: NVIDIA/RULER (Apache License 2.0), scripts/data/synthetic/constants.py (each task's
# template and answer prefix) and niah.py / variable_tracking.py / qa.py (needle sentence, noise sentence,
# document header), matched character for character: these strings are the benchmark's definition.
VT_HOPS = 4  # RULER's chain: one chain of 4 hops, 5 variables
VT_EXAMPLE_TOKENS = 500  # RULER's worked example: an instance of at most 500 tokens, its answer after it
CWE_COMMON = 10  # the words asked for
FWE_ALPHA = 2.0  # RULER's Zipf exponent
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."  # kind: numbers | uuids, as in RULER
_NIAH = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the {kind} afterwards.\n"
)
_NIAH_QUESTION = "\nWhat are all the special magic {kind} for {query} mentioned in the provided text?"
_NIAH_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
_VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
_VT_QUESTION = "\nQuestion: Find all variables that are assigned the value {value} in the text above."
_VT_PREFIX = " Answer: According to the chain(s) of variable assignment in the text above, {count} variables are assigned the value {value}, they are: "  # fmt: skip
_CWE_INTRO = "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n"  # fmt: skip
_CWE_QUESTION = f"\nQuestion: What are the {CWE_COMMON} most common words in the above list?"
_CWE_PREFIX = f" Answer: The top {CWE_COMMON} words that appear most often in the list are:"
_FWE_INTRO = "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. "  # fmt: skip
_FWE_QUESTION = "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?"  # fmt: skip
_FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
_QA_INSTRUCTION = "Answer the question based on the given documents. Only give me the answer and do not output any other words."  # fmt: skip
_QA_PREFIX = " Answer:"


def _niah_text(text: str, kind: str, single: bool) -> str:
    """RULER's wording for one asked value (``single``): its template's words made singular as RULER makes
    them ("Some" -> "A", "are all" -> "is", "are" -> "is"), ``numbers`` -> ``number``."""
    if not single:
        return text.format(kind=kind, query="{query}")
    text = text.replace("Some", "A").replace("are all", "is").replace("are", "is")
    return text.format(kind=kind[:-1], query="{query}")


@dataclass(frozen=True)
class _Text:
    """One draw of a task instance, as text."""

    user: str  # the task's text (vt: its worked example first), without the answer prefix
    prefix: str  # how the answer begins
    references: list[str]
    marks: list[int]  # where each needle, chain assignment or gold document starts in ``user``
    ordered: bool  # the references in this order are the teacher-forced answer
    separator: str = ","  # between references in that answer (then a space)
    example: tuple[str, str] | None = None  # cwe: RULER's worked example (its task text, its answer)
    english_words: bool = True  # False: cwe ran past wonderwords' words without english_words.json


def _join_marked(parts: Sequence[tuple[str, bool]], separator: str) -> tuple[str, list[int]]:
    """``parts`` joined by ``separator``, and where each part marked True begins.

    >>> _join_marked([("a", False), ("NEEDLE", True), ("b", False)], " ")
    ('a NEEDLE b', [2])
    """
    texts, marks, at = [], [], 0
    for i, (text, marked) in enumerate(parts):
        at += len(separator) if i else 0
        if marked:
            marks.append(at)
        texts.append(text)
        at += len(text)
    return separator.join(texts), marks


def _join(items: Sequence[str]) -> str:
    """RULER's list of asked keys: ``'a'``, ``'a, and b'``, ``'a, b, and c'``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def _numbered(words: Sequence[str]) -> str:
    """``'1. a 2. b 3. c'``: RULER's numbered list."""
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _lines_with(lines: list[str], pieces: list[str], rng: random.Random) -> tuple[str, list[int]]:
    """``pieces`` put among ``lines`` at random places, as RULER puts needles (and vt's chain) among lines:
    the pieces keep their order; the text joined by line breaks, and where each piece begins."""
    places = sorted(rng.sample(range(len(lines)), len(pieces)))
    parts = [(line, False) for line in lines]
    for j, place in enumerate(places):  # each piece goes before the line drawn for it
        parts.insert(place + j, (pieces[j], True))
    return _join_marked(parts, "\n")


def _search(total: Callable[[int], int], length: int, step_: int, probe: int, slack: float) -> int:
    """RULER's binary search: the largest haystack size whose prompt and budget (``total``, a fresh draw each
    time) fit ``length``, between ``step_`` and ``slack`` times the size a draw of ``probe`` units suggests;
    ``step_`` when none fits."""
    per_unit = max(total(probe), 1) / probe
    low, high, found = step_, max(int(length / per_unit * slack), 2 * step_), None
    while low <= high:
        mid = (low + high) // 2
        if total(mid) <= length:
            found, low = mid, mid + 1
        else:
            high = mid - 1
    return step_ if found is None else found


def _variables(rng: random.Random, count: int, letters: int) -> list[str]:
    """``count`` distinct names of ``letters`` capital letters."""
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        names += [] if name in names else [name]
    return names


def _chain(names: list[str], value: int | str) -> list[str]:
    """``['VAR ABCDE = 12345', 'VAR FGHIJ = VAR ABCDE ', ...]``: each variable bound to the one before (with
    RULER's space after each hop)."""
    return [f"VAR {names[0]} = {value}"] + [
        f"VAR {b} = VAR {a} " for a, b in zip(names, names[1:], strict=False)
    ]


def _zipf_counts(words: int, vocabulary: int) -> list[int]:
    """RULER's counts ``int(N k^-alpha / zeta(alpha))`` of ranks k = 1, 2, ... for ``N = words``."""
    zeta = math.pi**2 / 6  # zeta(2), RULER's alpha being 2
    return [int(words * (k**-FWE_ALPHA) / zeta) for k in range(1, vocabulary + 1)]


@dataclass(frozen=True)
class _VtExample:
    """vt's worked example as RULER draws it once per length: its noise lines and where its chain goes."""

    lines: int
    places: tuple[int, ...]  # the chain's line numbers among all lines


_FEWEST = {"vt": VT_HOPS + 1, "cwe": CWE_COMMON}  # units a draw needs: lines for the chain, the common words


class _Builder:
    """What the instances of one ``build_instances`` call share: the tokenizer, its frame, sizes, caches."""

    def __init__(self, tokenizer, *, haystack, squad, hotpot, english_words, seed, new_tokens, prefix_in,
                 lengths_setting):  # fmt: skip
        self.tokenizer = tokenizer
        self.lengths_setting = lengths_setting
        self.frame = chat_frame(tokenizer)
        self.new_tokens = new_tokens
        self.prefix_in = prefix_in
        self.haystack = haystack
        self.english_words = english_words
        self.qa_data = {"squad": squad, "hotpot": hotpot}
        self.seed = seed
        self.families = {"niah": self.niah, "vt": self.vt, "cwe": self.cwe, "fwe": self.fwe, "qa": self.qa}
        self._sizes: dict[tuple[str, int], int] = {}
        self._vt_examples: dict[int, _VtExample] = {}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    @functools.cached_property
    def essay_words(self) -> list[str]:
        """The essays' words, as RULER splits them (every run of white space one space)."""
        return re.sub(r"\s+", " ", read_essays(self.haystack, seed=self.seed)).split(" ")

    def rng(self, name: str, length: int, what: int | str) -> random.Random:
        return random.Random(f"ruler:{self.seed}:{name}:{length}:{what}")

    def render(self, text: _Text) -> tuple[Prompt, list[int]]:
        """The prompt of a draw, and the token where each of its marks begins."""
        frame = self.frame
        if self.prefix_in == "assistant":  # RULER's raw prompt: the template's text, then the prefix
            before = frame.before
            if text.example:  # RULER's few-shot: the example's whole prompt and its answer, then a line break
                asked, answer = text.example
                before = f"{frame.before}{asked}{frame.after}{text.prefix} {answer}\n{frame.before}"
            ids, spans = dataclasses.replace(frame, before=before).encode(
                text.user, answer_prefix=text.prefix
            )
            raw = before + text.user + frame.after + text.prefix
            prompt = Prompt(input_ids=ids, messages=[{"role": "user", "content": text.user}], text=raw)
            start = len(before)
        else:  # a chat server writes the template: the prefix ends the user's message, as RULER asks API models
            lead = f"{text.example[0]}{text.prefix} {text.example[1]}\n" if text.example else ""
            content = lead + text.user + text.prefix
            ids, spans = frame.encode(content)
            prompt = Prompt(input_ids=ids, messages=[{"role": "user", "content": content}])
            start = len(frame.before) + len(lead)
        offsets = [next(i for i, (_, end) in enumerate(spans) if end > start + mark) for mark in text.marks]
        return prompt, offsets

    def total(self, name: str, text: _Text) -> int:
        """RULER's measure of a draw: its prompt's tokens and the generation budget."""
        return len(self.render(text)[0].input_ids) + self.new_tokens[name]

    def size(self, name: str, length: int) -> int:
        """The haystack size of a task at a length: RULER's search, once, on draws of its own."""
        if (name, length) not in self._sizes:
            task, rng = TASKS[name], self.rng(name, length, "search")
            step_ = step(task, length, self.new_tokens[name])
            if task.family == "fwe":  # RULER walks up from a word per 6 tokens until the prompt reaches it
                room = length - self.new_tokens[name]
                vocabulary = self.fwe_vocabulary(rng, room)
                size = room // 6
                while self.total(name, self.fwe(name, length, size, rng, 0, vocabulary)) < length:
                    size += step_
                self._sizes[name, length] = max(size - step_, step_)
            else:
                draw = lambda n: self.total(name, self.families[task.family](name, length, n, rng, 0))  # noqa: E731
                probe, slack = (4096, 2) if task.family == "cwe" else (step_, 3)
                self._sizes[name, length] = _search(draw, length, step_, probe, slack)
        return self._sizes[name, length]

    def build(self, name: str, length: int, sample: int) -> RulerCase:
        task, new_tokens = TASKS[name], self.new_tokens[name]
        size, step_ = self.size(name, length), step(task, length, new_tokens)
        rng = self.rng(name, length, sample)
        vocabulary = self.fwe_vocabulary(rng, length - new_tokens) if task.family == "fwe" else None
        while True:  # RULER's step back: a whole step while this sample's draw overflows
            text = self.families[task.family](name, length, size, rng, sample, vocabulary)
            prompt, offsets = self.render(text)
            tokens = len(prompt.input_ids) + new_tokens
            if tokens <= length:
                break
            if size - step_ < _FEWEST.get(task.family, 1):
                raise ConfigError(
                    f"{self.lengths_setting} {length}: too short for {name} (with its smallest haystack, "
                    f"{size} {units(task)}, the prompt and the {new_tokens} tokens to generate are {tokens})"
                )
            size -= step_
        answer_ids, reference_spans = (
            self.answer(text.references, text.separator) if text.ordered else (None, None)
        )
        return RulerCase(
            task=name,
            length=length,
            sample=sample,
            new_tokens=new_tokens,
            units=size,
            prompt=prompt,
            needle_offsets=offsets,
            references=text.references,
            answer_prefix=text.prefix,
            answer_ids=answer_ids,
            reference_spans=reference_spans,
            english_words=text.english_words,
        )

    def answer(self, references: list[str], separator: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The answer's tokens after the prefix, ``" a, b, c"``, and each reference's token span in them."""
        text, places = "", []
        for i, reference in enumerate(references):
            text += (separator if i else "") + " " + reference
            places.append((len(text) - len(reference), len(text)))
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = []
        for start, end in places:
            covering = [j for j, (a, b) in enumerate(encoded.offset_mapping) if a < end and b > start]
            spans.append((covering[0], covering[-1] + 1))
        return encoded.input_ids, spans

    # --- needle in a haystack: needles among essay sentences, noise lines or other needles ---

    def niah(self, name: str, length: int, size: int, rng: random.Random, sample: int, _=None) -> _Text:
        task = TASKS[name]
        keys: list[str] = []
        while len(keys) < task.keys:
            key = random_key(rng, task.key)
            keys += [] if key in keys else [key]
        values = [[random_value(rng, task.value) for _ in range(task.values)] for _ in keys]
        pairs = fixed_shuffle([(k, v) for k in range(task.keys) for v in range(task.values)])  # RULER's order
        needles = [NEEDLE.format(kind=task.value, key=keys[k], value=values[k][v]) for k, v in pairs]
        if task.haystack == "essay":
            context, marks = self.essay_with(needles, size, rng)
        else:
            if task.haystack == "noise":
                lines = [NOISE] * size
            else:
                lines = []
                while len(lines) < size:
                    key = random_key(rng, task.key)
                    if key not in keys:  # a distractor never carries a key of the task's own
                        value = random_value(rng, task.value)
                        lines.append(NEEDLE.format(kind=task.value, key=key, value=value))
            # RULER inserts the needles from the last line drawn to the first, the first needle last
            context, marks = _lines_with(lines, needles[::-1], rng)
            marks = marks[::-1]
        asked = rng.sample(range(task.keys), task.queries)
        wanted = [(k, v) for k in asked for v in range(task.values)]
        query = _join([keys[k] for k in asked])
        single = task.values * task.queries == 1
        head, tail, prefix = (
            _niah_text(t, task.value, single) for t in (_NIAH, _NIAH_QUESTION, _NIAH_PREFIX)
        )
        return _Text(
            user=head + context + tail.format(query=query),
            prefix=prefix.format(query=query),
            references=[values[k][v] for k, v in wanted],
            marks=[len(head) + marks[pairs.index(pair)] for pair in wanted],
            ordered=task.one_order,
        )

    def essay_with(self, needles: list[str], size: int, rng: random.Random) -> tuple[str, list[int]]:
        """The essays' first ``size`` words (from the first again when they run out), split into sentences,
        with the needles between sentences at RULER's depths, all joined by spaces."""
        words = self.essay_words
        taken = words[:size] if size <= len(words) else (words * -(-size // len(words)))[:size]
        sentences = nd.split_sentences(" ".join(taken).strip())
        cuts = sorted(int(len(sentences) * depth / 100) for depth in rng.sample(DEPTHS, len(needles)))
        bounds = [0, *cuts, len(sentences)]
        parts = []
        for i in range(1, len(bounds)):
            parts.append((" ".join(sentences[bounds[i - 1] : bounds[i]]), False))
            if i - 1 < len(needles):
                parts.append((needles[i - 1], True))
        return _join_marked(parts, " ")

    # --- variable tracking: a chain of assignments among noise lines, after a worked example ---

    def vt_example(self, length: int) -> _VtExample:
        """RULER's worked example at a length: the most noise lines (searched in steps of 5) that keep it
        within 500 tokens, and its chain's places, drawn once."""
        if length not in self._vt_examples:
            rng = self.rng("vt", length, "example")

            def draw(lines: int) -> _VtExample:
                places = sorted(rng.sample(range(lines), VT_HOPS + 1))
                return _VtExample(lines, tuple(p + j for j, p in enumerate(places)))

            def tokens(example: _VtExample) -> int:
                return len(self.encode(self.vt_example_text(example, _variables(rng, VT_HOPS + 1, 3), 12345)))

            lines = _search(lambda n: tokens(draw(n)), VT_EXAMPLE_TOKENS, 5, 5, 3)
            example = draw(lines)
            while tokens(example) > VT_EXAMPLE_TOKENS and lines - 5 >= VT_HOPS + 1:
                lines -= 5
                example = draw(lines)
            self._vt_examples[length] = example
        return self._vt_examples[length]

    @staticmethod
    def vt_example_text(example: _VtExample, names: list[str], value: int) -> str:
        """The example's task text and answer prefix (RULER's template without the model's)."""
        lines = [NOISE] * (example.lines + VT_HOPS + 1)
        for place, statement in zip(example.places, _chain(names, value), strict=True):
            lines[place] = statement
        question = _VT_QUESTION.format(value=value)
        return f"{_VT_INTRO}{chr(10).join(lines)}{question}{_VT_PREFIX.format(count=len(names), value=value)}"

    def vt(self, name: str, length: int, size: int, rng: random.Random, sample: int, _=None) -> _Text:
        example = self.vt_example(length)
        # each sample renames the example's variables and changes its value, as RULER does
        example_names = ["".join(rng.choices(string.ascii_uppercase, k=3)) for _ in range(VT_HOPS + 1)]
        shown = self.vt_example_text(example, example_names, rng.randint(10_000, 99_998))
        head = f"{shown} {' '.join(example_names)}\n\n{_VT_INTRO}"
        names, value = _variables(rng, VT_HOPS + 1, 5), rng.randint(10_000, 99_998)
        context, marks = _lines_with([NOISE] * size, _chain(names, value), rng)
        return _Text(
            user=head + context + _VT_QUESTION.format(value=value),
            prefix=_VT_PREFIX.format(count=len(names), value=value),
            references=names,
            marks=[len(head) + m for m in marks],
            ordered=True,
            separator="",
        )

    # --- common words: a numbered list, ten words far more often than the rest, after a worked example ---

    def cwe(self, name: str, length: int, size: int, rng: random.Random, sample: int, _=None) -> _Text:
        # RULER's counts: under 4096 tokens 6 and 1 (its example: 20 words, 3 and 1), else 30 and 3 (40, 10, 3)
        common_n, rare_n, example_words, example_common, example_rare = (
            (6, 1, 20, 3, 1) if length < 4096 else (30, 3, 40, 10, 3)
        )
        example, _ = self.cwe_words(rng, example_words)
        listed = fixed_shuffle(example[:CWE_COMMON] * example_common + example[CWE_COMMON:] * example_rare)
        words, english = self.cwe_words(rng, size)
        items = fixed_shuffle(words[:CWE_COMMON] * common_n + words[CWE_COMMON:] * rare_n)
        return _Text(
            user=f"{_CWE_INTRO}{_numbered(items)}{_CWE_QUESTION}",
            prefix=_CWE_PREFIX,
            references=words[:CWE_COMMON],
            marks=[],
            ordered=False,
            example=(f"{_CWE_INTRO}{_numbered(listed)}{_CWE_QUESTION}", _numbered(example[:CWE_COMMON])),
            english_words=english,
        )

    def cwe_words(self, rng: random.Random, count: int) -> tuple[list[str], bool]:
        """``count`` distinct words: wonderwords', else RULER's english_words.json, else adjective-noun pairs
        (and False: not RULER's words)."""
        pool = _cwe_pool()
        if count <= len(pool):
            return rng.sample(pool, count), True
        if self.english_words is not None:
            return rng.sample(read_english_words(self.english_words), count), True
        nouns, adjectives, _ = word_lists()
        pairs: dict[str, None] = {}
        while len(pairs) < count:
            pairs[f"{rng.choice(adjectives)}-{rng.choice(nouns)}"] = None
        return list(pairs), False

    # --- frequent words: a coded text whose words follow a Zipf distribution ---

    @staticmethod
    def fwe_vocabulary(rng: random.Random, room: int) -> list[str]:
        """RULER's coded words: a word per 50 tokens of the prompt's room, 6 random letters each, in the fixed
        shuffle of their sorted order, the first replaced by the noise ``...``."""
        size = room // 50
        if size < 4:
            raise ConfigError(
                f"fwe: {room} tokens of prompt hold {size} coded words, fewer than the 4 it needs"
            )
        vocabulary: set[str] = set()
        while len(vocabulary) < size:
            vocabulary.add("".join(rng.choices(string.ascii_lowercase, k=6)))
        coded = fixed_shuffle(sorted(vocabulary))
        coded[0] = "..."
        return coded

    def fwe(
        self, name: str, length: int, size: int, rng: random.Random, sample: int, vocabulary=None
    ) -> _Text:
        coded = vocabulary or self.fwe_vocabulary(rng, length - self.new_tokens[name])
        drawn = fixed_shuffle(
            [w for w, c in zip(coded, _zipf_counts(size, len(coded)), strict=True) for _ in range(c)]
        )
        return _Text(
            user=f"{_FWE_INTRO}{' '.join(drawn)}{_FWE_QUESTION}",
            prefix=_FWE_PREFIX,
            references=coded[1:4],
            marks=[],
            ordered=True,
        )

    # --- question answering: the question's documents among distractors ---

    def qa(self, name: str, length: int, size: int, rng: random.Random, sample: int, _=None) -> _Text:
        data = self.qa_data[TASKS[name].source]
        question = data.questions[sample % len(data.questions)]  # RULER's: the file's first ones, in order
        own, related = question.own, question.related
        count = len(data.documents)
        if size >= count:  # every document, again and again
            chosen = (list(range(count)) * -(-size // count))[:size]
        elif size - len(own) > len(related):
            taken = {*own, *related}
            others = [d for d in range(count) if d not in taken]
            chosen = own + related + rng.sample(others, size - len(own) - len(related))
        else:
            chosen = own + rng.sample(related, max(size - len(own), 0))
        chosen = fixed_shuffle(chosen)  # RULER's one shuffle: the gold document's slot depends on the count
        parts = [
            (f"Document {i + 1}:\n{data.documents[d]}", d in question.gold) for i, d in enumerate(chosen)
        ]
        context, marks = _join_marked(parts, "\n\n")
        head = f"{_QA_INSTRUCTION}\n\nThe following are given documents.\n\n"
        return _Text(
            user=f"{head}{context}\n\n{_QA_INSTRUCTION}\n\nQuestion: {question.question}",
            prefix=_QA_PREFIX,
            references=question.answers,
            marks=[len(head) + m for m in marks],
            ordered=TASKS[name].one_order,
            separator="",
        )


# --- scoring -----------------------------------------------------------------------------------------------


def score_output(task: str, references: Sequence[str], output: str) -> float:
    """RULER's score of one reply: the share of ``references`` in it x 100; QA: 100 if any is in it.
    Case is folded with ``str.lower``, as RULER's scorer does.

    >>> score_output("niah_multivalue", ["123", "456", "789", "000"], "They are 123 and 789.")
    50.0
    """
    hits = [r.lower() in output.lower() for r in references]
    if TASKS[task].family == "qa":
        return 100.0 * any(hits)
    return 100.0 * sum(hits) / len(hits)


def _row(case: RulerCase) -> dict:
    return {
        "task": case.task,
        "length": case.length,
        "sample": case.sample,
        "prompt_tokens": len(case.prompt.input_ids),
        "units": case.units,
        "new_tokens": case.new_tokens,
        "answer_prefix": case.answer_prefix,
        "needle_offsets": case.needle_offsets,
        "references": case.references,
    } | ({} if case.english_words else {"cwe_words": "adjective-noun pairs"})


def generation_row(case: RulerCase, reply: Reply) -> dict:
    """The ``results.jsonl`` row of a generated reply; a failed request scores 0 (RULER's scorer sees an
    empty prediction) and keeps its error."""
    row = _row(case)
    row.update(
        output=reply.text, score=0.0 if reply.error else score_output(case.task, case.references, reply.text)
    )
    if reply.error:
        row["error"] = reply.error
    return row


def logprob_row(case: RulerCase, score: nd.AnswerScore, tokenizer) -> dict:
    """The row of a teacher-forced reading: the share of references whose every token is the most likely one
    (given the answer before it) x 100, and the answer's mean log-probability."""
    recalled = [score.predicted[a:b] == case.answer_ids[a:b] for a, b in case.reference_spans]
    row = _row(case)
    row.update(
        output=tokenizer.decode(score.predicted),
        score=100.0 * sum(recalled) / len(recalled),
        logprob=score.logprob,
    )
    return row


def effective_length(average_by_length: dict[int, float | None], threshold: float) -> int | None:
    """The longest length up to which every average is at least ``threshold``; None if the shortest is under.

    >>> effective_length({4096: 95.0, 8192: 88.0, 16384: 70.0, 32768: 90.0}, 85.6)
    8192
    """
    found = None
    for length in sorted(average_by_length):
        score = average_by_length[length]
        if score is None or score < threshold:
            break
        found = length
    return found


def confidence_interval(scores: Sequence[float], z: float = 1.96) -> list[float] | None:
    """The 95% interval of a mean score (0-100) over ``len(scores)`` samples: Wilson's score interval of the
    mean as a proportion. Partial scores (a share of the references) vary less than 0-or-100 ones, so for
    them it is wider than needed, never narrower.

    >>> confidence_interval([100.0] * 20)
    [83.9, 100.0]
    """
    if not scores:
        return None
    n, p = len(scores), sum(scores) / len(scores) / 100
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low, high = (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)
    return [round(100 * max(low, 0.0), 1), round(100 * min(high, 1.0), 1)]


def missing_for_comparison(
    tasks: Sequence[str],
    *,
    lengths: Sequence[int] = PUBLISHED_LENGTHS,
    samples: int = RULER_SAMPLES,
    inputs: ReferenceInputs = ReferenceInputs(),
    cwe_pairs_at: Sequence[int] = (),
) -> list[str]:
    """What keeps a run's average from standing next to RULER's published ones, one reason a line: tasks
    that did not run, inputs that are not the published files (by SHA-256), lengths of RULER's table that
    did not run, too few samples, cwe words that are not RULER's (``cwe_pairs_at``: the lengths).

    >>> missing_for_comparison(list(TASKS)[:11], samples=3)[:1]
    ['tasks not run: qa_squad, qa_hotpot (--squad, --hotpot)']
    """
    missing = []
    absent = [t for t in TASKS if t not in tasks]
    if absent:
        files = [f"--{TASKS[t].source}" for t in absent if TASKS[t].family == "qa"]
        missing.append(f"tasks not run: {', '.join(absent)}" + (f" ({', '.join(files)})" if files else ""))
    if not inputs.essays and any(TASKS[t].haystack == "essay" for t in tasks):
        missing.append(
            "essay haystack: not RULER's essays file (--haystack PaulGrahamEssays.json, whose text has the "
            "published SHA-256)"
        )
    for task, given, name in (("qa_squad", inputs.squad, "SQuAD 2.0's dev-v2.0.json"),
                              ("qa_hotpot", inputs.hotpot, "HotpotQA's hotpot_dev_distractor_v1.json")):  # fmt: skip
        if task in tasks and not given:
            missing.append(f"{task}: --{TASKS[task].source} is not {name} (by SHA-256)")
    unrun = [n for n in PUBLISHED_LENGTHS if n not in lengths]
    if unrun:
        missing.append(f"lengths not run: {', '.join(map(str, unrun))} (RULER's table: 4k to 128k)")
    if samples < MIN_SAMPLES:
        missing.append(
            f"samples per task and length: {samples}, indicative only (RULER's table: {RULER_SAMPLES}; "
            f"{MIN_SAMPLES} or more to compare, with the confidence intervals)"
        )
    if cwe_pairs_at:
        missing.append(
            f"cwe at {', '.join(map(str, cwe_pairs_at))}: adjective-noun pairs past wonderwords' words, not "
            "RULER's english_words.json (--english-words)"
        )
    return missing


def summary(
    rows: Sequence[dict], *, threshold: float = THRESHOLD, inputs: ReferenceInputs = ReferenceInputs()
) -> dict:
    """Mean score and its 95% interval by task and length; the average over RULER's 13 tasks by length and
    the effective length when the run can stand next to RULER's table, else the average over the tasks that
    ran, labelled, with every reason it cannot (``missing_for_comparison``).

    A failed request scored 0 and is counted in ``failed``. ``inputs``: which input files are the published
    ones (``reference_inputs``).
    """
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    lengths = sorted({r["length"] for r in rows})

    def cell(task: str, length: int, key: str) -> list[float]:
        return [r[key] for r in rows if r["task"] == task and r["length"] == length]

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    def table(key: str) -> dict[str, dict[str, float | None]]:
        return {t: {str(n): mean(cell(t, n, key)) for n in lengths} for t in tasks}

    by_task_length = table("score")
    average = {n: mean([v for t in tasks if (v := by_task_length[t][str(n)]) is not None]) for n in lengths}
    samples = min((len(cell(t, n, "score")) for t in tasks for n in lengths), default=0)
    pairs_at = sorted({r["length"] for r in rows if r.get("cwe_words") == "adjective-noun pairs"})
    missing = missing_for_comparison(
        tasks, lengths=lengths, samples=samples, inputs=inputs, cwe_pairs_at=pairs_at
    )
    result = {
        "by_task_length": by_task_length,
        "ci95_by_task_length": {
            t: {str(n): confidence_interval(cell(t, n, "score")) for n in lengths} for t in tasks
        },
        "comparable": not missing,  # RULER's 13 tasks on its inputs, lengths and enough samples: its average
        "not_comparable_because": missing,
        "indicative": samples < MIN_SAMPLES,  # too few samples per task and length for a comparison
        "samples_per_task": samples,  # the fewest of any task and length
        "average_by_length": None if missing else {str(n): v for n, v in average.items()},
        "effective_length": None if missing else effective_length(average, threshold),
        "partial_average_by_length": {str(n): v for n, v in average.items()} if missing else None,
        "threshold": threshold,
        "tasks": tasks,
        "lengths": lengths,
        "n": len(rows),
        "failed": sum("error" in r for r in rows),
    }
    if any("logprob" in r for r in rows):
        result["logprob_by_task_length"] = table("logprob")
    return result


def averages(summary_: dict) -> tuple[str, dict[str, float | None]]:
    """The row that closes the table: ``("average", ...)``, or ``("partial average", ...)`` when the run is
    not comparable with RULER's."""
    if summary_["comparable"]:
        return "average", summary_["average_by_length"]
    return "partial average", summary_["partial_average_by_length"]


def summary_csv(summary_: dict) -> str:
    """``task,length,score`` (and ``logprob``) per cell, then the ``average`` rows (``partial average
    (not comparable)`` when the run is not comparable with RULER's)."""
    logprob = summary_.get("logprob_by_task_length")
    lines = ["task,length,score" + (",logprob" if logprob else "")]
    fmt = lambda value: "" if value is None else f"{value:.6g}"  # noqa: E731
    for task, scores in summary_["by_task_length"].items():
        for length, value in scores.items():
            lines.append(
                f"{task},{length},{fmt(value)}" + (f",{fmt(logprob[task][length])}" if logprob else "")
            )
    label, values = averages(summary_)
    label = label if summary_["comparable"] else f"{label} (not comparable)"
    for length, value in values.items():
        lines.append(f"{label},{length},{fmt(value)}" + ("," if logprob else ""))
    return "\n".join(lines) + "\n"


def plot_heatmap(summary_: dict, path: Path, *, title: str) -> None:
    """``ruler.png``: score 0-100 by task (rows, the average last) and length (columns)."""
    from matplotlib.figure import Figure  # no pyplot, no display

    lengths = [str(n) for n in summary_["lengths"]]
    label, values = averages(summary_)
    rows = [*summary_["tasks"], label]
    grid = [[_value(summary_["by_task_length"][t][n]) for n in lengths] for t in summary_["tasks"]]
    grid.append([_value(values[n]) for n in lengths])
    figure = Figure(figsize=(3.5 + 0.8 * len(lengths), 1.2 + 0.35 * len(rows)), layout="constrained")
    ax = figure.subplots()
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=100.0, aspect="auto")
    for y, row in enumerate(grid):
        for x, value in enumerate(row):
            if value == value:  # not NaN
                ax.text(x, y, f"{value:.0f}", ha="center", va="center", fontsize=7,
                        fontweight="bold" if y == len(grid) - 1 else "normal")  # fmt: skip
    ax.axhline(len(grid) - 1.5, color="black", linewidth=1)
    ax.set_xticks(range(len(lengths)), lengths, rotation=45)
    ax.set_yticks(range(len(rows)), rows)
    effective = summary_["effective_length"]
    if summary_["comparable"]:
        heading = f"effective length {effective or 'none'} (average >= {summary_['threshold']:g})"
    else:
        heading = "not comparable with RULER's table:\n" + "\n".join(summary_["not_comparable_because"])
    ax.set(xlabel="length (tokens: prompt and generation budget)", title=heading)
    figure.colorbar(image, ax=ax, label="score (0-100)")
    figure.suptitle(title)
    figure.savefig(path, dpi=100)


def _value(value: float | None) -> float:
    return float("nan") if value is None else value
