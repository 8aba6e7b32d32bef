"""Cheap-then-full evaluation against full evaluation: trials per hour and the model each finds.

One search, same ``search.yml`` and seed, run once with full evaluation (what ``--full-eval`` sets)
and once per ``cheap`` share (cheap-then-full with early stopping), each arm in a process of its own,
one after the other (the harness's protocol; each arm is its own group, so a long run that stops
keeps the arms it finished, and the arm it stopped in resumes its search on the next run). Then
every arm's ``best/`` is scored on the test split, every example, and the figures are: trials per hour
(the search's own clock, over all its runs) and per CPU-hour (each trial's ``time.cpu`` in
``trials.jsonl``, so start-up and the final merge do not count), evaluation seconds per trial, the
share of validation examples scored, promotions, the best validation score, the test score with its
95 % bootstrap interval and the paired test difference (staged − full), and the CPU-seconds of each
ten trials against the full arm's same ten (the saving grows as the incumbent settles);
``search_fidelity.png`` is the best validation score against the search's clock.

The search comes from a merging-benchmark run (data-free BMM over Task Arithmetic at
``anchor_weight``, one block, the four λ groups and s): ``track=classification`` scores the MiniLM
experts with the run's classification evaluator, ``track=language`` the SmolLM2 experts of its language
track with lm-eval (``tasks``: some of them); or from any ``search_yml`` with a ``test_evaluator``
YAML. ``--quick`` searches a small generated encoder family (trial mechanics, no figure to report).

    python -m bench.perf search_fidelity --set budget=100
    python -m bench.perf search_fidelity --set track=language --set anchor_weight=0.5 \\
        --set tasks=rt_sentiment_mc,subjectivity_mc,election_tweets_mc --set cheap=0.25,0.15 --set budget=100
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from bench.common import ensure_encoder_family
from bench.perf.harness import Group, Job, Workload

REPO = Path(__file__).resolve().parents[3]
FULL = "full"
POSITION = 10  # trials a step of the by-position CPU figure


# -- the search --------------------------------------------------------------------------------
def _bmm_over_task_arithmetic(base: str, experts: list[str], weight: float) -> dict:
    return {
        "merge_method": "bmm",
        "base_model": base,
        "models": [{"model": path, "parameters": {"weight": weight}} for path in experts],
        "parameters": {"anchor_method": "task_arithmetic"},
        "dtype": "float32",
    }


def _from_classification_run(run: Path, parameters: dict[str, Any]) -> tuple[dict, dict]:
    manifest = json.loads((run / "manifest.json").read_text(encoding="utf-8"))
    validation = yaml.safe_load((run / "evaluator-validation.yml").read_text(encoding="utf-8"))
    test = yaml.safe_load((run / "evaluator-test.yml").read_text(encoding="utf-8"))
    recipe = _bmm_over_task_arithmetic(
        manifest["base"], list(manifest["experts"].values()), parameters["anchor_weight"]
    )
    return {"recipe": recipe, **validation}, test["evaluator"]


def _from_language_run(run: Path, parameters: dict[str, Any]) -> tuple[dict, dict]:
    """The language track's SmolLM2 experts (``<run>/language.json``, written by the track), scored
    by lm-eval ``acc``."""
    track = json.loads((run / "language.json").read_text(encoding="utf-8"))
    names = [n for n in str(parameters["tasks"]).split(",") if n] or list(track["tasks"])
    unknown = sorted(set(names) - set(track["tasks"]))
    if unknown:
        known = list(track["tasks"])
        raise SystemExit(f"--set tasks: {unknown} are not tasks of this language track; it has {known}")
    experts = [track["experts"][name] for name in names]

    def evaluator(split: str) -> dict:
        return {
            "type": "lm_eval",
            "tasks": [{"name": track["tasks"][name][split], "metric": "acc"} for name in names],
            "include_path": track["lm_eval_include_path"],
            "batch_size": 16,
            "dtype": "float32",
        }

    recipe = _bmm_over_task_arithmetic(track["base"], experts, parameters["anchor_weight"])
    return {"recipe": recipe, "evaluator": evaluator("validation")}, evaluator("test")


def search_and_test(parameters: dict[str, Any], root: Path) -> tuple[dict, dict]:
    """(the search.yml mapping, the test evaluator block) the arms share."""
    if parameters["search_yml"]:
        search = yaml.safe_load(Path(parameters["search_yml"]).read_text(encoding="utf-8"))
        test = yaml.safe_load(Path(parameters["test_evaluator"]).read_text(encoding="utf-8"))["evaluator"]
    elif parameters["run"]:
        read = _from_language_run if parameters["track"] == "language" else _from_classification_run
        search, test = read(Path(parameters["run"]), parameters)
        search = {**search, "blocks": 1, "groups": str(parameters["groups"]).split(",")}
    else:  # the quick size: a generated encoder family, its validation texts as the test split too
        family, evaluator = ensure_encoder_family(root / "encoder", hidden=64, layers=2, experts=3, tasks=2)
        recipe = _bmm_over_task_arithmetic(
            str(family["base"]), [str(p) for p in family["experts"]], parameters["anchor_weight"]
        )
        search, test = {"recipe": recipe, "blocks": 1, "evaluator": evaluator}, evaluator
    search = {**search, "budget": parameters["budget"]}
    search.setdefault("n_initial", min(parameters["n_initial"], parameters["budget"]))
    return search, test


def arms(parameters: dict[str, Any]) -> dict[str, float | None]:
    """Each arm's cheap share by its label (``None``: full evaluation)."""
    shares = [float(share) for share in str(parameters["cheap"]).split(",") if share]
    return {FULL: None, **{f"cheap {share:g}": share for share in shares}}


def base_dir(parameters: dict[str, Any], key: str) -> Path:
    """Where relative paths of the ``key`` YAML (``search_yml``, ``test_evaluator``) start: its folder."""
    return Path(parameters[key]).resolve().parent if parameters["search_yml"] else REPO


def arm_job(label: str, share: float | None, search: dict, paths_from: Path) -> Job:
    """An arm: the search into ``<out>/search`` (its ``search.yml`` kept beside it), run in the
    process the harness forks for it: imports paid once, memory its own."""

    def run(out: Path) -> None:
        from mergekit_bmm.search import SearchOptions, parse_search_config, run_search

        out.mkdir(parents=True, exist_ok=True)
        fidelity = {
            **search.get("fidelity", {}),
            **({"enabled": False} if share is None else {"cheap": share}),
        }
        arm = {**search, "fidelity": fidelity}  # enabled: false is what --full-eval sets
        (out / "search.yml").write_text(yaml.safe_dump(arm, sort_keys=False), encoding="utf-8")
        options = SearchOptions(device="cpu", progress=False, plots=False)  # the workload draws its own
        run_search(parse_search_config(arm, paths_from), out / "search", options, echo=lambda line: None)

    return Job(label, run)


def build(parameters: dict[str, Any], root: Path) -> list[Group]:
    import skopt  # noqa: F401  (imported once here, not in every forked search)
    import torch
    from transformers.utils import logging as hf_logging

    from mergekit_bmm.plugin import activate

    activate()
    hf_logging.set_verbosity_error()  # as mergekit-bmm-search does: the table, not loading bars
    hf_logging.disable_progress_bar()
    search, _ = search_and_test(parameters, root)
    torch.set_num_threads(1)  # the searches run on ``threads`` in their forked processes (harness.Group)
    return [
        Group(
            [arm_job(label, share, search, base_dir(parameters, "search_yml"))],
            rounds=1,
            warmup=0,
            fork=True,
            threads=parameters["threads"],
            resumes=True,  # the search goes on from its trials.jsonl; its own clock times it
        )
        for label, share in arms(parameters).items()
    ]


# -- the figures -------------------------------------------------------------------------------
def test_values(evaluator_block: dict, model_dir: Path, paths_from: Path) -> dict[str, list[float]]:
    """Per task, the per-example test scores of a merged model (every test example)."""
    from pydantic import TypeAdapter

    from mergekit_bmm.evaluation import make_evaluator
    from mergekit_bmm.evaluation.base import load_model, load_tokenizer
    from mergekit_bmm.evaluation.config import EvaluatorConfig

    config = TypeAdapter(EvaluatorConfig).validate_python(evaluator_block, context={"base_dir": paths_from})
    evaluator = make_evaluator(config, "cpu")
    if not getattr(evaluator, "scores_examples", False):
        raise SystemExit(
            "the test evaluator cannot score single examples (use classification or a mean metric)"
        )
    loading = evaluator.loading
    model = load_model(model_dir, loading.class_name, "cpu", loading.dtype)
    score = evaluator.example_scorer(model, load_tokenizer(model_dir))
    return {task: score(task, range(spec.count)) for task, spec in evaluator.examples().items()}


def measure(folder: Path, values: dict[str, list[float]]) -> dict[str, Any]:
    """One arm's figures from its search folder and its best model's test scores."""
    from bench.merging.intervals import interval
    from bench.merging.searches import search_clock, search_seconds

    summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    lines = (folder / "trials.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if '"trial"' in line]
    evaluate = sum(r["time"].get("evaluate", 0.0) for r in records)
    cpu = sum(r["time"].get("cpu", 0.0) + r["time"].get("surrogate", 0.0) for r in records)
    scored = sum((r.get("fidelity") or {}).get("scored", 0) for r in records)
    total = sum((r.get("fidelity") or {}).get("total", 0) for r in records)
    seconds = search_seconds(records)
    estimate, low, high = interval(values)
    by_position: dict[int, float] = {}  # CPU-s per ten trials, by trial number: where the saving grows
    for r in records:
        tens = r["trial"] // POSITION
        by_position[tens] = by_position.get(tens, 0.0) + r["time"].get("cpu", 0.0)
    return {
        "trials": len(records),
        "search_seconds": round(seconds, 1),
        "trials_per_hour": round(3600 * len(records) / seconds, 1),
        "cpu_seconds": round(cpu, 1),
        "trials_per_cpu_hour": round(3600 * len(records) / cpu, 1) if cpu else None,
        "evaluate_seconds_per_trial": round(evaluate / max(len(records), 1), 2),
        "examples_scored_share": round(scored / total, 4) if total else 1.0,
        "fidelity": summary.get("fidelity"),
        "best_validation": summary["best_score"],
        "best_values": summary["best_values"],
        "test": [round(estimate, 4), round(low, 4), round(high, 4)],
        "cpu_by_position": [round(by_position[k], 1) for k in sorted(by_position)],
        "curve": [
            [round(clock, 1), r["score"]]
            for clock, r in search_clock(records)
            if r.get("status") == "ok" and (r.get("fidelity") or {}).get("level", "full") == "full"
        ],
    }


def describe(results: dict[str, dict]) -> str:
    """The arms side by side, then each staged arm against the full one."""
    head = (
        f"{'evaluation':<16}{'K':>4}{'search s':>10}{'trials/h':>10}{'trials/CPU-h':>14}{'eval s/trial':>14}"
        f"{'examples':>10}{'full/promoted/stopped':>23}{'best val':>10}{'test [95% CI]':>24}"
    )
    lines = [head, "-" * len(head)]
    for label, row in results.items():
        fidelity = row["fidelity"] or {}
        counts = "/".join(
            str(fidelity.get(key, default))
            for key, default in (("full", row["trials"]), ("promoted", 0), ("stopped_early", 0))
        )
        test = f"{100 * row['test'][0]:.2f} [{100 * row['test'][1]:.2f}, {100 * row['test'][2]:.2f}]"
        lines.append(
            f"{label:<16}{row['trials']:>4}{row['search_seconds']:>10.0f}{row['trials_per_hour']:>10.1f}"
            f"{row['trials_per_cpu_hour'] or 0:>14.1f}{row['evaluate_seconds_per_trial']:>14.2f}"
            f"{100 * row['examples_scored_share']:>9.0f}%{counts:>23}"
            f"{100 * row['best_validation']:>10.2f}{test:>24}"
        )
    lines.append("")
    for label, row in results.items():
        if label != FULL:
            delta = ", ".join(f"{100 * v:.2f}" for v in row["test_delta"][1:])
            lines.append(
                f"{label} over full: trials/hour {row['speedup']:.2f}x, trials/CPU-hour "
                f"{row['cpu_speedup']:.2f}x; test, {label} - full (paired): "
                f"{100 * row['test_delta'][0]:+.2f} [{delta}] points"
            )
            steps = zip(results[FULL]["cpu_by_position"], row["cpu_by_position"])
            lines.append(
                f"{label}, CPU-s of full over {label} by trial number: "
                + ", ".join(
                    f"{POSITION * i}-{POSITION * i + POSITION - 1} {full / staged:.2f}x"
                    for i, (full, staged) in enumerate(steps)
                    if staged
                )
            )
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, row in results.items():
        best, xs, ys = None, [], []
        for clock, score in row["curve"]:
            best = score if best is None else max(best, score)
            xs.append(clock / 60)
            ys.append(100 * best)
        if ys:  # the best so far holds until the last trial ends
            xs.append(row["search_seconds"] / 60)
            ys.append(ys[-1])
        ax.step(xs, ys, where="post", label=f"{label} ({row['trials_per_hour']:.0f} trials/h)")
    ax.set_xlabel("the search's own clock (min)")
    ax.set_ylabel("best validation score (%)")
    ax.set_title("Cheap-then-full against full evaluation, same search and seed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figures(parameters: dict[str, Any], root: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    import os

    import torch

    from bench.merging.intervals import paired_difference

    torch.set_num_threads(os.cpu_count() or 1)  # the test scoring, in this process, after the forks
    search, test = search_and_test(parameters, root)
    results, values = {}, {}
    for number, label in enumerate(arms(parameters)):
        folder = root / "out" / f"group-{number}" / "0" / "search"
        values[label] = test_values(test, folder / "best", base_dir(parameters, "test_evaluator"))
        results[label] = measure(folder, values[label])
    full = results[FULL]
    for label, row in results.items():
        if label != FULL:
            row["speedup"] = round(row["trials_per_hour"] / full["trials_per_hour"], 3)
            cpu = (row["trials_per_cpu_hour"] or 0) / (full["trials_per_cpu_hour"] or 1)
            row["cpu_speedup"] = round(cpu, 3)
            row["test_delta"] = [round(v, 4) for v in paired_difference(values[label], values[FULL])]
    arms_json = root / "search_fidelity-arms.json"  # every arm's figures, curves and best values included
    arms_json.write_text(json.dumps({"search": search, "arms": results}, indent=2, default=str) + "\n")
    return {
        "arms": str(arms_json),
        "table": "\n" + describe(results),
        "picture": str(plot(results, root / "search_fidelity.png")),
    }


WORKLOAD = Workload(
    name="search_fidelity",
    summary="one search with cheap-then-full evaluation against full evaluation: trials/hour, test Δ",
    sizes={
        "full": {
            "run": "/work/bench-cache/runs/zeroshot8",
            "track": "classification",
            "search_yml": "",
            "test_evaluator": "",
            "tasks": "",
            "anchor_weight": 0.3,
            "groups": "attn_in,attn_out,mlp_in,mlp_out",
            "budget": 40,
            "n_initial": 10,
            "cheap": "0.25",
            "threads": 1,
            "rounds": 1,
        },
        "quick": {"run": "", "budget": 3, "n_initial": 2},
    },
    build=build,
    figures=figures,
    notes=lambda p: (
        f"{p['search_yml'] or p['run'] or 'a generated encoder family'}"
        f"{' (' + p['track'] + ')' if p['run'] and not p['search_yml'] else ''}, K = {p['budget']}, "
        f"cheap shares {p['cheap']}, {p['threads']} thread(s) a search"
    ),
)
