"""Test modules import their helpers the way CI's bare `pytest` can resolve them.

CI runs `pytest` (the console script), whose default import mode puts each test file's directory and
tests/ (via conftest.py) on sys.path, but not the repository root. `from tests.probes import X`
therefore works under `python -m pytest` (which adds the working directory) and fails in CI with
ModuleNotFoundError: No module named 'tests' (stop 84). Helpers are imported by their own name
(`from probes import X`).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def package_imports(source: str) -> list[str]:
    """The `tests` / `tests.x` imports in one module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [name for name in names if name == "tests" or name.startswith("tests.")]
    return found


def test_no_test_module_imports_the_tests_package():
    offenders = {
        str(path.relative_to(TESTS)): hits
        for path in sorted(TESTS.rglob("*.py"))
        if (hits := package_imports(path.read_text()))
    }
    assert not offenders, f"import helpers by their own name (from probes import X), not via tests.: {offenders}"


def test_a_planted_package_import_is_caught():
    assert package_imports("from tests.probes import LargestOutput\n") == ["tests.probes"]
    assert package_imports("import tests.probes as p\n") == ["tests.probes"]
    assert package_imports("from probes import LargestOutput\nfrom . import x\n") == []
