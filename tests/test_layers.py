"""The package's layout is its architecture: every kvproc module imports only from its own folder or a lower layer,
no private name crosses a module boundary, and the run-time import graph has no cycle (issue 16).

Layers, lowest first (a folder, or a root module):
    native <- contract <- core <- ipc <- runtime <- tiers <- workers <- store <- engine, integrations <- demo, bench <- cli
Imports under `if TYPE_CHECKING:` are types only and exempt from the layer and cycle rules (never from the private
name rule). Imports inside a function count for layers (they run), not for cycles (they run after both modules
loaded). `from kvproc import Name` (the public facade) counts as an import of the module that defines `Name`.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
from dataclasses import dataclass

import kvproc

ROOT = pathlib.Path(kvproc.__file__).parent

LAYERS: dict[str, int] = {
    "native": 0, "contract": 1, "core": 2, "ipc": 3, "runtime": 4, "tiers": 5, "workers": 6, "store": 7,
    "engine": 8, "integrations": 8, "demo": 9, "bench": 9, "check": 9, "cli": 10, "__main__": 11,
}


@dataclass(frozen=True)
class Import:
    src: str  # importing module
    dst: str  # imported module
    names: tuple[str, ...]
    in_function: bool
    type_only: bool
    line: int


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    rel = pathlib.Path(*name.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def _facade_source(name: str) -> str:
    return kvproc._EXPORTS.get(name, "kvproc")  # noqa: SLF001 (the test reads the facade's own table)


def _imports_of(path: pathlib.Path) -> list[Import]:
    src = _module_name(path)
    pkg = src if path.name == "__init__.py" else src.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), in_function, True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), in_function, type_only)
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True, type_only)
                continue
            if isinstance(child, ast.ImportFrom):
                module = child.module or ""
                if child.level:  # relative: resolve against this package
                    base = pkg.split(".")[: len(pkg.split(".")) - (child.level - 1)]
                    module = ".".join(base + ([module] if module else []))
                if module.split(".")[0] != "kvproc":
                    continue
                for alias in child.names:
                    if module == "kvproc" and not _is_module(f"kvproc.{alias.name}"):
                        dst = _facade_source(alias.name)
                    elif _is_module(f"{module}.{alias.name}"):
                        dst = f"{module}.{alias.name}"
                    else:
                        dst = module
                    found.append(Import(src, dst, (alias.name,), in_function, type_only, child.lineno))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "kvproc":
                        found.append(Import(src, alias.name, (), in_function, type_only, child.lineno))
            else:
                visit(child, in_function, type_only)

    visit(ast.parse(path.read_text(), str(path)), False, False)
    return found


def _all_imports() -> list[Import]:
    return [imp for path in sorted(ROOT.rglob("*.py")) for imp in _imports_of(path)]


def _layer(module: str) -> tuple[str, int]:
    parts = module.split(".")
    if len(parts) == 1:  # the facade itself
        return "kvproc", 99
    top = parts[1]
    assert top in LAYERS, f"{module}: folder or root module {top!r} has no layer; add it to LAYERS (and the docs)"
    return top, LAYERS[top]


def test_every_import_goes_to_the_same_folder_or_a_lower_layer() -> None:
    bad = []
    for imp in _all_imports():
        if imp.type_only or imp.src == "kvproc":
            continue
        (src_top, src_rank), (dst_top, dst_rank) = _layer(imp.src), _layer(imp.dst)
        if src_top != dst_top and dst_rank >= src_rank:
            bad.append(f"{imp.src}:{imp.line} imports {imp.dst} ({dst_top} is not below {src_top})")
    assert not bad, "\n".join(bad)


def test_no_private_name_is_imported_across_modules() -> None:
    bad = []
    for imp in _all_imports():
        for name in imp.names:
            if name.startswith("_") and not name.startswith("__") and imp.dst != imp.src:
                bad.append(f"{imp.src}:{imp.line} imports {name} from {imp.dst}")
    assert not bad, "\n".join(bad)


def test_the_run_time_import_graph_has_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for imp in _all_imports():
        if not imp.type_only and not imp.in_function and imp.dst != imp.src:
            graph.setdefault(imp.src, set()).add(imp.dst)
    # Tarjan's strongly connected components: any component of two or more modules is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    assert not cycles, f"run-time import cycles: {cycles}"


def test_every_public_name_is_importable_from_kvproc() -> None:
    for name in kvproc.__all__:
        assert getattr(kvproc, name) is getattr(importlib.import_module(kvproc._EXPORTS[name]), name)  # noqa: SLF001


def test_the_checker_sees_a_violation() -> None:
    """The control: a module of a low layer importing a high one, a private name and a cycle are all reported."""
    fake = [Import("kvproc.core.pool", "kvproc.store.kv_store", ("KvStore",), False, False, 1)]
    (src_top, src_rank), (dst_top, dst_rank) = _layer(fake[0].src), _layer(fake[0].dst)
    assert src_top != dst_top and dst_rank >= src_rank
    imports = _imports_of(ROOT / "core" / "pool.py")
    assert imports and all(i.src == "kvproc.core.pool" for i in imports)
