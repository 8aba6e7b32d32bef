"""search.yml validation and the search space: refusals are one clear line, before any merge."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.search import parse_search_config
from mergekit_bmm.search.space import SearchSpace
from mergekit_bmm.search.strategies import SkoptProposer

EVALUATOR = {"type": "python", "callable": "search_objectives:per_task_scores"}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    return make_tiny_family(tmp_path_factory.mktemp("cfg"), "llama", n_experts=2, hidden=16, layers=4)


def recipe(family, **parameters) -> dict:
    return {
        "merge_method": "bmm",
        "base_model": str(family.base),
        "models": [{"model": str(p), "parameters": {"weight": 0.5}} for p in family.experts],
        "parameters": {"anchor_method": "task_arithmetic", **parameters},
        "dtype": "float32",
    }


def write(tmp_path: Path, family, **fields) -> Path:
    data = {"recipe": recipe(family), "evaluator": EVALUATOR, **fields}
    path = tmp_path / "search.yml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"groups": ["attn_in", "mlp_gate"]}, "`groups`: unknown group 'mlp_gate'; use attn_in, attn_out"),
        ({"lambda_range": [0.1, 0.1]}, "`lambda_range`: empty range [0.1, 0.1]"),
        ({"scale_range": [1.3, 1.0]}, "`scale_range`: inverted range [1.3, 1.0]"),
        ({"lambda_range": [0, 1]}, "must be > 0"),
        ({"budget": 5, "n_initial": 10}, "budget (5) is smaller than n_initial (10)"),
        ({"lamda_range": [1e-3, 1]}, "`lamda_range`: unknown field"),
        (
            {"evaluator": {"callable": "a:b"}},
            "evaluator needs `type:` python, lm_eval, classification or agreement",
        ),
        (
            {"recipe": {"merge_method": "ties", "base_model": "/x", "models": [{"model": "/y"}]}},
            "merge_method is 'ties'",
        ),
        ({"blocks": 9}, "blocks is 9 but the base model has 4 layers"),
        ({"epsilon_range": [0.1, 0.9]}, "epsilon_range is set but the recipe's gram is 'data_free'"),
        ({"evaluator": {"type": "python", "callable": "nowhere_module:f"}}, "cannot import 'nowhere_module'"),
        ({"strategy": "annealing"}, "`strategy`: Input should be 'bo', 'random' or 'grid'"),
    ],
)
def test_bad_search_configs_are_refused_with_one_line(family, tmp_path, fields, message):
    from click.testing import CliRunner

    from mergekit_bmm.cli.search import main

    result = CliRunner().invoke(main, [str(write(tmp_path, family, **fields)), str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mergekit-bmm: error: "), lines
    assert message in lines[0]
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_without_a_gpu_is_one_line(family, tmp_path):
    from click.testing import CliRunner

    from mergekit_bmm.cli.search import main

    args = [str(write(tmp_path, family)), str(tmp_path / "out"), "--device", "cuda"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "--device cpu" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_defaults_and_relative_paths(family, tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "r.yml").write_text(yaml.safe_dump(recipe(family)))
    raw = {"recipe": "recipes/r.yml", "evaluator": {**EVALUATOR, "python_path": ["lib"]}}
    config = parse_search_config(raw, tmp_path)
    assert config.recipe == str(tmp_path / "recipes" / "r.yml")
    assert config.evaluator.python_path == [str(tmp_path / "lib")]
    assert (config.blocks, config.budget, config.n_initial, config.strategy, config.acquisition) == (
        3,
        60,
        10,
        "bo",
        "EI",
    )
    # the box follows the recipe's Gram mode unless given (docs/search.md, "Search boxes")
    from mergekit_bmm.search.config import DEFAULT_BOXES

    assert config.lambda_range is None and config.scale_range == "auto"
    for gram in ("data_free", "activations", "mix"):
        assert config.box(gram) == DEFAULT_BOXES[gram]
    assert DEFAULT_BOXES["activations"][1][0] < DEFAULT_BOXES["data_free"][1][0]  # s reaches lower (sweeps)
    fixed = parse_search_config({**raw, "lambda_range": [1e-4, 1], "scale_range": None}, tmp_path)
    assert fixed.box("activations") == ((1e-4, 1.0), None)
    # PyYAML reads 1e-4 as a string; it still validates as a number
    assert parse_search_config({**raw, "lambda_range": ["1e-4", "1"]}, tmp_path).lambda_range == (1e-4, 1.0)
    with pytest.raises(ConfigError, match=r"mixing weight in \[0, 1\]"):
        parse_search_config({**raw, "epsilon_range": [0.5, 1.5]}, tmp_path)


def test_space_is_5b_or_6b_dimensional_and_maps_to_block_settings(family, tmp_path):
    from mergekit_bmm.io.model_folder import weight_names_of

    names = weight_names_of(str(family.base))
    mix = recipe(family, gram="mix", stats="/stats")
    config = parse_search_config(
        {"recipe": mix, "evaluator": EVALUATOR, "blocks": 2, "epsilon_range": [0.2, 0.8]}, tmp_path
    )
    space = SearchSpace.from_config(config, mix, names)
    assert len(space.names) == 12  # 6B
    assert space.names[:6] == [
        "block0.attn_in",
        "block0.attn_out",
        "block0.mlp_in",
        "block0.mlp_out",
        "block0.scale",
        "block0.epsilon",
    ]
    dims = space.skopt_dimensions()
    assert dims[0].prior == "log-uniform" and dims[4].prior == "uniform" and dims[5].bounds == (0.2, 0.8)
    values = {name: 0.01 * (i + 1) for i, name in enumerate(space.names)}
    settings = space.settings(values)
    assert [(s.start, s.end) for s in settings] == [(0, 2), (2, 4)]
    assert settings[1].lambdas == {"attn_in": 0.07, "attn_out": 0.08, "mlp_in": 0.09, "mlp_out": 0.1}
    assert settings[1].scale == pytest.approx(0.11) and settings[1].extra == {"epsilon": 0.12}

    tied = recipe(family, **{"lambda": 0.25})
    config = parse_search_config(
        {
            "recipe": tied,
            "evaluator": EVALUATOR,
            "blocks": 1,
            "groups": ["attn_in+attn_out"],
            "scale_range": None,
        },
        tmp_path,
    )
    space = SearchSpace.from_config(config, tied, names)
    assert space.names == ["block0.attn_in+attn_out"]
    (block,) = space.settings({"block0.attn_in+attn_out": 0.003})
    # unsearched groups keep the recipe's λ, and s its scale (default 1)
    assert block.lambdas == {"attn_in": 0.003, "attn_out": 0.003, "mlp_in": 0.25, "mlp_out": 0.25}
    assert block.scale == 1.0


def test_same_seed_same_proposals_and_failures_told_as_the_worst_score(family, tmp_path):
    from mergekit_bmm.io.model_folder import weight_names_of

    config = parse_search_config(
        {
            "recipe": recipe(family),
            "evaluator": EVALUATOR,
            "blocks": 1,
            "n_initial": 3,
            "budget": 6,
            "acq_optimizer": "sampling",
        },
        tmp_path,
    )
    space = SearchSpace.from_config(config, recipe(family), weight_names_of(str(family.base)))

    def run(scores):
        proposer, asked = SkoptProposer(space, config), []
        for score in scores:
            asked.append(proposer.ask())
            proposer.tell(asked[-1], score)
        return proposer, asked

    scores = [None, 0.5, 0.2, None, 0.9]
    first, asked = run(scores)
    second, again = run(scores)
    assert asked == again and first.ask() == second.ask()
    # a failure before any success takes the first successful score; later ones the worst so far
    assert first.optimizer.yi == [-0.5, -0.5, -0.2, -0.2, -0.9]


def test_trial_recipes_carry_the_cache_when_given_one(family, tmp_path):
    from mergekit.merge_methods import registry

    from mergekit_bmm.io.model_folder import weight_names_of
    from mergekit_bmm.search.space import TrialRecipes

    names = weight_names_of(str(family.base))
    config = parse_search_config({"recipe": recipe(family), "evaluator": EVALUATOR, "blocks": 2}, tmp_path)
    space = SearchSpace.from_config(config, recipe(family), names)
    values = dict.fromkeys(space.names, 0.1)
    cached = yaml.safe_load(TrialRecipes(recipe(family), space, names, tmp_path / "cache").text(values))
    assert cached["parameters"]["cache"] == str(tmp_path / "cache")
    plain = yaml.safe_load(TrialRecipes(recipe(family), space, names).text(values))
    assert "cache" not in plain["parameters"] and len(plain["slices"]) == 2
    declared = {parameter.name for parameter in registry.get("bmm").spec.parameters}
    assert "cache" in declared
