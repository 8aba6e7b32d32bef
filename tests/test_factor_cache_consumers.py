"""The factor cache seen from its two users: ``mergekit-bmm-sample`` and ``mergekit-bmm-search``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from conftest import load_weights, relative_error

from mergekit_bmm.merge_methods.factor_cache.store import FactorCache
from mergekit_bmm.sampling.run import SamplingRequest, sample_models

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread_per_module")]  # conftest.py

TESTS = Path(__file__).parent
SCALE = 1.3


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    return make_tiny_family(tmp_path_factory.mktemp("cache-users"), "llama", n_experts=3, hidden=32, layers=2)


def recipe(family, **extra) -> dict:
    if "cache" in extra and extra.get("compute_dtype") != "float64":
        extra.setdefault("cache_dtype", "float32")  # samples held to rounding of the direct route
    return {
        "merge_method": "bmm",
        "base_model": str(family.base),
        "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in family.experts],
        "parameters": {"anchor_method": "task_arithmetic", "lambda": 0.05, "scale": SCALE, **extra},
        "dtype": "float32",
    }


def merge_options():
    from mergekit.options import MergeOptions

    return MergeOptions(quiet=True, write_model_card=False)


class CacheCounter:
    """Counts hits and misses of ``FactorCache.load_factors`` (the real method still runs)."""

    def __init__(self, monkeypatch):
        self.hits = self.misses = 0
        real = FactorCache.load_factors

        def counted(cache, *args, **kwargs):
            factors = real(cache, *args, **kwargs)
            if factors is None:
                self.misses += 1
            else:
                self.hits += 1
            return factors

        monkeypatch.setattr(FactorCache, "load_factors", counted)

    def take(self) -> tuple[int, int]:
        counts, self.hits, self.misses = (self.hits, self.misses), 0, 0
        return counts


def entries(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("*.safetensors"))


# float64 end to end: samples agree to rounding. float32: W is stored in float32 with
# |W| ≈ 10·|U| here, and the direct route solves in float32, so W − W_pre carries ~1e-5 of
# rounding either way (the cached MAP is the closer to a float64 solve: test_factor_cache).
@pytest.mark.parametrize("precision, tolerance", [("float64", 1e-10), ("float32", 3e-5)])
def test_sampling_with_a_cache_draws_the_same_samples(family, tmp_path, monkeypatch, precision, tolerance):
    """Same seed, same β: posterior samples with ``cache:`` (filling it, then reading it)
    equal those without, in every sampled tensor."""
    counter = CacheCounter(monkeypatch)
    request = SamplingRequest(2, beta=50.0, seed=3)

    def recipe_in(precision, **extra):
        return {**recipe(family, compute_dtype=precision, **extra), "dtype": precision}

    direct = sample_models(recipe_in(precision), tmp_path / "direct", request, merge_options())
    assert counter.take() == (0, 0)
    cache = tmp_path / "cache"
    filled = sample_models(
        recipe_in(precision, cache=str(cache)), tmp_path / "fill", request, merge_options()
    )
    solved = len(direct.tensors)
    assert solved == 2 * 7 and counter.take() == (0, solved)
    read = sample_models(recipe_in(precision, cache=str(cache)), tmp_path / "read", request, merge_options())
    assert counter.take() == (solved, 0)

    for summary in (filled, read):
        assert [t.name for t in summary.tensors] == [t.name for t in direct.tensors]
        for ours, theirs in zip(summary.tensors, direct.tensors):
            assert ours.ridge == pytest.approx(theirs.ridge, rel=1e-6)
            assert ours.noise_std == pytest.approx(theirs.noise_std, rel=1e-5)
    base = load_weights(family.base)
    for member in ("map", *direct.members):
        expected = load_weights(tmp_path / "direct" / member)
        for run in ("fill", "read"):
            got = load_weights(tmp_path / run / member)
            assert set(got) == set(expected)
            for tensor in direct.tensors:
                name = tensor.name
                error = relative_error(got[name] - base[name], expected[name] - base[name])
                assert error <= tolerance, (run, member, name, error)
    # the draws really are noisy (not the MAP), so the comparison above is of the noise too
    sample, map_ = (load_weights(tmp_path / "read" / folder)[name] for folder in ("sample-000", "map"))
    assert relative_error(sample - base[name], map_ - base[name]) > 0.01


def test_a_search_fills_the_cache_in_its_first_trial_and_reads_it_after(family, tmp_path, monkeypatch):
    from mergekit_bmm.search import SearchOptions, parse_search_config, run_search

    counter = CacheCounter(monkeypatch)
    evaluator = {
        "type": "python",
        "callable": "search_objectives:per_task_scores",
        "python_path": [str(TESTS)],
    }
    # float64, so that the last check compares the two routes, not float32's rounding at small λ
    template = {**recipe(family, compute_dtype="float64"), "dtype": "float64"}
    del template["parameters"]["lambda"], template["parameters"]["scale"]
    config = parse_search_config(
        {
            "recipe": template,
            "blocks": 1,
            "evaluator": evaluator,
            "strategy": "random",
            "budget": 3,
            "trials": "disk",
        },
        TESTS,
    )
    out = tmp_path / "out"
    seen: list[tuple[int, int]] = []

    from mergekit_bmm.plugin import run as recipe_run

    real_merge = recipe_run.merge_recipe_text

    def merge_and_count(*args, **kwargs):
        real_merge(*args, **kwargs)
        seen.append(counter.take())

    monkeypatch.setattr(recipe_run, "merge_recipe_text", merge_and_count)
    result = run_search(config, out, SearchOptions(progress=False, device="cpu", plots=False))
    assert result.summary.completed_trials == 3

    solved = 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
    # trials 0-2: the first trial builds every entry, every later one reads them; best/ is merged
    # from best.yml, which carries no machine-local cache path
    assert seen == [(0, solved), (solved, 0), (solved, 0), (0, 0)]
    cache_dir = out / "cache"
    factor_files = [p for p in entries(cache_dir) if "layers" in p.name]
    assert len(factor_files) == solved
    # nothing else: Task Arithmetic's embeddings / lm_head are recomputed, not stored
    assert len(entries(cache_dir)) == solved
    for path in (out / "trials").glob("*.yml"):
        assert yaml.safe_load(path.read_text())["parameters"]["cache"] == str(cache_dir)
    best = yaml.safe_load((out / "best.yml").read_text())
    assert "cache" not in best["parameters"]
    assert "cache" not in yaml.safe_load((out / "best" / "mergekit_config.yml").read_text())["parameters"]

    # best/ is mergekit-yaml best.yml bit for bit, and the scored (cached) trial to rounding
    real_merge((out / "best.yml").read_text(), tmp_path / "again")
    scored = (out / "trials" / f"trial-{result.summary.best_trial:04d}.yml").read_text()
    real_merge(scored, tmp_path / "scored")
    built, again, cached = (load_weights(p) for p in (out / "best", tmp_path / "again", tmp_path / "scored"))
    base = load_weights(family.base)
    assert all(torch.equal(built[name], again[name]) for name in built)
    solved_names = [name for name in built if "layers" in name and built[name].ndim == 2]
    assert len(solved_names) == solved
    for name in solved_names:
        assert relative_error(cached[name] - base[name], built[name] - base[name]) <= 1e-10, name
