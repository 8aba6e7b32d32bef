"""The benchmark's protocol pieces: early stopping, zero-shot heads, and the headline evidence."""

from __future__ import annotations

import importlib.metadata
import json

import numpy as np
import pytest
import torch
import yaml

from bench.merging.config import FinetuneSpec
from bench.merging.evidence import best_anchor, best_models, range_figures, summary_row, verdict
from bench.merging.intervals import interval, paired_difference
from bench.merging.training import batch_order, train_loop


def _loop(scores: list[float], patience: int, folder=None):
    """A linear model trained on noise; ``evaluate`` returns the given scores in turn and
    records the weights it saw, so the test knows which weights each score belonged to."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data, targets = torch.randn(64, 4), torch.randint(0, 2, (64,))
    spec = FinetuneSpec(steps=40, batch_size=8, lr=0.05, eval_every=5, patience=patience, threads=1)
    seen: list[dict[str, torch.Tensor]] = []

    def step_loss(rows):
        logits = model(data[torch.from_numpy(rows)])
        return torch.nn.functional.cross_entropy(logits, targets[torch.from_numpy(rows)]), 0

    def evaluate() -> float:
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        return scores[len(seen) - 1]

    state = train_loop(model, spec, batch_order(64, 8, 40, 0), step_loss, folder, evaluate=evaluate)
    return model, state, seen


@pytest.mark.parametrize("on_disk", [False, True])
def test_training_stops_after_patience_and_keeps_the_best_weights(tmp_path, on_disk):
    scores = [0.5, 0.7, 0.6, 0.65, 0.9, 0.95, 0.99, 0.99]
    model, state, seen = _loop(scores, patience=2, folder=tmp_path if on_disk else None)
    assert state["stopped_early"] and state["step"] == 20  # evaluations at 5, 10, 15, 20
    assert state["evals"] == [[5, 0.5], [10, 0.7], [15, 0.6], [20, 0.65]]
    assert state["best"] == {"step": 10, "score": 0.7}
    kept = model.state_dict()
    assert all(torch.equal(kept[k], seen[1][k]) for k in kept)  # the weights scored 0.7
    assert not list(tmp_path.glob("*.ckpt"))  # nothing left behind


def test_a_resumed_training_removes_what_a_killed_save_left_half_written(tmp_path):
    """A checkpoint write cut off by a kill leaves a temporary file; the finished build must not
    carry it (the expert folder is installed as it is)."""
    for name in ("resume-state.ckpt", "best-state.ckpt"):
        (tmp_path / f".{name}.12345.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / "notes.tmp").write_text("not ours")
    _loop([0.5, 0.7, 0.6, 0.65, 0.9, 0.95, 0.99, 0.99], patience=2, folder=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp"]


def test_training_without_a_plateau_runs_to_the_cap_and_keeps_the_last_best():
    scores = [0.1 * i for i in range(1, 9)]
    model, state, seen = _loop(scores, patience=3)
    assert not state["stopped_early"] and state["step"] == 40 and len(state["evals"]) == 8
    assert state["best"]["step"] == 40
    assert all(torch.equal(model.state_dict()[k], seen[-1][k]) for k in seen[-1])


def _flags(rng, accuracy: float, n: int = 300) -> dict[str, np.ndarray]:
    return {task: (rng.random(n) < accuracy).astype(float) for task in ("a", "b")}


def test_range_and_summary_are_paired_bootstrap_figures():
    rng = np.random.default_rng(0)
    indiv, pretrained, ta, bmm, ties = (_flags(rng, p) for p in (0.9, 0.5, 0.7, 0.8, 0.72))
    figures = range_figures(indiv, pretrained, ta)
    gap = paired_difference(indiv, pretrained)
    assert figures["experts_minus_pretrained"] == {
        "estimate": round(gap[0], 4),
        "low": round(gap[1], 4),
        "high": round(gap[2], 4),
    }
    assert figures["experts_minus_pretrained"]["low"] > 0.3  # 40 points apart: clearly above zero
    rows = [
        {"anchor": "pretrained", "setting": "anchor", "validation_avg": 0.99},
        {"anchor": "task_arithmetic", "setting": "anchor", "validation_avg": 0.70},
        {"anchor": "ties", "setting": "anchor", "validation_avg": 0.75},
        {"anchor": "ties", "setting": "data_free", "validation_avg": 0.95},
    ]
    assert best_anchor(rows) == "ties"  # chosen on validation, never Pretrained or a BMM row
    cell = summary_row("task_arithmetic", "data_free", bmm, ta, ties, indiv)
    delta = paired_difference(bmm, ta)
    assert cell["delta"] == round(delta[0], 4) and cell["delta_low"] == round(delta[1], 4)
    assert cell["above_anchor"] and cell["interval_above_zero"]
    assert cell["gap_closed"] == round(delta[0] / (interval(indiv)[0] - interval(ta)[0]), 4)
    assert cell["delta_best_anchor"] == round(paired_difference(bmm, ties)[0], 4)
    worse = summary_row("ties", "data_assisted", ta, ties, ties, indiv)
    cell["defaults_share"] = 0.85  # BMM at its defaults got 85 % of what the search gained
    assert verdict([cell, worse]) == {
        "data_free": {
            "anchors": 1,
            "above": 1,
            "interval_above_zero": 1,
            "search_gained": 1,
            "defaults_reach_80": 1,
        },
        "data_assisted": {
            "anchors": 1,
            "above": 0,
            "interval_above_zero": 0,
            "search_gained": 0,
            "defaults_reach_80": 0,
        },
    }


def test_a_label_free_tally_counts_only_the_anchors_where_it_ran():
    """Entropy searched over one anchor of two: its bar is out of one, not out of every anchor."""
    cells = [
        {"mode": "data_free", "above_anchor": True, "interval_above_zero": True, "defaults_share": 1.0},
        {"mode": "data_free", "above_anchor": True, "interval_above_zero": False, "defaults_share": 0.5},
    ]
    cells[0].update(agreement_share=0.9, entropy_share=0.4)
    cells[1].update(agreement_share=0.85)
    counts = verdict(cells)["data_free"]
    assert (
        counts["search_gained"] == 2 and counts["agreement_measured"] == 2 and counts["entropy_measured"] == 1
    )
    assert counts["agreement_reach_80"] == 2 and counts["entropy_reach_80"] == 0


def test_the_model_to_keep_is_chosen_on_validation_and_paired_on_test():
    rng = np.random.default_rng(1)
    best_anchor_flags, strong, weak = (_flags(rng, p) for p in (0.75, 0.8, 0.9))
    candidates = [  # the weak one scores better on test, but validation decides, as a user would
        {"label": "ta (data_free)", "mode": "data_free", "validation_avg": 0.79, "avg": 0.8, "flags": strong},
        {
            "label": "ta (data_free, k100)",
            "mode": "data_free",
            "validation_avg": 0.7,
            "avg": 0.9,
            "flags": weak,
        },
        {
            "label": "ta (data_assisted)",
            "mode": "data_assisted",
            "validation_avg": None,
            "avg": 0.9,
            "flags": weak,
        },
    ]
    picks = best_models(candidates, best_anchor_flags)
    assert set(picks) == {"data_free"}  # a mode with no validation score has nothing to keep
    assert picks["data_free"]["label"] == "ta (data_free)" and picks["data_free"]["candidates"] == 2
    estimate, low, high = paired_difference(strong, best_anchor_flags)
    assert picks["data_free"]["delta_best_anchor"] == {
        "estimate": round(estimate, 4),
        "low": round(low, 4),
        "high": round(high, 4),
    }


@pytest.mark.slow
def test_zero_shot_run_stops_experts_early_and_reports_range(tmp_path):
    """A tiny run with zero-shot heads and early stopping: heads are cosine heads, each expert's
    held-out curve and kept step are recorded and drawn, and the range figures are reported."""
    from click.testing import CliRunner

    from bench.merging.__main__ import main
    from bench.tests.test_smoke import tiny_encoder_config, write_task
    from mergekit_bmm.evaluation.classification import load_head

    config = {
        **tiny_encoder_config(tmp_path, "zs"),
        "head": {"kind": "zero_shot", "scale": 20.0},
        "tasks": [
            {
                "name": "mood",
                "jsonl": str(write_task(tmp_path / "mood.jsonl", "mood", 120, 1, True)),
                "labels": ["positive", "negative"],
                "descriptions": {"positive": "good great happy", "negative": "bad awful sad"},
                "train": 64,
                "head": 24,
                "validation": 16,
                "test": 24,
            },
        ],
        "finetune": {"steps": 12, "eval_every": 2, "patience": 2, "batch_size": 8, "lr": 1e-3, "threads": 1},
        "task_arithmetic": {"weights": [1.0]},
        "niceness": 0,
    }
    path = tmp_path / "zs.yml"
    path.write_text(yaml.safe_dump(config))
    args = ["run", str(path), "--cache-dir", str(tmp_path / "cache"), "--results-dir", str(tmp_path / "out")]
    args += ["--device", "auto"]  # the GPU where there is one: here, the CPU
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "out" / "zs" / "results.json").read_text())
    assert results["machine"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    manifest = json.loads((tmp_path / "cache" / "runs" / "zs" / "manifest.json").read_text())
    head = load_head(manifest["heads"]["mood"])
    assert head.normalize == "l2" and torch.allclose(head.weight.norm(dim=-1), torch.full((2,), 20.0))
    assert results["heads"]["mood"]["kind"] == "zero_shot"
    expert = results["experts"]["mood"]
    curve = expert["held_out_curve"]
    assert curve and curve[-1][0] == expert["steps"] <= 12
    best_score = max(score for _, score in curve)
    assert expert["kept_step"] == next(step for step, score in curve if score == best_score)
    assert (tmp_path / "out" / "zs" / "experts.png").stat().st_size > 0
    assert set(results["range"]) >= {"indiv", "pretrained", "experts_minus_pretrained"}
    assert (
        "Range: can this run tell merge methods apart?"
        in (tmp_path / "out" / "zs" / "results.md").read_text()
    )


def test_an_interrupted_sweep_keeps_its_scored_points(tmp_path):
    """Each scored sweep point is one JSON line; a torn last line (a kill mid-write) is ignored."""
    from bench.merging.sweeps import finished_points

    done = tmp_path / "sweep.points.jsonl"
    rows = [{"along": "reference", "value": None, "validation": 0.7}, {"along": "mlp_in", "value": 0.1}]
    done.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"along": "mlp_in", "val')
    finished = finished_points(done)
    assert set(finished) == {("reference", None), ("mlp_in", 0.1)}
    assert finished[("reference", None)]["validation"] == 0.7
    assert finished_points(tmp_path / "missing.jsonl") == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_run_without_a_gpu_is_one_line(tmp_path):
    """``--device cuda`` on a machine without a GPU stops before any work, in one line that
    says how to go on."""
    from click.testing import CliRunner

    from bench.merging.__main__ import main
    from bench.tests.test_smoke import tiny_encoder_config, write_task

    config = {
        **tiny_encoder_config(tmp_path, "gpu"),
        "tasks": [{"name": "mood", "jsonl": str(write_task(tmp_path / "mood.jsonl", "mood", 40, 1, True))}],
        "niceness": 0,
    }
    path = tmp_path / "gpu.yml"
    path.write_text(yaml.safe_dump(config))
    args = ["run", str(path), "--device", "cuda", "--cache-dir", str(tmp_path / "cache")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "--device cpu" in lines[0], result.output
    assert not (tmp_path / "cache" / "tasks").exists()


def test_a_picture_redrawn_from_results_json_keeps_the_runs_order_of_variants(tmp_path):
    from bench.merging.report.plots import plot_deltas
    from bench.merging.variants import variant_rows

    def row(anchor: str) -> dict:
        return {"anchor": anchor, "setting": "data_free", "delta_main": [0.001, -0.002, 0.004]}

    config = {
        "variants": [{"name": "zeta", "anchors": ["ties", "ace"]}, {"name": "alpha", "anchors": ["iso_cts"]}]
    }
    results = {
        "name": "run",
        "config": config,
        "variants": {"zeta": {"ties": row("ties"), "ace": row("ace")}, "alpha": {"iso_cts": row("iso_cts")}},
    }
    # results.json is written with sorted keys: read back, the variants and their anchors come alphabetically
    results = json.loads(json.dumps(results, sort_keys=True))
    assert [(name, r["anchor"]) for name, r in variant_rows(results)] == [
        ("zeta", "ties"),
        ("zeta", "ace"),
        ("alpha", "iso_cts"),
    ]
    assert plot_deltas(results, tmp_path / "deltas.png").stat().st_size > 0


def test_a_carved_task_relabels_its_corpus_and_keeps_the_corpus_test_pool(tmp_path, monkeypatch):
    """``classes:`` groups or keeps a subset of a corpus's labels; a carved task's test texts are held out
    of the corpus as the task named like the loader holds them out, so no expert trained on them."""
    import json

    from bench.merging import corpora
    from bench.merging.config import TaskSpec
    from bench.merging.tasks import build_task_data

    speakers = ["CLINTON", "KAINE", "TRUMP", "PENCE", "HOLT"]
    toy = corpora.Corpus(
        "debates", {"all": [(f"statement {i} by someone", speakers[i % 5]) for i in range(600)]}
    )
    monkeypatch.setitem(corpora.BUILTIN, "debates", lambda: toy)

    def texts(spec: TaskSpec, split: str):
        data, _ = build_task_data(spec, tmp_path, 0)
        lines = [json.loads(line) for line in data.data.read_text().splitlines()]
        return {line["text"] for line in lines if line["split"] == split}, data

    budgets = {"train": 300, "head": 20, "validation": 20, "test": 100}
    whole = TaskSpec(name="debates", **budgets)
    carved = TaskSpec(
        name="debate_party",
        loader="debates",
        classes={"democrat": ["CLINTON", "KAINE"], "republican": ["TRUMP", "PENCE"]},
        **budgets,
    )
    carved_test, data = texts(carved, "test")
    assert data.labels == ("democrat", "republican")  # the moderator's lines are dropped
    assert carved_test and not carved_test & texts(whole, "train")[0]
    with pytest.raises(Exception, match="not labels of debates"):
        build_task_data(carved.model_copy(update={"classes": {"x": ["OBAMA"]}}), tmp_path, 0)


def test_a_search_finished_before_the_gram_sharing_default_changed_keeps_its_scores(tmp_path):
    """Its ``best.yml`` leaves the rule out (then ``weight``); the folder is found under a template
    that states ``weight``, so the best recipe states it and its scores keep the key they had."""
    from bench.merging.merging import recipe_key
    from bench.merging.searches import best_recipe

    best = {"merge_method": "bmm", "base_model": "base", "models": [], "parameters": {"lambda": 0.2}}
    (tmp_path / "best.yml").write_text(yaml.safe_dump(best))
    template = {**best, "parameters": {"lambda": 0.1, "gram_sharing": "weight"}}
    recipe = best_recipe(tmp_path / "best.yml", template)
    assert recipe["parameters"] == {"lambda": 0.2, "gram_sharing": "weight"}
    from bench.merging.cache import stable_key
    from bench.merging.merging import _fingerprinted

    version = importlib.metadata.version("mergekit")  # the key it had: the recipe as it stood, then
    before = "merge:" + stable_key({"recipe": _fingerprinted(best), "mergekit": version}, 24)
    assert recipe_key(recipe) == before
    assert recipe_key(best) != before  # read as it stands, it would name today's default
    assert best_recipe(tmp_path / "best.yml", best)["parameters"] == {"lambda": 0.2}
