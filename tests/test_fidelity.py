"""Cheap-then-full evaluation: what is scored, when a trial is promoted or stopped, and that it
neither changes a full score nor misleads the optimiser."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from mergekit_bmm.evaluation.base import TaskExamples
from mergekit_bmm.search.fidelity import CHEAP, FULL, STOPPED, cheap_subset, staged_scores

RULE = {"cheap": 0.25, "promote_z": 2.0, "early_stop": True, "chunk": 16}


def _scorer(accuracy: dict[str, float], seed: int = 0):
    """Per-example right/wrong with fixed per-example draws: example i is right iff u_i < p."""
    draws = {task: np.random.default_rng([seed, len(task)]).random(400) for task in accuracy}
    asked: list[tuple[str, list[int]]] = []

    def score(task, indices):
        asked.append((task, list(indices)))
        return [float(draws[task][i] < accuracy[task]) for i in indices]

    return score, draws, asked


EXAMPLES = {"a": TaskExamples(400, tuple(i % 4 for i in range(400))), "b": TaskExamples(200)}


def _full(draws, accuracy):
    return {t: float(np.mean(draws[t][: EXAMPLES[t].count] < accuracy[t])) for t in accuracy}


def test_cheap_subset_is_fixed_stratified_and_a_quarter():
    first, again = cheap_subset(EXAMPLES, 0.25), cheap_subset(EXAMPLES, 0.25)
    assert first == again  # the same examples for every trial and every worker
    assert len(first["a"]) == 100 and len(first["b"]) == 50
    assert [sum(1 for i in first["a"] if i % 4 == label) for label in range(4)] == [25] * 4


def test_first_trial_is_scored_in_full_and_equals_the_plain_score():
    accuracy = {"a": 0.7, "b": 0.4}
    score, draws, _ = _scorer(accuracy)
    result = staged_scores(EXAMPLES, score, {}, None, **RULE)
    assert result.level == FULL and result.scored == result.total == 600
    assert result.per_task == _full(draws, accuracy)  # exactly: the same examples, the same mean


def test_values_pack_into_the_log_and_back():
    from mergekit_bmm.search.fidelity import pack, unpack

    bits = [1.0, 0.0, 0.0, 1.0, 1.0] * 41
    assert isinstance(pack(bits), str) and unpack(pack(bits)) == bits
    assert unpack(pack([0.0, 0.0])) == [0.0, 0.0] and unpack(pack([])) == []
    assert unpack(pack([0.25, 1.0])) == [0.25, 1.0]


def test_a_close_trial_is_judged_against_the_incumbent_on_the_same_examples():
    """Paired: a trial that agrees with the incumbent on all but a few cheap examples is told
    apart from it where an unpaired interval could not, and its estimate is incumbent + d."""
    from mergekit_bmm.search.fidelity import Incumbent

    examples = {"t": TaskExamples(400)}
    draws = np.random.default_rng(3).random(400)
    first = cheap_subset(examples, 0.25)["t"]
    right = [i for i in first if draws[i] < 0.8]
    worse = set(right[:4])  # the trial gets 4 of the incumbent's right cheap examples wrong

    def score(task, indices):
        return [float(draws[i] < 0.8 and i not in worse) for i in indices]

    incumbent = Incumbent(0.8, {"t": [float(v < 0.8) for v in draws]})
    whole_share = {**RULE, "chunk": 100}  # one look, at the end of the cheap share
    paired = staged_scores(examples, score, {}, incumbent, **whole_share)
    assert paired.paired and paired.level == CHEAP and paired.scored == 100
    assert paired.estimate == pytest.approx(0.8 - 4 / 100)
    unpaired = staged_scores(examples, score, {}, 0.8, **whole_share)
    assert not unpaired.paired and unpaired.level != CHEAP  # within the unpaired band: promoted


def test_a_promoted_trial_that_falls_behind_stops_before_the_end():
    """The paired comparison is repeated after each round of chunks: a trial ahead of the
    incumbent on the cheap examples but clearly worse on the rest stops early (estimate)."""
    from mergekit_bmm.search.fidelity import Incumbent

    examples = {"t": TaskExamples(400)}
    draws = np.random.default_rng(4).random(400)
    first = set(cheap_subset(examples, 0.25)["t"])
    incumbent = Incumbent(float(np.mean(draws < 0.8)), {"t": [float(v < 0.8) for v in draws]})

    def score(task, indices):  # a little better on the cheap examples, 15 points worse elsewhere
        return [float(draws[i] < (0.84 if i in first else 0.65)) for i in indices]

    result = staged_scores(examples, score, {}, incumbent, 0.25, 2.0, True, 50)
    assert result.promoted and result.level == STOPPED and "(estimate)" in result.stopped_at
    assert result.scored < 400 and result.estimate < incumbent.score


def test_full_trials_keep_every_example_score_for_pairing_after_a_resume():
    from mergekit_bmm.search.fidelity import Incumbent

    score, draws, _ = _scorer({"a": 0.7, "b": 0.4})
    result = staged_scores(EXAMPLES, score, {}, None, **RULE)
    record = result.record()
    assert set(record["values"]) == {"a", "b"}

    class Logged:  # what a resumed search reads back from trials.jsonl
        fidelity = record
        score = 0.55

    incumbent = Incumbent.of(Logged)
    assert incumbent.values["a"] == [float(v < 0.7) for v in draws["a"][:400]]


def test_a_clearly_worse_trial_stops_at_the_first_look_of_its_cheap_stage():
    """Once every task has one chunk, a trial far behind ends without the rest of its cheap share."""
    score, _, asked = _scorer({"a": 0.3, "b": 0.2})
    result = staged_scores(EXAMPLES, score, {}, 0.8, **RULE)
    assert result.level == CHEAP and result.scored == 2 * RULE["chunk"]
    assert [task for task, _ in asked] == ["a", "b"]
    assert "cheap examples (estimate)" in result.stopped_at
    assert result.cheap_score + 2 * result.cheap_se < 0.8
    assert result.record()["level"] == "cheap" and result.record()["scored"] == 2 * RULE["chunk"]


def test_a_close_trial_is_promoted_and_its_full_score_is_exact():
    accuracy = {"a": 0.7, "b": 0.6}
    score, draws, _ = _scorer(accuracy)
    full = _full(draws, accuracy)
    incumbent = (full["a"] + full["b"]) / 2 - 0.005  # just below: it must be scored in full
    result = staged_scores(EXAMPLES, score, {}, incumbent, **RULE)
    assert result.level == FULL and result.cheap_score is not None
    assert result.per_task == full


def test_the_bound_only_stops_trials_that_cannot_win():
    """Without a cheap stage only the bound stops a trial: then its full score is at or below
    the incumbent (it could never have won)."""
    rng = random.Random(0)
    stopped = 0
    for trial in range(40):
        accuracy = {"a": rng.uniform(0.4, 0.9), "b": rng.uniform(0.4, 0.9)}
        score, draws, _ = _scorer(accuracy, seed=trial)
        full = _full(draws, accuracy)
        incumbent = rng.uniform(0.55, 0.8)
        result = staged_scores(EXAMPLES, score, {}, incumbent, None, 0.0, True, 16)
        if result.level == STOPPED:
            stopped += 1
            assert (full["a"] + full["b"]) / 2 <= incumbent
            assert result.scored < result.total and "examples" in result.stopped_at
        elif result.level == FULL:
            assert result.per_task == full
    assert stopped > 0


def test_weights_count_in_the_bound_and_the_score():
    accuracy = {"a": 0.9, "b": 0.1}
    score, draws, _ = _scorer(accuracy)
    result = staged_scores(EXAMPLES, score, {"a": 3.0, "b": 1.0}, None, **RULE)
    full = _full(draws, accuracy)
    weighted = (3 * full["a"] + full["b"]) / 4
    assert math.isclose((3 * result.per_task["a"] + result.per_task["b"]) / 4, weighted)


@pytest.mark.parametrize("promote_z", [2.0, 1.0])  # 1.0 is the default
def test_staged_search_finds_the_known_optimum_as_full_evaluation_does(promote_z):
    """A GP search (scikit-optimize, EI) on a known objective: accuracy peaks at x = 0.3.
    Telling the optimiser cheap estimates for trials that stopped must not lead it astray."""
    from skopt import Optimizer

    examples = {"t": TaskExamples(400)}
    draws = np.random.default_rng(1).random(400)

    def run(staged: bool) -> tuple[float, int, float]:
        from mergekit_bmm.search.fidelity import Incumbent

        optimizer = Optimizer(
            [(0.0, 1.0)], base_estimator="GP", acq_func="EI", n_initial_points=6, random_state=0
        )
        best_x, best, scored = None, None, 0
        for _ in range(24):
            (x,) = optimizer.ask()
            p = 0.9 - 2.0 * (x - 0.3) ** 2

            def score(task, indices, p=p):
                return [float(draws[i] < p) for i in indices]

            full = {"cheap": None, "promote_z": 0.0, "early_stop": False, "chunk": 400}
            rule = {**RULE, "promote_z": promote_z} if staged else full
            result = staged_scores(examples, score, {}, best, **rule)
            value = result.per_task["t"] if result.level == FULL else result.estimate
            scored += result.scored
            optimizer.tell([x], -value)
            if result.level == FULL and (best is None or value > best.score):
                values = {task: [by[i] for i in range(len(by))] for task, by in result.values.items()}
                best, best_x = Incumbent(value, values), x
        return best_x, scored, best.score

    full_x, full_scored, full_best = run(False)
    staged_x, staged_scored, staged_best = run(True)
    assert abs(full_x - 0.3) < 0.12 and abs(staged_x - 0.3) < 0.12
    assert staged_best >= full_best - 0.02  # within the noise of 400 examples
    assert staged_scored < 0.6 * full_scored  # and it spent far fewer examples


@pytest.mark.slow
def test_a_classification_search_scores_in_stages_and_resumes(tmp_path):
    """A real search: the first trial is full, later ones stop early where they cannot win, only
    full trials can be best, the log and summary say so, and --full-eval gives the same full scores."""
    from test_evaluators import write_head
    from test_search import make_config, quiet

    from mergekit_bmm.examples.tiny_models import make_tiny_family
    from mergekit_bmm.search.log import read_trials
    from mergekit_bmm.search.loop import run_search

    family = make_tiny_family(tmp_path / "family", "llama", n_experts=3, hidden=16, layers=2)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "merge", "model", "expert", "task"]
    data = tmp_path / "task.jsonl"
    data.write_text(
        "".join(
            json.dumps({"text": " ".join(rng.choices(words, k=6)), "label": i % 3, "split": "validation"})
            + "\n"
            for i in range(240)
        )
    )
    head = write_head(tmp_path / "head.safetensors", 16, classes=3)
    evaluator = {
        "type": "classification",
        "max_length": 16,
        "batch_size": 32,
        "tasks": [{"name": "t", "head": str(head), "data": str(data), "split": "validation"}],
    }
    fields = {"strategy": "random", "budget": 8, "fidelity": {"cheap": 0.25, "promote_z": 1.0, "chunk": 30}}
    staged = run_search(make_config(family, evaluator, **fields), tmp_path / "staged", quiet(skip_best=True))
    records, _ = read_trials(tmp_path / "staged" / "trials.jsonl")
    assert records[0].fidelity["level"] == "full" and records[0].fidelity["scored"] == 240
    assert all(r.fidelity and r.fidelity["total"] == 240 for r in records)
    best = staged.summary.best_trial
    assert records[best].fidelity["level"] == "full"
    assert all(r.score <= records[best].score for r in records if r.fidelity["level"] == "full")
    summary = staged.summary.fidelity
    assert summary["trials"] == 8 and summary["full"] + summary["cheap_only"] + summary["stopped_early"] == 8
    assert summary["examples_scored"] == sum(r.fidelity["scored"] for r in records)
    assert "cheap-then-full evaluation" in staged.report

    plain = make_config(family, evaluator, **{**fields, "fidelity": {"enabled": False}})
    full = run_search(plain, tmp_path / "full", quiet(skip_best=True)).records
    assert [r.values for r in full] == [r.values for r in records]  # same seed, same points
    for ours, reference in zip(records, full):
        if ours.fidelity["level"] == "full":
            assert ours.score == reference.score  # a full score is the plain score, exactly
        else:
            assert reference.score <= records[best].score or ours.fidelity["level"] == "cheap"
    assert full[0].fidelity is None  # evaluated as before: no staged record

    resumed = run_search(
        make_config(family, evaluator, **{**fields, "budget": 10}), tmp_path / "staged", quiet(skip_best=True)
    )
    assert len(resumed.records) == 10 and resumed.replayed == 8

    workers = {**fields, "budget": 6, "parallel": {"workers": 2}}  # the incumbent travels to each worker
    parallel = run_search(
        make_config(family, evaluator, **workers), tmp_path / "workers", quiet(skip_best=True)
    )
    assert {r.worker for r in parallel.records} == {"w0", "w1"}
    assert all(r.fidelity for r in parallel.records) and parallel.records[0].fidelity["level"] == "full"
    assert parallel.records[parallel.summary.best_trial].fidelity["level"] == "full"


@pytest.mark.slow
def test_lm_eval_scores_single_documents_as_it_scores_the_task(tmp_path, monkeypatch):
    """lm-eval's per-document accuracies (its `samples`) average to its own task score, so a
    staged evaluation that reaches `full` gives exactly the plain score."""
    from pathlib import Path

    from mergekit_bmm.evaluation.base import load_model, load_tokenizer
    from mergekit_bmm.evaluation.config import LMEvalEvaluatorConfig
    from mergekit_bmm.evaluation.lm_harness import LMEvalEvaluator
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    tests = Path(__file__).resolve().parent
    monkeypatch.chdir(tests.parent)  # the task YAML's data_files is relative to the working directory
    family = make_tiny_family(tmp_path / "family", "llama", n_experts=1, hidden=16, layers=2)
    config = LMEvalEvaluatorConfig(
        type="lm_eval", tasks=["toy_choice"], include_path=str(tests / "fixtures" / "lm_eval"), limit=6
    )
    evaluator = LMEvalEvaluator(config, "cpu")
    model, tokenizer = load_model(family.base, "AutoModelForCausalLM", "cpu"), load_tokenizer(family.base)
    assert evaluator.scores_examples and evaluator.examples()["toy_choice"].count == 6
    import torch.utils.collect_env

    reports = []  # a search calls lm-eval once per chunk: its environment report is skipped
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: reports.append(1) or "")
    plain = evaluator.evaluate_model(model, tokenizer)
    values = evaluator.example_scorer(model, tokenizer)("toy_choice", [5, 0, 2])
    every = evaluator.example_scorer(model, tokenizer)("toy_choice", range(6))
    assert values == [every[5], every[0], every[2]] and set(every) <= {0.0, 1.0}
    assert math.isclose(sum(every) / 6, plain["toy_choice"])
    staged = staged_scores(evaluator.examples(), evaluator.example_scorer(model, tokenizer), {}, None, **RULE)
    assert staged.level == FULL and math.isclose(staged.per_task["toy_choice"], plain["toy_choice"])
    assert not reports  # no `pip list` and the like per call
