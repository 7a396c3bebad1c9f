"""The shape of `services/phalanx`: sizes a reader can hold in mind, and imports that only run down the layers.

A file over 800 lines, a class over 500 or a function over 80 is a place where concerns have run together; a
package importing one of a layer above it (`launch` importing `cli`) makes the lower layer depend on the upper
one.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import phalanx

PACKAGE_ROOT = Path(phalanx.__file__).parent
GENERATED = "_proto"

MAX_FILE_LINES = 800
MAX_CLASS_LINES = 500
MAX_FUNCTION_LINES = 80

# Lowest first. A package may import its own layer and those below it. The services of layer 3 call one another
# (the router asks the encoder pool, the gateway the router); launch starts them; chaos, bench and the test
# helpers drive launched fleets; the CLI sits on top of everything.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"_proto", "client"}),
    frozenset({"common"}),
    frozenset({"model", "failover"}),
    frozenset({"worker", "expert_worker", "ert_manager", "router", "health", "migration", "checkpoint_store", "planner", "encoder_pool", "gateway"}),
    frozenset({"launch"}),
    frozenset({"chaos", "bench", "testing"}),
    frozenset({"cli"}),
)


@dataclass(frozen=True)
class Sized:
    name: str
    lines: int


def _sources() -> list[Path]:
    return sorted(path for path in PACKAGE_ROOT.rglob("*.py") if GENERATED not in path.relative_to(PACKAGE_ROOT).parts)


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE_ROOT).as_posix()


def _span(node: ast.AST) -> int:
    return (node.end_lineno or node.lineno) - node.lineno + 1  # type: ignore[attr-defined]


def _definitions(tree: ast.AST, prefix: str = "") -> list[tuple[str, ast.AST]]:
    """Every class and function with its qualified name (``Class.method``, ``function.inner``)."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            found.append((name, node))
            found += _definitions(node, f"{name}.")
        else:
            found += _definitions(node, prefix)
    return found


def measure() -> tuple[list[Sized], list[Sized], list[Sized]]:
    """Files, classes and functions over the limits, across the package."""
    files, classes, functions = [], [], []
    for path in _sources():
        source = path.read_text()
        relative = _relative(path)
        if source.count("\n") > MAX_FILE_LINES:
            files.append(Sized(relative, source.count("\n")))
        for name, node in _definitions(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and _span(node) > MAX_CLASS_LINES:
                classes.append(Sized(f"{relative}:{name}", _span(node)))
            elif not isinstance(node, ast.ClassDef) and _span(node) > MAX_FUNCTION_LINES:
                functions.append(Sized(f"{relative}:{name}", _span(node)))
    return files, classes, functions


def _layer(package: str) -> int | None:
    return next((index for index, layer in enumerate(LAYERS) if package in layer), None)


def upward_imports() -> set[tuple[str, str]]:
    """(importing package, imported package) for every import of a package in a higher layer."""
    found = set()
    for path in _sources():
        parts = path.relative_to(PACKAGE_ROOT).parts
        if len(parts) < 2:
            continue
        importer = parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                names = module.split(".")
                if names[0] != "phalanx" or len(names) < 2:
                    continue
                low, high = _layer(importer), _layer(names[1])
                if low is not None and high is not None and high > low:
                    found.add((importer, names[1]))
    return found


def _described(found: list[Sized], limit: int) -> list[str]:
    return [f"{item.name}: {item.lines} lines (limit {limit})" for item in found]


def test_every_package_has_a_layer() -> None:
    packages = {path.relative_to(PACKAGE_ROOT).parts[0] for path in PACKAGE_ROOT.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert sorted(package for package in packages if _layer(package) is None) == []


def test_no_file_class_or_function_is_over_its_limit() -> None:
    files, classes, functions = measure()
    assert _described(files, MAX_FILE_LINES) == []
    assert _described(classes, MAX_CLASS_LINES) == []
    assert _described(functions, MAX_FUNCTION_LINES) == []


def test_no_package_imports_one_of_a_layer_above_it() -> None:
    assert sorted(upward_imports()) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("class A:\n    def f(self):\n        pass\n", ["A", "A.f"]),
        ("def f():\n    def g():\n        pass\n", ["f", "f.g"]),
        ("if True:\n    class B:\n        async def h(self):\n            pass\n", ["B", "B.h"]),
    ],
)
def test_definitions_are_named_by_where_they_sit(source: str, expected: list[str]) -> None:
    assert [name for name, _ in _definitions(ast.parse(source))] == expected
