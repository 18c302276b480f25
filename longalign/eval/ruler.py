"""RULER's long-context tasks (NVIDIA/RULER), built as RULER builds them at its lengths, and their scores.

An instance is RULER's text: the task's template (its instructions, the haystack with its needles, the
question) as the user's message, the chat template around it, and the task's answer prefix after the
generation prompt (local models) or at the end of the user's message (served models, as RULER sends API
models). cwe's worked example is a turn of its own before it, vt's opens the user's message. A length is
RULER's: the prompt and the task's generation budget, so the 128k column runs on a 131,072-position model::

    [chat template, (cwe: example turn)][template head][haystack with needles][question][generation prompt][prefix]
                                                              ^ needle_offsets
    len(prompt) + new_tokens == length   (QA keeps whole documents, as RULER: it may fall short, never over)

The prompt is the rendered chat encoded once (``longalign.eval.models.ChatFrame``), as pre-tokenize
encodes a training chat; the haystack is counted in tokens and cut to the count that makes up the length,
then moved by the few tokens that merge at its edges. The needles go between its units (sentences, lines,
list items, documents), never into one. Each instance draws its randomness from ``(seed, task, length,
sample)``, so the same seed gives the same prompts whatever else is asked.

    cases = build_instances(tokenizer, tasks=["niah_single_1", "vt"], lengths=[4096, 8192],
                            samples_per_task=20, seed=0)
    replies = generator.generate([case.prompt for case in cases])
    rows = [generation_row(case, reply) for case, reply in zip(cases, replies)]
    summary(rows)  -> {'by_task_length': {'niah_single_1': {'4096': 100.0, ...}, ...}, 'comparable': False,
                       'not_comparable_because': ['tasks not run: niah_single_2, ...'],
                       'partial_average_by_length': {'4096': 97.5, '8192': 90.0}, ...}

Scores are RULER's: the share of the references found in the output (``str.lower`` on both) x 100, or for
the QA tasks 100 when any reference is found; a failed request scores 0. The average over RULER's 13 tasks
and the effective length are given only when all 13 ran on the reference inputs (``missing_for_comparison``).
The teacher-forced alternative (``--score logprob``) reads ``answer_ids`` after the prompt with
``longalign.eval.needle.score_answers``; ``logprob_row`` scores it.

Where this differs from RULER's generators: the haystack may end inside a sentence or line (the exact
length), sentences are split by ``longalign.eval.needle.split_sentences`` (RULER uses NLTK's punkt), and
keys and cwe's words come from wonderwords' lists with its profanity list left out (RULER's extra English
word list, used past wonderwords' size, is replaced by adjective-noun pairs).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
import string
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from longalign.errors import ConfigError, InputError, PathError
from longalign.eval import needle as nd
from longalign.eval.models import Prompt, Reply, chat_frame, fit_length

THRESHOLD = 85.6  # RULER's: Llama-2-7B's average at 4k, the bar for the effective length
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's needle depths: 40 from 0% to 100%


@dataclass(frozen=True)
class Task:
    """One task: its family, RULER's generation budget, and the family's settings."""

    family: str  # niah | vt | cwe | fwe | qa
    new_tokens: int  # RULER's generation budget
    one_order: bool  # its answer has one order: --score logprob can teacher-force it
    haystack: str = ""  # niah: noise (one line repeated), essay (--haystack sentences), needles (distractors)
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


@dataclass(frozen=True)
class RulerCase:
    """One instance: the prompt, where its needles went, the references that score, the teacher-forced answer."""

    task: str
    length: int  # RULER's length: the prompt's tokens and new_tokens
    sample: int
    new_tokens: int  # the tokens a reply may have (RULER's budget of the task, unless set)
    prompt: Prompt
    needle_offsets: list[int]  # where each needle, chain assignment or gold document starts; [] for cwe/fwe
    references: list[str]  # the strings a reply is scored on
    answer_prefix: str  # how the answer begins (the prompt ends with it)
    answer_ids: list[int] | None  # the answer's tokens after the prompt (tasks whose answer has one order)
    reference_spans: list[tuple[int, int]] | None  # where each reference's tokens are in answer_ids


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
    new_tokens: Mapping[str, int] | None = None,
    prefix_in: str = "assistant",
    lengths_setting: str = "--lengths",
) -> list[RulerCase]:
    """``samples_per_task`` instances of each task at each length, in that order; no model needed.

    A length is RULER's: the prompt and the tokens it may generate (``new_tokens``, by task; RULER's
    budgets when None), so a 131,072-position model takes the 128k column.
    ``haystack``: the essay text (``.txt`` file or directory; generated filler sentences when None).
    ``squad`` / ``hotpot``: ``read_squad`` / ``read_hotpot`` of the datasets' files, for ``qa_squad`` /
    ``qa_hotpot``.
    ``prefix_in``: where the task's answer prefix goes, as RULER puts it: ``"assistant"`` after the
    generation prompt (a local model's reply continues it), ``"user"`` at the end of the user's message
    (a served model, whose server writes the generation prompt).
    Raises ``ConfigError`` naming ``lengths_setting`` when a length cannot hold a task's fixed text.
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
    builder = _Builder(tokenizer, haystack=haystack, squad=squad, hotpot=hotpot, seed=seed, new_tokens=budgets,
                       prefix_in=prefix_in, lengths_setting=lengths_setting)  # fmt: skip
    return [
        builder.build(task, length, sample)
        for task in tasks
        for length in lengths
        for sample in range(samples_per_task)
    ]


def is_essays_file(haystack: Path | None) -> bool:
    """Whether ``--haystack`` is an essays file in the format of RULER's download (``PaulGrahamEssays.json``,
    ``{"text": ...}``): the reference's essay haystack, as far as a file can say."""
    return haystack is not None and haystack.suffix == ".json"


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


@dataclass(frozen=True)
class Question:
    """One QA question: its answers, and its documents by index into ``QAData.documents``."""

    question: str
    answers: list[str]
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
                    answers += [_field(answer, "text", f"{at}.answers[{n}]", str).strip()]
                answers = [a for a in answers if a]
                if qa.get("is_impossible") or not answers:
                    skipped += 1
                    continue
                related = [d for d in dict.fromkeys(mine) if d != doc]
                questions.append(Question(text, list(dict.fromkeys(answers)), [doc], [doc], related))
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
        question, answer = _field(row, "question", where, str), _field(row, "answer", where, str).strip()
        parsed.append((question, answer, paragraphs, facts))
    documents = sorted({text for _, _, paragraphs, _ in parsed for _, text in paragraphs})
    index = {d: i for i, d in enumerate(documents)}
    questions = []
    for question, answer, paragraphs, facts in parsed:
        if not answer or not paragraphs:
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
    them ("Some" -> "A", "are" -> "is"), ``numbers`` -> ``number``."""
    if not single:
        return text.format(kind=kind, query="{query}")
    text = text.replace("Some", "A").replace("are all", "is").replace("are", "is")
    return text.format(kind=kind[:-1], query="{query}")


_Body = Callable[[int], "tuple[list[int], list[int]] | None"]


@dataclass(frozen=True)
class _Draft:
    """A task instance before its body is cut to size."""

    head: str  # the instructions before the body (and a worked example)
    tail: str  # the question after it
    prefix: str  # how the answer begins
    references: list[str]
    body: _Body  # budget -> (budget ids (QA: whole documents, up to budget), the needles' offsets), or None
    ordered: bool  # the references in this order are the teacher-forced answer
    separator: str = ","  # between references in that answer (then a space)
    history: tuple[dict[str, str], ...] = ()  # turns before the task's (cwe: RULER's example, answered)


def _join(items: Sequence[str]) -> str:
    """``'a'``, ``'a and b'``, ``'a, b, and c'``."""
    if len(items) < 3:
        return " and ".join(items)
    return ", ".join(items[:-1]) + ", and " + items[-1]


def _repeated(unit: list[int], tokens: int) -> list[list[int]]:
    """``unit`` as many times as it takes to hold ``tokens`` tokens."""
    return [unit] * -(-tokens // len(unit))


def _insert(units: list[list[int]], tokens: int, pieces: list[list[int]], depths: list[float]):
    """Units cut to ``tokens`` with ``pieces`` put at the unit boundaries nearest ``depths`` (sorted, percent).

    Returns the ids and each piece's offset in them, in the pieces' order.
    """
    haystack = [t for unit in units for t in unit][:tokens]
    lens = [len(unit) for unit in units]
    out, offsets, done = [], [], 0
    for piece, depth in zip(pieces, depths, strict=True):
        cut = nd.nearest_boundary(lens, tokens, depth)
        out += haystack[done:cut]
        done = cut
        offsets.append(len(out))
        out += piece
    return out + haystack[done:], offsets


class _Builder:
    """What the instances of one ``build_instances`` call share: the tokenizer, its frame, pools, caches."""

    def __init__(self, tokenizer, *, haystack, squad, hotpot, seed, new_tokens, prefix_in, lengths_setting):
        self.tokenizer = tokenizer
        self.lengths_setting = lengths_setting
        self.frame = chat_frame(tokenizer)
        self.new_tokens = new_tokens
        self.prefix_in = prefix_in
        self.haystack = haystack
        self.qa_data = {"squad": squad, "hotpot": hotpot}
        self.seed = seed
        self.families = {"niah": self.niah, "vt": self.vt, "cwe": self.cwe, "fwe": self.fwe, "qa": self.qa}
        self._numbers: list[list[int]] = []  # " 1.", " 2.", ... of the numbered list
        self._essay: list[list[int]] = []  # the essays' first sentences, encoded
        self._essay_tokens = 0

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False).input_ids

    @functools.cached_property
    def essay_text(self) -> list[str]:
        """The essays' sentences: ``--haystack``'s, or the needle's generated filler."""
        if self.haystack is None:
            return nd.filler_sentences(random.Random(f"haystack:{self.seed}"), nd.FILLER_SENTENCES)
        return nd.read_haystack(self.haystack)

    def essay(self, tokens: int) -> list[list[int]]:
        """The essays' first sentences holding ``tokens`` tokens (from the first again when they run out),
        each encoded with its leading space, as many as needed."""
        while self._essay_tokens < tokens and len(self._essay) < len(self.essay_text):
            more = self.encode_many(
                [" " + t for t in self.essay_text[len(self._essay) : len(self._essay) + 512]]
            )
            self._essay += more
            self._essay_tokens += sum(map(len, more))
        return nd.sentences_from(self._essay, 0, tokens)

    @functools.cached_property
    def noise(self) -> list[int]:
        return self.encode("\n" + NOISE)

    def number(self, i: int) -> list[int]:
        """The tokens of ``" {i}."``, the number of item i (from 1) of a numbered list."""
        while len(self._numbers) < i:
            start = len(self._numbers) + 1
            self._numbers += self.encode_many([f" {n}." for n in range(start, 2 * start + 1024)])
        return self._numbers[i - 1]

    def build(self, name: str, length: int, sample: int) -> RulerCase:
        task = TASKS[name]
        new_tokens = self.new_tokens[name]
        target = length - new_tokens  # RULER's length: the prompt and the tokens it may generate
        rng = random.Random(f"ruler:{self.seed}:{name}:{length}:{sample}")
        draft = self.families[task.family](name, task, length, sample, rng)
        state = rng.getstate()  # every try at a budget draws the same body

        def text(content: str) -> tuple[str, str]:  # the user's text, and what follows the generation prompt
            return (content + draft.prefix, "") if self.prefix_in == "user" else (content, draft.prefix)

        frame = chat_frame(self.tokenizer, draft.history) if draft.history else self.frame

        def make(budget: int):
            rng.setstate(state)
            body = draft.body(budget)
            if body is None:
                return None
            ids, offsets = body
            shown = nd.decode_text(self.tokenizer, ids)
            # RULER's context begins its line: no space or newline of the first unit after a line break
            strip = 1 if draft.head[-1:] in (" ", "\n") and shown[:1] in (" ", "\n") else 0
            user, after = text(draft.head + shown[strip:] + draft.tail)
            prompt_ids, spans = frame.encode(user, answer_prefix=after)
            return prompt_ids, spans, ids, offsets, user, strip

        user, after = text(draft.head + draft.tail)
        fixed = len(frame.encode(user, answer_prefix=after)[0])
        made = fit_length(make, lambda made: len(made[0]) if made else 0, target, target - fixed)
        if made is None:
            raise ConfigError(
                f"{self.lengths_setting} {length}: too short for {name} ({fixed} tokens of instructions and chat "
                f"template, {new_tokens} to generate, and the task's text does not fit in the "
                f"{max(target - fixed, 0)} left)"
            )
        prompt_ids, spans, body_ids, body_offsets, user, strip = made
        start = len(frame.before) + len(draft.head)
        needle_offsets = []
        for at in body_offsets:  # the token of the prompt where each needle's text begins
            char = start + max(len(nd.decode_text(self.tokenizer, body_ids[:at])) - strip, 0)
            needle_offsets.append(next(i for i, (_, end) in enumerate(spans) if end > char))
        answer_ids, reference_spans = (
            self.answer(draft.references, draft.separator) if draft.ordered else (None, None)
        )
        return RulerCase(
            task=name,
            length=length,
            sample=sample,
            new_tokens=new_tokens,
            prompt=Prompt(input_ids=prompt_ids, messages=[*draft.history, {"role": "user", "content": user}]),
            needle_offsets=needle_offsets,
            references=draft.references,
            answer_prefix=draft.prefix,
            answer_ids=answer_ids,
            reference_spans=reference_spans,
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

    # --- needle in a haystack: needles at random depths of noise, essay sentences or other needles ---

    def niah(self, name: str, task: Task, length: int, sample: int, rng: random.Random) -> _Draft:
        keys: list[str] = []
        while len(keys) < task.keys:
            key = random_key(rng, task.key)
            keys += [] if key in keys else [key]
        values = [[random_value(rng, task.value) for _ in range(task.values)] for _ in keys]
        needles = [(k, v) for k in range(task.keys) for v in range(task.values)]
        rng.shuffle(needles)
        asked = rng.sample(range(task.keys), task.queries)
        wanted = [(k, v) for k in asked for v in range(task.values)]
        query = _join([keys[k] for k in asked])
        sep = (
            " " if task.haystack == "essay" else "\n"
        )  # RULER joins essay sentences with spaces, lines with \n
        pieces = self.encode_many(
            [sep + NEEDLE.format(kind=task.value, key=keys[k], value=values[k][v]) for k, v in needles]
        )
        depths = _depths(rng, len(needles), lines=task.haystack != "essay")
        needed = sum(map(len, pieces))

        def body(budget: int):
            if budget <= needed:
                return None
            units = self.haystack_units(task, rng, budget - needed, avoid=set(keys))
            ids, at = _insert(units, budget - needed, pieces, depths)
            offset = dict(zip(needles, at, strict=True))
            return ids, [offset[needle] for needle in wanted]

        single = task.values * task.queries == 1
        head, tail, prefix = (
            _niah_text(t, task.value, single) for t in (_NIAH, _NIAH_QUESTION, _NIAH_PREFIX)
        )
        references = [values[k][v] for k, v in wanted]
        return _Draft(head, tail.format(query=query), prefix.format(query=query), references, body,
                      ordered=task.one_order)  # fmt: skip

    def haystack_units(
        self, task: Task, rng: random.Random, tokens: int, *, avoid: set[str]
    ) -> list[list[int]]:
        """Units holding ``tokens`` tokens or more: essay sentences (from the first, as RULER takes the essays'
        first words), noise lines, or needles of other keys."""
        if task.haystack == "essay":
            return self.essay(tokens)
        if task.haystack == "noise":
            return _repeated(self.noise, tokens)
        units: list[list[int]] = []
        while (total := sum(map(len, units))) < tokens:
            # a first batch measures the needles' size; the next one is about as many as are still needed
            wanted = int((tokens - total) * 1.05 * len(units) / total) + 1 if units else 32
            texts = []
            while len(texts) < wanted:
                key = random_key(rng, task.key)
                if key not in avoid:
                    texts.append(
                        "\n" + NEEDLE.format(kind=task.value, key=key, value=random_value(rng, task.value))
                    )
            units += self.encode_many(texts)
        return units

    # --- variable tracking: a chain of assignments among noise lines, after a worked example ---

    def vt(self, name: str, task: Task, length: int, sample: int, rng: random.Random) -> _Draft:
        example_names, example_value = _variables(rng, VT_HOPS + 1, 3), rng.randint(10_000, 99_999)
        example_chain = _chain(example_names, example_value)
        slots = rng.random()

        def example(
            noise_lines: int,
        ) -> str:  # RULER's worked example: an instance, its answer prefix included
            lines = [NOISE] * (noise_lines + len(example_chain))
            places = sorted(random.Random(slots).sample(range(len(lines)), len(example_chain)))
            for slot, statement in zip(places, example_chain, strict=True):
                lines[slot] = statement
            context, question = "\n".join(lines), _VT_QUESTION.format(value=example_value)
            return f"{_VT_INTRO}{context}{question}{_VT_PREFIX.format(count=len(example_names), value=example_value)}"

        # the most noise lines that keep the example within RULER's 500 tokens (at least 5, as RULER)
        size = lambda lines: len(self.encode(example(lines)))  # noqa: E731
        noise_lines = max(5, (VT_EXAMPLE_TOKENS - size(0)) // len(self.noise))
        while size(noise_lines + 1) <= VT_EXAMPLE_TOKENS:
            noise_lines += 1
        while noise_lines > 5 and size(noise_lines) > VT_EXAMPLE_TOKENS:
            noise_lines -= 1
        names, value = _variables(rng, VT_HOPS + 1, 5), rng.randint(10_000, 99_999)
        pieces = self.encode_many([f"\n{statement}" for statement in _chain(names, value)])
        depths = _depths(rng, len(pieces), lines=True)
        needed = sum(map(len, pieces))

        def body(budget: int):
            if budget <= needed:
                return None
            return _insert(_repeated(self.noise, budget - needed), budget - needed, pieces, depths)

        head = f"{example(noise_lines)} {' '.join(example_names)}\n{_VT_INTRO}"
        tail = _VT_QUESTION.format(value=value)
        prefix = _VT_PREFIX.format(count=len(names), value=value)
        return _Draft(head, tail, prefix, names, body, ordered=True, separator="")

    # --- common words: a numbered list, ten words far more often than the rest, after a worked example ---

    def cwe(self, name: str, task: Task, length: int, sample: int, rng: random.Random) -> _Draft:
        # RULER's counts: under 4096 tokens 6 and 1 (its example: 20 words, 3 and 1), else 30 and 3 (40, 10, 3)
        common_n, rare_n, example_words, example_common, example_rare = (
            (6, 1, 20, 3, 1) if length < 4096 else (30, 3, 40, 10, 3)
        )
        order = rng.random()  # the words' order: every try at a budget takes the same ones
        words = _word_stream(random.Random(order))
        example = [next(words) for _ in range(example_words)]
        items = example[:CWE_COMMON] * example_common + example[CWE_COMMON:] * example_rare
        rng.shuffle(items)
        numbered = lambda ws: " ".join(f"{i + 1}. {w}" for i, w in enumerate(ws))  # noqa: E731
        # RULER's worked example is a turn of its own, answered after the answer prefix
        history = ({"role": "user", "content": f"{_CWE_INTRO}{numbered(items)}{_CWE_QUESTION}"},
                   {"role": "assistant", "content": f"{_CWE_PREFIX.lstrip()} {numbered(example[:CWE_COMMON])}"})  # fmt: skip
        common = [next(words) for _ in range(CWE_COMMON)]
        common_ids = self.encode_many([f" {w}" for w in common])
        taken = example_words + CWE_COMMON

        def body(budget: int):
            encoded = self.encoded_words(itertools.islice(_word_stream(random.Random(order)), taken, None))
            listed = [ids for ids in common_ids for _ in range(common_n)]
            cost = sum(map(len, listed)) + sum(len(self.number(i + 1)) for i in range(len(listed)))
            if cost > budget:
                return None
            for ids in encoded:  # rare words, each rare_n times, while they fit
                more = rare_n * len(ids) + sum(len(self.number(len(listed) + j + 1)) for j in range(rare_n))
                if cost + more > budget:
                    break
                listed += [ids] * rare_n
                cost += more
            rng.shuffle(listed)
            out = [t for i, item in enumerate(listed) for t in (*self.number(i + 1), *item)]
            count = len(listed)
            while len(out) < budget:  # new words once each, from the one that did not fit; the last is cut
                count += 1
                out += [*self.number(count), *ids]
                ids = next(encoded)
            return out[:budget], []

        return _Draft(_CWE_INTRO, _CWE_QUESTION, _CWE_PREFIX, common, body, ordered=False, history=history)

    def encoded_words(self, words: Iterator[str]) -> Iterator[list[int]]:
        """The tokens of ``" {word}"`` for each word, encoded a batch at a time."""
        while True:
            yield from self.encode_many([f" {next(words)}" for _ in range(256)])

    # --- frequent words: a coded text whose words follow a Zipf distribution ---

    def fwe(self, name: str, task: Task, length: int, sample: int, rng: random.Random) -> _Draft:
        size = max(
            (length - self.new_tokens[name]) // 50, 5
        )  # RULER's vocabulary: a word per 50 prompt tokens
        vocab: set[str] = set()
        while len(vocab) < size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
        coded = sorted(vocab)
        rng.shuffle(coded)
        coded[0] = "..."  # the most frequent rank is noise, as in RULER
        ids = self.encode_many([f" {w}" for w in coded])

        def body(budget: int):
            counts, used = _zipf_counts([len(w) for w in ids], budget)
            if not counts[1] > counts[2] > counts[3] > counts[4]:
                return None  # too short for three clear winners
            counts[0] += (budget - used) // len(ids[0])  # the tokens left over are more noise
            drawn = [k for k, c in enumerate(counts) for _ in range(c)]
            rng.shuffle(drawn)
            return ([t for k in drawn for t in ids[k]] + ids[0])[:budget], []

        return _Draft(_FWE_INTRO, _FWE_QUESTION, _FWE_PREFIX, coded[1:4], body, ordered=True)

    # --- question answering: the question's documents among distractors ---

    def qa(self, name: str, task: Task, length: int, sample: int, rng: random.Random) -> _Draft:
        data = self.qa_data[task.source]
        question = data.questions[sample % len(data.questions)]  # RULER's: the file's first ones, in order
        blank = self.encode("\n\n")
        header = lambda i: (blank if i > 1 else []) + self.encode(f"Document {i}:\n")  # noqa: E731

        def body(budget: int):
            chosen = list(question.own)
            texts = dict(zip(chosen, self.encode_many([data.documents[d] for d in chosen]), strict=True))
            cost = sum(len(texts[d]) + len(header(i + 1)) for i, d in enumerate(chosen))
            if cost > budget:
                return None
            for extra in _distractors(question, len(data.documents), rng):
                if extra not in texts:
                    texts[extra] = self.encode(data.documents[extra])
                more = len(texts[extra]) + len(header(len(chosen) + 1))
                if cost + more > budget:
                    break
                chosen.append(extra)
                cost += more
            rng.shuffle(chosen)
            out, gold = [], []
            for i, doc in enumerate(chosen):  # whole documents only, as RULER: the prompt may fall short
                out += blank if i else []
                if doc in question.gold:
                    gold.append(len(out))
                out += [*self.encode(f"Document {i + 1}:\n"), *texts[doc]]
            return out, gold

        head = f"{_QA_INSTRUCTION}\n\nThe following are given documents.\n\n"
        tail = f"\n\n{_QA_INSTRUCTION}\n\nQuestion: {question.question}"
        return _Draft(head, tail, _QA_PREFIX, question.answers, body, ordered=task.one_order, separator="")


def _depths(rng: random.Random, count: int, *, lines: bool) -> list[float]:
    """Where ``count`` needles go, in percent of the haystack, sorted: in essays, RULER's depths (``DEPTHS``,
    without repeats); among lines (noise, other needles, vt's chain), anywhere, as RULER picks random lines."""
    if lines:
        return sorted(100 * rng.random() for _ in range(count))
    return sorted(rng.sample(DEPTHS, count))


def _zipf_counts(lens: list[int], budget: int) -> tuple[list[int], int]:
    """RULER's counts ``int(N k^-2 / zeta(2))`` of ranks k = 1, 2, ... for the largest N whose words fit.

    ``lens`` are the words' token counts by rank; returns the counts and the tokens they take.
    """
    zeta2 = math.pi**2 / 6  # RULER's alpha is 2.0
    counts = lambda n: [int(n / (k + 1) ** 2 / zeta2) for k in range(len(lens))]  # noqa: E731
    cost = lambda n: sum(c * w for c, w in zip(counts(n), lens, strict=True))  # noqa: E731
    low, high = 0, 2 * budget + 8  # the noise rank alone takes 60% of the words, a token or more each
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if cost(mid) <= budget else (low, mid - 1)
    return counts(low), cost(low)


def _word_stream(rng: random.Random) -> Iterator[str]:
    """wonderwords' words in a random order without repeats; then adjective-noun pairs when they run out."""
    nouns, adjectives, verbs = word_lists()
    words = sorted({*nouns, *adjectives, *verbs})
    yield from rng.sample(words, len(words))
    seen: set[str] = set()
    while True:
        pair = f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
        if pair not in seen:
            seen.add(pair)
            yield pair


def _distractors(question: Question, documents: int, rng: random.Random) -> Iterator[int]:
    """The question's related documents in a random order, then all others in a random order, again and again."""
    yield from rng.sample(question.related, len(question.related))
    taken = {*question.own, *question.related}
    others = [d for d in range(documents) if d not in taken] or [*question.related] or [*question.own]
    while True:
        yield from rng.sample(others, len(others))


def _variables(rng: random.Random, count: int, letters: int) -> list[str]:
    """``count`` distinct names of ``letters`` capital letters."""
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        names += [] if name in names else [name]
    return names


def _chain(names: list[str], value: int) -> list[str]:
    """``['VAR ABCDE = 12345', 'VAR FGHIJ = VAR ABCDE ', ...]``: each variable bound to the one before (with
    RULER's space after each hop)."""
    return [f"VAR {names[0]} = {value}"] + [
        f"VAR {b} = VAR {a} " for a, b in zip(names, names[1:], strict=False)
    ]


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
        "new_tokens": case.new_tokens,
        "answer_prefix": case.answer_prefix,
        "needle_offsets": case.needle_offsets,
        "references": case.references,
    }


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


def missing_for_comparison(tasks: Sequence[str], *, essays: bool) -> list[str]:
    """What keeps a run's average from standing next to RULER's published ones: tasks that did not run,
    and haystacks that are not the reference's. ``essays``: the essay haystack is RULER's essays file.

    >>> missing_for_comparison(list(TASKS)[:11], essays=False)
    ['tasks not run: qa_squad, qa_hotpot (--squad, --hotpot)', "essay haystack: not RULER's essays file (--haystack PaulGrahamEssays.json)"]
    """
    missing = []
    absent = [t for t in TASKS if t not in tasks]
    if absent:
        files = [f"--{TASKS[t].source}" for t in absent if TASKS[t].family == "qa"]
        missing.append(f"tasks not run: {', '.join(absent)}" + (f" ({', '.join(files)})" if files else ""))
    if not essays and any(TASKS[t].haystack == "essay" for t in tasks):
        missing.append("essay haystack: not RULER's essays file (--haystack PaulGrahamEssays.json)")
    return missing


def summary(rows: Sequence[dict], *, threshold: float = THRESHOLD, essays: bool = False) -> dict:
    """Mean score by task and length; the average over RULER's 13 tasks by length and the effective length
    when the run can stand next to RULER's table, else the average over the tasks that ran, labelled.

    A failed request scored 0 and is counted in ``failed``. ``essays``: the essay haystack was RULER's
    essays file (``missing_for_comparison``).
    """
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    lengths = sorted({r["length"] for r in rows})

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    def table(key: str) -> dict[str, dict[str, float | None]]:
        return {
            t: {str(n): mean([r[key] for r in rows if r["task"] == t and r["length"] == n]) for n in lengths}
            for t in tasks
        }

    by_task_length = table("score")
    average = {n: mean([v for t in tasks if (v := by_task_length[t][str(n)]) is not None]) for n in lengths}
    missing = missing_for_comparison(tasks, essays=essays)
    result = {
        "by_task_length": by_task_length,
        "comparable": not missing,  # all 13 tasks on the reference haystacks: RULER's average
        "not_comparable_because": missing,
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
