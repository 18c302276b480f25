"""The prompts the generators send: text files shipped in ``prompts/``, each replaceable from a directory.

    templates = load_templates(SELF_INSTRUCT_TEMPLATES, override_dir=None)
    render(templates["user_turn"], document="...", instruction="Summarize it.")
        -> '...\\n\\nSummarize it.'
    load_tasks(templates["tasks"]) -> {'summary': 'a summary of the whole document, ...', 'single_hop': ...}

A template names its slots in braces (``{document}``); anything else in braces is left as it is, and a
value is never searched for slots, so documents and answers may contain braces freely.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from longalign.errors import ConfigError, PathError

SHIPPED = Path(__file__).parent / "prompts"
# Every template of each generator, with the slots it must have; "tasks" is a list, not a template.
SELF_INSTRUCT_TEMPLATES = {
    "instruction": ("document", "task", "task_description"),
    "follow_up": ("document", "conversation", "task", "task_description"),
    "user_turn": ("document", "instruction"),
    "tasks": (),
}
AGENTWRITE_TEMPLATES = {
    "plan": ("instruction", "length"),
    "write": ("instruction", "plan", "text_so_far", "step_number", "step", "words"),
}
_SLOT = re.compile(r"\{([a-z_]+)\}")


def load_templates(
    slots: dict[str, tuple[str, ...]], override_dir: str | os.PathLike | None
) -> dict[str, str]:
    """The shipped templates, each replaced by ``override_dir/NAME.txt`` where that file exists.

    Raises ``PathError`` for a missing directory and ``ConfigError`` for a ``.txt`` file there that is not
    one of ours (a misspelt name would be silently unused) or a template that lacks one of its slots.
    """
    files = {name: SHIPPED / f"{name}.txt" for name in slots}
    if override_dir is not None:
        directory = Path(override_dir)
        if not directory.is_dir():
            raise PathError(f"{override_dir}: not a directory of prompt files")
        for path in sorted(directory.glob("*.txt")):
            if path.stem not in slots:
                raise ConfigError(
                    f"{path}: not a prompt of this command; expected one of {', '.join(f'{n}.txt' for n in slots)}"
                )
            files[path.stem] = path
    templates = {}
    for name, path in files.items():
        try:
            text = path.read_text(encoding="utf-8").rstrip()
        except (OSError, UnicodeDecodeError) as err:
            raise PathError(
                f"{path}: cannot read the prompt ({getattr(err, 'strerror', None) or err})"
            ) from None
        missing = [slot for slot in slots[name] if f"{{{slot}}}" not in text]
        if missing:
            raise ConfigError(f"{path}: the prompt lacks {', '.join(f'{{{m}}}' for m in missing)}")
        templates[name] = text
    return templates


def render(template: str, **values: object) -> str:
    """``template`` with each ``{slot}`` that ``values`` names replaced, in one pass.

    render("Task: {task}. Keep {braces}.", task="summary") -> 'Task: summary. Keep {braces}.'
    """
    return _SLOT.sub(lambda m: str(values[m[1]]) if m[1] in values else m[0], template)


def load_tasks(text: str, *, where: str = "tasks.txt") -> dict[str, str]:
    """Task types from ``name: description`` lines; blank lines and ``#`` comments are skipped.

    load_tasks("summary: a summary\\n# note\\nmulti_hop: facts joined") -> {'summary': 'a summary', 'multi_hop': 'facts joined'}
    """
    tasks = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, colon, description = line.partition(":")
        name = name.strip()
        if not colon or not re.fullmatch(r"[a-z0-9_]+", name) or not description.strip():
            raise ConfigError(f"{where}: line {number}: expected 'name: description' with a lower-case name")
        tasks[name] = description.strip()
    if not tasks:
        raise ConfigError(f"{where}: no task types")
    return tasks


def choose_tasks(available: dict[str, str], wanted: str | None) -> dict[str, str]:
    """The task types ``--tasks`` names (comma-separated), in its order; all of them when it is None.

    choose_tasks({"summary": "...", "multi_hop": "..."}, "multi_hop") -> {'multi_hop': '...'}
    """
    if wanted is None:
        return dict(available)
    names = [name.strip() for name in wanted.split(",") if name.strip()]
    unknown = [name for name in names if name not in available]
    if unknown or not names:
        raise ConfigError(
            f"--tasks: unknown task type(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(available)}"
        )
    return {name: available[name] for name in dict.fromkeys(names)}
