"""Every install command the README and the manual show resolves, as pip answers a dry run of it here.

``pip install --dry-run`` runs pip's resolver against the package index without installing anything: it
fails where a user's install would fail to resolve or to build its metadata (a package that does not
exist, a pin with no release, an sdist whose build needs what its isolated environment lacks). A command
that needs more than the package index (``# needs the network: GitHub``) is listed with its reason.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT
from docs_commands import argv, commands_in, is_install, steps

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# flash-attn's setup.py compiles its CUDA extension unless told not to; this machine has no CUDA, and the
# metadata pip resolves with is the same either way.
NO_CUDA_HERE = {"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"}


def install_steps() -> list[tuple[str, list[str], str | None]]:
    """``(where, pip arguments after "install", why it cannot resolve here)`` for every pip install shown."""
    found = []
    for page in PAGES:
        for command in commands_in(page.read_text(), str(page.relative_to(ROOT))):
            for step in steps(command.text):
                _, words = argv(step)
                if is_install(words) and "-m" not in words[1:3]:
                    found.append((command.where, words[words.index("install") + 1 :], command.needs))
    return found


def dry_run(arguments: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", *arguments]
    env = {**os.environ, **NO_CUDA_HERE}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_pages_show_each_gpu_route_s_install():
    shown = {" ".join(arguments) for _, arguments, _ in install_steps()}
    assert "flash-attn --no-build-isolation" in shown
    assert "flash-attn-4==4.0.0b36" in shown
    assert any("flash-attention/hopper" in line for line in shown)
    assert not any("[flash]" in line for line in shown)  # no extra can pass --no-build-isolation


@pytest.mark.integration
def test_every_install_command_shown_resolves():
    """One resolution for longalign with all the extras the pages install (if they resolve together, each
    does alone), one per other package; only FA3's install leaves the package index."""
    shown = install_steps()
    unresolvable = [f"{where}: {needs}" for where, _, needs in shown if needs is not None]
    assert unresolvable and all("GitHub" in line for line in unresolvable), unresolvable
    extras, others = set(), set()
    for _, arguments, needs in shown:
        if needs is not None:
            continue
        if arguments[0] == "-e":
            extras.update(
                arguments[1].partition("[")[2].rstrip("]").split(",") if "[" in arguments[1] else []
            )
        else:
            others.add(tuple(arguments))
    assert {"dev", "sp", "lora", "qlora", "eval"} <= extras and ("torch==2.13.0",) in others
    requests = [
        ["torch==2.13.0", "-e", f".[{','.join(sorted(extras))}]"],
        *map(list, others - {("torch==2.13.0",)}),
    ]
    failures = []
    for arguments in requests:
        result = dry_run(arguments)
        if result.returncode != 0:
            failures.append(f"pip install {' '.join(arguments)}\n{result.stderr[-1500:]}")
    assert not failures, "\n\n".join(failures)
