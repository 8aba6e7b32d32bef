"""``lambda: auto`` through real merges: each weight solved at the λ its evidence maximises (checked
against a float64 scan of the Gaussian likelihood), the same through the factor cache and the
search's resident trials, recorded in the merge record and the card."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from conftest import load_weights, reference_solve, relative_error
from search_objectives import EVALUATOR

from mergekit_bmm.cards.merge_record import read_record
from mergekit_bmm.core.module_map import classify
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.examples.synthetic_stats import stats_for_family
from mergekit_bmm.plugin.run import merge_recipe_text

F64 = torch.float64


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    return make_tiny_family(tmp_path_factory.mktemp("auto"), "llama", n_experts=3, hidden=32, layers=2)


def _recipe(family, **parameters) -> str:
    recipe = {
        "merge_method": "bmm",
        "base_model": str(family.base),
        "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in family.experts],
        "parameters": {"anchor_method": "task_arithmetic", "lambda": "auto", **parameters},
        "dtype": "float32",
    }
    return yaml.safe_dump(recipe)


def _solved(weights: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, t in weights.items() if t.ndim == 2 and classify(name, "llama")]


READ_TOGETHER = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _inputs(experts, base, name: str) -> list[torch.Tensor]:
    """Each task's data-free observations of ``name``'s input under the default ``gram_sharing:
    input``: ``X_t = [U_t^pᵀ]`` over the weights that read it (q/k/v, gate/up), else ``U_tᵀ``."""
    module, projection = name.rsplit(".", 2)[0], name.split(".")[-2]
    group = next((g for g in READ_TOGETHER if projection in g), (projection,))
    names = [f"{module}.{p}.weight" for p in group]
    return [torch.cat([(e[n].double() - base[n].double()).T for n in names], dim=1) for e in experts]


def _log_evidence(vectors, anchor, lam: float, inputs) -> float:
    """float64 log p(Y | λ) with σ² at its maximiser, data-free (``inputs``: each task's ``X_t``),
    every row at once."""
    x = torch.cat(inputs, dim=1)
    gram = x @ x.T
    ridge = lam * float(gram.trace()) / gram.shape[0]
    n, rows = x.shape[1], anchor.shape[0]
    residual = torch.cat([(u - anchor) @ x_t for u, x_t in zip(vectors, inputs)], dim=1)
    covariance = torch.eye(n, dtype=F64) + x.T @ x / ridge
    quadratic = float((residual @ torch.linalg.solve(covariance, residual.T)).trace())
    log_det = float(torch.linalg.slogdet(covariance)[1])
    sigma2 = quadratic / (rows * n)
    return -0.5 * (rows * n * (math.log(2 * math.pi * sigma2) + 1) + rows * log_det)


def test_each_weight_is_solved_at_the_lambda_its_evidence_maximises(family, tmp_path):
    out = tmp_path / "merged"
    merge_recipe_text(_recipe(family, compute_dtype="float64"), out)  # the solve exact; the choice is checked
    record = read_record(out)
    merged, base = load_weights(out), load_weights(family.base)
    experts = [load_weights(path) for path in family.experts]
    names = _solved(base)
    assert sorted(record.lambda_auto) == sorted(names)
    for index, name in enumerate(names):
        vectors = [e[name].double() - base[name].double() for e in experts]
        anchor = 0.3 * sum(vectors)
        chosen = record.lambda_auto[name]
        lam = chosen["lambda"]
        assert chosen["interval"][0] <= lam <= chosen["interval"][1]
        inputs = _inputs(experts, base, name)
        expected = reference_solve(vectors, anchor, lam, [x @ x.T for x in inputs])
        assert relative_error(merged[name].double() - base[name].double(), expected) < 1e-5, name
        if index < 2:  # the choice itself, against a scan of the likelihood (two weights: it is slow)
            grid = torch.logspace(-4, 4, 161, dtype=F64).tolist()
            best = max(grid, key=lambda value: _log_evidence(vectors, anchor, value, inputs))
            assert abs(math.log10(lam) - math.log10(best)) <= 0.026, (name, lam, best)
    card = (out / "README.md").read_text()
    assert "λ chosen by the evidence" in card and "| mlp_in |" in card


def test_the_cache_chooses_the_same_lambdas_and_a_second_merge_reads_them(family, tmp_path):
    direct, cached, again = tmp_path / "direct", tmp_path / "cached", tmp_path / "again"
    merge_recipe_text(_recipe(family), direct)
    merge_recipe_text(_recipe(family, cache=str(tmp_path / "cache")), cached)
    merge_recipe_text(_recipe(family, cache=str(tmp_path / "cache")), again)
    chosen = {path: read_record(path).lambda_auto for path in (direct, cached, again)}
    for name, choice in chosen[direct].items():
        assert chosen[cached][name]["lambda"] == pytest.approx(choice["lambda"], rel=1e-6)
    assert chosen[again] == chosen[cached]
    a, b, c = load_weights(direct), load_weights(cached), load_weights(again)
    for name in _solved(a):
        assert relative_error(b[name], a[name]) < 1e-5
        assert torch.equal(b[name], c[name])


def test_data_assisted_auto_counts_the_statistics_tokens(family, tmp_path):
    stats, _ = stats_for_family(tmp_path / "stats", family)
    out = tmp_path / "merged"
    merge_recipe_text(_recipe(family, gram="activations", stats=str(stats)), out)
    chosen = read_record(out).lambda_auto
    assert chosen and all(c["edge"] in (None, "low", "high") for c in chosen.values())
    manifest = json.loads((stats / "manifest.json").read_text())
    for task in manifest["tasks"]:  # statistics without token counts cannot tell how many observations
        task["tokens"] = 0
    (stats / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="lambda: auto` needs the number of observations"):
        merge_recipe_text(_recipe(family, gram="activations", stats=str(stats)), tmp_path / "blind")


def test_a_word_other_than_auto_is_one_line(family, tmp_path):
    with pytest.raises(ConfigError, match="lambda`: 'automatic' is not a valid number >= 0, or auto"):
        merge_recipe_text(_recipe(family, **{"lambda": "automatic"}), tmp_path / "x")


def test_a_search_over_scale_only_keeps_auto_and_resident_trials_equal_disk_merges(family, tmp_path):
    from mergekit_bmm.search import SearchOptions, parse_search_config, run_search

    tests = Path(__file__).parent
    raw = {
        "recipe": yaml.safe_load(_recipe(family)),
        "blocks": 1,
        "groups": [],
        "scale_range": [0.5, 1.5],
        "budget": 3,
        "n_initial": 3,
        "trials": "memory",
        "evaluator": EVALUATOR,
    }
    config = parse_search_config(raw, tests)
    result = run_search(config, tmp_path / "search", SearchOptions(progress=False, device="cpu", plots=False))
    assert result.summary.status == "finished" and result.summary.trials == "memory"
    best = yaml.safe_load((tmp_path / "search" / "best.yml").read_text())
    lambdas = [p["value"] for s in best["slices"] for p in s["parameters"]["lambda"]]
    assert lambdas and set(lambdas) == {"auto"}
    disk = tmp_path / "disk"
    merge_recipe_text((tmp_path / "search" / "best.yml").read_text(), disk)
    searched = load_weights(tmp_path / "search" / "best")
    for name in _solved(searched):
        assert relative_error(searched[name], load_weights(disk)[name]) < 1e-6


def test_nothing_to_search_is_one_line(family, tmp_path):
    from mergekit_bmm.search import SearchOptions, parse_search_config, run_search

    raw = {
        "recipe": yaml.safe_load(_recipe(family)),
        "groups": [],
        "scale_range": None,
        "blocks": 1,
        "budget": 2,
        "n_initial": 2,
        "evaluator": {"type": "python", "callable": "search_objectives:per_task_scores"},
    }
    with pytest.raises(ConfigError, match="nothing to search"):
        config = parse_search_config(raw, Path(__file__).parent)
        run_search(config, tmp_path / "s", SearchOptions(progress=False))
