"""The commands the README and the manual show: their fenced blocks, the commands in them, and their markers.

How a page shows a command (docs/contributing.md says the same for writers of pages):

- Every fenced block has a language. ```bash holds commands and nothing else; ```console holds commands
  after a ``$ `` prompt, each followed by the lines it prints (output: never run, never compared); any
  other language (```text, ```toml, ```json, ```python, ```yaml, ```jinja) holds no command.
- A line that ends with ``\\`` goes on on the next one. Blank lines and lines that are only a ``#`` comment
  are not commands.
- A command's trailing comment may be a marker::

      vllm serve out/run --port 8000      # needs a GPU: vLLM serves on CUDA
      longalign convert THUDM/glm-4-9b-chat out/glm4-native      # needs the network
      python train.py --config configs/demo.toml training.sequence_parallel_size=3      # exits 2

  ``# needs a GPU``, ``# needs the network`` and ``# needs a hosted model`` (each with an optional
  ``: why``) say why the command cannot run in the tests; ``# exits N`` shows a command failing on
  purpose: it runs and must exit with status N; ``# run by tests/NAME.py`` (with an optional ``: how``)
  says that test file reads the command from the page and runs it, checking what it prints, so this test
  does not run it again. Any other comment is a comment.
- Installing needs the network (PyPI): a step of a ``&&`` chain that makes a virtual environment or runs
  ``pip install`` is not run, the suite runs in the environment such steps make; the chain's other steps are.
- The test command, which ``.ci/run`` holds verbatim, is run by CI.

A block and what ``commands_in`` makes of it::

    ```bash
    longalign pack --input out/tok \\
        --output out/packed --max-seq-len 4096      # rows of 4096 tokens
    ```
    -> Command(text="longalign pack --input out/tok --output out/packed --max-seq-len 4096",
               comment="rows of 4096 tokens")
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

COMMAND_LANGUAGES = ("bash", "console")
OTHER_LANGUAGES = ("text", "toml", "json", "python", "yaml", "jinja")
NEEDS = ("a GPU", "the network", "a hosted model")  # why a command cannot run in the tests
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>.*)$")
_NEEDS = re.compile(r"^needs (?P<kind>" + "|".join(map(re.escape, NEEDS)) + r")(?::\s*(?P<why>.+))?$")
_EXITS = re.compile(r"^exits (?P<status>\d+)\b")
_RUN_BY = re.compile(r"^run by (?P<test>tests/[\w/]+\.py)(?::|$)")
_SHELL_SYNTAX = set("|;<>$`(){}*?~")  # outside quotes: the step needs a shell, not an argv


@dataclass(frozen=True)
class Block:
    """One fenced block: its language and text, and the line of its first content line."""

    language: str
    text: str
    line: int


@dataclass(frozen=True)
class Command:
    """One command as a page shows it: continuations joined, the trailing comment apart."""

    page: str  # the file, relative to the repository
    line: int  # the line it starts on
    text: str  # the command, on one line, without its trailing comment
    comment: str = ""  # its trailing comment, without the "#"

    @property
    def needs(self) -> str | None:
        """Why it cannot run in the tests (``"a GPU: vLLM serves on CUDA"``), or None."""
        found = _NEEDS.match(self.comment)
        if not found:
            return None
        return found["kind"] + (f": {found['why']}" if found["why"] else "")

    @property
    def run_by(self) -> str | None:
        """The test file that runs the command (``"tests/test_probe.py"``), or None."""
        found = _RUN_BY.match(self.comment)
        return found["test"] if found else None

    @property
    def expected_status(self) -> int:
        found = _EXITS.match(self.comment)
        return int(found["status"]) if found else 0

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def fenced_blocks(markdown: str) -> list[Block]:
    """Every fenced block of ``markdown``, dedented by its fence's indentation (fences inside lists)."""
    blocks, lines, i = [], markdown.splitlines(), 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        body, j = [], i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence[0] * len(fence)) and not lines[j].strip().strip(fence[0])
        ):
            body.append(lines[j][indent:] if not lines[j][:indent].strip() else lines[j].lstrip())
            j += 1
        language = opening["info"].strip().split(" ")[0]
        blocks.append(Block(language, "\n".join(body), i + 2))
        i = j + 1
    return blocks


def commands_in(markdown: str, page: str = "<text>") -> list[Command]:
    """The commands of every ```bash and ```console block of ``markdown``."""
    found = []
    for block in fenced_blocks(markdown):
        if block.language in COMMAND_LANGUAGES:
            found += _block_commands(block, page)
    return found


def _block_commands(block: Block, page: str) -> list[Command]:
    found, lines, i = [], block.text.splitlines(), 0
    while i < len(lines):
        line, start = lines[i], i
        i += 1
        if block.language == "console":
            if not line.startswith("$ "):
                continue  # what the command above printed
            line = line[2:]
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = [line]
        while parts[-1].endswith("\\") and i < len(lines):
            parts[-1] = parts[-1][:-1]
            parts.append(lines[i])
            i += 1
        joined = " ".join(part.strip() for part in parts)
        text, comment = split_comment(joined)
        found.append(Command(page, block.line + start, text, comment))
    return found


def split_comment(line: str) -> tuple[str, str]:
    """``(command, comment)``: a ``#`` that starts a word outside quotes starts the comment."""
    quote, escaped = None, False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def steps(text: str) -> list[str]:
    """The steps of an ``a && b && c`` chain, split outside quotes."""
    parts, quote, start, i = [], None, 0, 0
    while i < len(text):
        char = text[i]
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif text.startswith("&&", i):
            parts.append(text[start:i].strip())
            start = i = i + 2
            continue
        i += 1
    return [*parts, text[start:].strip()]


def needs_shell(step: str) -> bool:
    """Whether ``step`` uses shell syntax (pipes, redirections, variables, globs) outside single quotes."""
    quote = None
    for char in step:
        if quote:
            quote = None if char == quote else quote
            if quote == '"' and char == "$":
                return True
        elif char in "'\"":
            quote = char
        elif char in _SHELL_SYNTAX:
            return True
    return False


def argv(step: str) -> tuple[dict[str, str], list[str]]:
    """``(environment, argv)`` of a step without shell syntax: leading ``NAME=value`` words are the environment."""
    words = shlex.split(step)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def is_install(words: list[str]) -> bool:
    """``python3 -m venv DIR``, ``pip install ...``, ``DIR/bin/pip install ...``, ``python -m pip install ...``."""
    if not words:
        return False
    program = Path(words[0]).name
    if program in ("pip", "pip3"):
        return words[1:2] == ["install"]
    if program.startswith("python"):
        return words[1:3] == ["-m", "venv"] or words[1:4] == ["-m", "pip", "install"]
    return False


# accelerate launch's options that take no value (every other option takes one)
_LAUNCH_SWITCHES = {"--cpu", "--multi_gpu", "--use_deepspeed", "--use_fsdp", "-m", "--module", "--debug"}


def program(words: list[str]) -> str:
    """What a command runs, the key of the test's cuts: ``longalign eval needle``, ``train.py``, ``scripts/demo.sh``.

    ``python scripts/x.py``, ``accelerate launch [options] scripts/x.py`` -> ``scripts/x.py``;
    ``python -m longalign pack``, ``accelerate launch -m longalign pack`` -> ``longalign pack``.
    """
    if not words:
        return ""
    first = Path(words[0]).name
    rest = words[1:]
    if first == "accelerate" and rest[:1] == ["launch"]:
        rest = rest[1:]
        while rest and rest[0].startswith("-") and rest[0] not in ("-m", "--module"):
            rest = rest[1:] if rest[0] in _LAUNCH_SWITCHES or "=" in rest[0] else rest[2:]
        return program(["python", *rest])
    if first.startswith("python") and rest[:1] in (["-m"], ["--module"]) and rest[1:2] == ["longalign"]:
        return program(["longalign", *rest[2:]])
    if first.startswith("python") or first == "bash":
        return rest[0] if rest and not rest[0].startswith("-") else " ".join([first, *rest[:1]])
    if first == "longalign":
        names = [word for word in rest[:2] if not word.startswith("-")]
        if names[:1] not in (["data"], ["eval"]):
            names = names[:1]
        return " ".join(["longalign", *names])
    return first
