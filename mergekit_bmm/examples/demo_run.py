"""``mergekit-bmm-demo``'s job, step by step through the real commands.

Models are made locally (:mod:`~mergekit_bmm.examples.demo_training`); Task Arithmetic and TIES
are tuned on validation and merged by the stock ``mergekit-yaml``; ``bmm`` at its defaults is
merged the same way; ``mergekit-bmm-search`` tunes bmm over Task Arithmetic (cheap-then-full
evaluation through the demo's ``type: python`` evaluator) and merges its best recipe; the same
search then runs with no labels (``type: agreement``: how closely the merge reproduces each expert on
its task's unlabelled validation texts); every model is then scored on the held-out test split.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mergekit_bmm.errors import BMMError
from mergekit_bmm.examples import demo_tasks
from mergekit_bmm.examples.demo_training import FULL, DemoModels, DemoSize, build

TA_WEIGHTS = (0.25, 0.5, 0.75, 1.0)
TIES_DENSITIES = (0.3, 0.5, 0.8)


@dataclass
class DemoResult:
    """What the demo made and measured (test accuracy per model and task)."""

    root: Path
    models: DemoModels
    accuracy: dict[str, dict[str, float]] = field(default_factory=dict)
    recipes: dict[str, Path] = field(default_factory=dict)
    merged: dict[str, Path] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    convergence_plot: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _run(command: list[str], result: DemoResult, show: bool = False) -> None:
    """Run one of the real commands; its output shows when ``show`` (a progress bar), else on failure."""
    result.commands.append(shlex.join([Path(command[0]).name, *command[1:]]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, env=env, text=True, capture_output=not show)
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-1:] if not show else []
        raise BMMError(f"`{shlex.join(command)}` failed" + (f": {tail[0]}" if tail else ""))


def _merge(recipe: Path, out: Path, result: DemoResult, command: bool) -> None:
    """``mergekit-yaml recipe out``; without ``command`` the same merge runs in this process
    (the reduced run: mergekit's import costs seconds per command)."""
    if command:
        _run([_bin("mergekit-yaml"), str(recipe), str(out)], result)
        return
    from mergekit_bmm.plugin.run import merge_recipe_text

    result.commands.append(shlex.join(["mergekit-yaml", str(recipe), str(out)]))
    merge_recipe_text(recipe.read_text(encoding="utf-8"), out, source=str(recipe))


def _recipe(models: DemoModels, method: str, **parameters) -> dict:
    per_model = {key: parameters.pop(key) for key in ("weight", "density") if key in parameters}
    recipe = {
        "merge_method": method,
        "base_model": str(models.base),
        "models": [{"model": str(path), "parameters": dict(per_model)} for path in models.experts.values()],
        "dtype": "float32",
    }
    if parameters:
        recipe["parameters"] = parameters
    return recipe


def _load(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _accuracy(path: Path, data: Path, split: str, tasks: list[str] | None = None) -> dict[str, float]:
    model, tokenizer = _load(path)
    return demo_tasks.accuracy(model, tokenizer, str(data), split, tasks)


def _mean(values: dict[str, float]) -> float:
    return sum(values.values()) / len(values)


def _tune(
    models: DemoModels, root: Path, method: str, key: str, values: tuple[float, ...], **fixed: float
) -> float:
    """The value of ``key`` whose merge scores best on validation (merged in this process)."""
    from mergekit_bmm.plugin.run import merge_recipe_text

    best, best_score = values[0], -1.0
    for value in values:
        out = root / "tuning" / f"{method}-{key}-{value}"
        merge_recipe_text(yaml.safe_dump(_recipe(models, method, **fixed, **{key: value})), out)
        score = _mean(_accuracy(out, models.data, "validation"))
        if score > best_score:
            best, best_score = value, score
    return best


def _search_config(models: DemoModels, recipe: Path, budget: int) -> dict:
    return {
        "recipe": str(recipe),
        "blocks": 1,
        "budget": budget,
        "n_initial": min(4, budget),
        "seed": 0,
        "evaluator": {
            "type": "python",
            "callable": "mergekit_bmm.examples.demo_tasks:score",
            "examples": "mergekit_bmm.examples.demo_tasks:examples",
            "args": {"data": str(models.data), "split": "validation"},
        },
    }


def _label_free_config(models: DemoModels, recipe: Path, budget: int, root: Path) -> dict:
    """The same search scored by agreement with each expert on its task's validation texts, written
    without their labels (what a user with calibration text but no labels has), read through the
    task's head as the demo's tasks are (the class distribution of the mean-pooled last state)."""
    import torch

    from mergekit_bmm.evaluation.classification import save_head

    heads = demo_tasks.load_heads(str(models.data))
    tasks = []
    for task, expert in models.experts.items():
        rows = (models.data / "validation" / f"{task}.jsonl").read_text(encoding="utf-8").splitlines()
        texts = root / "unlabelled" / f"{task}.jsonl"
        texts.parent.mkdir(parents=True, exist_ok=True)
        unlabelled = (json.dumps({"text": json.loads(row)["text"]}) + "\n" for row in rows if row.strip())
        texts.write_text("".join(unlabelled), encoding="utf-8")
        weight = heads[task]
        head = save_head(
            root / "unlabelled" / f"{task}.head.safetensors",
            weight,
            torch.zeros(weight.shape[0]),
            [str(label) for label in range(weight.shape[0])],
        )
        tasks.append({"name": task, "model": str(expert), "data": str(texts), "head": str(head)})
    search = _search_config(models, recipe, budget)
    return {**search, "evaluator": {"type": "agreement", "tasks": tasks}}


def _search(search_yml: Path, out: Path, result: DemoResult, command: bool) -> dict:
    """``mergekit-bmm-search search_yml out`` (its progress shown); its summary. Without ``command``
    the search and its report run in this process (the reduced run, as for the merges)."""
    args = [str(search_yml), str(out), "--device", "cpu"]
    if command:
        _run([_bin("mergekit-bmm-search"), *args], result, show=True)
    else:  # what the command runs: the search, then its report
        from tqdm.auto import tqdm

        from mergekit_bmm.search import SearchOptions, load_search_config, run_search

        result.commands.append(shlex.join(["mergekit-bmm-search", *args]))
        echo = lambda line: tqdm.write(line, file=sys.stderr)  # noqa: E731  (beside its progress bar)
        print(run_search(load_search_config(search_yml), out, SearchOptions(device="cpu"), echo=echo).report)
    return json.loads((out / "summary.json").read_text(encoding="utf-8"))


def run_demo(root: Path, size: DemoSize = FULL, say: Callable[[str], None] = print) -> DemoResult:
    """Every step of the demo under ``root``; returns what it measured."""
    steps = 7
    started = time.perf_counter()
    say(f"[1/{steps}] pre-training a tiny Llama and fine-tuning 4 experts in {root}/models ...")
    models = build(root, size)
    result = DemoResult(root=root, models=models)
    result.seconds["models"] = time.perf_counter() - started

    mark = time.perf_counter()
    say(f"      tuning Task Arithmetic's weight and TIES's density on validation in {root}/tuning ...")
    weights, densities = TA_WEIGHTS[-size.grid :], TIES_DENSITIES[-size.grid :]
    weight = _tune(models, root, "task_arithmetic", "weight", weights)
    density = _tune(models, root, "ties", "density", densities, weight=1.0)
    plan = {
        "task_arithmetic": _recipe(models, "task_arithmetic", weight=weight),
        "ties": _recipe(models, "ties", weight=1.0, density=density),
        "bmm": _recipe(models, "bmm", weight=weight, anchor_method="task_arithmetic"),
    }
    notes = {
        "task_arithmetic": f"weight {weight} (best on validation of {', '.join(map(str, weights))})",
        "ties": f"density {density} (best on validation of {', '.join(map(str, densities))})",
        "bmm": "at its defaults (lambda 0.1, scale 1.0), over that Task Arithmetic",
    }
    for step, (name, recipe) in enumerate(plan.items(), start=2):
        path = root / f"{name}.yml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
        result.recipes[name], result.merged[name] = path, root / name
        say(f"[{step}/{steps}] mergekit-yaml {path.name} -> {root / name}  ({notes[name]})")
        _merge(path, root / name, result, size.commands)
    result.seconds["merges"] = time.perf_counter() - mark

    mark = time.perf_counter()
    search_yml = root / "search.yml"
    search_yml.write_text(
        yaml.safe_dump(_search_config(models, result.recipes["bmm"], size.budget), sort_keys=False),
        encoding="utf-8",
    )
    trials = f"{size.budget} trials of data-free bmm over Task Arithmetic"
    say(f"[5/{steps}] mergekit-bmm-search search.yml -> {root / 'search'}  ({trials})")
    summary = _search(search_yml, root / "search", result, size.commands)
    result.merged["bmm searched"] = root / "search" / (summary.get("best_model") or "best")
    if summary.get("convergence_plot"):
        result.convergence_plot = str(root / "search" / summary["convergence_plot"])
    result.seconds["search"] = time.perf_counter() - mark

    mark = time.perf_counter()
    label_free = root / "search-label-free.yml"
    config = _label_free_config(models, result.recipes["bmm"], size.budget, root)
    label_free.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    no_labels = "the same search with no labels: agreement with each expert on its unlabelled texts"
    say(f"[6/{steps}] mergekit-bmm-search {label_free.name} -> {root / 'search-label-free'}  ({no_labels})")
    summary = _search(label_free, root / "search-label-free", result, size.commands)
    result.merged["bmm no labels"] = root / "search-label-free" / (summary.get("best_model") or "best")
    result.seconds["search without labels"] = time.perf_counter() - mark

    mark = time.perf_counter()
    say(f"[7/{steps}] scoring every model on the test split ...")
    result.accuracy["base"] = _accuracy(models.base, models.data, "test")
    result.accuracy["experts"] = {
        task: _accuracy(path, models.data, "test", [task])[task] for task, path in models.experts.items()
    }
    for name, path in result.merged.items():
        result.accuracy[name] = _accuracy(path, models.data, "test")
    result.seconds["scoring"] = time.perf_counter() - mark
    result.seconds["total"] = time.perf_counter() - started
    return result


ROWS = (
    ("base", "base (before fine-tuning)"),
    ("experts", "each expert on its own task"),
    ("task_arithmetic", "Task Arithmetic"),
    ("ties", "TIES"),
    ("bmm", "BMM at its defaults"),
    ("bmm searched", "BMM searched"),
    ("bmm no labels", "BMM searched, no labels"),
)


def table(result: DemoResult) -> str:
    """Test accuracy per task and on average, one row per model."""
    tasks = [task.name for task in demo_tasks.TASKS]
    header = f"{'test accuracy (%)':<30}" + "".join(f"{t:>9}" for t in tasks) + f"{'mean':>9}"
    lines = [header, "-" * len(header)]
    for key, label in ROWS:
        found = result.accuracy.get(key)
        if found is None:
            continue
        cells = "".join(f"{100 * found[t]:>9.1f}" for t in tasks)
        lines.append(f"{label:<30}{cells}{100 * _mean(found):>9.1f}")
    return "\n".join(lines)


def what_next(result: DemoResult) -> str:
    """Where everything is, and the commands that repeat each step."""
    root = result.root
    lines = [
        f"tasks (each on its own alphabet; {len(demo_tasks.TASKS)} fixed heads, one per task): "
        + "; ".join(f"{task.name}: {task.question}" for task in demo_tasks.TASKS),
        f"models: {root / 'models'}/   data: {result.models.data}/",
        f"search: {root / 'search'}/ (summary.json, trials.jsonl, best.yml, best/); without labels: "
        f"{root / 'search-label-free'}/ (texts in {root / 'unlabelled'}/)",
    ]
    if result.convergence_plot:
        lines.append(f"convergence: {result.convergence_plot}")
    lines += ["", "Repeat any step, or run it on your own models (docs/your-own-models.md):"]
    lines += [f"  {command}" for command in result.commands]
    return "\n".join(lines)
