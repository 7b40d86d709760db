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


def room_of(module: str) -> str:
    """A module's room: the package under allsync/ it sits in (allsync.update.loss -> update), or its own name for a
    module loose in allsync/ (allsync.cli -> cli); outside allsync, its top package."""
    parts = module.split(".")
    return parts[1] if parts[0] == "allsync" and len(parts) > 1 else parts[0]


def room_graph() -> dict[str, set[str]]:
    """Which rooms of allsync import which (every import counts, those in functions too)."""
    rooms: dict[str, set[str]] = {}
    for module, deps in import_graph().items():
        if module.startswith("allsync."):
            rooms.setdefault(room_of(module), set()).update(
                room_of(d) for d in deps if d.startswith("allsync.") and room_of(d) != room_of(module)
            )
    return rooms


def test_the_rooms_of_allsync_import_one_way():
    """No room imports one that imports it back (docs/architecture.md draws the floors): a launch mode starts workers,
    a worker runs the update, and neither is imported by what it calls."""
    assert cycles(room_graph()) == []


# the update's stages, top to bottom (allsync/update/__init__.py): each imports only stages after it in this list
UPDATE_STAGES = [
    "learner",
    "batches",
    "passes",
    "balance",
    "policy_state",
    "optimizer",
    "loss",
    "critic",
    "forward",
    "train_batch",
    "sequences",
]


def test_the_updates_stages_call_only_downward():
    graph = import_graph()
    found = sorted(m.rpartition(".")[2] for m in graph if m.startswith("allsync.update."))
    assert found == sorted(UPDATE_STAGES), "a module of allsync/update/ not in UPDATE_STAGES (or gone from it)"
    upward = [
        (stage, dep)
        for i, stage in enumerate(UPDATE_STAGES)
        for dep in graph[f"allsync.update.{stage}"]
        if dep.startswith("allsync.update.") and UPDATE_STAGES.index(dep.rpartition(".")[2]) <= i
    ]
    assert upward == []


def test_no_module_over_500_lines_and_no_class_over_250():
    """The size goal of issue 72: a room that grows past it is split by responsibility."""
    too_big = []
    for package in ("allsync", "moe_lora", "quant"):
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text()
            if source.count("\n") > 500:
                too_big.append(f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                    too_big.append(f"{path.relative_to(ROOT)}: class {node.name} {node.end_lineno - node.lineno + 1}")
    assert too_big == []


def documented_floors() -> dict[str, int]:
    """docs/architecture.md's floor table: room -> floor."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("<!-- floors: checked by tests/test_import_graph.py -->\n```\n", 1)[1].split("```", 1)[0]
    floors = {}
    for line in block.splitlines()[1:]:
        floor, rooms = line.split(maxsplit=1)
        floors.update({room.strip(): int(floor) for room in rooms.split(",")})
    return floors


def test_every_room_imports_only_rooms_on_lower_floors_as_the_architecture_page_draws_them():
    floors, graph = documented_floors(), import_graph()
    rooms = {room_of(m) for m in graph if m != "allsync"}  # allsync/__init__.py is empty: the house, not a room
    assert rooms == set(floors), f"rooms not on the page: {rooms - set(floors)}; gone: {set(floors) - rooms}"
    upward = sorted({(room_of(m), room_of(d)) for m, deps in graph.items() for d in deps if room_of(m) != room_of(d)})
    assert [(a, b) for a, b in upward if floors[b] >= floors[a]] == []
