"""The merging benchmark end to end on two tiny generated tasks and a tiny BERT.

Same command and stages as the real run (data, heads, experts, scores, Task Arithmetic
through mergekit), tiny budgets; a second run must reuse everything (resume = no-op).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

WORDS = {
    "mood": (["good", "great", "fine", "happy"], ["bad", "awful", "sad", "poor"]),
    "topic": (["dog", "cat", "fox", "bird"], ["one", "two", "seven", "nine"]),
}
FILLER = ["the", "a", "is", "very", "and", "it", "was", "so"]


def write_task(path: Path, kind: str, n: int, seed: int, with_split: bool) -> Path:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(n):
            label = i % 2
            words = [rng.choice(FILLER) for _ in range(5)] + [
                rng.choice(WORDS[kind][label]) for _ in range(2)
            ]
            rng.shuffle(words)
            record = {"text": " ".join(words), "label": label}
            if with_split:
                record["split"] = "test" if i % 5 == 0 else "train"
            handle.write(json.dumps(record) + "\n")
    return path


def tiny_encoder_config(root: Path, name: str) -> dict:
    """A tiny BERT saved under ``root`` and the benchmark config fields that point at it."""
    from mergekit_bmm.examples.tiny_models import make_base

    model, tokenizer = make_base("bert", hidden=32, layers=2, seed=0)
    model.save_pretrained(root / "tiny-bert")
    tokenizer.save_pretrained(root / "tiny-bert")
    return {
        "name": name,
        "encoder": {"name": "tiny-bert", "path": str(root / "tiny-bert")},
        "max_length": 16,
        "eval_batch_size": 16,
    }


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    config = {
        **tiny_encoder_config(root, "smoke"),
        "tasks": [
            {
                "name": "mood",
                "jsonl": str(write_task(root / "mood.jsonl", "mood", 120, 1, True)),
                "labels": ["positive", "negative"],
                "train": 64,
                "head": 24,
                "validation": 16,
                "test": 24,
            },
            {
                "name": "topic",
                "jsonl": str(write_task(root / "topic.jsonl", "topic", 120, 2, False)),
                "train": 64,
                "head": 24,
                "validation": 16,
                "test": 24,
            },
        ],
        "head": {"c_grid": [1.0], "max_iter": 200},
        "finetune": {"steps": 6, "batch_size": 8, "lr": 1e-3, "threads": 1},
        "task_arithmetic": {"weights": [0.5, 1.0]},
        "niceness": 0,
    }
    path = root / "smoke.yml"
    path.write_text(yaml.safe_dump(config))
    return root, path


def run_cli(config: Path, root: Path, *extra: str):
    from click.testing import CliRunner

    from bench.merging.__main__ import main

    args = [
        "run",
        str(config),
        "--cache-dir",
        str(root / "cache"),
        "--results-dir",
        str(root / "results"),
        *extra,
    ]
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_pipeline_builds_heads_experts_scores_and_resumes(tiny_run):
    from safetensors import safe_open

    root, config = tiny_run
    first = run_cli(config, root)
    assert first.exit_code == 0, first.output
    results = json.loads((root / "results" / "smoke" / "results.json").read_text())
    assert results["tasks"] == ["mood", "topic"]
    rows = {row["anchor"]: row for row in results["rows"]}
    assert set(rows) == {"pretrained", "task_arithmetic"}
    for row in rows.values():
        assert set(row["per_task"]) == {"mood", "topic"}
        assert all(0.0 <= v <= 1.0 for v in row["per_task"].values())
    assert rows["task_arithmetic"]["hyperparameters"]["weight"] in (0.5, 1.0)
    assert set(results["indiv"]) == {"mood", "topic"}
    assert (root / "results" / "smoke" / "per_task.png").stat().st_size > 0
    assert "Indiv." in (root / "results" / "smoke" / "results.md").read_text()

    manifest = json.loads((root / "cache" / "runs" / "smoke" / "manifest.json").read_text())
    for task in ("mood", "topic"):
        with safe_open(manifest["heads"][task], framework="pt") as handle:
            assert json.loads(handle.metadata()["labels"]) == (
                ["positive", "negative"] if task == "mood" else ["0", "1"]
            )
            assert handle.get_tensor("weight").shape == (2, 32)
        expert = Path(manifest["experts"][task])
        assert (expert / "model.safetensors").is_file() and (expert / "tokenizer.json").is_file()
        lines = [json.loads(x) for x in Path(manifest["data"][task]).read_text().splitlines()]
        assert {x["split"] for x in lines} == {"train", "head", "validation", "test"}
        head_texts = {x["text"] for x in lines if x["split"] == "head"}
        assert head_texts and not head_texts & {x["text"] for x in lines if x["split"] == "train"}
    evaluator = yaml.safe_load((root / "cache" / "runs" / "smoke" / "evaluator-validation.yml").read_text())
    assert evaluator["evaluator"]["type"] == "classification"

    built = sorted(p.name for p in (root / "cache").glob("*/*") if p.is_dir())
    stamps = {p: p.stat().st_mtime_ns for p in (root / "cache").rglob("done.json")}
    second = run_cli(config, root)
    assert second.exit_code == 0, second.output
    assert "built" not in second.output and "(cached)" in second.output
    assert sorted(p.name for p in (root / "cache").glob("*/*") if p.is_dir()) == built
    assert {p: p.stat().st_mtime_ns for p in (root / "cache").rglob("done.json")} == stamps
    assert json.loads((root / "results" / "smoke" / "results.json").read_text())["rows"] == results["rows"]

    # Any encoder folder (here an expert) is scored with the run's heads; cached scores agree.
    from click.testing import CliRunner

    from bench.merging.__main__ import main

    args = [
        "score",
        str(config),
        manifest["experts"]["mood"],
        "--cache-dir",
        str(root / "cache"),
        "--task",
        "mood",
    ]
    scored = CliRunner().invoke(main, args, catch_exceptions=False)
    assert scored.exit_code == 0, scored.output
    assert f"mood {100 * results['indiv_validation']['mood']:.1f}" in scored.output


def test_experts_are_deterministic(tiny_run, tmp_path):
    """A second cache gets bit-identical expert weights (seeded order, dropout, threads)."""
    from bench.merging.config import load_config
    from bench.merging.pipeline import run_benchmark
    from mergekit_bmm.io.checkpoint import load_state_dict as load_weights

    root, config_path = tiny_run
    config = load_config(config_path)
    config.tasks = config.tasks[:1]
    run_benchmark(config, tmp_path / "cache", tmp_path / "results", until="experts")
    manifest = json.loads((tmp_path / "cache" / "runs" / "smoke" / "manifest.json").read_text())
    reference = json.loads((root / "cache" / "runs" / "smoke" / "manifest.json").read_text())
    assert Path(manifest["experts"]["mood"]).name == Path(reference["experts"]["mood"]).name
    ours, theirs = load_weights(manifest["experts"]["mood"]), load_weights(reference["experts"]["mood"])
    assert ours.keys() == theirs.keys()
    assert all(bool((ours[k] == theirs[k]).all()) for k in ours)


def test_interrupted_expert_resumes_to_identical_weights(tiny_run, tmp_path, monkeypatch):
    """Stop fine-tuning after 3 of 6 steps (checkpoint every 2), resume: same weights as uninterrupted."""
    import shutil

    import bench.merging.finetune as finetune
    from bench.merging.config import load_config
    from bench.merging.pipeline import run_benchmark
    from mergekit_bmm.io.checkpoint import load_state_dict as load_weights

    root, config_path = tiny_run
    config = load_config(config_path)
    config.tasks = config.tasks[:1]
    cache = tmp_path / "cache"
    shutil.copytree(root / "cache", cache)
    reference = json.loads((root / "cache" / "runs" / "smoke" / "manifest.json").read_text())["experts"][
        "mood"
    ]
    shutil.rmtree(cache / "experts" / Path(reference).name)

    class Interrupted(Exception):
        pass

    def stop_at(step):
        if step == 2:
            raise Interrupted

    original = finetune.train_loop
    monkeypatch.setattr(
        finetune,
        "train_loop",
        lambda *a, **k: original(*a[:5], checkpoint_every=2, progress=None, on_step=stop_at),
    )
    with pytest.raises(Interrupted):
        run_benchmark(config, cache, tmp_path / "results", until="experts")
    partial = cache / "experts" / (Path(reference).name + ".partial")
    assert (partial / "resume-state.ckpt").is_file()

    monkeypatch.setattr(finetune, "train_loop", original)
    run_benchmark(config, cache, tmp_path / "results", until="experts")
    resumed = cache / "experts" / Path(reference).name
    assert json.loads((resumed / "done.json").read_text())["info"]["resumed_at_step"] == 2
    assert not (resumed / "resume-state.ckpt").exists() and not partial.exists()
    ours, theirs = load_weights(resumed), load_weights(reference)
    assert all(bool((ours[k] == theirs[k]).all()) for k in theirs)


def test_modified_expert_is_rebuilt_not_trusted(tiny_run, tmp_path):
    import shutil

    from bench.merging.config import load_config
    from bench.merging.pipeline import run_benchmark

    root, config_path = tiny_run
    config = load_config(config_path)
    config.tasks = config.tasks[:1]
    cache = tmp_path / "cache"
    shutil.copytree(root / "cache", cache)
    manifest = json.loads((root / "cache" / "runs" / "smoke" / "manifest.json").read_text())
    expert = cache / "experts" / Path(manifest["experts"]["mood"]).name
    (expert / "model.safetensors").write_bytes(b"corrupt")
    run_benchmark(config, cache, tmp_path / "results", until="experts")
    assert (expert / "model.safetensors").stat().st_size > 1000


def test_bad_config_is_one_line_error(tmp_path):
    path = tmp_path / "bad.yml"
    path.write_text("name: x\ntasks: [{name: t, jsonl: relative.jsonl}]\n")
    result = run_cli(path, tmp_path)
    assert result.exit_code != 0
    assert result.output.strip().startswith("mergekit-bmm: error: benchmark config")
    assert len(result.output.strip().splitlines()) == 1


def test_an_anchor_tuned_at_the_end_of_its_grid_is_marked():
    from bench.merging.anchor_tuning import grid_edge

    assert grid_edge([0.3, 0.5, 1.0, 1.5], 1.5) == "largest"
    assert grid_edge([0.3, 0.5, 1.0, 1.5], 0.3) == "smallest"
    assert grid_edge([0.3, 0.5, 1.0, 1.5], 1.0) is None
    assert grid_edge([1.0], 1.0) is None and grid_edge([None], None) is None  # nothing was tuned


def test_anchors_statistics_and_bmm_searches(tiny_run, tmp_path, monkeypatch):
    """Phase 2 on the tiny run: an anchor grid, mergekit-bmm-stats, BMM searches and the ablation.

    The search's own validation score of its best trial must equal the benchmark's score of
    ``best/`` on the same subsets: both go through the one classification scorer.
    """
    import shutil

    root, config_path = tiny_run
    config = yaml.safe_load(config_path.read_text())
    config.update(
        {
            "evaluation": {"validation_limit": 12, "test_limit": 20},
            "anchors": [{"name": "tsv", "method": "tsv", "grid": {"alpha": [0.5, 1.0]}}],
            "stats": {"max_samples": 4},
            "search": {
                "anchors": ["task_arithmetic"],
                "settings": ["data_free", "data_assisted"],
                "blocks": 1,
                "groups": ["attn_in+attn_out", "mlp_in+mlp_out"],
                "budget": 2,
                "n_initial": 1,
                "seeds": [0, 1],
                "default_candidates": {"data_assisted": {"scale": 1.5}},
            },
            "sweeps": {
                "anchor": "task_arithmetic",
                "lambdas": [0.01, 1.0],
                "scales": [0.5, 1.5],
                "balance_anchors": ["task_arithmetic"],
                "balances": ["none", "trace"],
            },
            "ablation": {"anchor": "task_arithmetic", "setting": "data_free", "strategies": ["grid"]},
            "variants": [{"name": "balanced", "anchors": ["task_arithmetic"], "task_balance": "trace"}],
        }
    )
    phase2 = tmp_path / "phase2.yml"
    phase2.write_text(yaml.safe_dump(config))
    if (root / "cache").is_dir():  # reuse the first test's data, heads and experts when it ran
        shutil.copytree(root / "cache", tmp_path / "cache")

    class Killed(Exception):
        pass

    def killed(*args, **kwargs):
        raise Killed("the session ended")

    with monkeypatch.context() as patch:  # a run killed in the variants stage still leaves its report
        patch.setattr("bench.merging.variants.run_variants", killed)
        with pytest.raises(Killed):
            run_cli(phase2, tmp_path)
    so_far = (tmp_path / "results" / "smoke" / "results.md").read_text()
    assert (
        "Stages run: data, heads, experts, scores, task_arithmetic, anchors, sweeps, bmm, ablation;" in so_far
    )
    assert "not yet run: variants, language" in so_far and "## BMM against its anchor" in so_far
    result = run_cli(phase2, tmp_path)  # resumes: only the variants are new
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results" / "smoke" / "results.json").read_text())
    cells = {(row["anchor"], row["setting"]): row for row in results["rows"]}
    assert set(cells) == {
        ("pretrained", "anchor"),
        ("task_arithmetic", "anchor"),
        ("tsv", "anchor"),
        ("task_arithmetic", "data_free"),
        ("task_arithmetic", "data_assisted"),
    }
    assert cells[("tsv", "anchor")]["hyperparameters"]["alpha"] in (0.5, 1.0)
    for setting in ("data_free", "data_assisted"):
        row = cells[("task_arithmetic", setting)]
        assert row["budget"] == 2 and set(row["hyperparameters"]["best_values"])
        assert [seed["seed"] for seed in row["seeds"]] == [0, 1]
        defaults = row["defaults"]  # BMM at its defaults: one merge, no trials, scored like the rest
        assert 0 <= defaults["avg"] <= 1 and set(defaults["per_task"]) == {"mood", "topic"}
        for seed in row["seeds"]:  # the search's score of its best trial is the benchmark's of best/
            assert abs(seed["search_validation"] - seed["validation_avg"]) < 1e-3
        estimate, low, high = row["ci"]  # from the per-example scores: the same mean as the table's
        assert abs(estimate - row["avg"]) < 1e-3 and low <= estimate <= high
        assert row["delta"][1] <= row["delta"][0] <= row["delta"][2]
    summary = {(cell["anchor"], cell["mode"]): cell for cell in results["summary"]}
    assert set(summary) == {("task_arithmetic", "data_free"), ("task_arithmetic", "data_assisted")}
    for (anchor, mode), cell in summary.items():  # what a user reads off: scores, Δ, its interval
        assert cell["anchor_score"] == pytest.approx(cells[(anchor, "anchor")]["avg"], abs=1e-3)
        assert cell["bmm_score"] == pytest.approx(cells[(anchor, mode)]["avg"], abs=1e-3)
        assert cell["delta_low"] <= cell["delta"] <= cell["delta_high"]
        assert cell["best_anchor"] in ("task_arithmetic", "tsv") and "delta_best_anchor" in cell
        assert cell["defaults_delta_low"] <= cell["defaults_delta"] <= cell["defaults_delta_high"]
    proposed = cells[("task_arithmetic", "data_assisted")]["candidate"]  # a proposed default: one more merge
    today = cells[("task_arithmetic", "data_assisted")]["defaults"]
    assert proposed["parameters"] == {"scale": 1.5} and proposed["model_id"] != today["model_id"]
    assert "candidate" not in cells[("task_arithmetic", "data_free")]
    cell = summary[("task_arithmetic", "data_assisted")]
    assert cell["candidate_delta_low"] <= cell["candidate_delta"] <= cell["candidate_delta_high"]
    versus = cell["candidate_vs_defaults"]  # the choice between the two defaults, paired on test
    assert versus["low"] <= versus["estimate"] <= versus["high"]
    assert results["verdict"]["data_assisted"]["candidate_vs_defaults"] == 1
    assert "candidate_reach_80" not in results["verdict"]["data_free"]
    for mode in ("data_free", "data_assisted"):  # λ from the evidence: paired with anchor and search
        auto = cells[("task_arithmetic", mode)]["auto"]
        assert auto["parameters"] == {"lambda": "auto"} and len(auto["lambda_auto"]) == 6 * 2
        assert all(choice["lambda"] > 0 for choice in auto["lambda_auto"].values())
        cell = summary[("task_arithmetic", mode)]
        assert cell["auto_delta_low"] <= cell["auto_delta"] <= cell["auto_delta_high"]
        for key in ("auto_vs_search", "auto_vs_defaults"):  # the search it would replace, the default
            versus = cell[key]
            assert versus["low"] <= versus["estimate"] <= versus["high"]
    paired = results["verdict"]["data_free"]
    assert paired["auto_above_defaults"] + paired["auto_below_defaults"] <= paired["auto_vs_defaults"] == 1
    assert (tmp_path / "results" / "smoke" / "lambda_auto.png").stat().st_size > 0
    from bench.merging.report.plots import searched_lambdas

    for mode in ("data_free", "data_assisted"):  # the picture's crosses: the search's λ per group
        groups = set(searched_lambdas(cells[("task_arithmetic", mode)]))
        assert groups == {"attn_in", "attn_out", "mlp_in", "mlp_out"}
    page = (tmp_path / "results" / "smoke" / "results.md").read_text()
    assert "BMM at `lambda: auto`" in page and "`lambda: auto` paired against BMM at its defaults" in page
    assert results["verdict"]["data_free"]["anchors"] == 1
    tsv = next(r for r in results["rows"] if r["anchor"] == "tsv" and r["setting"] == "anchor")
    assert tsv["hyperparameters"]["grid_edge"] in {"largest", "smallest"}  # two points: the best ends it
    assert "grid_edge=" in page
    gained = results["verdict"]["data_free"]["search_gained"]  # defaults judged only where a search gained
    assert 0 <= results["verdict"]["data_free"]["defaults_reach_80"] <= gained <= 1
    for setting in ("data_free", "data_assisted"):  # how far BMM went from its anchor, per group
        moved = cells[("task_arithmetic", setting)]["moved"]
        assert set(moved) == {"attn_in", "attn_out", "mlp_in", "mlp_out"}
        assert all(value >= 0 for value in moved.values())
    norms = results["task_norms"]  # each task's weight in the data-free Gram, beside what BMM did to it
    assert set(norms) == {"mood", "topic"} and abs(sum(n["trace_share"] for n in norms.values()) - 1) < 1e-3
    assert all(n["norm"] > 0 for n in norms.values())
    assert set(results["alignment"]) == {"mood", "topic"}  # cos_F of U_tᵀU_t against each Gram
    assert all(0 <= task["mean"] <= 1 for task in results["alignment"].values())
    assert set(results["range"]) >= {"experts_minus_pretrained", "experts_minus_task_arithmetic"}
    estimate, low, high = cells[("task_arithmetic", "anchor")]["ci"]
    assert abs(estimate - cells[("task_arithmetic", "anchor")]["avg"]) < 1e-3 and low <= estimate <= high
    sweeps = results["sweeps"]["settings"]
    assert set(sweeps) == {"data_free", "data_assisted"}
    assert len(sweeps["data_free"]["points"]) == 1 + 4 * 2 + 2  # reference, λ per group, s
    assert (tmp_path / "results" / "smoke" / "sweeps.png").stat().st_size > 0
    assert [r["strategy"] for r in results["ablation"]["rows"]] == ["grid", "bo"]
    balance = results["balance_sweeps"]["cells"]["task_arithmetic/data_free"]  # one shared λ, then s
    assert set(balance) == {"none", "trace"} and len(balance["trace"]["points"]) == 1 + 2 + 2
    assert balance["trace"]["points"][0]["values"] == balance["none"]["points"][0]["values"]
    assert (tmp_path / "results" / "smoke" / "balance.png").stat().st_size > 0
    variant = results["variants"]["balanced"]["task_arithmetic/data_free"]  # paired against the main search
    assert variant["variant"]["task_balance"] == "trace" and variant["trials"] == 2
    assert variant["delta_main"][1] <= variant["delta_main"][0] <= variant["delta_main"][2]
    assert (
        variant["delta_best_anchor"][1] <= variant["delta_best_anchor"][0] <= variant["delta_best_anchor"][2]
    )
    recipe = yaml.safe_load((Path(variant["seeds"][0]["search"]) / "best.yml").read_text())
    assert recipe["parameters"]["task_balance"] == "trace"
    picks = results["best_models"]  # per mode, the search a user keeps (validation), against the best anchor
    assert picks["data_free"]["candidates"] == 2 and picks["data_assisted"]["candidates"] == 1
    best_free = max([cells[("task_arithmetic", "data_free")], variant], key=lambda r: r["validation_avg"])
    assert picks["data_free"]["avg"] == best_free["avg"]
    figure = picks["data_free"]["delta_best_anchor"]
    assert figure["low"] <= figure["estimate"] <= figure["high"]
    text = (tmp_path / "results" / "smoke" / "results.md").read_text()
    assert "Table 1 in kind" in text and "Table 3 in kind" in text and "Table 5 in kind" in text
    assert "Why BMM moves or keeps its anchor" in text and "mean cos_F" in text
    assert "## Variants" in text and "## Task balance" in text and "## The BMM model to keep" in text
    assert "BMM at a proposed default" in text and "scale 1.5: " in text
    assert "The proposed default paired against today's defaults on test — data_assisted: " in text
    assert (
        "share of range: anchor → BMM" in text and "| 100% |" in text
    )  # where models land, read as the paper
    assert (tmp_path / "results" / "smoke" / "per_anchor.png").stat().st_size > 0
    assert "![paired test differences](deltas.png)" in text  # Δ and intervals at a glance
    assert (tmp_path / "results" / "smoke" / "deltas.png").stat().st_size > 0

    again = run_cli(phase2, tmp_path)  # every cell is cached: nothing is merged or searched again
    assert again.exit_code == 0, again.output
    assert (
        json.loads((tmp_path / "results" / "smoke" / "results.json").read_text())["rows"] == results["rows"]
    )

    config["language"] = {"enabled": True}  # a run killed in the hour-long language track keeps the variants
    phase3 = tmp_path / "phase3.yml"
    phase3.write_text(yaml.safe_dump(config))
    with monkeypatch.context() as patch:
        patch.setattr("bench.merging.language.track.run_language_track", killed)
        with pytest.raises(Killed):
            run_cli(phase3, tmp_path)
    so_far = (tmp_path / "results" / "smoke" / "results.md").read_text()
    assert "ablation, variants; not yet run: language" in so_far and "## Variants" in so_far


def test_label_free_searches_beside_the_labelled_one(tiny_run, tmp_path):
    """``search.label_free``: the same search scored by agreement with the experts and by entropy on
    the statistics' unlabelled text, its best model scored on test and paired with the labelled search,
    the defaults and each other; ``search.objective`` makes the main searches label-free too."""
    import shutil

    root, config_path = tiny_run
    config = yaml.safe_load(config_path.read_text())
    free = {"anchors": ["task_arithmetic"], "settings": ["data_free"]}
    config.update(
        {
            "evaluation": {"validation_limit": 12, "test_limit": 20},
            "stats": {"max_samples": 4},
            "search": {
                "anchors": ["pretrained", "task_arithmetic"],  # the report is written after each cell
                "settings": ["data_free"],
                "blocks": 1,
                "groups": ["attn_in+attn_out+mlp_in+mlp_out"],
                "budget": 3,
                "n_initial": 2,
                "evidence_lambda": False,
                "label_free": [
                    {"objective": "agreement", "trace": ["task_arithmetic"], **free},
                    {"objective": "entropy", **free},
                ],
                "oracle": free,
            },
        }
    )
    path = tmp_path / "label-free.yml"
    path.write_text(yaml.safe_dump(config))
    if (root / "cache").is_dir():
        shutil.copytree(root / "cache", tmp_path / "cache")
    result = run_cli(path, tmp_path, "--until", "ablation")
    assert result.exit_code == 0, result.output
    assert "(up to bmm; bmm: data_free up to pretrained)" in result.output  # a cell's report, mid-stage
    results = json.loads((tmp_path / "results" / "smoke" / "results.json").read_text())
    row = next(r for r in results["rows"] if r["setting"] == "data_free" and r["anchor"] == "task_arithmetic")
    assert set(row["label_free"]) == {"agreement", "entropy"}
    for record in row["label_free"].values():
        assert 0 <= record["avg"] <= 1 and set(record["per_task"]) == {"mood", "topic"}
        search = json.loads((Path(record["search"]) / "summary.json").read_text())
        assert search["evaluator"]["type"] == "agreement"  # its trials read no labels
    assert (
        json.loads((Path(row["label_free"]["entropy"]["search"]) / "summary.json").read_text())["evaluator"][
            "objective"
        ]
        == "entropy"
    )
    cell = next(c for c in results["summary"] if c["anchor"] == "task_arithmetic")
    for key in (
        "agreement_vs_search",
        "agreement_vs_defaults",
        "entropy_vs_defaults",
        "agreement_vs_entropy",
    ):
        assert set(cell[key]) == {"estimate", "low", "high"}
    assert results["verdict"]["data_free"]["agreement_vs_entropy"] == 1
    oracle = json.loads((Path(row["oracle"]["search"]) / "summary.json").read_text())  # scored on test
    assert (
        all(task["split"] == "test" for task in oracle["evaluator"]["tasks"])
        and "oracle-" in row["oracle"]["search"]
    )
    assert set(cell["oracle_vs_search"]) == {"estimate", "low", "high"} and "found_share" in cell
    text = (tmp_path / "results" / "smoke" / "results.md").read_text()
    assert "searched with no labels, agreement with the experts" in text and "AdaMerging's entropy" in text
    trace = row["label_free"]["agreement"]["trace"]  # every trial re-merged: its test and every objective
    assert len(trace["trials"]) == 3 and all(0 <= t["test_avg"] <= 1 for t in trace["trials"])
    assert set(trace["trials"][0]["divergences"]) == {"kl", "reverse_kl", "top1", "entropy"}
    assert set(trace["correlations"]) == {
        f"{o}/{s}" for o in ("kl", "reverse_kl", "top1", "entropy") for s in ("base", "none")
    }
    assert "does a better agreement mean a better model?" in text and "oracle: BMM searched on test" in text
    assert (tmp_path / "results" / "smoke" / "label_free.png").is_file()
    from bench.merging.report.curve import write_curve  # the curve against the number of tasks

    curve = write_curve([tmp_path / "results" / "smoke" / "results.json"], tmp_path / "curve").read_text()
    assert "2 tasks (smoke)" in curve and "bmm over task_arithmetic (data_free)" in curve
    assert -1 <= results["task_cosines"]["mean"] <= 1 and "mean pairwise cosine | " in curve
    assert (tmp_path / "curve" / "curve.png").is_file()
    # the main searches themselves label-free: another search folder, its evaluator the agreement one
    config["search"].update({"objective": "agreement", "label_free": [], "oracle": None})
    path.write_text(yaml.safe_dump(config))
    result = run_cli(path, tmp_path, "--until", "bmm")
    assert result.exit_code == 0
    assert "(up to bmm; bmm: data_free up to pretrained)" in result.output  # stopping at bmm: still reports
    results = json.loads((tmp_path / "results" / "smoke" / "results.json").read_text())
    row = next(r for r in results["rows"] if r["setting"] == "data_free" and r["anchor"] == "task_arithmetic")
    assert "agreement-task_arithmetic" in row["seeds"][0]["search"]
