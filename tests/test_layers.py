"""The layers of the developers' guide, read from the imports of every module (ast, no import).

models/ decide without Faust, Kafka, gRPC or protobuf and without the layers around them; collectors/
produce without models/ or streams/; simulator/ is a world model without streams/ or actions/;
and the module-level imports form no cycle. Imports inside a function, or under
``if TYPE_CHECKING:``, are deferred: allowed by the cycle rule (they run after both modules
exist), still held to the layer rules.
"""
from __future__ import annotations

import ast
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Top-level package folders; installed (and imported) as fabricwatch.<folder>.
FOLDERS = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
KAFKA_FAUST_GRPC = ("faust", "aiokafka", "kafka", "grpc")
# layer (module prefix) -> what its modules may not import (module prefixes)
FORBIDDEN = {
    "fabricwatch.models": (*KAFKA_FAUST_GRPC, "google.protobuf", "fabricwatch.protos", "fabricwatch.streams",
                           "fabricwatch.collectors", "fabricwatch.actions", "fabricwatch.dashboard", "fabricwatch.cli"),
    "fabricwatch.collectors": ("fabricwatch.models", "fabricwatch.streams", "fabricwatch.actions",
                               "fabricwatch.dashboard"),
    "fabricwatch.simulator": ("fabricwatch.streams", "fabricwatch.actions", "faust", "aiokafka"),
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    deferred: bool   # inside a function or `if TYPE_CHECKING:`


def module_files() -> dict[str, Path]:
    """Every module of the package tree by its installed name (the real folders, not fabricwatch/'s links)."""
    out = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            if "__pycache__" in rel.parts or path.name.endswith(("_pb2.py", "_pb2_grpc.py")) \
                    or any((ROOT / Path(*rel.parts[:i])).is_symlink() for i in range(1, len(rel.parts))):
                continue
            parts = list(rel.parts) if folder == "fabricwatch" else ["fabricwatch", *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def canonical(name: str) -> str:
    """`models.x` (the bare spelling) is `fabricwatch.models.x`."""
    head = name.split(".", 1)[0]
    return f"fabricwatch.{name}" if head in FOLDERS and head != "fabricwatch" else name


def imports_of(module: str, source: str, is_package: bool, known: Collection[str] = ()) -> list[Import]:
    """What ``module`` imports, relative imports resolved; ``from pkg import sub`` names the
    submodule when ``sub`` is one of ``known``."""
    found: list[Import] = []

    def visit(node: ast.AST, deferred: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(module, canonical(a.name), node.lineno, deferred) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = canonical(node.module or "")
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append(Import(module, sub if sub in known else target, node.lineno, deferred))
        inner = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, inner)
            return
        for inner_node in ast.iter_child_nodes(node):
            visit(inner_node, inner)

    visit(ast.parse(source), False)
    return found


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_violations(imports: list[Import], forbidden: dict[str, tuple[str, ...]]) -> list[str]:
    return [f"{i.importer}:{i.line} imports {i.imported}" for i in imports
            for layer, banned in forbidden.items()
            if within(i.importer, layer) and any(within(i.imported, b) for b in banned)]


def cycles(imports: list[Import], modules: set[str]) -> list[list[str]]:
    """Strongly connected groups (Tarjan) of the module-level import graph among ``modules``."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for i in imports:
        if not i.deferred and i.imported in modules and i.imported != i.importer:
            graph[i.importer].add(i.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def tree_imports() -> tuple[list[Import], set[str]]:
    files = module_files()
    known = set(files)
    imports = [imp for name, path in files.items()
               for imp in imports_of(name, path.read_text(encoding="utf-8"), path.name == "__init__.py", known)]
    return imports, known


def test_the_tree_is_read():
    imports, modules = tree_imports()
    assert {"fabricwatch.cli", "fabricwatch.models.baseline", "fabricwatch.actions.alerts",
            "fabricwatch.simulator.cluster", "fabricwatch.rank.reporter"} <= modules
    assert len(modules) > 100 and len(imports) > 500


def test_layers_import_only_what_they_may():
    imports, _ = tree_imports()
    assert layer_violations(imports, FORBIDDEN) == []


def test_no_import_cycles_at_module_level():
    imports, modules = tree_imports()
    assert cycles(imports, modules) == []


def test_the_checks_catch_a_cycle_and_a_forbidden_edge():
    # A tiny synthetic tree: models.a -> models.b -> models.a at module level, models.b -> grpc,
    # a relative import, a bare spelling, and deferred imports that do not make a cycle.
    sources = {
        "fabricwatch.models.a": ("from . import b\n", False),
        "fabricwatch.models.b": ("import grpc\nfrom models.a import thing\n", False),
        "fabricwatch.streams.c": ("def f():\n    from fabricwatch.streams import d\n", False),
        "fabricwatch.streams.d": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from .c import f\nimport fabricwatch.models.a\n", False),
    }
    known = set(sources)
    imports = [i for name, (src, pkg) in sources.items() for i in imports_of(name, src, pkg, known)]
    assert {(i.importer, i.imported, i.deferred) for i in imports} >= {
        ("fabricwatch.models.a", "fabricwatch.models.b", False),
        ("fabricwatch.models.b", "fabricwatch.models.a", False),
        ("fabricwatch.streams.c", "fabricwatch.streams.d", True),
        ("fabricwatch.streams.d", "fabricwatch.streams.c", True)}
    assert cycles(imports, known) == [["fabricwatch.models.a", "fabricwatch.models.b"]]
    assert layer_violations(imports, FORBIDDEN) == ["fabricwatch.models.b:1 imports grpc"]
    assert layer_violations(imports, {"fabricwatch.streams": ("fabricwatch.models",)}) == [
        "fabricwatch.streams.d:4 imports fabricwatch.models.a"]
