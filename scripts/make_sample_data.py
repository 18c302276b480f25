"""Generate the shipped sample chat dataset, ``data/sample.jsonl``.

    python scripts/make_sample_data.py                      # writes data/sample.jsonl + data/sample.meta.json

Every line is one conversation, ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}]}``,
about the documentation of the Python standard library: a user asks about a module, class or function and
the assistant answers with its docstring; long samples paste the reference text of one or several modules
and ask for a summary, for the one function that does something, or for the reference itself. Lengths are
long-tailed like real long-context SFT data: most conversations are a few hundred tokens, a tail reaches
several thousand.

Source text and licence: the docstrings and signatures of pure-Python standard-library modules of the
interpreter that runs this script, read from the ``.py`` files with ``ast`` (nothing is imported). They
are part of Python, distributed under the Python Software Foundation License, which permits
redistribution of derived works.

Reproducibility: the module list is fixed and sorted, the only randomness is ``random.Random(seed).random()``
(whose sequence Python guarantees across versions), and nothing depends on dict or set ordering, so a
re-run on the same interpreter writes the same bytes. Docstrings differ between Python releases, so a
run on another version may write different text. The committed file is the source of truth;
``sample.meta.json`` records the Python version and a hash of the source text that produced it.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import random
import re
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

# Pure-Python modules present in every Python from 3.10 to 3.13; a module missing from the running
# interpreter is skipped. Kept sorted so that the order never depends on how the list was edited.
MODULES = (
    "abc",
    "argparse",
    "ast",
    "asyncio.locks",
    "asyncio.queues",
    "asyncio.tasks",
    "base64",
    "bdb",
    "bisect",
    "calendar",
    "cmd",
    "code",
    "codecs",
    "collections",
    "colorsys",
    "compileall",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "dis",
    "doctest",
    "email.message",
    "email.utils",
    "enum",
    "filecmp",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "html.parser",
    "http.client",
    "http.cookiejar",
    "http.cookies",
    "http.server",
    "imaplib",
    "inspect",
    "ipaddress",
    "json",
    "json.decoder",
    "json.encoder",
    "linecache",
    "locale",
    "logging",
    "logging.handlers",
    "lzma",
    "mailbox",
    "mimetypes",
    "multiprocessing.pool",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pickletools",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "pprint",
    "profile",
    "pstats",
    "py_compile",
    "queue",
    "quopri",
    "random",
    "re",
    "reprlib",
    "rlcompleter",
    "runpy",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "socketserver",
    "sqlite3",
    "ssl",
    "stat",
    "statistics",
    "string",
    "subprocess",
    "symtable",
    "sysconfig",
    "tabnanny",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "tracemalloc",
    "turtle",
    "types",
    "typing",
    "unittest.case",
    "unittest.mock",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "webbrowser",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "zipapp",
    "zipfile",
    "zipimport",
)

NUM_CONVERSATIONS = 400
SEED = 1234
SYSTEM_FRACTION = 0.3
# Long samples are drawn log-uniformly between these sizes (characters of pasted or written reference).
# With the shipped 4096-token BPE this puts the longest conversations near 7-8k tokens.
LONG_MIN_CHARS = 3_000
LONG_MAX_CHARS = 24_000
# A short question is only asked about a member whose docstring has at least this many characters and
# at most SHORT_MAX_DOC, so that short samples stay short.
MIN_DOC = 40
SHORT_MAX_DOC = 6_000

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant who answers questions about the Python standard library.",
    "You are an expert Python programmer. Answer precisely and quote the documentation when it helps.",
    "Answer questions about Python using the official documentation. Be accurate.",
    "You are a concise technical assistant for Python developers.",
    "You help users read long technical documents. Base every answer on the text you are given.",
)
MEMBER_QUESTIONS = (
    "What does `{name}` do?",
    "Explain `{name}`.",
    "How do I use `{name}`?",
    "Can you describe `{short}` from the `{module}` module?",
    "What is `{name}` for?",
    "I found `{short}` in `{module}`. What does it do?",
)
MODULE_QUESTIONS = (
    "What is the `{module}` module for?",
    "Give me an overview of the `{module}` module.",
    "What does Python's `{module}` module provide?",
)
FOLLOW_UPS = (
    "What about `{name}`?",
    "And `{short}`?",
    "Next, tell me about `{name}`.",
    "Does `{module}` also have `{short}`? What does it do?",
    "Thanks. How about `{name}`?",
)
SUMMARY_QUESTIONS = (
    "Summarize the documentation above.",
    "Which modules are documented above, and what do they provide?",
    "Give me a short overview of the API described in this reference.",
    "I don't have time to read all of this. What is it about?",
)
FIND_QUESTIONS = (
    'In the reference above, which function or class does this: "{summary}"',
    'Using only the documentation above: what should I call if I want this? "{summary}"',
    'Which entry in this reference matches the description "{summary}"? Explain it.',
)
REFERENCE_QUESTIONS = (
    "Write the reference documentation for the public API of the `{module}` module.",
    "List the public functions and classes of `{module}` with their signatures and documentation.",
    "Document the `{module}` module for me, entry by entry.",
)


@dataclass(frozen=True)
class Member:
    """A documented public function, class or method of a module."""

    name: str  # qualified, e.g. "json.dumps" or "json.JSONEncoder.encode"
    signature: str  # e.g. "json.dumps(obj, *, skipkeys=False, ...)"
    doc: str


@dataclass(frozen=True)
class ModuleDoc:
    """The documentation of one module: its docstring and its documented public members, in source order."""

    name: str
    doc: str
    members: tuple[Member, ...]


def _signature(qualname: str, node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        return f"class {qualname}({bases})" if bases else f"class {qualname}"
    text = ast.unparse(node.args)
    # A method's first parameter is not part of how users call it.
    text = re.sub(r"^(self|cls)(, |$)", "", text)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{qualname}({text}){returns}"


def _documented(node: ast.AST) -> bool:
    return (
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and not node.name.startswith("_")
        and bool(ast.get_docstring(node))
    )


def read_module(stdlib: Path, name: str) -> ModuleDoc | None:
    """Read the docstrings of module ``name`` from its source under ``stdlib``; None if it has no source."""
    relative = Path(*name.split("."))
    for path in (stdlib / relative.with_suffix(".py"), stdlib / relative / "__init__.py"):
        if path.is_file():
            break
    else:
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    members = []
    # Only top-level definitions and the methods of top-level classes: definitions nested in
    # ``if sys.platform ...`` blocks would make the text depend on the platform that parses it.
    for node in tree.body:
        if not _documented(node):
            continue
        qualname = f"{name}.{node.name}"
        members.append(Member(qualname, _signature(qualname, node), ast.get_docstring(node)))
        if isinstance(node, ast.ClassDef):
            for child in node.body:
                if _documented(child) and not isinstance(child, ast.ClassDef):
                    method = f"{qualname}.{child.name}"
                    members.append(Member(method, _signature(method, child), ast.get_docstring(child)))
    return ModuleDoc(name, ast.get_docstring(tree) or "", tuple(members))


def read_sources(stdlib: Path) -> list[ModuleDoc]:
    """The documentation of every module of MODULES found under ``stdlib`` that documents something."""
    modules = [read_module(stdlib, name) for name in MODULES]
    return [m for m in modules if m is not None and (m.doc or m.members)]


def source_fingerprint(modules: list[ModuleDoc]) -> str:
    """sha256 of the extracted source text: equal fingerprints and seed give byte-identical output."""
    blob = json.dumps([asdict(m) for m in modules], ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class Draw:
    """Every random choice of the generator, built on ``random.Random.random`` alone.

    Python keeps ``random()``'s sequence for a given integer seed stable across versions, while helpers
    such as ``choice`` or ``shuffle`` may change how they consume it; this class avoids them.
    """

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def uniform(self) -> float:
        return self._rng.random()

    def index(self, n: int) -> int:
        return min(int(self._rng.random() * n), n - 1)

    def pick(self, items):
        return items[self.index(len(items))]

    def log_uniform(self, low: float, high: float) -> int:
        return int(math.exp(math.log(low) + self._rng.random() * (math.log(high) - math.log(low))))

    def sample(self, items, k: int) -> list:
        """``k`` distinct items in draw order (a partial Fisher-Yates shuffle)."""
        pool = list(items)
        for i in range(min(k, len(pool))):
            j = i + self.index(len(pool) - i)
            pool[i], pool[j] = pool[j], pool[i]
        return pool[:k]


def _short_name(member: Member, module: ModuleDoc) -> str:
    return member.name[len(module.name) + 1 :]


def _fill(template: str, member: Member | None, module: ModuleDoc) -> str:
    if member is None:
        return template.format(module=module.name)
    return template.format(name=member.name, short=_short_name(member, module), module=module.name)


def _answer(member: Member) -> str:
    return f"`{member.signature}`\n\n{member.doc}"


def _first_paragraph(text: str) -> str:
    return text.strip().split("\n\n", 1)[0].strip()


def _summary_line(doc: str) -> str:
    return " ".join(_first_paragraph(doc).split())


def _reference_sections(module: ModuleDoc) -> list[str]:
    sections = [f"# Module `{module.name}`\n\n{module.doc}".rstrip()]
    sections += [f"## `{m.signature}`\n\n{m.doc}" for m in module.members]
    return sections


def _askable(module: ModuleDoc) -> list[Member]:
    return [m for m in module.members if MIN_DOC <= len(m.doc) <= SHORT_MAX_DOC]


def _reference(draw: Draw, modules: list[ModuleDoc], budget: int) -> tuple[str, list[ModuleDoc]]:
    """Reference text of randomly drawn modules, cut at whole sections to at most ``budget`` characters.

    The first section of the first module is always kept, so the text is never empty.
    """
    parts: list[str] = []
    used: list[ModuleDoc] = []
    size = 0
    for module in draw.sample(modules, len(modules)):
        for section in _reference_sections(module):
            if parts and size + len(section) + 2 > budget:
                return "\n\n".join(parts), used
            if not used or used[-1] is not module:
                used.append(module)
            parts.append(section)
            size += len(section) + 2
    return "\n\n".join(parts), used


def ask_member(draw: Draw, modules: list[ModuleDoc]) -> list[dict]:
    module = draw.pick([m for m in modules if _askable(m)])
    member = draw.pick(_askable(module))
    question = _fill(draw.pick(MEMBER_QUESTIONS), member, module)
    return [{"role": "user", "content": question}, {"role": "assistant", "content": _answer(member)}]


def ask_module(draw: Draw, modules: list[ModuleDoc]) -> list[dict]:
    module = draw.pick([m for m in modules if len(m.doc) >= MIN_DOC])
    question = _fill(draw.pick(MODULE_QUESTIONS), None, module)
    answer = f"The `{module.name}` module's documentation says:\n\n{module.doc}"
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def multi_turn(draw: Draw, modules: list[ModuleDoc]) -> list[dict]:
    """2-4 assistant turns about members of one module."""
    module = draw.pick([m for m in modules if len(_askable(m)) >= 4])
    turns = 2 + draw.index(3)
    asked = draw.sample(_askable(module), turns)
    messages = []
    for i, member in enumerate(asked):
        template = draw.pick(MEMBER_QUESTIONS if i == 0 else FOLLOW_UPS)
        messages.append({"role": "user", "content": _fill(template, member, module)})
        messages.append({"role": "assistant", "content": _answer(member)})
    return messages


def summarize(draw: Draw, modules: list[ModuleDoc]) -> list[dict]:
    """Long context, short answer: summarize pasted reference text."""
    reference, used = _reference(draw, modules, draw.log_uniform(LONG_MIN_CHARS, LONG_MAX_CHARS))
    lines = [f"The text documents {len(used)} module(s)."]
    for module in used:
        about = _summary_line(module.doc) or "(no module description)"
        lines.append(f"\n`{module.name}`: {about}")
        shown = [m for m in module.members if reference.count(f"## `{m.signature}`")][:12]
        lines += [f"- `{m.name}`: {_summary_line(m.doc)}" for m in shown]
    question = draw.pick(SUMMARY_QUESTIONS)
    return [
        {"role": "user", "content": f"{reference}\n\n{question}"},
        {"role": "assistant", "content": "\n".join(lines)},
    ]


def find_member(draw: Draw, modules: list[ModuleDoc]) -> list[dict] | None:
    """Long context, retrieval: name the one entry whose summary line the user quotes."""
    reference, used = _reference(draw, modules, draw.log_uniform(LONG_MIN_CHARS, LONG_MAX_CHARS))
    shown = [m for u in used for m in u.members if f"## `{m.signature}`" in reference]
    # The quoted line must identify exactly one entry of the pasted text.
    summaries = [_summary_line(m.doc) for m in shown]
    candidates = [
        m for m, s in zip(shown, summaries, strict=True) if len(s) >= 30 and summaries.count(s) == 1
    ]
    if not candidates:
        return None
    member = draw.pick(candidates)
    question = draw.pick(FIND_QUESTIONS).format(summary=_summary_line(member.doc))
    answer = f"That is `{member.name}`:\n\n{_answer(member)}"
    return [
        {"role": "user", "content": f"{reference}\n\n{question}"},
        {"role": "assistant", "content": answer},
    ]


def write_reference(draw: Draw, modules: list[ModuleDoc]) -> list[dict]:
    """Short prompt, long answer: the assistant writes a module's reference."""
    module = draw.pick([m for m in modules if len(m.members) >= 4])
    budget = draw.log_uniform(LONG_MIN_CHARS, LONG_MAX_CHARS)
    parts, size = [], 0
    for section in _reference_sections(module):
        if parts and size + len(section) + 2 > budget:
            break
        parts.append(section)
        size += len(section) + 2
    question = _fill(draw.pick(REFERENCE_QUESTIONS), None, module)
    return [{"role": "user", "content": question}, {"role": "assistant", "content": "\n\n".join(parts)}]


# (cumulative probability, builder): most samples short, about a quarter with long context or output.
KINDS = (
    (0.42, ask_member),
    (0.52, ask_module),
    (0.76, multi_turn),
    (0.86, summarize),
    (0.95, find_member),
    (1.00, write_reference),
)


def generate(modules: list[ModuleDoc], *, num: int, seed: int) -> list[list[dict]]:
    """``num`` conversations drawn from ``modules`` with ``seed``."""
    draw = Draw(seed)
    conversations = []
    while len(conversations) < num:
        roll = draw.uniform()
        builder = next(b for edge, b in KINDS if roll < edge)
        messages = builder(draw, modules)
        if messages is None:
            continue
        if draw.uniform() < SYSTEM_FRACTION:
            messages.insert(0, {"role": "system", "content": draw.pick(SYSTEM_PROMPTS)})
        conversations.append(messages)
    return conversations


def percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[max(0, math.ceil(q / 100 * len(sorted_values)) - 1)]


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp creates the file private; the data is meant to be shared
    os.replace(tmp, path)


def meta_path(output: Path) -> Path:
    """Where the provenance record of ``output`` lives: ``sample.jsonl`` -> ``sample.meta.json``."""
    return output.with_name(f"{output.stem}.meta.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--output", type=Path, default=Path("data/sample.jsonl"))
    parser.add_argument("--num", type=int, default=NUM_CONVERSATIONS, help="number of conversations")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()

    modules = read_sources(Path(sysconfig.get_paths()["stdlib"]))
    conversations = generate(modules, num=args.num, seed=args.seed)
    text = "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in conversations)
    write_atomic(args.output, text)
    meta = {
        "file": args.output.name,
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "conversations": len(conversations),
        "seed": args.seed,
        "python": platform.python_version(),
        "source": "docstrings of the Python standard library (Python Software Foundation License)",
        "source_modules": [m.name for m in modules],
        "source_sha256": source_fingerprint(modules),
    }
    write_atomic(meta_path(args.output), json.dumps(meta, indent=2) + "\n")

    chars = sorted(sum(len(m["content"]) for m in c) for c in conversations)
    turns = [sum(m["role"] == "assistant" for m in c) for c in conversations]
    with_system = sum(c[0]["role"] == "system" for c in conversations)
    print(f"wrote {len(conversations)} conversations to {args.output} ({len(text.encode('utf-8'))} bytes)")
    print(f"source: {len(modules)} stdlib modules of Python {platform.python_version()}")
    print(f"system message: {with_system}; multi-turn: {sum(t > 1 for t in turns)}")
    print(
        "characters per conversation: "
        + ", ".join(f"p{q}={percentile(chars, q)}" for q in (10, 50, 90, 99))
        + f", max={chars[-1]}"
    )


if __name__ == "__main__":
    main()
