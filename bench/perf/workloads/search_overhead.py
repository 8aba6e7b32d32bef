"""Where a search trial's time goes: merge / evaluate / surrogate (GP), per strategy; resuming; merge routes.

``mergekit-bmm-search``'s loop in-process on a tiny generated Llama family with the example evaluator
(one forward pass per expert comparison), on the harness's protocol (:mod:`bench.perf.harness`):

* a whole search per strategy (random, the baseline; grid; bo with either acquisition optimiser); the
  figures split each one's mean trial into merge, evaluation and surrogate (from its ``trials.jsonl``);
* resuming the finished bo search for one more trial, from the proposer's snapshot and by replaying
  the log through a fresh optimiser;
* the merge route a search used before resident trials (``run_merge`` into a folder, then loading it)
  against the in-memory route (mergekit's plan and executor straight into a loaded model), same recipe.

    python -m bench.perf search_overhead [--set budget=20] [--set hidden=64] [--set blocks=2]
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path
from typing import Any

import torch

from bench.perf.harness import Group, Job, Workload


def _config(family, strategy: str, budget: int, blocks: int, acq_optimizer: str, folder: Path):
    from mergekit_bmm.search import parse_search_config

    experts = {path.name: str(path) for path in family.experts}
    raw = {
        "recipe": {
            "merge_method": "bmm",
            "base_model": str(family.base),
            "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in family.experts],
            "parameters": {"anchor_method": "task_arithmetic"},
            "dtype": "float32",
        },
        "blocks": blocks,
        "budget": budget,
        "n_initial": min(8, budget),
        "strategy": strategy,
        "acq_optimizer": acq_optimizer,
        "lambda_range": [1e-3, 100],
        "evaluator": {
            "type": "python",
            "callable": "mergekit_bmm.examples.tiny_objective:expert_agreement",
            "load_model": "AutoModelForCausalLM",
            "args": {"experts": experts},
        },
    }
    return parse_search_config(raw, folder)


def _search(config, out: Path) -> None:
    from mergekit_bmm.search import SearchOptions, run_search

    run_search(config, out, SearchOptions(device="cpu", progress=False, skip_best=True, plots=False))


def _resume(config, finished: Path, snapshot: bool):
    """A job: ``finished`` copied into the run's folder and resumed for one more trial, from the
    proposer's snapshot or by replaying the whole log (snapshot removed)."""

    def run(out: Path) -> None:
        shutil.copytree(finished, out)
        if not snapshot:
            (out / "proposer.pkl").unlink()
        _search(config.model_copy(update={"budget": config.budget + 1}), out)

    return run


def _in_memory_merge(text: str, model):
    """The recipe merged into an already loaded model, through the package's in-memory merge
    (mergekit's own plan and executor; no files)."""
    from mergekit.options import MergeOptions

    from mergekit_bmm.plugin.run import merge_recipe_in_memory

    parameters = dict(model.named_parameters())

    def into_model(name: str, tensor, out_dtype) -> None:
        if name in parameters:
            with torch.no_grad():
                parameters[name].copy_(tensor)

    merge_recipe_in_memory(text, MergeOptions(quiet=True), into_model)


def _route_recipe(family, work: Path) -> str:
    from mergekit_bmm.io.model_folder import weight_names_of
    from mergekit_bmm.search import parse_search_config
    from mergekit_bmm.search.space import SearchSpace, TrialRecipes

    recipe = {
        "merge_method": "bmm",
        "base_model": str(family.base),
        "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in family.experts],
        "parameters": {"anchor_method": "task_arithmetic"},
        "dtype": "float32",
    }
    config = parse_search_config(
        {"recipe": recipe, "blocks": 2, "evaluator": {"type": "python", "callable": "a:b"}}, work
    )
    names = weight_names_of(str(family.base))
    space = SearchSpace.from_config(config, recipe, names)
    return TrialRecipes(recipe, space, names).text(
        {n: 0.05 if "scale" not in n else 1.1 for n in space.names}
    )


STRATEGIES = (("random", "auto"), ("grid", "auto"), ("bo", "sampling"), ("bo", "lbfgs"))
DISK, MEMORY = "run_merge to a folder + from_pretrained", "in-memory plan + Executor into a loaded model"


def _label(strategy: str, acq: str) -> str:
    return f"search, {strategy}" if strategy != "bo" else f"search, bo (EI, acq_optimizer={acq})"


def _family(parameters: dict[str, Any], root: Path):
    from mergekit_bmm.examples.tiny_models import make_tiny_family

    return make_tiny_family(
        root / "models", "llama", n_experts=3, hidden=parameters["hidden"], layers=parameters["layers"]
    )


def build(parameters: dict[str, Any], root: Path) -> list[Group]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from mergekit_bmm.plugin.run import merge_recipe_text

    hf_logging.set_verbosity_error()
    family, budget, blocks = _family(parameters, root), parameters["budget"], parameters["blocks"]
    configs = {_label(s, a): _config(family, s, budget, blocks, a, root) for s, a in STRATEGIES}
    baseline = _label(*STRATEGIES[0])
    searches = [
        Job(label, lambda out, c=config: _search(c, out), None if label == baseline else baseline)
        for label, config in configs.items()
    ]
    bo = _label("bo", "sampling")
    finished = root / "out" / "group-0" / str(list(configs).index(bo))  # the harness's folder of that search
    snapshot = "resume one more trial from the snapshot (proposer.pkl)"
    resumes = [
        Job(snapshot, _resume(configs[bo], finished, True)),
        Job(
            "resume one more trial by replaying trials.jsonl", _resume(configs[bo], finished, False), snapshot
        ),
    ]
    text = _route_recipe(family, root)
    model = AutoModelForCausalLM.from_pretrained(family.base, dtype=torch.float32)
    routes = [
        Job(DISK, lambda out: (merge_recipe_text(text, out), AutoModelForCausalLM.from_pretrained(out))),
        Job(MEMORY, lambda out: _in_memory_merge(text, model), DISK),
    ]
    return [Group(searches, rounds=1), Group(resumes, rounds=1), Group(routes)]


def figures(parameters: dict[str, Any], root: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each search's mean trial split into merge, evaluation and surrogate, and its best score."""
    out = {}
    for index, (strategy, acq) in enumerate(STRATEGIES):
        lines = (root / "out" / "group-0" / str(index) / "trials.jsonl").read_text().splitlines()
        records = [r for r in (json.loads(line) for line in lines if line.strip()) if "event" not in r]
        mean = {k: statistics.mean(r["time"][k] for r in records) for k in ("merge", "evaluate", "surrogate")}
        best = max(r["score"] for r in records if r.get("score") is not None)
        out[_label(strategy, acq)] = (
            f"per trial: merge {mean['merge']:.3f} s, evaluate {mean['evaluate']:.3f} s, "
            f"surrogate {mean['surrogate']:.3f} s; best {best:.4f}"
        )
    return out


WORKLOAD = Workload(
    name="search_overhead",
    summary="a search trial split into merge, evaluation and surrogate per strategy; resuming; merge routes",
    sizes={
        "full": {"budget": 20, "hidden": 64, "layers": 4, "blocks": 2, "rounds": 5},
        "quick": {"budget": 3, "hidden": 32, "layers": 2, "blocks": 1, "rounds": 1},
    },
    build=build,
    figures=figures,
    notes=lambda p: (
        f"tiny Llama, hidden {p['hidden']}, {p['layers']} layers, 3 experts; "
        f"{5 * p['blocks']}-dimensional space; K = {p['budget']}"
    ),
)
