"""The core install (``pip install -e .``, no extras) runs the README's demo and the console commands.

Every process below starts with the packages that only the extras bring made unimportable
(``tests/hidden_extras.py`` reads them from ``pyproject.toml``): the demo's pre-tokenize, pack and a few
training steps of ``train.py`` on the demo run file, and ``longalign probe --simulate`` on it;
every module, script and console command loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import DEMO, ROOT, SAMPLE, TOKENIZER
from hidden_extras import extra_only_distributions, sitecustomize, top_level_modules

PYPROJECT = ROOT / "pyproject.toml"
# What the extras serve, each of which a core run must not need; more are hidden (read from pyproject).
SERVED_BY_EXTRAS = ("peft", "bitsandbytes", "deepspeed", "openai")


@pytest.fixture(scope="module")
def core_environment(tmp_path_factory) -> dict[str, str]:
    """The environment of a process that sees only the core install."""
    distributions = extra_only_distributions(PYPROJECT)
    modules = top_level_modules(distributions)
    assert set(SERVED_BY_EXTRAS) <= modules, sorted(modules)
    site = tmp_path_factory.mktemp("core_site")
    (site / "sitecustomize.py").write_text(sitecustomize(modules, distributions))
    path = os.pathsep.join([str(site), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), "OMP_NUM_THREADS": "1"}


def run(argv: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(argv)}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


@pytest.mark.integration
def test_the_demo_and_the_console_commands_run_with_every_extra_missing(core_environment, tmp_path):
    tokenized, packed, output = tmp_path / "tokenized", tmp_path / "packed", tmp_path / "run"
    run(
        [sys.executable, "scripts/pre_tokenize.py", "--input", str(SAMPLE), "--tokenizer", str(TOKENIZER)]
        + ["--output", str(tokenized), "--max-seq-len", "4096", "--truncation", "right"],
        core_environment,
    )
    run(
        [sys.executable, "scripts/sort_and_group.py", "--input", str(tokenized), "--output", str(packed)]
        + ["--max-seq-len", "4096"],
        core_environment,
    )
    trained = run(
        [
            sys.executable,
            "train.py",
            "--config",
            str(DEMO),
            f'data.train_file="{packed}"',
        ]
        + [f'training.output_dir="{output}"', "training.max_steps=3", "training.disable_tqdm=true"]
        + ["training.save_steps=3", "training.logging_steps=1"],
        core_environment,
    )
    assert "train_loss" in trained.stdout + trained.stderr
    assert (output / "model.safetensors").exists()
    simulated = tmp_path / "simulated.json"
    run(
        [sys.executable, "-m", "longalign", "probe", "--simulate", "--config", str(DEMO), "--lengths", "4k"]
        + ["--gpu-memory", "1GiB", "--output", str(simulated)],
        core_environment,
    )
    assert json.loads(simulated.read_text())["simulated"][0]["tokens_per_gpu"] == 4096


# The modules that exist to drive one extra's package; every other module imports without any extra.
EXTRA_MODULES = {"longalign.lora": "peft"}


# The hiding itself: an extra's package is neither importable nor installed, for imports, probes and metadata.
HIDDEN_CHECK = f"""
import importlib.metadata, importlib.util
for name in {list(SERVED_BY_EXTRAS)!r}:
    assert importlib.util.find_spec(name) is None, name
    try:
        __import__(name)
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit(f"{{name}} imported")
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        raise SystemExit(f"{{name}} has metadata")
from transformers.utils import is_peft_available
from accelerate.utils import is_deepspeed_available
assert not is_peft_available() and not is_deepspeed_available()
"""


def test_the_extras_are_hidden_and_every_module_and_console_command_loads(core_environment):
    """One process: the extras are hidden; every module of the package and the scripts imports, every
    command's --help prints."""
    check = (
        HIDDEN_CHECK
        + f"""
import contextlib, importlib, io, pkgutil, runpy, sys
import longalign, longalign.patch
from longalign.cli import main
failed = {{}}
for info in [*pkgutil.walk_packages(longalign.__path__, "longalign."), *pkgutil.walk_packages(longalign.patch.__path__, "longalign.patch.")]:
    if info.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as err:
        failed[info.name] = err.name
assert failed == {EXTRA_MODULES!r}, failed
for command in ("train", "probe", "eval", "data", "pre-tokenize", "pack", "convert"):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([command, "--help"])
    assert "usage:" in out.getvalue(), command
for script in ("pre_tokenize", "sort_and_group", "probe_memory", "preflight", "merge_adapter"):
    out = io.StringIO()
    sys.argv = [script, "--help"]
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        runpy.run_path(f"scripts/{{script}}.py", run_name="__main__")
    assert "usage:" in out.getvalue(), script
"""
    )
    run([sys.executable, "-c", check], core_environment)


def test_the_hidden_set_follows_pyproject(tmp_path):
    """A new extra is hidden without editing the test: its packages come from the file itself."""
    project = PYPROJECT.read_text().replace(
        "[project.optional-dependencies]", '[project.optional-dependencies]\nnew = ["tiktoken"]', 1
    )
    project = project.replace(', "tiktoken"]', "]")  # only the new extra brings it now
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(project)
    assert "tiktoken" in extra_only_distributions(pyproject)
    assert "torch" not in extra_only_distributions(pyproject)
    assert "transformers" not in extra_only_distributions(pyproject)
    assert {"peft", "deepspeed", "bitsandbytes"} <= extra_only_distributions(pyproject)
