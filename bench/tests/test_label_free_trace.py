"""Which trials a label-free trace re-merges: all, or a budget spread over the search."""

from __future__ import annotations

import json

import yaml

from bench.merging.label_free_trace import traced_trials


def _search(folder, scores: list[float]) -> None:
    """A search folder as mergekit-bmm-search leaves it: a recipe per trial and trials.jsonl."""
    (folder / "trials").mkdir(parents=True)
    lines = []
    for trial, score in enumerate(scores):
        recipe = {"merge_method": "bmm", "models": [], "parameters": {"lambda": 0.01 * (trial + 1)}}
        (folder / "trials" / f"trial-{trial:04d}.yml").write_text(yaml.safe_dump(recipe))
        lines.append(
            {"trial": trial, "score": score, "status": "ok", "yaml": f"trials/trial-{trial:04d}.yml"}
        )
    (folder / "trials.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_trace_budget_spreads_over_the_search_keeps_its_best_and_what_was_traced(tmp_path):
    scores = [0.1 * (i % 7) for i in range(40)]  # best: trial 6 (the first 0.6)
    _search(tmp_path / "search", scores)

    def trials(limit):
        return traced_trials(tmp_path / "search", tmp_path / "cache", limit, {})

    every = trials(None)
    assert [record["trial"] for record, *_ in every] == list(range(40))
    picked = [record["trial"] for record, *_ in trials(5)]
    assert picked == [0, 6, 10, 20, 29, 39]  # evenly spaced, both ends, and the best
    stored = every[13][3]  # a trial traced by an earlier run is kept: its scores cost nothing
    stored.parent.mkdir(parents=True)
    stored.write_text("{}")
    assert 13 in [record["trial"] for record, *_ in trials(5)]
