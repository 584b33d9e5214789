"""The repository's modules import one way: no import cycle among the pipeline's modules
(ci/, noxfile.py) or the package's (custom_esimd_kernels_vllm/), counting imports inside
functions too; and no pipeline module shadows an installed or standard module when ci/ is a
script's first path entry (``python ci/gsm8k_gate.py``)."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "custom_esimd_kernels_vllm"


def module_names() -> dict[str, Path]:
    """Dotted name -> file, for ci/ (package ``ci``; its scripts' sibling imports by bare name
    resolve there too) and the package."""
    names = {"noxfile": ROOT / "noxfile.py"}
    for base in ("ci", PACKAGE):
        for path in sorted((ROOT / base).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules ``name`` imports, anywhere in its file (its own packages aside)."""
    is_package = path.name == "__init__.py"
    found = set()

    def resolve(target: str) -> str | None:
        for candidate in (target, f"ci.{target}"):  # ci/ scripts import siblings by bare name
            while candidate:
                if candidate in known:
                    return candidate
                candidate = candidate.rpartition(".")[0]
        return None

    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            module = resolve(target)
            # A module's own packages run before it whatever it imports: not an edge.
            if module is not None and not f"{name}.".startswith(f"{module}."):
                found.add(module)
    return found


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def graph_of(prefix: str) -> dict[str, set[str]]:
    known = module_names()
    return {
        name: {m for m in imports_of(name, path, known) if m.startswith(prefix)}
        for name, path in known.items()
        if name.startswith(prefix)
    }


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("prefix", ["ci", PACKAGE, ""])
def test_no_import_cycle(prefix):
    graph = graph_of(prefix)
    assert graph, prefix
    found = cycle(graph)
    assert found is None, "import cycle: " + " -> ".join(found)


def test_the_driver_is_on_top():
    """Only noxfile.py imports the driver; the driver imports every step module."""
    graph = graph_of("")
    importers = sorted(name for name, deps in graph.items() if "ci.pipeline" in deps)
    assert importers == ["noxfile"]
    assert {"ci.build_steps", "ci.check_steps", "ci.containers", "ci.gpu"} <= graph["ci.pipeline"]


def test_no_pipeline_module_shadows_another():
    installed = set(importlib.metadata.packages_distributions())
    taken = installed | set(sys.stdlib_module_names)
    ours = {p.stem for p in (ROOT / "ci").glob("*.py")} | {
        p.name for p in (ROOT / "ci").iterdir() if (p / "__init__.py").is_file()
    }
    assert sorted(ours & taken) == []
