"""The stages that run BMM: statistics, sweeps, the searches over every anchor (with BMM at its
defaults beside each), and the search-strategy ablation. Every search resumes from its folder."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from bench.merging import report
from bench.merging.artifacts import Artifacts, say
from bench.merging.cache import ScoreCache, stable_key
from bench.merging.config import LabelFreeSpec, RunConfig, VariantSpec, limits
from bench.merging.diagnostics import (
    cached_moved_from_anchor,
    expert_alignment,
    task_update_norms,
    task_vector_cosines,
)
from bench.merging.encoder import load_encoder
from bench.merging.merging import recipe_key
from bench.merging.model_scores import evaluator_block, merge_and_score, search_evaluator
from bench.merging.scoring import mean, score_model
from bench.merging.searches import (
    bmm_template,
    collect_stats,
    keyed_search,
    run_search,
    search_config,
    seed_record,
)
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.search.config import default_box, recipe_gram


def ensure_stats(config: RunConfig, cache_dir: Path, art: Artifacts, results) -> None:
    if art.stats is not None:
        return
    names = list(art.tasks)
    art.stats, seconds = collect_stats(
        config.stats,
        {name: art.experts[name] for name in names},
        {name: art.tasks[name].data.data for name in names},
        config.max_length,
        cache_dir,
        config.name,
        {name: art.records[f"expert/{name}"]["fingerprint"] for name in names},
    )
    results["timings"]["stats_seconds"] = seconds
    results["stats"] = {
        "max_samples": config.stats.max_samples,
        "max_length": config.max_length,
        "split": "train",
    }
    say(f"stats     {config.stats.max_samples} sequences per task -> {art.stats} ({seconds} s)")


def cell_template(config: RunConfig, art: Artifacts, anchor: str, setting: str) -> dict[str, Any]:
    """The bmm recipe of one cell (``anchor``, ``setting``) over every task's expert."""
    experts = [art.experts[task.name] for task in art.tasks.values()]
    anchor_dir = anchor_folder(anchor, art)
    return bmm_template(art.encoder, experts, anchor_dir, setting, art.stats, config.gram_sharing)


def sweeps_stage(config: RunConfig, cache_dir: Path, art: Artifacts, results, folder: Path) -> None:
    """Validation along one λ group or s at a time (bench/merging/sweeps.py), data-free and data-assisted."""
    from bench.merging.sweeps import run_sweeps

    spec = config.sweeps
    ensure_stats(config, cache_dir, art, {"timings": {}})
    searches = {}
    for setting in spec.settings:
        template = cell_template(config, art, spec.anchor, setting)
        searches[setting] = sweep_search(config, art, template)
    anchor_row = report.find_row(results, spec.anchor) if spec.anchor != "pretrained" else None
    anchor_validation = anchor_row["validation_avg"] if anchor_row else None
    folder.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results["sweeps"] = run_sweeps(spec, searches, anchor_validation, cache_dir, folder)
    say(f"sweeps    {spec.anchor}: {len(searches)} settings, {round(time.time() - started)} s -> sweeps.png")
    if spec.balance_anchors:
        balance_sweeps_stage(config, art, results, cache_dir, folder)


def sweep_search(config: RunConfig, art: Artifacts, template: dict[str, Any]) -> dict[str, Any]:
    """The search.yml a sweep's resident model is built from: one block, every group, the grid's box."""
    from mergekit_bmm.core.module_map import GROUP_NAMES

    spec = config.sweeps
    return {
        "recipe": template,
        "blocks": 1,
        "groups": list(GROUP_NAMES),
        "lambda_range": [min(spec.lambdas), max(spec.lambdas)],
        "scale_range": [min(spec.scales), max(spec.scales)],
        "budget": 1,
        "n_initial": 1,
        "strategy": "random",
        "evaluator": evaluator_block(config, art, "validation"),
    }


def balance_sweeps_stage(config: RunConfig, art: Artifacts, results, cache_dir: Path, folder: Path) -> None:
    """Validation along one shared λ and then s, per ``task_balance``, over each balance anchor."""
    from bench.merging.sweeps import run_balance_sweeps

    spec = config.sweeps
    searches = {}
    for anchor in spec.balance_anchors:
        for setting in spec.balance_settings:
            for balance in spec.balances:
                template = cell_template(config, art, anchor, setting)
                if balance != "none":  # today's Gram: the parameter unset, as a user's recipe has it
                    template["parameters"]["task_balance"] = balance
                searches[(anchor, setting, balance)] = sweep_search(config, art, template)
    started = time.time()
    results["balance_sweeps"] = run_balance_sweeps(spec, searches, cache_dir, folder)
    say(f"balance   {len(searches)} sweeps, {round(time.time() - started)} s -> balance.png")


def anchor_folder(name: str, art: Artifacts) -> Path | None:
    if name == "pretrained":
        return None
    if name not in art.anchors:
        raise ConfigError(f"search anchor {name!r} is not a tuned anchor; known: {sorted(art.anchors)}")
    return art.anchors[name]


def search_folder(config: RunConfig, cache_dir: Path, label: str, search: dict[str, Any]) -> Path:
    # the default box is in: a search left to the defaults is another search when they change
    key = stable_key(
        {
            "search": keyed_search(search),
            "limits": limits(config),
            "default_box": default_box(recipe_gram(search["recipe"])),
        }
    )
    return cache_dir / "searches" / config.name / f"{label}-{key}"


def one_search(
    config: RunConfig,
    cache_dir: Path,
    art: Artifacts,
    anchor: str,
    setting: str,
    strategy: str,
    seed: int,
    variant: VariantSpec | None = None,
    label_free: LabelFreeSpec | None = None,
    oracle: bool = False,
) -> dict[str, Any]:
    """One ``mergekit-bmm-search``, its best model scored on validation and test; a ``variant``
    changes the main searches' blocks, budget or task balance; ``label_free`` scores its trials with
    no labels (the benchmark still scores its best model on validation and test)."""
    tasks = list(art.tasks.values())
    if setting == "data_assisted":
        ensure_stats(config, cache_dir, art, {"timings": {}})
    template = cell_template(config, art, anchor, setting)
    spec = config.search
    if variant is not None:
        changes = {"blocks": variant.blocks, "budget": variant.budget, "n_initial": variant.n_initial}
        spec = spec.model_copy(update={key: value for key, value in changes.items() if value is not None})
        if variant.task_balance is not None:
            template["parameters"]["task_balance"] = variant.task_balance
        if variant.gram_sharing is not None:
            template["parameters"]["gram_sharing"] = variant.gram_sharing
    search = search_config(spec, template, search_evaluator(config, art, label_free, oracle), strategy, seed)
    label = f"{anchor}-{setting}-{strategy}" + (f"-seed{seed}" if seed else "")
    label = f"{variant.name}-{label}" if variant is not None else label
    objective = label_free.objective if label_free is not None else config.search.objective
    label = f"{objective}-{label}" if objective != "labelled" else label
    label = f"oracle-{label}" if oracle else label  # scored on test: a ceiling, never a result
    folder = search_folder(config, cache_dir, label, search)
    factors = cache_dir / "factors" / config.name / f"{anchor}-{setting}"  # shared by the cell's searches
    started = time.time()
    outcome = run_search(search, folder, config.search.threads, config.search.workers, factors)
    recipe = outcome["best_recipe"]
    recipe["parameters"].pop("cache", None)  # where the factors were kept does not change the model
    key = recipe_key(recipe)
    best_dir = outcome["best_dir"]
    scores = score_model(
        key,
        lambda: load_encoder(best_dir, config.work_threads),
        [(t, s) for t in tasks for s in ("validation", "test")],
        config.max_length,
        config.eval_batch_size,
        ScoreCache(cache_dir),
        f"{anchor} {setting} {strategy} seed {seed}",
        limits(config),
    )
    validation = mean([scores[(t.name, "validation")] for t in tasks])
    outcome.update(
        scores=scores,
        folder=folder,
        model_id=key,
        seed=seed,
        validation_rescored=validation,
        seconds_this_run=round(time.time() - started, 1),
    )
    return outcome


def bmm_stage(
    config: RunConfig,
    cache_dir: Path,
    art: Artifacts,
    results,
    setting: str,
    after_cell: Callable[[str], None] | None = None,
) -> None:
    """BMM over each anchor in one setting, λ/s from ``mergekit-bmm-search``, one search per seed;
    ``after_cell(anchor)`` once an anchor's searches are done (the pipeline writes the report there, so a
    run cut short mid-stage still leaves every finished cell)."""
    cells = [(anchor, setting) for anchor in config.search.anchors]
    runtime = results.setdefault("bmm_runtime", {})
    if setting == "data_assisted":
        ensure_stats(config, cache_dir, art, {"timings": {}})
    if "task_norms" not in results:  # how much each task weighs in the data-free Gram
        results["task_norms"] = task_update_norms(
            art.encoder, {t: art.experts[t] for t in art.tasks}, cache_dir
        )
    if "task_cosines" not in results:  # how far the experts pull the encoder apart
        results["task_cosines"] = task_vector_cosines(
            art.encoder, {t: art.experts[t] for t in art.tasks}, cache_dir
        )
    if art.stats is not None and "alignment" not in results:
        experts = [art.experts[task] for task in art.tasks]
        results["alignment"] = expert_alignment(art.stats, art.encoder, experts, cache_dir)
    for anchor, setting in tqdm(cells, desc="bmm searches", leave=False):
        seeds = config.search.anchor_seeds.get(anchor, config.search.seeds)
        outcomes = [one_search(config, cache_dir, art, anchor, setting, "bo", seed) for seed in seeds]
        seeds = [seed_record(outcome, list(art.tasks)) for outcome in outcomes]
        scores = {
            (t, split): mean([outcome["scores"][(t, split)] for outcome in outcomes])
            for t in art.tasks
            for split in ("validation", "test")
        }
        first = outcomes[0]
        hyper = {"best_values": first["best_values"], "search_validation": first["best_validation"]}
        row = report.add_row(results, anchor, setting, scores, hyper, budget=first["trials"])
        row["seeds"] = seeds
        row["defaults"] = bmm_defaults(config, cache_dir, art, anchor, setting)
        proposed = config.search.default_candidates.get(setting)
        if proposed:  # a default proposed for this mode: one merge, no trials, scored the same way
            row["candidate"] = bmm_defaults(config, cache_dir, art, anchor, setting, proposed)
        if config.search.evidence_lambda:  # λ from the evidence, s 1: one merge, no validation data
            row["auto"] = bmm_defaults(config, cache_dir, art, anchor, setting, {"lambda": "auto"})
        for spec in config.search.label_free:  # the same search with no labels, same K and seed
            if anchor in spec.anchors and setting in spec.settings:
                outcome = one_search(
                    config, cache_dir, art, anchor, setting, "bo", seeds[0]["seed"], None, spec
                )
                record = seed_record(outcome, list(art.tasks))
                row.setdefault("label_free", {})[spec.name] = record
                if anchor in spec.trace:  # every trial against test: does the objective transfer?
                    from bench.merging.label_free_trace import trace_search

                    folder = Path(outcome["folder"])
                    record["trace"] = trace_search(config, cache_dir, art, spec, folder, outcome["template"])
                say(f"bmm       {anchor:16s} {setting:13s} no labels ({spec.name}) {100 * record['avg']:.1f}")
        oracle = config.search.oracle
        if oracle is not None and anchor in oracle.anchors and setting in oracle.settings:
            found = one_search(config, cache_dir, art, anchor, setting, "bo", seeds[0]["seed"], oracle=True)
            row["oracle"] = seed_record(found, list(art.tasks))  # its search score is a test score
            say(f"bmm       {anchor:16s} {setting:13s} oracle (test as objective) {100 * found_avg(row):.1f}")
        if anchor != "pretrained" and Path(first["best_dir"]).is_dir():
            row["moved"] = cached_moved_from_anchor(
                Path(first["best_dir"]), art.anchors[anchor], art.encoder, cache_dir
            )
        runtime[f"{anchor}/{setting}"] = {
            "trials": sum(o["trials"] for o in outcomes),
            "failed": sum(o["failed"] for o in outcomes),
            **{key: round(sum(o["times"][key] for o in outcomes), 1) for key in first["times"]},
            "wall": round(sum(o["wall"] for o in outcomes), 1),
        }
        spread = [seed["avg"] for seed in seeds]
        say(
            f"bmm       {anchor:16s} {setting:13s} K={first['trials']} x {len(seeds)} seeds, test "
            f"{100 * mean(spread):.1f} (seeds {', '.join(f'{100 * v:.1f}' for v in spread)})"
        )
        if after_cell is not None:
            after_cell(anchor)


def found_avg(row: dict[str, Any]) -> float:
    return row["oracle"]["avg"]


def bmm_defaults(
    config: RunConfig,
    cache_dir: Path,
    art: Artifacts,
    anchor: str,
    setting: str,
    parameters: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """BMM at its defaults over ``anchor``: the search's recipe with no λ or s (one merge, no trials);
    with ``parameters``, at those instead (a proposed default)."""
    tasks = list(art.tasks.values())
    recipe = cell_template(config, art, anchor, setting)
    recipe["parameters"].update(parameters or {})
    jobs = [(t, s) for t in tasks for s in ("validation", "test")]
    work = cache_dir / "merges" / "work"
    outcome = merge_and_score(recipe, jobs, config, ScoreCache(cache_dir), cache_dir, work)
    scores = outcome["scores"]
    return {
        "model_id": outcome["key"],
        "avg": round(mean([scores[(t.name, "test")] for t in tasks]), 4),
        "validation_avg": round(mean([scores[(t.name, "validation")] for t in tasks]), 4),
        "per_task": {t.name: round(scores[(t.name, "test")], 4) for t in tasks},
        "merge_seconds": outcome["merge_seconds"],
        **({"parameters": dict(parameters)} if parameters else {}),
        **({"lambda_auto": outcome["lambda_auto"]} if "lambda_auto" in outcome else {}),
    }


def ablation_stage(config: RunConfig, cache_dir: Path, art: Artifacts, results) -> None:
    """Shared-λ grid and random search against BO, same anchor, setting and budget K."""
    spec = config.ablation
    rows = []
    for strategy in tqdm([*spec.strategies, "bo"], desc="ablation", leave=False):
        outcome = one_search(
            config, cache_dir, art, spec.anchor, spec.setting, strategy, config.search.seeds[0]
        )
        rows.append(
            {
                "strategy": strategy,
                "budget": outcome["trials"],
                "validation": round(outcome["best_validation"], 4),
                "test": round(mean([outcome["scores"][(t, "test")] for t in art.tasks]), 4),
                "best_values": outcome["best_values"],
                "times": outcome["times"],
                "wall": outcome["wall"],
                "curve": outcome["curve"],
            }
        )
    results["ablation"] = {"anchor": spec.anchor, "setting": spec.setting, "rows": rows}
