"""The package's layering, read from the source (every import, at the top or inside a function; a
module's script entry, `if __name__ == "__main__":`, is not an import of the module and is left out):

* no import circle between modules (a circle makes the order of imports matter and hides the layering);
* the model layer imports neither Ray nor the data layer (it runs in a notebook or a serving engine);
* the data layer and the sizing models import neither torch nor Ray (the plan is pure and cheap);
* the record's layout imports nothing heavy (every reader of a run directory may use it).
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
        allowed = {"dflash_ray.runtime.record.layout"} if layer == "dflash_ray.sizing" else set()
        bad = {m: sorted(d for d in deps if d in ("torch", "ray") or (d.startswith(("dflash_ray.runtime", "dflash_ray.model"))
                                                                      and d not in allowed))
               for m, deps in _imports_of(layer).items()}
        assert {m: d for m, d in bad.items() if d} == {}, layer


def test_the_run_layout_is_light():
    deps = import_graph()["dflash_ray.runtime.record.layout"]
    assert not deps & {"torch", "ray", "transformers", "numpy"}
