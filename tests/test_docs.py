"""The README and the manual: every command they show runs, or says why it cannot; their links and paths exist.

How pages show commands and mark the ones that cannot run here is in ``docs_commands.py`` and in
docs/contributing.md. The fast tests read the pages; ``test_every_documented_command_runs`` runs every
command, in page order (the README, then the pages in the order of mkdocs.yml's nav), in one scratch
directory that links the repository's data/, configs/, scripts/, tests/, docs/, benchmarks/ and train.py,
so a page can read what an earlier page wrote. It prints how many commands ran and which are marked, with
the reason for each, at the end of the pytest run.

A command runs as a user types it, with three changes a user could make too:

- ``CUTS`` appends small sizes (the last value of a flag or an override wins), so training takes two steps,
  a needle grid one cell, RULER one instance of each task and a probe one length (two with ``--plan``);
- ``--base-url`` and ``--judge-base-url`` point at ``tests/openai_stub.py`` on 127.0.0.1, with its model
  name and key;
- a launch of several processes takes a free port (``--main_process_port 0``): other runs on the machine
  may hold the default one.

``longalign ...``, ``python scripts/NAME.py ...``, ``python train.py ...`` and ``python -c ...`` run in this
process (through ``longalign.cli``, as the console script and the scripts do); everything else (scripts/demo.sh,
accelerate launch, benchmarks) runs as a subprocess.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import runpy
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import DOCS_REPORT, ROOT, run_process
from docs_commands import (
    COMMAND_LANGUAGES,
    NEEDS,
    OTHER_LANGUAGES,
    Command,
    argv,
    commands_in,
    fenced_blocks,
    is_install,
    needs_shell,
    program,
    split_comment,
    steps,
)
from openai_stub import OpenAIStub

# Appended to a command to keep it small, by what it runs (docs_commands.program).
TRAIN_CUT = ["training.max_steps=2"]
NEEDLE_CUT = ["--lengths", "500", "--depths", "50", "--samples-per-cell", "1", "--max-new-tokens", "8"]
RULER_CUT = ["--lengths", "2k", "--samples-per-task", "1", "--max-new-tokens", "8"]
PROBE_CUT = ["--lengths", "1k"]
PLAN_CUT = ["--lengths", "1k,2k"]  # a probe's --plan fits its memory per token between two measured lengths
CUTS = {
    "scripts/demo.sh": [*TRAIN_CUT, 'data.eval_file=""'],  # and no eval over the whole sample
    "longalign train": TRAIN_CUT,
    "train.py": TRAIN_CUT,
    "longalign eval needle": NEEDLE_CUT,
    "longalign eval ruler": RULER_CUT,
    "longalign eval chat": ["--max-new-tokens", "8"],
    "longalign eval write": ["--max-new-tokens", "8"],
    "longalign probe": PROBE_CUT,
    "scripts/probe_memory.py": PROBE_CUT,
    "benchmarks/packing.py": ["--chat-samples", "20000", "--long-samples", "2000"],
}
# Linked into the scratch directory the commands run in.
SHARED = ("data", "configs", "scripts", "tests", "docs", "benchmarks", "train.py", "mkdocs.yml")
STUB_KEY = "sk-docs-7c41"
STUB_MODEL = "stub-model"
# One reply for every call the pages make: a plan agentwrite can parse, text for everything else, and a
# rating a judge's reply would hold.
STUB_REPLY = "1. [40 words] The setting.\n2. [60 words] The turn.\n3. [30 words] The close, rated [[7]]."
# python SCRIPT runs in this process for these scripts, as do longalign, python -m longalign and python -c.
IN_PROCESS = ("scripts/", "train.py")
KNOWN_PROGRAMS = ("longalign", "python", "python3", "bash", "accelerate")


def pages() -> list[Path]:
    """The README, then the manual's pages in the order of mkdocs.yml's nav."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def walk(entries) -> list[str]:
        out = []
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            out += walk(value) if isinstance(value, list) else [value]
        return out

    return [ROOT / "README.md", *(ROOT / "docs" / name for name in walk(nav))]


def all_commands() -> list[Command]:
    return [
        command
        for path in pages()
        for command in commands_in(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    ]


def ci_command() -> str:
    """The line of .ci/run that runs the tests."""
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if " -m pytest" in line]
    assert len(lines) == 1, lines
    return lines[0].strip()


@dataclass(frozen=True)
class Plan:
    """What the test does with one command: ``run`` its steps, or not, and why."""

    command: Command
    run: list[str]  # the steps it runs; empty when it runs none
    why_not: str | None = None  # why it runs nothing (marked, installs only, run by CI)


def plan(command: Command) -> Plan:
    if command.needs:
        return Plan(command, [], f"needs {command.needs}")
    if command.run_by:
        return Plan(command, [], f"run by {command.run_by}, which reads it from the page")
    if command.text == ci_command():
        return Plan(command, [], "the test command: .ci/run runs it verbatim")
    chain = [step for step in steps(command.text) if needs_shell(step) or not is_install(argv(step)[1])]
    if not chain:
        return Plan(command, [], "installs from PyPI: needs the network")
    return Plan(command, chain)


# --- the pages, read ---------------------------------------------------------------------------------------


def test_blocks_commands_and_markers_are_read_as_written():
    page = """
Text, then a block inside a list item:

  ```bash
  longalign pack --input out/tok \\
      --output out/packed --max-seq-len 4096    # rows of 4096 tokens
  # a comment line

  vllm serve out/run --port 8000      # needs a GPU: vLLM serves on CUDA
  python train.py --config c.toml training.sequence_parallel_size=3   # exits 2
  echo '# not a comment' && pip install -e '.[eval]'  # needs the network
  ```

```console
$ longalign --help
usage: longalign [-h] SUBCOMMAND ...
$ longalign pack --help \\
    --strategy bfd
```

```toml
[data]
train_file = "x"  # not a command
```
"""
    found = commands_in(page, "page.md")
    assert [(c.line, c.text) for c in found] == [
        (5, "longalign pack --input out/tok --output out/packed --max-seq-len 4096"),
        (9, "vllm serve out/run --port 8000"),
        (10, "python train.py --config c.toml training.sequence_parallel_size=3"),
        (11, "echo '# not a comment' && pip install -e '.[eval]'"),
        (15, "longalign --help"),
        (17, "longalign pack --help --strategy bfd"),
    ]
    assert [c.comment for c in found][:2] == ["rows of 4096 tokens", "needs a GPU: vLLM serves on CUDA"]
    assert [c.needs for c in found] == [None, "a GPU: vLLM serves on CUDA", None, "the network", None, None]
    assert [c.expected_status for c in found] == [0, 0, 2, 0, 0, 0]
    assert [b.language for b in fenced_blocks(page)] == ["bash", "console", "toml"]


def test_steps_words_and_programs():
    assert steps("a && b 'x && y' && c") == ["a", "b 'x && y'", "c"]
    assert split_comment('echo "a # b" # c') == ('echo "a # b"', "c")
    assert split_comment("echo a#b") == ("echo a#b", "")
    assert needs_shell("longalign pack --input a > log") and needs_shell('vllm serve --api-key "$KEY"')
    assert not needs_shell("longalign eval needle --lengths 4k,8k --needle 'costs $5'")
    assert argv("HF_HUB_OFFLINE=1 longalign train --config 'a b.toml'") == (
        {"HF_HUB_OFFLINE": "1"},
        ["longalign", "train", "--config", "a b.toml"],
    )
    assert is_install(["python3", "-m", "venv", ".venv"]) and is_install(
        [".venv/bin/pip", "install", "-e", "."]
    )
    assert not is_install(["pip", "show", "torch"]) and not is_install(["bash", "scripts/demo.sh"])
    assert program(["longalign", "eval", "needle", "--model", "m"]) == "longalign eval needle"
    assert program(["longalign", "train", "--config", "c"]) == "longalign train"
    assert program(["python", "scripts/probe_memory.py", "--config", "c"]) == "scripts/probe_memory.py"
    assert program([".venv/bin/python", "-c", "print(1)"]) == "python -c"
    assert program(["bash", "scripts/demo.sh"]) == "scripts/demo.sh"
    launch = ["accelerate", "launch", "--config_file", "f.yaml", "--num_processes", "2", "--cpu"]
    assert program([*launch, "-m", "longalign", "preflight", "--config", "c"]) == "longalign preflight"
    assert program([*launch, "train.py", "--config", "c"]) == "train.py"


def test_a_marker_is_read_only_in_its_own_words():
    def command(comment: str) -> Command:
        return Command("p.md", 1, "longalign train --config c.toml", comment)

    assert command("needs a GPU").needs == "a GPU" and command("needs the network: the Hub").needs == (
        "the network: the Hub"
    )
    assert command("needs a GPU cluster").needs is None  # not one of the reasons: a comment
    assert command("needs GPU").needs is None and command("exits two").expected_status == 0
    assert command("run by tests/test_probe.py: at 4k").run_by == "tests/test_probe.py"
    assert command("run by the probe test").run_by is None  # names no test file: a comment
    assert plan(command("run by tests/test_probe.py")).why_not.startswith("run by tests/test_probe.py")
    assert plan(command("needs a hosted model")).why_not == "needs a hosted model"
    assert (
        plan(Command("p.md", 1, "pip install -e '.[flash]'")).why_not
        == "installs from PyPI: needs the network"
    )
    chain = plan(
        Command("p.md", 1, "python3 -m venv .venv && .venv/bin/pip install -e . && bash scripts/demo.sh")
    )
    assert chain.run == ["bash scripts/demo.sh"] and chain.why_not is None


def test_every_block_has_a_language_and_every_marker_a_known_reason(request):
    plans, bad = [], []
    for path in pages():
        name = str(path.relative_to(ROOT))
        for block in fenced_blocks(path.read_text(encoding="utf-8")):
            if block.language not in (*COMMAND_LANGUAGES, *OTHER_LANGUAGES):
                bad.append(
                    f"{name}:{block.line}: a fenced block needs one of {COMMAND_LANGUAGES + OTHER_LANGUAGES}"
                )
        for command in commands_in(path.read_text(encoding="utf-8"), name):
            if command.comment.startswith("needs") and not command.needs:
                bad.append(f"{command.where}: '# {command.comment}': a marker says needs {' / '.join(NEEDS)}")
            runner = command.run_by and ROOT / command.run_by
            if runner and not (runner.exists() and name in runner.read_text(encoding="utf-8")):
                bad.append(f"{command.where}: {command.run_by} does not read {name}, so nothing runs it")
            found = plan(command)
            for step in found.run:
                first = Path(argv(step)[1][0]).name if not needs_shell(step) else "bash"
                if not first.startswith(KNOWN_PROGRAMS):
                    bad.append(
                        f"{command.where}: {first} runs nowhere in the tests: mark why it cannot run here"
                    )
            plans.append(found)
    assert not bad, "\n".join(bad)
    assert any(p.why_not == "the test command: .ci/run runs it verbatim" for p in plans)
    request.config.stash.setdefault(DOCS_REPORT, report(plans, None))


def test_the_readme_test_command_is_the_one_ci_runs():
    readme = commands_in((ROOT / "README.md").read_text(encoding="utf-8"), "README.md")
    tests = [c.text for c in readme if "pytest" in c.text]
    assert tests == [ci_command()]
    assert tests[0].endswith(
        "&& .venv/bin/python -m pytest -q -n 2 --dist loadfile && .venv/bin/mkdocs build --strict"
    )
    demo = [c.text for c in readme if c.text.endswith("bash scripts/demo.sh")]
    assert len(demo) == 1 and demo[0].startswith(
        "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0"
    )


PATH_IN_CODE = re.compile(r"`((?:benchmarks|configs|data|docs|scripts|tests|longalign|patch)/[^`\s]*)`")


def test_links_and_named_paths_exist():
    missing = []
    for path in [*pages(), ROOT / "data" / "README.md"]:
        text = path.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not re.match(r"[a-z]+://", target) and not (path.parent / target).exists():
                missing.append(f"{path.relative_to(ROOT)}: link {target}")
        for named in PATH_IN_CODE.findall(text):
            candidates = [ROOT / named.rstrip("/"), path.parent / named.rstrip("/")]
            if "*" not in named and not any(c.exists() for c in candidates):
                missing.append(f"{path.relative_to(ROOT)}: {named}")
    assert not missing, "\n".join(missing)
    listed = (ROOT / "docs" / "benchmarks.md").read_text()
    assert [
        p.name for p in sorted((ROOT / "benchmarks").glob("*.py")) if f"`benchmarks/{p.name}`" not in listed
    ] == []


def test_every_flag_of_every_command_is_in_the_manual():
    from longalign.cli import COMMANDS

    def flags(parser: argparse.ArgumentParser, name: str) -> list[tuple[str, str]]:
        out = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    out += flags(sub, f"{name} {sub_name}")
            elif action.help != argparse.SUPPRESS:
                out += [
                    (name, flag)
                    for flag in action.option_strings
                    if flag.startswith("--") and flag != "--help"
                ]
        return out

    found = []
    for name, command in COMMANDS.items():
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        found += flags(parser, name)
    manual = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs").rglob("*.md"))
    assert [f"longalign {name}: {flag}" for name, flag in found if f"`{flag}" not in manual] == []


# --- the commands, run ---------------------------------------------------------------------------------------


def report(plans: list[Plan], results: dict[str, tuple[int, float]] | None) -> str:
    """How many commands the pages show, how many ran (or are to run), and why each other one does not.

    A command shown on several pages counts once, under every place it is shown.
    """
    distinct: dict[str, Plan] = {}
    places: dict[str, list[str]] = {}
    for p in plans:
        distinct.setdefault(p.command.text, p)
        places.setdefault(p.command.text, []).append(p.command.where)

    def shown(text: str) -> str:
        return text if len(text) <= 100 else text[:97] + "..."

    def where(p: Plan) -> str:
        return ", ".join(places[p.command.text])

    ran = [p for p in distinct.values() if p.run]
    marked = [p for p in distinct.values() if not p.run and p.command.needs]
    unmarked = [p for p in distinct.values() if not p.run and not p.command.needs]
    kinds: dict[str, int] = {}
    for p in marked:
        kind = p.why_not.split(":")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    counts = f"{len(marked)} marked, {len(unmarked)} installs, the test command or run by other tests"
    if results is None:
        lines = [
            f"{len(plans)} commands in README.md and docs/ ({len(distinct)} distinct): "
            f"{len(ran)} to run (-m integration), {counts}"
        ]
    else:
        failed = sum(
            status != distinct[text].command.expected_status for text, (status, _) in results.items()
        )
        slowest = sorted(results.items(), key=lambda item: -item[1][1])[:3]
        lines = [
            f"{len(plans)} commands in README.md and docs/ ({len(distinct)} distinct): "
            f"ran {len(ran)} in {sum(s for _, s in results.values()):.0f} s ({failed} failed), {counts}",
            "  slowest: " + ", ".join(f"{places[text][0]} {s:.0f} s" for text, (_, s) in slowest),
        ]
    for p in ran:
        if p.run != steps(p.command.text):
            lines.append(
                f"  {where(p)}: runs only {' && '.join(p.run)}; the rest installs (needs the network)"
            )
    lines.append(f"marked {len(marked)} (" + ", ".join(f"{n} {kind}" for kind, n in kinds.items()) + "):")
    lines += [f"  {where(p)}: {p.why_not}\n      {shown(p.command.text)}" for p in marked]
    lines.append(f"not run here, installs, the test command or run by other tests {len(unmarked)}:")
    lines += [f"  {where(p)}: {p.why_not}\n      {shown(p.command.text)}" for p in unmarked]
    return "\n".join(lines)


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The directory the pages' commands run in, with the repository's shared files linked into it."""
    for name in SHARED:
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    bin_dir = str(Path(sys.executable).parent)
    for name, value in {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHON": sys.executable,  # scripts/demo.sh's interpreter
        "OPENAI_API_KEY": STUB_KEY,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("JUDGE_API_KEY", raising=False)
    return tmp_path


def prepared(words: list[str], stub: OpenAIStub) -> list[str]:
    """``words`` with the cuts, the stub for any server, and a free port for a launch of several processes."""
    words = [
        sys.executable if w in (".venv/bin/python", "python", "python3") else w for w in words[:1]
    ] + words[1:]
    if Path(words[0]).name == "accelerate" and "--main_process_port" not in words:
        words = [*words[:2], "--main_process_port", "0", *words[2:]]
    extra = list(CUTS.get(program(words), []))
    if extra == PROBE_CUT and "--plan" in words:
        extra = list(PLAN_CUT)
    for flag, model_flag in (("--base-url", "--served-model"), ("--judge-base-url", "--judge-model")):
        if flag in words:
            extra += [flag, stub.base_url, model_flag, STUB_MODEL]
    return words + extra


def run_in_process(words: list[str]) -> tuple[int, str]:
    """Run a ``longalign`` or script command here: its exit status and what it printed."""
    from longalign.cli import main

    out = io.StringIO()
    saved_argv = sys.argv
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                if Path(words[0]).name == "longalign":
                    return main(words[1:]), out.getvalue()
                if words[1:3] == ["-m", "longalign"]:
                    return main(words[3:]), out.getvalue()
                if words[1] == "-c":
                    sys.argv = ["-c", *words[3:]]
                    exec(compile(words[2], "<string>", "exec"), {"__name__": "__main__"})
                    return 0, out.getvalue()
                sys.argv = words[1:]  # python SCRIPT ARGS: the script sees itself and its arguments
                runpy.run_path(words[1], run_name="__main__")
                return 0, out.getvalue()
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                return code, out.getvalue()
            except Exception:  # a fault: the status the command would exit with, and its traceback
                traceback.print_exc(file=out)
                return 1, out.getvalue()
    finally:
        sys.argv = saved_argv


def runs_in_process(words: list[str]) -> bool:
    if Path(words[0]).name == "longalign":
        return True
    return words[0] == sys.executable and (
        words[1:3] == ["-m", "longalign"]
        or words[1:2] == ["-c"]
        or words[1:2] != []
        and words[1].startswith(IN_PROCESS)
    )


def run_step(step: str, stub: OpenAIStub, cwd: Path) -> tuple[int, str]:
    if needs_shell(step):
        result = run_process(["bash", "-c", step], timeout=600, cwd=cwd)
        return result.returncode, result.stdout + result.stderr
    env, words = argv(step)
    words = prepared(words, stub)
    if runs_in_process(words) and not env:
        return run_in_process(words)
    result = run_process(words, timeout=600, cwd=cwd, env={**os.environ, **env})
    return result.returncode, result.stdout + result.stderr


@pytest.mark.integration
@pytest.mark.timeout(1800)  # every command of the manual, one after another
def test_every_documented_command_runs(scratch, request):
    plans = [plan(command) for command in all_commands()]
    results: dict[str, tuple[int, float]] = {}
    failures = []
    with OpenAIStub(lambda body: STUB_REPLY, key=STUB_KEY, model=STUB_MODEL) as stub:
        for p in plans:
            if not p.run or p.command.text in results:
                continue
            start, status, output = time.perf_counter(), 0, ""
            for step in p.run:
                status, output = run_step(step, stub, scratch)
                if status != 0:
                    break
            results[p.command.text] = (status, time.perf_counter() - start)
            if status != p.command.expected_status:
                failures.append(
                    f"{p.command.where}: exit {status}, expected {p.command.expected_status}: {p.command.text}\n"
                    + output[-3000:]
                )
    request.config.stash[DOCS_REPORT] = report(plans, results)
    assert not failures, "\n\n".join(failures)
    made = json.loads((scratch / "out" / "gen" / "report.json").read_text())  # the README's first command
    assert made["samples"]["made"] > 0 and stub.calls > 0
