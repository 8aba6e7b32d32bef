"""mergekit-bmm-search end to end on tiny models: optimisation, resume after a kill, outputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mergekit_bmm.search import SearchOptions, parse_search_config, run_search

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent
BIN = Path(sys.executable).parent
GROUPS = ("attn_in", "attn_out", "mlp_in", "mlp_out")
TARGET = {"attn_in": 0.003, "attn_out": 0.03, "mlp_in": 0.01, "mlp_out": 0.1, "scale": 1.15}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny merges are latency-bound; one thread avoids oversubscribing a shared machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A very small Llama family: trials merge in a fraction of a second."""
    from mergekit_bmm.tiny_models import make_tiny_family

    return make_tiny_family(
        tmp_path_factory.mktemp("search-family"), "llama", n_experts=3, hidden=16, layers=2
    )


def recipe(family) -> dict:
    return {
        "merge_method": "bmm",
        "base_model": str(family.base),
        "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in family.experts],
        "parameters": {"anchor_method": "task_arithmetic", "gram": "data_free"},
        "dtype": "float32",
    }


def config_dict(family, evaluator: dict, **fields) -> dict:
    return {"recipe": recipe(family), "blocks": 1, "evaluator": evaluator, **fields}


def make_config(family, evaluator: dict, **fields):
    return parse_search_config(config_dict(family, evaluator, **fields), TESTS)


def python_evaluator(function: str, **args) -> dict:
    return {
        "type": "python",
        "callable": f"search_objectives:{function}",
        "python_path": [str(TESTS)],
        "args": args,
    }


@pytest.fixture(scope="module")
def target(family, tmp_path_factory):
    """The merge at the known optimum TARGET (1 block), made exactly as a trial is."""
    from mergekit_bmm.recipe import weight_names_of
    from mergekit_bmm.search.space import SearchSpace
    from mergekit_bmm.search.trial import TrialRecipes, merge_text

    config = make_config(family, python_evaluator("per_task_scores"))
    names = weight_names_of(str(family.base))
    space = SearchSpace.from_config(config, recipe(family), names)
    values = {f"block0.{key}": value for key, value in TARGET.items()}
    out = tmp_path_factory.mktemp("target") / "model"
    merge_text(TrialRecipes(recipe(family), space, names).text(values), out)
    return out


def quiet(**fields) -> SearchOptions:
    return SearchOptions(progress=False, device="cpu", **fields)


def test_bo_ends_closer_to_the_known_optimum_than_random_search(family, target, tmp_path):
    evaluator = python_evaluator("distance_to_target", target=str(target), base=str(family.base))
    best = {"bo": [], "random": []}
    for seed in (0, 1, 2):
        for strategy in best:
            config = make_config(
                family,
                evaluator,
                strategy=strategy,
                budget=25,
                n_initial=8,
                seed=seed,
                acq_optimizer="sampling",
            )
            result = run_search(config, tmp_path / f"{strategy}-{seed}", quiet(skip_best=True, plots=False))
            assert result.summary["completed_trials"] == 25
            best[strategy].append(result.summary["best_score"])
    mean = {strategy: sum(scores) / len(scores) for strategy, scores in best.items()}
    # scores are minus the relative distance to the optimum's weights: higher is closer
    assert mean["bo"] > mean["random"], best
    print("best score (minus relative weight distance to the optimum):", best)
