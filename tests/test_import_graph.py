"""The import graph of the project's packages: no cycles, no upward imports.

Built from the source with `ast`, so every import counts: module level, inside functions (a lazy
import hides a cycle, it does not remove it), relative ones resolved, and `__import__` /
`importlib.import_module` with a literal name. A package's `__init__` is a node of its own: an edge
goes to it only when the import names the package itself, not one of its submodules.

Layers, bottom to top: candidate_gen and proto (candidate_gen.files holds the shared I/O), then
reranker, then integration. A module may import its own layer or a lower one, never a higher one.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("candidate_gen", "proto", "reranker", "integration")
LAYER = {"candidate_gen": 0, "proto": 0, "reranker": 1, "integration": 2}


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the project's packages."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            mods[".".join(parts)] = path
    return mods


def _literal_import(node: ast.Call) -> str | None:
    """The module named by `__import__("x.y", ...)` or `importlib.import_module("x.y")`."""
    f = node.func
    named = (isinstance(f, ast.Name) and f.id in ("__import__", "import_module")) or \
            (isinstance(f, ast.Attribute) and f.attr == "import_module")
    if named and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that module `name` imports anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]

    def resolve(target: str) -> str | None:
        # The deepest project module the dotted name reaches ("a.b.func" -> "a.b").
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub when there is one, else pkg itself.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        elif isinstance(node, ast.Call) and (lit := _literal_import(node)):
            targets = [lit]
        else:
            continue
        for t in targets:
            r = resolve(t)
            if r is not None and r != name:
                found.add(r)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = project_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    layer = lambda m: LAYER[m.split(".")[0]]  # noqa: E731
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer(b) > layer(a))


def test_graph_sees_every_kind_of_import(tmp_path):
    """The checker itself: relative, function-level and literal __import__ imports are edges; a
    two-module cycle and an upward import are reported."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "reranker" / "sub").mkdir()
    (tmp_path / "reranker" / "sub" / "__init__.py").write_text("from .b import f\n")
    (tmp_path / "reranker" / "a.py").write_text("def g():\n    from .sub import b\n")
    (tmp_path / "reranker" / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")
    (tmp_path / "reranker" / "c.py").write_text("x = __import__('integration.top', fromlist=['y'])\n")
    (tmp_path / "integration" / "top.py").write_text("from reranker.sub import f\n")
    (tmp_path / "candidate_gen" / "low.py").write_text("import reranker.c\n")
    graph = import_graph(tmp_path)
    assert graph["reranker.a"] == {"reranker.sub.b"}
    assert graph["reranker.sub.b"] == {"reranker.a"}
    assert graph["reranker.sub"] == {"reranker.sub.b"}
    assert graph["integration.top"] == {"reranker.sub"}  # the package __init__, a node of its own
    assert cycles(graph) == [["reranker.a", "reranker.sub.b"]]
    assert upward_imports(graph) == ["candidate_gen.low -> reranker.c", "reranker.c -> integration.top"]


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_no_import_cycles(graph):
    found = cycles(graph)
    assert not found, "import cycles (modules that import each other, directly or around a loop):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_no_upward_imports(graph):
    found = upward_imports(graph)
    assert not found, "upward imports (a lower layer importing a higher one):\n" + "\n".join(found)


# The stage modules' shared infrastructure: the contract, discovery and the runner.
STAGE_INFRA = {"reranker.stages", "reranker.stages.base", "reranker.stages.registry", "reranker.stages.pipeline"}


def stage_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a stage module (a plugin of reranker/stages that is not STAGE_INFRA), from anywhere."""
    plugins = {m for m in graph if m.startswith("reranker.stages.") and m not in STAGE_INFRA}
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if b in plugins)


def test_stage_imports_are_found(tmp_path):
    (tmp_path / "reranker" / "stages").mkdir(parents=True)
    for name in ("__init__", "base", "a", "b"):
        (tmp_path / "reranker" / "stages" / f"{name}.py").write_text("")
    (tmp_path / "reranker" / "__init__.py").write_text("")
    (tmp_path / "reranker" / "stages" / "b.py").write_text("from reranker.stages.base import Stage\nfrom .a import f\n")
    (tmp_path / "reranker" / "shared.py").write_text("def g():\n    from reranker.stages import a\n")
    assert stage_imports(import_graph(tmp_path)) == ["reranker.shared -> reranker.stages.a", "reranker.stages.b -> reranker.stages.a"]


def test_stages_do_not_import_each_other(graph):
    """Each stage (sft, cft, opd, ar_rl, rl, any later one) imports the stage contract from
    reranker.stages.base and its shared components from reranker.training, never another stage:
    what two stages share lives once, in a module named for what it is. Nothing else imports a
    stage either; the registry finds them by entry point."""
    assert {f"reranker.stages.{s}" for s in ("sft", "cft", "opd", "ar_rl", "rl")} <= set(graph)
    found = stage_imports(graph)
    assert not found, "imports of a stage module (move what they share into reranker/training):\n" + "\n".join(found)
