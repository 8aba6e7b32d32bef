"""Theorem 1's alignment check: cos_F, and ``mergekit-bmm-align`` on tiny models with synthetic statistics."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import load_weights

from mergekit_bmm.core.module_map import classify
from mergekit_bmm.errors import StatisticsError
from mergekit_bmm.io.fingerprint import model_fingerprint
from mergekit_bmm.stats.alignment import frobenius_cosine, gram_alignment
from mergekit_bmm.stats.store import StatsManifest, TaskStats, write_grams, write_manifest


def test_cosine_of_identical_grams_is_one():
    u = torch.randn(7, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    gram = u.T @ u
    assert frobenius_cosine(gram, gram) == pytest.approx(1.0, abs=1e-14)
    assert gram_alignment(gram, u) == pytest.approx(1.0, abs=1e-14)
    assert gram_alignment(3.5 * gram, 0.1 * u) == pytest.approx(1.0, abs=1e-14)  # scale-free


@pytest.mark.parametrize("shape", [(3, 6), (6, 3)])
def test_gram_alignment_matches_the_definition(shape):
    generator = torch.Generator().manual_seed(1)
    u = torch.randn(*shape, generator=generator, dtype=torch.float64)
    x = torch.randn(shape[1], 40, generator=generator, dtype=torch.float64)
    a = x @ x.T / 40
    b = u.T @ u
    expected = torch.trace(a.T @ b).item() / (a.norm().item() * b.norm().item())
    assert gram_alignment(a, u) == pytest.approx(expected, rel=1e-12)
    assert frobenius_cosine(a, b) == pytest.approx(expected, rel=1e-12)


def test_orthogonal_and_zero():
    u = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    assert gram_alignment(torch.diag(torch.tensor([0.0, 1.0])), u) == 0.0
    assert math.isnan(gram_alignment(torch.eye(2), torch.zeros(1, 2)))
    with pytest.raises(StatisticsError, match="another model"):
        gram_alignment(torch.eye(3), u)


@functools.lru_cache(maxsize=8)
def weights_of(path):
    return load_weights(path)


def write_stats(stats_dir, family, gram_of, experts=None, fingerprint_of=model_fingerprint):
    """A statistics directory whose Gram for every solved weight is gram_of(U_t)."""
    base = weights_of(family.base)
    experts = family.experts if experts is None else experts
    names = [n for n, t in base.items() if t.ndim == 2 and classify(n, "llama")]
    tasks = []
    for path in experts:
        weights = weights_of(path)
        grams = {name: gram_of(weights[name].double() - base[name].double()) for name in names}
        write_grams(stats_dir / "grams" / f"{path.name}.safetensors", grams)
        tasks.append(
            TaskStats(
                name=f"task-{path.name[-1]}",
                model=str(path),
                fingerprint=fingerprint_of(path),
                file=f"{path.name}.safetensors",
                samples=8,
                tokens=64,
            )
        )
    write_manifest(
        stats_dir,
        StatsManifest(format_version=1, package_version="test", tasks=tasks, modules={n: n for n in names}),
    )
    return names


def write_recipe(path, family):
    path.write_text(
        yaml.safe_dump(
            {
                "merge_method": "bmm",
                "base_model": str(family.base),
                "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in family.experts],
                "parameters": {"gram": "data_free"},
            }
        )
    )
    return path


@pytest.mark.slow
def test_align_command_reports_one_for_task_vector_grams(tiny_llama, tmp_path):
    from mergekit_bmm.cli.align import main

    names = write_stats(tmp_path / "stats", tiny_llama, lambda u: u.T @ u)
    recipe = write_recipe(tmp_path / "recipe.yml", tiny_llama)
    out = tmp_path / "report"
    result = CliRunner().invoke(main, [str(recipe), "--stats", str(tmp_path / "stats"), str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "task-a" in result.output and "mean over tasks" in result.output
    report = json.loads((out / "alignment.json").read_text())
    assert len(report["modules"]) == len(names) * 3
    assert all(row["cosine"] == pytest.approx(1.0, abs=1e-6) for row in report["modules"])
    assert [t["task"] for t in report["tasks"]] == ["task-a", "task-b", "task-c"]
    assert (out / "alignment.png").stat().st_size > 1000
    assert (out / "alignment.csv").read_text().count("\n") == len(names) * 3 + 1

    again = CliRunner().invoke(main, [str(recipe), "--stats", str(tmp_path / "stats"), str(out)])
    assert again.exit_code != 0 and "--force" in again.output


@pytest.mark.slow
def test_align_measures_real_alignment_and_refuses_foreign_statistics(tiny_llama, tmp_path):
    from mergekit_bmm.cli.align import main
    from mergekit_bmm.stats.alignment import alignment_rows, summarize

    # Gram of an unrelated random input distribution: cosine well below 1
    generator = torch.Generator().manual_seed(0)

    def random_gram(u):
        x = torch.randn(u.shape[1], 4 * u.shape[1], generator=generator, dtype=torch.float64)
        return x @ x.T / x.shape[1]

    write_stats(tmp_path / "stats", tiny_llama, random_gram)
    rows = alignment_rows(
        tmp_path / "stats", str(tiny_llama.base), [str(p) for p in tiny_llama.experts], progress=False
    )
    summaries = summarize(rows)
    assert all(0 < s.mean < 0.9 and s.min < s.max for s in summaries)

    recipe = write_recipe(tmp_path / "recipe.yml", tiny_llama)
    runner = CliRunner()

    def refused(stats):
        result = runner.invoke(main, [str(recipe), "--stats", str(stats), str(tmp_path / "r"), "--quiet"])
        assert result.exit_code != 0
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("mergekit-bmm: error:"), result.output
        return lines[0]

    # statistics made from other checkpoints (fingerprint of the base, not the expert)
    write_stats(
        tmp_path / "other",
        tiny_llama,
        lambda u: u.T @ u,
        fingerprint_of=lambda p: model_fingerprint(tiny_llama.base),
    )
    assert "different checkpoint" in refused(tmp_path / "other")
    # statistics that lack one of the recipe's experts
    write_stats(tmp_path / "partial", tiny_llama, lambda u: u.T @ u, experts=tiny_llama.experts[:2])
    assert "no task for model" in refused(tmp_path / "partial")
    # Grams of another width (another architecture under the same names)
    write_stats(tmp_path / "wide", tiny_llama, lambda u: torch.eye(u.shape[1] + 1))
    assert "but the weight has 128 inputs" in refused(tmp_path / "wide")
    assert "not a statistics directory" in refused(tmp_path / "missing")
