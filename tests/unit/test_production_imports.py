"""Production code never imports `phalanx.testing`: launchers that `phalanx up` and the tests share live in `phalanx.launch`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import phalanx

PACKAGE_ROOT = Path(phalanx.__file__).parent
TEST_ONLY = "phalanx.testing"
# Test helpers themselves, and generated stubs that no one edits by hand.
EXCLUDED = (TEST_ONLY, "phalanx._proto")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_test_only(module: str) -> bool:
    return _is_under(module, TEST_ONLY)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module an ``from … import`` names, relative forms (``from ..testing import x``) included."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def find_imports_of(package: str, source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of ``package`` (or a module in it) in ``source``, as written."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {alias.name}" for alias in node.names if _is_under(alias.name, package)]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node, module, is_package)
            if _is_under(target, package) or any(_is_under(f"{target}.{alias.name}", package) for alias in node.names):
                found.append(f"from {'.' * node.level}{node.module or ''} import {', '.join(a.name for a in node.names)}")
    return found


def find_testing_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of ``phalanx.testing`` (or a module in it) in ``source``, as written."""
    return find_imports_of(TEST_ONLY, source, module, is_package)


def _production_modules() -> list[Path]:
    return sorted(
        path for path in PACKAGE_ROOT.rglob("*.py") if not any(_is_under(_module_name(path), excluded) for excluded in EXCLUDED)
    )


def test_no_production_module_imports_phalanx_testing() -> None:
    modules = _production_modules()
    assert PACKAGE_ROOT / "cli" / "up.py" in modules, "the walk must cover the CLI"
    offenders = {
        _module_name(path): imports
        for path in modules
        if (imports := find_testing_imports(path.read_text(), _module_name(path), is_package=path.name == "__init__.py"))
    }
    assert offenders == {}, f"production modules import {TEST_ONLY}: {offenders}"


@pytest.mark.parametrize(
    "source",
    [
        "import phalanx.testing",
        "import phalanx.testing.asserts as asserts",
        "from phalanx.testing import asserts",
        "from phalanx.testing.asserts import assert_eventually",
        "from phalanx import testing",
        "from phalanx import client, testing",
        "from ..testing import asserts",
        "from ..testing.asserts import assert_eventually",
        "from .. import testing",
        "def later():\n    from phalanx.testing.asserts import assert_eventually",
        "if TYPE_CHECKING:\n    import phalanx.testing.cleanup",
    ],
)
def test_every_import_form_is_caught(source: str) -> None:
    assert find_testing_imports(source, "phalanx.cli.up") != []


@pytest.mark.parametrize(
    "source",
    [
        "import phalanx.launch.infra",
        "from phalanx.launch.stack import Stack",
        "from phalanx import launch",
        "from phalanx.testing_tools import x",
        "from . import testing",  # phalanx.cli.testing, not phalanx.testing
        "import testing",
    ],
)
def test_other_imports_pass(source: str) -> None:
    assert find_testing_imports(source, "phalanx.cli.up") == []


# A layer imports only those below it: the launchers know nothing of the command line that drives them, the planner
# nothing of the launchers that start its processes.
LOWER_LAYERS = [("phalanx.launch", "phalanx.cli"), ("phalanx.planner", "phalanx.launch"), ("phalanx.planner", "phalanx.cli")]


@pytest.mark.parametrize(("layer", "above"), LOWER_LAYERS)
def test_no_module_imports_a_layer_above_its_own(layer: str, above: str) -> None:
    modules = [path for path in _production_modules() if _is_under(_module_name(path), layer)]
    assert modules, f"the walk must cover {layer}"
    offenders = {
        _module_name(path): imports
        for path in modules
        if (imports := find_imports_of(above, path.read_text(), _module_name(path), is_package=path.name == "__init__.py"))
    }
    assert offenders == {}, f"{layer} imports {above}: {offenders}"
