"""Resident trials: merged in place from cached factors, scored live, equal to mergekit-yaml's merges."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_weights

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.evaluation.base import ModelLoading
from mergekit_bmm.plugin.run import merge_options, merge_recipe_text
from mergekit_bmm.search import SearchOptions, parse_search_config, run_search
from mergekit_bmm.search.experiment import prepare_experiment
from mergekit_bmm.search.resident import ParameterLookup, ResidentModel

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent
BIN = Path(sys.executable).parent
EVALUATOR = {"type": "python", "callable": "search_objectives:per_task_scores", "python_path": [str(TESTS)]}


def family_of(tmp_path_factory, architecture: str):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    return make_tiny_family(
        tmp_path_factory.mktemp(architecture), architecture, n_experts=3, hidden=32, layers=2
    )


def search_config(family, dtype: str = "float32", **fields):
    recipe = {
        "merge_method": "bmm",
        "base_model": str(family.base),
        "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in family.experts],
        "parameters": {"anchor_method": "task_arithmetic"},
        "dtype": dtype,
    }
    raw = {"recipe": recipe, "blocks": 2, "evaluator": EVALUATOR, "lambda_range": [1e-3, 10.0]}
    raw["scale_range"] = [0.5, 1.5]
    return parse_search_config({**raw, **fields}, TESTS)


def solvable(base: Path) -> list[str]:
    from mergekit_bmm.core.module_map import classify
    from mergekit_bmm.io.model_folder import model_type_of

    model_type = model_type_of(base)
    return [
        name for name, tensor in load_weights(base).items() if tensor.ndim == 2 and classify(name, model_type)
    ]


def points(space, count: int, seed: int = 0) -> list[dict[str, float]]:
    from skopt.space import Space

    return [space.as_values(p) for p in Space(space.skopt_dimensions()).rvs(count, random_state=seed)]


def assert_equal_to_folder(resident: ResidentModel, folder: Path) -> int:
    """Every tensor of the merged folder equals the resident model's, exactly (in the file's dtype)."""
    lookup = ParameterLookup(resident.model)
    compared = 0
    for name, expected in load_weights(folder).items():
        live = lookup.get(name)
        if live is None:
            continue
        assert torch.equal(live.to(expected.dtype), expected), name
        compared += 1
    return compared


@pytest.mark.parametrize(
    ("architecture", "dtype", "loading"),
    [
        ("llama", "bfloat16", ModelLoading("auto", "float32")),
        ("qwen2", "float32", ModelLoading("auto", "float32")),
        ("gpt2", "float32", ModelLoading("AutoModel", "float32")),  # prefix-mapped names (transformer.)
        ("bert", "bfloat16", ModelLoading("AutoModel", "float32")),
    ],
)
def test_resident_trials_equal_mergekit_merges_tensor_for_tensor(
    tmp_path_factory, architecture, dtype, loading
):
    family = family_of(tmp_path_factory, architecture)
    work = tmp_path_factory.mktemp(f"{architecture}-work")
    experiment = prepare_experiment(search_config(family, dtype), work / "cache")
    options = merge_options(None, quiet=True, device="cpu")
    trials = points(experiment.space, 3, seed=1)
    resident = ResidentModel.load(
        experiment.recipes.text(trials[0]), experiment.base_model, experiment.space, loading, options
    )
    # GPT-2's c_attn is one solve: its q, k and v read one input (bmm's default `gram_sharing: input`)
    assert resident.plan.solved == len(solvable(family.base))
    for index, values in enumerate(trials):
        resident.apply(values)
        folder = work / f"trial-{index}"
        merge_recipe_text(experiment.recipes.text(values), folder, options)
        assert assert_equal_to_folder(resident, folder) >= resident.plan.solved


def test_the_stock_command_on_a_trial_file_rebuilds_the_scored_model(tmp_path_factory, tmp_path):
    family = family_of(tmp_path_factory, "llama")
    result = run_search(
        search_config(family, "bfloat16", strategy="random", budget=2, trials="memory"),
        tmp_path / "out",
        SearchOptions(progress=False, device="cpu", skip_best=True, plots=False),
    )
    assert result.summary.trials == "memory" and result.summary.memory_plan["solved"] == 14
    experiment = prepare_experiment(
        search_config(family, "bfloat16", strategy="random", budget=2), tmp_path / "out" / "cache"
    )
    options = merge_options(None, quiet=True, device="cpu")
    resident = ResidentModel.load(
        (tmp_path / "out" / result.records[0].yaml).read_text(),
        experiment.base_model,
        experiment.space,
        ModelLoading("auto", "float32"),
        options,
    )
    record = result.records[1]
    resident.apply(record.values)
    command = [str(BIN / "mergekit-yaml"), str(tmp_path / "out" / record.yaml), str(tmp_path / "stock")]
    done = subprocess.run([*command, "--no-copy-tokenizer"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert assert_equal_to_folder(resident, tmp_path / "stock") > 14


def test_memory_and_disk_trials_give_the_same_search(tmp_path_factory, tmp_path):
    """Same seed: the same points, the same scores; the second search reuses the first's cache."""
    family = family_of(tmp_path_factory, "llama")
    quiet = SearchOptions(progress=False, device="cpu", skip_best=True, plots=False)
    memory = run_search(search_config(family, strategy="bo", budget=6, n_initial=3), tmp_path / "m", quiet)
    disk = run_search(
        search_config(family, strategy="bo", budget=6, n_initial=3, trials="disk"), tmp_path / "d", quiet
    )
    assert memory.summary.trials == "memory" and disk.summary.trials == "disk"
    assert [r.values for r in memory.records] == [r.values for r in disk.records]
    assert [r.per_task for r in memory.records] == [r.per_task for r in disk.records]
    # streamed factors (a budget nothing fits in) give the same trials again
    streamed = run_search(
        search_config(family, strategy="bo", budget=6, n_initial=3),
        tmp_path / "s",
        SearchOptions(progress=False, device="cpu", skip_best=True, plots=False, max_memory=1),
    )
    plan = streamed.summary.memory_plan
    assert plan["streamed"] == plan["solved"] == 14
    # the Task Arithmetic anchors, which the cache does not store, stay in memory and are counted
    assert 0 < plan["resident_factor_bytes"] < plan["factor_bytes"]
    assert [r.per_task for r in streamed.records] == [r.per_task for r in disk.records]


def test_what_cannot_run_in_memory_runs_on_disk_and_says_why(tmp_path_factory, tmp_path):
    family = family_of(tmp_path_factory, "llama")
    folder_evaluator = {**EVALUATOR, "input": "folder"}
    notes: list[str] = []
    quiet = SearchOptions(progress=False, device="cpu", skip_best=True, plots=False)
    config = search_config(family, strategy="random", budget=1, evaluator=folder_evaluator)
    result = run_search(config, tmp_path / "folder", quiet, echo=notes.append)
    assert result.summary.trials == "disk"
    assert any("trials run on disk: the evaluator scores folders" in note for note in notes)
    with pytest.raises(ConfigError, match="trials: memory is not possible here: --no-cache"):
        run_search(
            search_config(family, strategy="random", budget=1, trials="memory"),
            tmp_path / "nocache",
            SearchOptions(progress=False, device="cpu", skip_best=True, plots=False, use_cache=False),
        )


def test_lm_eval_scores_a_live_model_as_it_scores_its_folder(tmp_path_factory, monkeypatch):
    from mergekit_bmm.evaluation.base import load_model, load_tokenizer
    from mergekit_bmm.evaluation.config import LMEvalEvaluatorConfig
    from mergekit_bmm.evaluation.lm_harness import LMEvalEvaluator

    family = family_of(tmp_path_factory, "llama")
    monkeypatch.chdir(TESTS.parent)  # the task YAML's data_files is relative to the working directory
    config = LMEvalEvaluatorConfig(
        type="lm_eval", tasks=["toy_choice"], include_path=str(TESTS / "fixtures" / "lm_eval"), limit=6
    )
    evaluator = LMEvalEvaluator(config, "cpu")
    live = evaluator.evaluate_model(
        load_model(family.base, "AutoModelForCausalLM", "cpu"), load_tokenizer(family.base)
    )
    assert live == evaluator.evaluate(family.base)
