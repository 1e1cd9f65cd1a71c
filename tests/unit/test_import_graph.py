"""The services import no module that imports them back (type-only and function-level imports included):
the model side reports to its observers; the Prometheus code imports it, never the other way round."""
from __future__ import annotations

import ast

from tests.helpers import REPO_ROOT


def _imports() -> dict[str, set[str]]:
    modules: dict[str, set[str]] = {}
    for path in (REPO_ROOT / "services").rglob("*.py"):
        name = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("services"):
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("services")}
        modules[name] = deps
    return {m: {d for d in deps if d in modules and d != m} for m, deps in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle (its modules in order), or [] when there is none."""
    state: dict[str, int] = {}   # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        state[m] = 2
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_the_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_no_import_cycle_in_services():
    graph = _imports()
    assert "services.engine.metrics" in graph and "services.engine.models.manager" in graph
    assert _cycle(graph) == []
    for model_side in ("services.engine.models.manager", "services.engine.models.runtime"):
        assert "services.engine.metrics" not in graph[model_side]
