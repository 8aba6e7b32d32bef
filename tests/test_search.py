"""mergekit-bmm-search end to end on tiny models: optimisation, resume after a kill, outputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mergekit_bmm.search import SearchOptions, parse_search_config, run_search
from mergekit_bmm.search.log import read_trials

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread_per_module")]  # conftest.py

TESTS = Path(__file__).parent
BIN = Path(sys.executable).parent
GROUPS = ("attn_in", "attn_out", "mlp_in", "mlp_out")
TARGET = {"attn_in": 0.003, "attn_out": 0.03, "mlp_in": 0.01, "mlp_out": 0.1, "scale": 1.15}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A very small Llama family: trials merge in a fraction of a second."""
    from mergekit_bmm.examples.tiny_models import make_tiny_family

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


def python_evaluator(function: str, folder: bool = False, **args) -> dict:
    return {
        "type": "python",
        "callable": f"search_objectives:{function}",
        "python_path": [str(TESTS)],
        "args": args,
        **({"input": "folder"} if folder else {}),
    }


@pytest.fixture(scope="module")
def target(family, tmp_path_factory):
    """The merge at the known optimum TARGET (1 block), made exactly as a trial is."""
    from mergekit_bmm.io.model_folder import weight_names_of
    from mergekit_bmm.plugin.run import merge_recipe_text as merge_text
    from mergekit_bmm.search.space import SearchSpace, TrialRecipes

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
            assert result.summary.completed_trials == 25
            best[strategy].append(result.summary.best_score)
    mean = {strategy: sum(scores) / len(scores) for strategy, scores in best.items()}
    # scores are minus the relative distance to the optimum's weights: higher is closer
    assert mean["bo"] > mean["random"], best
    print("best score (minus relative weight distance to the optimum):", best)


def test_the_first_trial_starts_at_the_anchor(family, tmp_path):
    """BO and random search first try the box's point nearest the anchor (every λ at the top of
    its range, s = 1); not over the pretrained anchor, nor with ``anchor_start: false``."""
    evaluator = python_evaluator("per_task_scores")
    nearest = {f"block0.{group}": 1000.0 for group in ("attn_in", "attn_out", "mlp_in", "mlp_out")}
    nearest["block0.scale"] = 1.0
    for strategy in ("bo", "random"):
        config = make_config(family, evaluator, strategy=strategy, budget=2, n_initial=2)
        told = []  # the Python hook: every finished trial, in order
        result = run_search(
            config, tmp_path / strategy, quiet(skip_best=True, plots=False, on_trial=told.append)
        )
        assert [record.trial for record in told] == [record.trial for record in result.records]
        assert result.records[0].values == nearest and result.records[1].values != nearest

    off = make_config(family, evaluator, budget=1, n_initial=1, anchor_start=False)
    assert run_search(off, tmp_path / "off", quiet(skip_best=True, plots=False)).records[0].values != nearest
    pretrained = config_dict(family, evaluator, budget=1, n_initial=1)
    pretrained["recipe"]["parameters"]["anchor_method"] = "pretrained"
    config = parse_search_config(pretrained, TESTS)
    result = run_search(config, tmp_path / "pretrained", quiet(skip_best=True, plots=False))
    assert result.records[0].values != nearest


def test_a_search_resumes_in_the_box_it_began_in(family, tmp_path, monkeypatch):
    """A search records the box it began in and resumes there, even where today's default box
    differs (the data-free default λ box once ended at 10)."""
    from mergekit_bmm.search import config as search_config

    evaluator = python_evaluator("per_task_scores")
    fresh = run_search(
        make_config(family, evaluator, budget=1, n_initial=1), tmp_path / "new", quiet(skip_best=True)
    )
    assert fresh.summary.lambda_range == [1e-3, 1000.0]
    assert json.loads((tmp_path / "new" / "experiment.json").read_text())["box"]["lambda"] == [1e-3, 1000.0]

    out = tmp_path / "earlier"
    earlier = dict(search_config.DEFAULT_BOXES, data_free=((1e-3, 10.0), (0.8, 2.2)))
    with monkeypatch.context() as patch:  # the version that began this search
        patch.setattr(search_config, "DEFAULT_BOXES", earlier)
        begun = make_config(family, evaluator, budget=3, n_initial=3, widen_box=False)
        run_search(begun, out, quiet(skip_best=True))
    assert json.loads((out / "experiment.json").read_text())["box"]["lambda"] == [1e-3, 10.0]

    notes: list[str] = []
    config = make_config(family, evaluator, budget=6, n_initial=3, widen_box=False)
    result = run_search(config, out, quiet(skip_best=True), echo=notes.append)
    assert result.summary.completed_trials == 6 and result.summary.lambda_range == [1e-3, 10.0]
    assert all(v <= 10.0 for r in result.records for k, v in r.values.items() if k != "block0.scale")
    assert any("began with lambda in [0.001, 10]" in note for note in notes), notes


def read_records(out: Path):
    records, _ = read_trials(out / "trials.jsonl")
    return records


def test_resume_after_sigkill_gives_exactly_k_trials_and_the_same_proposals(family, target, tmp_path):
    """Kill a real search process mid-run, resume it, and compare with an uninterrupted run."""
    evaluator = python_evaluator("distance_to_target", target=str(target), base=str(family.base))
    fields = {"budget": 8, "n_initial": 4, "seed": 7, "acq_optimizer": "sampling"}
    search_file = tmp_path / "search.yml"
    search_file.write_text(yaml.safe_dump(config_dict(family, evaluator, **fields)))
    out = tmp_path / "killed"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [str(BIN / "mergekit-bmm-search"), str(search_file), str(out), "--quiet"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if len(read_records(out)) >= 3:
            break
        time.sleep(0.05)
    assert process.poll() is None, process.stderr.read().decode()[-2000:]
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = len(read_records(out))
    assert 3 <= killed_at < 8

    config = make_config(family, evaluator, **fields)
    resumed = run_search(config, out, quiet())
    assert resumed.replayed == killed_at
    records = read_records(out)
    assert [r.trial for r in records] == list(range(8))
    assert len({tuple(r.values.values()) for r in records}) == 8
    assert resumed.summary.completed_trials == 8

    fresh = run_search(config, tmp_path / "fresh", quiet(skip_best=True, plots=False))
    assert [r.values for r in fresh.records] == [r.values for r in records]
    assert [r.score for r in fresh.records] == [r.score for r in records]

    # best.yml through the stock command rebuilds best/ bit for bit
    assert resumed.summary.best_recipe == "best.yml" and resumed.summary.best_model == "best"
    rebuilt = tmp_path / "rebuilt"
    stock = subprocess.run(
        [str(BIN / "mergekit-yaml"), str(out / "best.yml"), str(rebuilt)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert stock.returncode == 0, stock.stderr[-2000:]
    weights = sorted(p.name for p in (out / "best").glob("*.safetensors"))
    assert weights and weights == sorted(p.name for p in rebuilt.glob("*.safetensors"))
    for name in weights + ["config.json"]:
        assert (out / "best" / name).read_bytes() == (rebuilt / name).read_bytes(), name


def test_resume_restores_the_optimiser_without_refitting_it(family, target, tmp_path, monkeypatch):
    """A finished search extended by 2 trials fits the surrogate twice, not once per logged trial,
    and proposes what a full replay of the log proposes."""
    import shutil

    from skopt.learning import GaussianProcessRegressor

    evaluator = python_evaluator("distance_to_target", target=str(target), base=str(family.base))
    config = make_config(  # a fixed box: a widening refits the surrogate once more
        family, evaluator, budget=8, n_initial=3, seed=3, acq_optimizer="sampling", widen_box=False
    )
    out = tmp_path / "out"
    run_search(config, out, quiet(skip_best=True, plots=False))
    assert (out / "proposer.pkl").is_file()
    shutil.copytree(out, tmp_path / "replayed")
    (tmp_path / "replayed" / "proposer.pkl").unlink()

    fits = []
    real_fit = GaussianProcessRegressor.fit
    monkeypatch.setattr(
        GaussianProcessRegressor, "fit", lambda self, *a, **k: fits.append(1) or real_fit(self, *a, **k)
    )
    longer = config.model_copy(update={"budget": 10})
    notes = []
    restored = run_search(longer, out, quiet(skip_best=True, plots=False), echo=notes.append)
    assert len(fits) == 2 and any("restored from its snapshot after trial 7" in note for note in notes)
    fits.clear()
    replayed = run_search(longer, tmp_path / "replayed", quiet(skip_best=True, plots=False))
    assert len(fits) == 2 + (8 - 3 + 1)  # a fit per logged trial from the n_initial-th on, then the new ones
    assert [r.values for r in restored.records] == [r.values for r in replayed.records]

    # a snapshot that no longer matches the log is not used: the log is replayed
    (out / "proposer.pkl").write_bytes((tmp_path / "replayed" / "proposer.pkl").read_bytes()[:-9])
    again = run_search(config.model_copy(update={"budget": 11}), out, quiet(skip_best=True, plots=False))
    assert again.summary.completed_trials == 11


def test_torn_last_line_is_dropped_and_that_trial_run_again(family, tmp_path):
    evaluator = python_evaluator("per_task_scores")
    config = make_config(family, evaluator, strategy="random", budget=3)
    out = tmp_path / "out"
    run_search(config, out, quiet(skip_best=True, plots=False))
    with open(out / "trials.jsonl", "ab") as handle:
        handle.write(b'{"trial":3,"status":"ok","val')  # a write cut short by a kill
    notes = []
    result = run_search(
        config.model_copy(update={"budget": 4}), out, quiet(skip_best=True, plots=False), echo=notes.append
    )
    assert any("torn line" in note for note in notes)
    assert [r.trial for r in read_records(out)] == [0, 1, 2, 3]
    assert result.replayed == 3
    reference = run_search(
        config.model_copy(update={"budget": 4}), tmp_path / "ref", quiet(skip_best=True, plots=False)
    )
    assert [r.values for r in reference.records] == [r.values for r in result.records]


def test_failed_trials_are_recorded_and_the_search_goes_on(family, tmp_path):
    evaluator = python_evaluator("fails_on", folder=True, trials=[1])
    config = make_config(family, evaluator, strategy="random", budget=4)
    result = run_search(config, tmp_path / "out", quiet(skip_best=True, plots=False))
    records = read_records(tmp_path / "out")
    assert [r.status for r in records] == ["ok", "failed", "ok", "ok"]
    assert records[1].score is None
    assert records[1].error == "evaluate: RuntimeError: evaluation blew up on trial-0001"
    assert "evaluation blew up" in (tmp_path / "out" / "errors.log").read_text()
    assert result.summary.failed_trials == 1 and result.summary.best_trial == 3

    nan = make_config(
        family, python_evaluator("fails_on", folder=True, trials=[0], nan=True), strategy="random", budget=2
    )
    records = run_search(nan, tmp_path / "nan", quiet(skip_best=True, plots=False)).records
    assert records[0].status == "failed" and records[0].error == "evaluate: non-finite score for score"


def test_three_failures_in_a_row_stop_with_one_line(family, tmp_path):
    from click.testing import CliRunner

    from mergekit_bmm.cli.search import main

    search_file = tmp_path / "search.yml"
    evaluator = python_evaluator("fails_on", folder=True, trials=[0, 1, 2, 3])
    search_file.write_text(yaml.safe_dump(config_dict(family, evaluator, strategy="random", budget=6)))
    result = CliRunner().invoke(main, [str(search_file), str(tmp_path / "out"), "--quiet"])
    assert result.exit_code == 3
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, "--quiet: the error line and nothing else"
    assert lines[0].startswith(
        "mergekit-bmm: error: 3 trials in a row failed (last: trial 2: evaluate: RuntimeError"
    )
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (
        summary["status"] == "stopped" and summary["completed_trials"] == 3 and summary["best_trial"] is None
    )


def test_a_folder_style_function_is_told_to_ask_for_a_folder(family, tmp_path):
    """A function written as fn(model_dir, ...) before resident trials, left with `input: model`."""
    from click.testing import CliRunner

    from mergekit_bmm.cli.search import main

    search_file = tmp_path / "search.yml"
    evaluator = python_evaluator("fails_on", trials=[])  # fails_on(model_dir, trials, ...): a folder function
    search_file.write_text(yaml.safe_dump(config_dict(family, evaluator, strategy="random", budget=2)))
    result = CliRunner().invoke(main, [str(search_file), str(tmp_path / "out"), "--quiet"])
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert "seems to expect a model folder" in lines[-1] and "`input: folder`" in lines[-1]
    assert "model_dir" in lines[-1]


def test_grid_tries_one_shared_lambda_log_spaced(family, tmp_path):
    config = make_config(
        family,
        python_evaluator("per_task_scores"),
        strategy="grid",
        budget=4,
        blocks=2,
        lambda_range=[1e-3, 1.0],
        grid_scale=1.1,
    )
    result = run_search(config, tmp_path / "out", quiet(skip_best=True, plots=False))
    for record, expected in zip(result.records, (1e-3, 1e-2, 1e-1, 1.0)):
        recipe_text = (tmp_path / "out" / record.yaml).read_text()
        slices = yaml.safe_load(recipe_text)["slices"]
        assert len(slices) == 2
        for block in slices:
            lambdas = [item["value"] for item in block["parameters"]["lambda"]]
            assert lambdas == pytest.approx([expected] * 4)
            assert block["parameters"]["scale"] == pytest.approx(1.1)


def test_eval_anchor_outputs_and_summary_contract(family, tmp_path):
    from search_objectives import per_task_scores

    from mergekit_bmm.plugin.run import merge_recipe_text as merge_text
    from mergekit_bmm.recipes.parse import yaml_text

    config = make_config(family, python_evaluator("per_task_scores"), strategy="random", budget=2, blocks=2)
    result = run_search(config, tmp_path / "out", quiet(eval_anchor=True))
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    contract = {
        "recipe", "strategy", "budget", "n_initial", "seed", "blocks", "groups", "completed_trials",
        "failed_trials", "best_trial", "best_score", "best_per_task", "best_values", "anchor_score",
        "anchor_per_task", "evaluator", "convergence_plot", "lambda_plot", "best_recipe", "best_model",
    }  # fmt: skip
    assert contract <= set(summary)
    assert summary["blocks"] == [[0, 1], [1, 2]] and summary["groups"] == list(GROUPS)
    assert summary["evaluator"]["type"] == "python" and summary["status"] == "finished"
    assert set(summary["best_values"]) == {f"block{b}.{k}" for b in (0, 1) for k in (*GROUPS, "scale")}
    for name in ("convergence.png", "lambdas.png", "best.yml", "summary.json", "anchor.yml"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "best" / "model.safetensors").exists()
    for line in (out / "trials.jsonl").read_text().splitlines():
        times = json.loads(line)["time"]  # wall seconds per stage, and the trial's CPU seconds
        assert {"merge", "evaluate", "surrogate", "total", "elapsed"} <= set(times) and times["cpu"] > 0
        assert times["total"] >= times["merge"] + times["evaluate"] + times["surrogate"] - 1e-3
    # files get the permissions the user's umask gives, like any other tool's
    umask = os.umask(0)
    os.umask(umask)
    written = ["best.yml", "summary.json", "anchor.json", "anchor.yml", "trials.jsonl", "convergence.png"]
    written += [f"trials/{path.name}" for path in (out / "trials").iterdir()]
    modes = {name: (out / name).stat().st_mode & 0o777 for name in written}
    assert modes == {name: 0o666 & ~umask for name in written}

    # the anchor is the task_arithmetic merge of the same models, scored the same way
    anchor = {
        "merge_method": "task_arithmetic",
        "base_model": str(family.base),
        "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in family.experts],
        "dtype": "float32",
    }
    assert yaml.safe_load((out / "anchor.yml").read_text()) == anchor
    merge_text(yaml_text(anchor), tmp_path / "ta")
    expected = per_task_scores(tmp_path / "ta")
    assert summary["anchor_per_task"] == pytest.approx(expected)
    assert summary["anchor_score"] == pytest.approx(sum(expected.values()) / 2)
    assert "anchor" in result.report and "best values" in result.report


def test_eval_anchor_over_a_regmean_anchor_reads_the_statistics(family, tmp_path):
    """The anchor model gets bmm's ``stats`` as bmm's own anchor call does (one forwarding rule)."""
    from mergekit_bmm.examples.synthetic_stats import stats_for_family

    stats, _ = stats_for_family(tmp_path / "stats", family)
    raw = config_dict(family, python_evaluator("per_task_scores"), strategy="random", budget=1)
    raw["recipe"]["parameters"].update({"anchor_method": "regmean", "stats": str(stats)})
    result = run_search(
        parse_search_config(raw, TESTS), tmp_path / "out", quiet(eval_anchor=True, plots=False)
    )
    anchor = yaml.safe_load((tmp_path / "out" / "anchor.yml").read_text())
    assert anchor["merge_method"] == "regmean" and anchor["parameters"] == {"stats": str(stats)}
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["anchor_score"] is not None and all(r.ok for r in result.records)


def test_a_search_begun_under_the_earlier_gram_sharing_default_resumes_once_its_template_states_it(
    family, tmp_path, monkeypatch
):
    """``gram_sharing`` defaulted to ``weight``: a search whose template left it out merged with it, so
    it is refused with the line that resumes it, and resumes once the template says ``weight``; a
    template that stated ``weight`` keeps its experiment."""
    from mergekit_bmm.errors import OutputFolderError
    from mergekit_bmm.search import experiment

    evaluator = python_evaluator("per_task_scores")
    options = quiet(skip_best=True, plots=False)

    def search(out: Path, budget: int, sharing: str | None = None):
        data = config_dict(family, evaluator, strategy="random", budget=budget, anchor_start=False)
        if sharing is not None:
            data["recipe"]["parameters"]["gram_sharing"] = sharing
        return run_search(parse_search_config(data, TESTS), out, options)

    with monkeypatch.context() as patch:  # hashed as before the default changed
        patch.setattr(experiment, "keyed_recipe", lambda recipe: recipe)
        patch.setattr(experiment, "relies_on_changed_default", lambda recipe: False)
        search(tmp_path / "left out", 1)
        search(tmp_path / "stated", 1, sharing="weight")
    with pytest.raises(
        OutputFolderError, match=r"defaulted to `weight`.* add `gram_sharing: weight`"
    ) as info:
        search(tmp_path / "left out", 2)
    assert "\n" not in str(info.value)
    for folder in ("left out", "stated"):
        resumed = search(tmp_path / folder, 2, sharing="weight")
        assert resumed.replayed == 1 and len(read_records(tmp_path / folder)) == 2


def test_out_folder_of_another_experiment_is_protected(family, tmp_path):
    from mergekit_bmm.errors import OutputFolderError

    evaluator = python_evaluator("per_task_scores")
    first = make_config(family, evaluator, strategy="random", budget=1, anchor_start=False)  # seeds differ
    out = tmp_path / "out"
    run_search(first, out, quiet(skip_best=True, plots=False))
    again = run_search(first, out, quiet(skip_best=True, plots=False))  # same command: resumes, nothing to do
    assert again.replayed == 1 and len(read_records(out)) == 1

    other = make_config(family, evaluator, strategy="random", budget=1, seed=5, anchor_start=False)
    with pytest.raises(OutputFolderError, match="holds a different experiment"):
        run_search(other, out, quiet(skip_best=True, plots=False))
    assert len(read_records(out)) == 1  # untouched
    run_search(other, out, quiet(skip_best=True, plots=False, force=True))
    assert read_records(out)[0].values != again.records[0].values

    foreign = tmp_path / "model-folder"
    foreign.mkdir()
    (foreign / "weights.bin").write_bytes(b"precious")
    with pytest.raises(OutputFolderError, match="did not write"):
        run_search(first, foreign, quiet(skip_best=True, plots=False))
    with pytest.raises(OutputFolderError, match="holds no search to resume"):
        run_search(first, tmp_path / "empty", quiet(skip_best=True, plots=False, resume=True))


def test_a_folder_that_cannot_be_written_is_free_again_for_the_next_search_in_the_process(family, tmp_path):
    """A write that fails once the folder is claimed (here its ``.work`` folder is a file) must not
    leave it locked: the next command in the same process (a notebook, a sweep) is not told that
    another search is writing it."""
    evaluator = python_evaluator("per_task_scores")
    config = make_config(family, evaluator, strategy="random", budget=1, anchor_start=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".work").write_text("in the way")
    with pytest.raises(OSError) as failed:  # kept, as a notebook keeps its last traceback
        run_search(config, out, quiet(skip_best=True, plots=False))
    (out / ".work").unlink()
    assert len(run_search(config, out, quiet(skip_best=True, plots=False)).records) == 1
    assert isinstance(failed.value, FileExistsError)


def test_search_with_the_lm_eval_evaluator_on_a_local_task(family, tmp_path, monkeypatch):
    monkeypatch.chdir(TESTS.parent)  # the task YAML's data_files is relative to the working directory
    evaluator = {
        "type": "lm_eval",
        "tasks": [{"name": "toy_choice", "metric": "acc"}],
        "include_path": str(TESTS / "fixtures" / "lm_eval"),
        "limit": 4,
        "batch_size": 4,
    }
    config = make_config(family, evaluator, strategy="random", budget=1)
    result = run_search(config, tmp_path / "out", quiet(skip_best=True, plots=False))
    (record,) = result.records
    assert record.ok and set(record.per_task) == {"toy_choice"}
    assert record.score in {k / 4 for k in range(5)}


def test_search_with_the_classification_evaluator(family, tmp_path):
    from test_evaluators import SENTIMENT, write_head

    head = write_head(tmp_path / "head.safetensors", 16)
    evaluator = {
        "type": "classification",
        "max_length": 16,
        "batch_size": 8,
        "tasks": [{"name": "sentiment", "head": str(head), "data": str(SENTIMENT), "split": "validation"}],
    }
    config = make_config(family, evaluator, strategy="random", budget=1)
    result = run_search(config, tmp_path / "out", quiet(skip_best=True, plots=False))
    (record,) = result.records
    assert record.ok and set(record.per_task) == {"sentiment"}
    assert record.score in {k / 8 for k in range(9)}


def test_the_shipped_example_runs_from_the_command_line(family, tmp_path):
    from click.testing import CliRunner

    from mergekit_bmm.cli.search import main

    text = (TESTS.parent / "configs" / "search-example.yml").read_text()
    text = text.replace("/models/base", str(family.base))
    for path in family.experts:
        text = text.replace(f"/models/{path.name}", str(path))
    search_file = tmp_path / "search.yml"
    search_file.write_text(text)
    out = tmp_path / "out"
    arguments = [
        str(search_file),
        str(out),
        "--budget",
        "8",
        "--skip-best",
        "--quiet",
        "--eval-anchor",
    ]
    result = CliRunner().invoke(main, arguments)
    assert result.exit_code == 0, result.output + str(result.exception)
    assert "mergekit-bmm-search [bo] 8/8 trials (0 failed)" in result.stdout
    assert "best values" in result.stdout and "anchor" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["best_per_task"]) == {"a", "b", "c"} and summary["anchor_score"] is not None
    # the copy kept in OUT_PATH is enough to resume (and extend) the search
    extended = CliRunner().invoke(main, ["--resume", str(out), "--budget", "9", "--skip-best", "--quiet"])
    assert extended.exit_code == 0, extended.output
    assert "9/9 trials" in extended.stdout


def test_mix_gram_searches_epsilon_per_block(family, tmp_path):
    """gram: mix with epsilon_range: a 6B-dimensional space, ε written per slice and merged."""
    import torch
    from conftest import load_weights

    from mergekit_bmm import __version__
    from mergekit_bmm.core.module_map import classify
    from mergekit_bmm.io.fingerprint import model_fingerprint
    from mergekit_bmm.io.model_folder import weight_names_of
    from mergekit_bmm.stats.store import StatsManifest, TaskStats, write_grams, write_manifest

    stats = tmp_path / "stats"
    base = load_weights(family.base)
    names = [n for n in weight_names_of(str(family.base)) if base[n].ndim == 2 and classify(n)]
    generator = torch.Generator().manual_seed(0)
    tasks = []
    for index, expert in enumerate(family.experts):
        grams = {}
        for name in names:
            features = torch.randn(64, base[name].shape[1], generator=generator)
            grams[name] = features.T @ features / 64
        write_grams(stats / "grams" / f"t{index}.safetensors", grams)
        tasks.append(
            TaskStats(
                name=f"t{index}",
                model=str(expert),
                fingerprint=model_fingerprint(expert),
                file=f"t{index}.safetensors",
                samples=64,
                tokens=64,
            )
        )
    write_manifest(
        stats,
        StatsManifest(
            format_version=1, package_version=__version__, tasks=tasks, modules={n: n for n in names}
        ),
    )

    fields = {"strategy": "random", "budget": 2, "blocks": 2, "epsilon_range": [0.2, 0.8]}
    raw = config_dict(family, python_evaluator("per_task_scores"), **fields)
    raw["recipe"]["parameters"].update({"gram": "mix", "stats": str(stats)})
    config = parse_search_config(raw, TESTS)
    result = run_search(config, tmp_path / "out", quiet(skip_best=True, plots=False))
    assert len(result.space.names) == 12 and all(r.ok for r in result.records)
    for record in result.records:
        slices = yaml.safe_load((tmp_path / "out" / record.yaml).read_text())["slices"]
        epsilons = [block["parameters"]["epsilon"] for block in slices]
        assert epsilons == [record.values["block0.epsilon"], record.values["block1.epsilon"]]
        assert all(0.2 <= value <= 0.8 for value in epsilons)
    assert result.records[0].per_task != result.records[1].per_task


def test_interrupt_keeps_finished_trials_and_writes_the_summary(family, tmp_path):
    config = make_config(
        family, python_evaluator("interrupts_on", folder=True, trial=2), strategy="random", budget=5
    )
    with pytest.raises(KeyboardInterrupt):
        run_search(config, tmp_path / "out", quiet())
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["completed_trials"] == 2
    assert (tmp_path / "out" / "convergence.png").exists() and not (tmp_path / "out" / ".work").exists()
    assert [r.trial for r in read_records(tmp_path / "out")] == [0, 1]


@pytest.mark.slow
def test_search_card_and_push_to_hub(family, tmp_path):
    """The best model gets a search card and is uploaded to a local stand-in for the Hub."""
    import os
    import subprocess

    import yaml
    from hub_standin import HubStandIn
    from huggingface_hub import ModelCard

    config = config_dict(family, python_evaluator("per_task_scores"), strategy="random", budget=3, seed=0)
    search_file = tmp_path / "search.yml"
    search_file.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    ids = [f"--base-model-id={family.base}=org/base"]
    ids += [f"--base-model-id={p}=org/{p.name}" for p in family.experts]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    with HubStandIn() as hub:
        env.update(HF_ENDPOINT=hub.endpoint, HF_TOKEN="hf_standin_token", HF_HOME=str(tmp_path / "hf"))
        command = [
            str(BIN / "mergekit-bmm-search"),
            str(search_file),
            str(out),
            "--quiet",
            "-j",
            "1",
        ]
        command += ["--push-to-hub", "me/searched", *ids]
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        state = hub.state
    assert result.returncode == 0, result.stderr[-3000:]
    card = ModelCard((out / "best" / "README.md").read_text())
    assert {"mergekit", "merge", "bmm"} <= set(card.data.tags)
    assert "random" in card.text and "convergence.png" in card.text
    assert (out / "best" / "convergence.png").exists()
    uploaded = state.repos["me/searched"].branches["main"]
    assert {"README.md", "convergence.png", "mergekit_config.yml"} <= set(uploaded)
    assert ModelCard(uploaded["README.md"].decode()).data.base_model == [
        "org/base",
        *(f"org/{p.name}" for p in family.experts),
    ]


def test_push_to_hub_is_checked_before_the_search_starts(family, tmp_path):
    from click.testing import CliRunner

    from mergekit_bmm.cli.search import main

    search_file = tmp_path / "search.yml"
    import yaml

    search_file.write_text(yaml.safe_dump(config_dict(family, python_evaluator("per_task_scores"))))
    result = CliRunner().invoke(
        main, [str(search_file), str(tmp_path / "out"), "--push-to-hub", "me/x", "--quiet"]
    )
    assert result.exit_code != 0
    assert "offline mode" in result.output  # the test session is offline
    assert not (tmp_path / "out" / "trials.jsonl").exists()


def test_a_box_that_is_too_small_widens_and_says_so(family, target, tmp_path):
    """The optimum's λ lie below the box: the best point sits on the low edge, which moves down."""
    from mergekit_bmm.search.log import read_events

    evaluator = python_evaluator("distance_to_target", target=str(target), base=str(family.base))
    fields = {
        "budget": 10,
        "n_initial": 4,
        "seed": 3,
        "acq_optimizer": "lbfgs",  # it follows the slope to the edge; sampling rarely lands within 3 %
        "lambda_range": [0.3, 1.0],
    }
    notes: list[str] = []
    result = run_search(
        make_config(family, evaluator, **fields), tmp_path / "out", quiet(), echo=notes.append
    )
    events = read_events(tmp_path / "out" / "trials.jsonl")
    assert events and all(event["event"] == "box" for event in events)
    lowered = [e for e in events if e["low"] < e["old_low"]]
    assert lowered and all(e["low"] == pytest.approx(e["old_low"] / 10) for e in lowered)
    assert [vars_ for vars_ in result.summary.box_changes] == [
        {k: v for k, v in e.items() if k != "event"} for e in events
    ]
    assert any(note.startswith("search box widened: block0.") for note in notes)
    assert min(result.summary.box[name][0] for name in result.summary.box if "scale" not in name) < 0.3
    later = [r for r in result.records if r.trial > events[0]["after_trial"]]
    assert any(min(v for k, v in r.values.items() if "scale" not in k) < 0.3 for r in later)
    card = (tmp_path / "out" / "best" / "README.md").read_text()
    assert "search box widened" in card

    # a resumed search replays the box as logged; widen_box: false keeps the box
    again = run_search(make_config(family, evaluator, **{**fields, "budget": 12}), tmp_path / "out", quiet())
    assert [r.values for r in again.records[:10]] == [r.values for r in result.records]
    fixed = run_search(
        make_config(family, evaluator, **fields, widen_box=False), tmp_path / "fixed", quiet(skip_best=True)
    )
    assert not read_events(tmp_path / "fixed" / "trials.jsonl") and fixed.summary.box_changes == []
    assert all(min(v for k, v in r.values.items() if "scale" not in k) >= 0.3 for r in fixed.records)


def test_the_report_lists_what_the_search_does_not_tune(family, tmp_path):
    """Groups left out stay at the recipe's λ; 2-D weights outside every group keep the anchor's value."""
    evaluator = python_evaluator("per_task_scores")
    config = make_config(family, evaluator, strategy="random", budget=1, groups=["attn_in", "mlp_out"])
    result = run_search(config, tmp_path / "out", quiet(skip_best=True, plots=False))
    assert result.summary.not_searched["groups"] == {"attn_out": 0.1, "mlp_in": 0.1}
    assert "model.embed_tokens.weight" in result.summary.not_searched["anchor_kept"]
    assert not any(".layers." in name for name in result.summary.not_searched["anchor_kept"])
    assert "not searched, at the recipe's lambda: attn_out (lambda 0.1), mlp_in (lambda 0.1)" in result.report
    kept = "outside every module group, kept at the anchor's value: lm_head.weight, model.embed_tokens.weight"
    assert kept in result.report


def test_a_failing_search_under_quiet_prints_one_line(family, tmp_path):
    """Every trial's evaluator fails: with ``--quiet`` the one error line is all (the merges' notes on
    what they keep at the anchor belong to the report, not to every trial)."""
    evaluator = python_evaluator("fails_on", folder=True, trials=list(range(10)))
    search_file = tmp_path / "search.yml"
    search_file.write_text(yaml.safe_dump(config_dict(family, evaluator, budget=6, n_initial=3)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(BIN / "mergekit-bmm-search"), str(search_file), str(tmp_path / "out"), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
    )
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, lines
    assert lines[0].startswith("mergekit-bmm: error: 3 trials in a row failed")
