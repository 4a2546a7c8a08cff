"""The package's layering, read from the source (every import, at the top or inside a function; a
module's script entry, `if __name__ == "__main__":`, is not an import of the module and is left out):

* an order of floors (FLOORS, written down in docs/design.md): a module imports only from its own floor or
  the floors below it, and no two rooms of one floor import each other both ways;
* no import circle between modules (a circle makes the order of imports matter and hides the layering);
* the model layer imports neither Ray nor the data layer (it runs in a notebook or a serving engine);
* the data layer and the sizing models import neither torch nor Ray (the plan is pure and cheap);
* the run's layout imports nothing heavy (every reader of a run directory may use it).
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "dflash_ray"


def _module(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_script_entry(node) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def import_graph() -> dict[str, set[str]]:
    """module -> the modules it imports (external ones by their top-level name, ours in full)."""
    modules = {_module(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        out = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        tree.body = [n for n in tree.body if not _is_script_entry(n)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for t in targets:
                if t.startswith("dflash_ray"):
                    while t not in modules and "." in t:
                        t = t.rpartition(".")[0]
                    if t != name and t != "dflash_ray":
                        out.add(t)
                else:
                    out.add(t.split(".")[0])
        graph[name] = out
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# The floors, lowest first: each room (a module, or a folder of modules: the longest prefix names the room)
# imports from its own floor and those below. docs/design.md shows the same order.
FLOORS = [
    ("base", ["errors", "atomic", "required", "machine_cache", "tokenizer", "processor", "run_layout", "hf_config",
              "config", "console", "search_space"]),
    ("data", ["data"]),
    ("sizing", ["sizing"]),
    ("model", ["model"]),
    ("threads and paths", ["threads", "paths"]),
    ("runtime base", ["runtime.cluster", "runtime.coordinator", "runtime.progress"]),
    ("stream", ["runtime.stream"]),
    ("training", ["runtime.training"]),
    ("record", ["runtime.record"]),
    ("runtime", ["runtime.spec", "runtime.plan_sizing", "runtime.fit", "runtime.checkpoints"]),
    ("jobs", ["runtime.jobs"]),
    ("recipe", ["train", "demo"]),
    ("entry points", ["compare", "sweep", "cli", "publish", "__main__"]),
]


def room(module: str) -> str:
    """The room a module of the package is in: the longest FLOORS entry that is the module or its package."""
    name = module.removeprefix("dflash_ray.")
    rooms = [r for _, rs in FLOORS for r in rs if name == r or name.startswith(r + ".")]
    return max(rooms, key=len) if rooms else ""


def floor_of(module: str) -> int:
    r = room(module)
    return next(i for i, (_, rs) in enumerate(FLOORS) if r in rs)


def floor_breaks(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up a floor, and every pair of rooms on one floor that import each other."""
    ours = {m: {d for d in deps if d.startswith("dflash_ray.") and d in graph} for m, deps in graph.items()
            if m.startswith("dflash_ray.") and not _is_package(m, graph)}
    up = [f"{m} -> {d}" for m, deps in sorted(ours.items()) for d in sorted(deps) if floor_of(d) > floor_of(m)]
    rooms = {(room(m), room(d)) for m, deps in ours.items() for d in deps if room(m) != room(d)}
    same_floor = {r: i for i, (_, rs) in enumerate(FLOORS) for r in rs}
    both = [f"{a} <-> {b}" for a, b in sorted(rooms) if a < b and (b, a) in rooms and same_floor[a] == same_floor[b]]
    return up + both


def _is_package(module: str, graph) -> bool:
    return any(m.startswith(module + ".") for m in graph)


def test_every_module_is_on_a_floor():
    g = import_graph()
    assert sorted(m for m in g if not _is_package(m, g) and not room(m)) == []


def test_imports_go_down_the_floors():
    assert floor_breaks(import_graph()) == []


def test_a_reversed_import_breaks_the_floors():
    g = {m: set(d) for m, d in import_graph().items()}
    g["dflash_ray.data.plan"].add("dflash_ray.runtime.spec")     # the planner asking the runtime: up 9 floors
    assert floor_breaks(g) == ["dflash_ray.data.plan -> dflash_ray.runtime.spec"]
    g = {m: set(d) for m, d in import_graph().items()}
    g["dflash_ray.threads"].add("dflash_ray.paths")               # two rooms of one floor, both ways
    g["dflash_ray.paths"].add("dflash_ray.threads")
    assert floor_breaks(g) == ["paths <-> threads"]


def test_the_reader_sees_real_imports():
    g = import_graph()   # the reader itself: a known edge of each kind is found
    assert "ray" in g["dflash_ray.runtime.coordinator"] or "ray" in g["dflash_ray.runtime.record.record"]
    assert "dflash_ray.data.plan" in g["dflash_ray.runtime.spec"]
    assert "torch" in g["dflash_ray.model.drafter"]


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _imports_of(prefix: str) -> dict[str, set[str]]:
    return {m: deps for m, deps in import_graph().items() if m == prefix or m.startswith(prefix + ".")}


def test_the_model_layer_imports_neither_ray_nor_the_data_layer():
    bad = {m: sorted(d for d in deps if d == "ray" or d.startswith(("dflash_ray.data", "dflash_ray.runtime")))
           for m, deps in _imports_of("dflash_ray.model").items()}
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_planner_and_sizing_import_neither_torch_nor_ray():
    # the sizing models may read the run directory's layout (it is light: below); the data layer reads none
    # of the runtime
    for layer in ("dflash_ray.data", "dflash_ray.sizing"):
        bad = {m: sorted(d for d in deps if d in ("torch", "ray") or d.startswith(("dflash_ray.runtime", "dflash_ray.model")))
               for m, deps in _imports_of(layer).items()}
        assert {m: d for m, d in bad.items() if d} == {}, layer


def test_the_run_layout_is_light():
    deps = import_graph()["dflash_ray.run_layout"]
    assert not deps & {"torch", "ray", "transformers", "numpy"}
