"""The package's shape: the mathematics works without mergekit; imports point down; docs links resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_math_imports_and_runs_where_mergekit_cannot_be_imported():
    code = """
import sys
sys.modules["mergekit"] = None  # any `import mergekit...` now raises ImportError
import torch
from mergekit_bmm.core import closed_form, module_map, normal_equations
from mergekit_bmm.core import ace, iso, regmean, tsv, wudi
vectors = [torch.randn(6, 5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
merged = closed_form.merge_matrix(normal_equations.data_free_equations(vectors), torch.zeros(6, 5), 0.1)
print(tuple(merged.shape), module_map.classify("model.layers.0.mlp.down_proj.weight").group.value,
      tuple(tsv.tsv_merge(vectors).shape), sorted(m for m in sys.modules if m.startswith("mergekit.")))
"""
    env = {**os.environ, "MERGEKIT_BMM_NO_AUTOLOAD": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["(6,", "5)", "mlp_out", "(6,", "5)", "[]"]


def _relative_links(markdown: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", markdown.read_text(encoding="utf-8"), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [link for link in links if not re.match(r"^[a-z]+:", link) and not link.startswith("#")]


def test_every_relative_link_in_the_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
    broken = []
    for page in pages:
        if not page.exists():
            broken.append(f"{page.relative_to(ROOT)} is missing")
            continue
        for link in _relative_links(page):
            target = (page.parent / link.split("#", 1)[0]).resolve()
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {link}")
    assert not broken, broken


def _imports(folder: str) -> set[str]:
    """The mergekit_bmm modules a folder's files import (at module level or inside functions)."""
    import ast

    found = set()
    for path in (ROOT / "mergekit_bmm" / folder).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mergekit_bmm"):
                found.add(node.module)
    return found


# The pipeline from the bottom up (docs/development.md): a module imports only from its own
# folder or one below it.
PIPELINE = (
    "errors", "io", "devices", "core", "anchors", "recipes", "stats", "evaluation", "merge_methods",
    "cards", "sampling", "plugin", "adapters", "search", "examples", "ensemble", "cli",
)  # fmt: skip


def test_every_import_points_down_the_pipeline_and_no_file_is_long():
    import ast

    package = ROOT / "mergekit_bmm"
    rank = {name: index for index, name in enumerate(PIPELINE)}
    upward, long_files = [], []
    for path in package.rglob("*.py"):
        here = path.relative_to(package).parts[0].removesuffix(".py")
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > 450:
            long_files.append(path.name)
        if here == "__init__":
            continue
        assert here in rank, f"{here} is not in the pipeline order of this test and docs/development.md"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mergekit_bmm."):
                there = node.module.split(".")[1]
                if rank.get(there, -1) > rank[here]:
                    upward.append(f"{path.relative_to(package)} imports {node.module}")
    assert not upward and not long_files, (upward, long_files)
    assert not {m for m in _imports("core") if not m.startswith(("mergekit_bmm.core", "mergekit_bmm.errors"))}
    search = {}
    for name in ("trials", "workers"):
        tree = ast.parse((package / "search" / f"{name}.py").read_text(encoding="utf-8"))
        search[name] = {
            node.module.rsplit(".", 1)[-1]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mergekit_bmm.search.")
        }
        assert not search[name] & {"pools", "ray_pool"}, (name, search[name])
    assert not search["trials"] & {"workers", "resident"}  # resident trials build on trials, not back


def test_the_search_reads_as_a_short_list_of_modules_each_saying_its_job():
    import ast

    modules = sorted((ROOT / "mergekit_bmm" / "search").glob("*.py"))
    assert len(modules) <= 17  # 16 and __init__
    for path in modules:
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        assert docstring and len(docstring.splitlines()[0]) <= 110, path.name


@pytest.mark.parametrize(
    ("old_import", "new_module", "warning"),
    [
        (
            "from mergekit_bmm.anchors import tsv_merge as f",
            "mergekit_bmm.core.tsv",
            "moved to mergekit_bmm.core",
        ),
        (
            "from mergekit_bmm.core import closed_form; f = closed_form.data_free_equations",
            "mergekit_bmm.core.normal_equations",
            "moved to mergekit_bmm.core.normal_equations.data_free_equations",
        ),
    ],
)
def test_an_old_import_path_still_works_and_says_where_it_moved(old_import, new_module, warning):
    code = f"import warnings; warnings.simplefilter('always'); {old_import}; print(f.__module__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == new_module
    assert warning in result.stderr
