"""Make the packages that only longalign's extras bring unimportable, as on a machine with the core install.

What a plain ``pip install -e .`` lacks is read from ``pyproject.toml``: every distribution that the
optional dependencies need (their requirements, followed through the installed packages' own metadata)
and the core dependencies do not. A new extra is covered without editing anything here.

``install(modules, distributions)`` wraps every finder on ``sys.meta_path``: a hidden top-level module is
not found (``import peft`` raises ``ModuleNotFoundError``, ``importlib.util.find_spec("peft")`` is
``None``) and a hidden distribution has no metadata (``importlib.metadata.version("peft")`` raises
``PackageNotFoundError``), so libraries that probe for an optional package see it absent, as they would::

    PYTHONPATH=<dir with sitecustomize.py calling install(...)>:tests  python train.py ...

``sitecustomize(modules, distributions)`` writes that file's text: every Python process started with it on
``PYTHONPATH``, ``accelerate launch``'s workers included, starts with the extras hidden.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from collections.abc import Iterable
from pathlib import Path

from packaging.markers import UndefinedEnvironmentName
from packaging.requirements import Requirement


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(pyproject: Path) -> tuple[list[Requirement], dict[str, list[Requirement]]]:
    project = tomllib.loads(pyproject.read_text())["project"]
    core = [Requirement(line) for line in project["dependencies"]]
    extras = {
        name: [Requirement(line) for line in lines]
        for name, lines in project.get("optional-dependencies", {}).items()
    }
    return core, extras


def _applies(requirement: Requirement, extra: str = "") -> bool:
    if requirement.marker is None:
        return True
    try:
        return requirement.marker.evaluate({"extra": extra})
    except UndefinedEnvironmentName:
        return False


def _closure(requirements: Iterable[Requirement], own: str, extras: dict[str, list[Requirement]]) -> set[str]:
    """The installed distributions that ``requirements`` need, followed through installed metadata."""
    found: set[str] = set()
    todo = [(requirement, "") for requirement in requirements]
    while todo:
        requirement, extra = todo.pop()
        if not _applies(requirement, extra):
            continue
        name = _normalized(requirement.name)
        if name == own:  # longalign[lora] inside another extra
            todo += [(r, "") for extra_name in requirement.extras for r in extras.get(extra_name, [])]
            continue
        wanted = [(name, "")] + [(name, extra_name) for extra_name in requirement.extras]
        for dist_name, dist_extra in wanted:
            if (dist_name, dist_extra) in found:
                continue
            try:
                needs = importlib.metadata.requires(dist_name) or []
            except importlib.metadata.PackageNotFoundError:
                continue  # not installed here: nothing to hide
            found.add((dist_name, dist_extra))
            todo += [(Requirement(line), dist_extra) for line in needs]
    return {name for name, _ in found}


def extra_only_distributions(pyproject: Path) -> set[str]:
    """Installed distributions (normalized names) that the extras need and the core install does not."""
    core, extras = _requirements(pyproject)
    own = _normalized(tomllib.loads(pyproject.read_text())["project"]["name"])
    with_core = _closure(core, own, extras)
    with_extras = _closure([r for lines in extras.values() for r in lines], own, extras)
    return with_extras - with_core


def top_level_modules(distributions: set[str]) -> set[str]:
    """The importable top-level names that only ``distributions`` provide (a shared namespace stays)."""
    providers = importlib.metadata.packages_distributions()
    return {
        module
        for module, names in providers.items()
        if names and all(_normalized(name) in distributions for name in names) and module.isidentifier()
    }


class _Hiding:
    """A ``sys.meta_path`` entry that asks the finder it wraps for everything but the hidden names."""

    def __init__(self, finder, modules: frozenset[str], distributions: frozenset[str]) -> None:
        self.finder, self.modules, self.distributions = finder, modules, distributions

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.modules or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(fullname, path, target)

    def find_distributions(self, *args, **kwargs):
        found = getattr(self.finder, "find_distributions", None)
        if found is None:
            return iter(())
        return (
            dist
            for dist in found(*args, **kwargs)
            if _normalized(dist.metadata["Name"] or "") not in self.distributions
        )

    def invalidate_caches(self) -> None:
        if hasattr(self.finder, "invalidate_caches"):
            self.finder.invalidate_caches()


def install(modules: Iterable[str], distributions: Iterable[str]) -> None:
    """Hide ``modules`` and ``distributions`` from every import and metadata look-up of this process."""
    modules, distributions = frozenset(modules), frozenset(distributions)
    sys.meta_path[:] = [_Hiding(finder, modules, distributions) for finder in sys.meta_path]
    for name in list(sys.modules):
        if name.partition(".")[0] in modules:
            del sys.modules[name]


def sitecustomize(modules: Iterable[str], distributions: Iterable[str]) -> str:
    """The text of a ``sitecustomize.py`` that runs :func:`install` at every interpreter start."""
    return (
        "import hidden_extras\n"
        f"hidden_extras.install({json.dumps(sorted(modules))}, {json.dumps(sorted(distributions))})\n"
    )
