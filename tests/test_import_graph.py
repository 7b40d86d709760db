"""The packages' import graph: no module imports another that imports it back, and the layers point one way
(quant <- moe_lora <- allsync; evals imports none of them). Every import counts, those inside functions too: an
import put in a function to dodge a circle at load time still ties the two modules together (issue 50)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = ("quant", "moe_lora", "allsync", "evals")
LAYER_MAY_IMPORT = {"quant": set(), "moe_lora": {"quant"}, "allsync": {"quant", "moe_lora", "evals"}, "evals": set()}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports anywhere, in functions too (`from x import y` counts x.y when it is a
    module)."""
    tree, name = ast.parse(path.read_text()), module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules) for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle_through_a_package():
    graph = {"a": {"a.b"}, "a.b": {"c"}, "c": {"a"}, "d": {"c"}}
    assert cycles(graph) == [["a", "a.b", "c"]]


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


def test_an_import_inside_a_function_counts(tmp_path, monkeypatch):
    """A function-local import is an edge of the graph like a module-level one."""
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    path = tmp_path / "m.py"
    path.write_text("import a\n\ndef f():\n    from b import c\n    import d\n")
    assert imported_modules(path, {"a", "b", "b.c", "d"}) == {"a", "b", "b.c", "d"}


def test_layers_point_one_way():
    wrong = [
        (m, d)
        for m, deps in import_graph().items()
        for d in deps
        if d.split(".")[0] != m.split(".")[0] and d.split(".")[0] not in LAYER_MAY_IMPORT[m.split(".")[0]]
    ]
    assert wrong == []
