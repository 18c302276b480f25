"""The package's imports run one way: no module of longalign/ or patch/ reaches itself through its imports.

Every import counts, also one inside a function (a lazy import hides a cycle, it does not untie it).
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGES = {"longalign": ROOT / "longalign", "longalign.patch": ROOT / "patch"}
# What reads or writes files: the pure ChatGLM layout mapping imports none of it.
FILE_ACCESS = {"os", "pathlib", "json", "safetensors", "shutil", "io", "glob"}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``longalign.patch`` lives in patch/)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.glob("**/*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 more
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # "from package import module" imports a module; "from module import name" the module itself
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:  # longalign.run.x -> longalign.run
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def top_level_imports(path: Path) -> set[str]:
    """The top-level names of everything the file imports, anywhere in it (``safetensors.torch`` -> ``safetensors``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add(node.module.split(".")[0])
    return out


def reached(graph: dict[str, set[str]], name: str) -> set[str]:
    """The modules ``name`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen - {name}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_walk_sees_the_package_and_its_imports():
    graph = import_graph()
    assert {"longalign.run", "longalign.loss", "longalign.patch", "longalign.patch.interface"} <= set(graph)
    assert "longalign.loss" in graph["longalign.trainer"]  # a module-level import
    assert "longalign.patch.interface" in graph["longalign.patch"]  # a relative one
    assert "longalign.lora" in graph["longalign.run"]  # one inside a function


def test_the_walk_finds_a_cycle_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_the_run_file_checker_imports_no_stage():
    # config heads the data flow: the stages import the names it checks (backends, weightings, strategies,
    # truncations, the ignore index, Source), so checking a run file loads none of them (nor torch); it
    # reads token counts ("4k") as the commands do (longalign.arguments, which imports no stage either).
    graph = import_graph()
    assert graph["longalign.config"] <= {"longalign.errors", "longalign.arguments"}
    assert graph["longalign.arguments"] <= {"longalign.errors"}


def test_the_chatglm_layout_mapping_opens_no_files():
    files, graph = module_files(), import_graph()
    assert {"json", "pathlib", "safetensors", "shutil"} <= top_level_imports(files["longalign.checkpoints"])
    assert not top_level_imports(files["longalign.chatglm_layout"]) & FILE_ACCESS
    # Of longalign it reaches the error classes only; they format values as JSON text and open nothing.
    assert reached(graph, "longalign.chatglm_layout") == {"longalign.errors"}
    assert not top_level_imports(files["longalign.errors"]) & (FILE_ACCESS - {"json"})
