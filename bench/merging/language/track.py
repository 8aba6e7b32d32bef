"""The language track's phase-1 stages: model, tasks, experts, lm-eval scores, TA merges.

Scores: the pretrained model on every task (validation and test), each expert on its
own task ("Indiv."), and Task Arithmetic over all experts at a few weights on validation
(the best also on test) — the dynamic range the merge methods are judged in.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from bench.merging.anchor_tuning import materialise, tune_anchor
from bench.merging.cache import ScoreCache, write_json
from bench.merging.config import RunConfig
from bench.merging.intervals import paired_difference
from bench.merging.language.convert import prepare_language_model
from bench.merging.language.label_free import every_bmm_model, label_free_pairs, label_free_searches
from bench.merging.language.lm_eval_runner import (
    lm_score_key,
    needs_scoring,
    score_lm,
    summarize,
    test_documents,
)
from bench.merging.language.lm_finetune import build_lm_expert
from bench.merging.language.mc_tasks import build_mc_task, write_lm_eval_yamls
from bench.merging.language.statistics import expert_statistics
from bench.merging.merging import (
    chooses_lambda,
    chosen_lambdas,
    recipe_key,
    run_mergekit,
    task_arithmetic_recipe,
)
from bench.merging.scoring import mean

Progress = Callable[[dict[str, Any]], None]  # handed the results so far, at each checkpoint


def say(message: str) -> None:
    tqdm.write(message)


def run_language_track(
    config: RunConfig, cache_dir: Path, checkpoint: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Every model of the language track scored, every stage cached; ``checkpoint`` is handed the
    results so far (``reached`` says how far) where the LoRA track finishes an anchor or a method."""
    spec = config.language
    cache = ScoreCache(cache_dir)
    timings: dict[str, float] = {}
    model_dir, record, cached = prepare_language_model(spec, cache_dir)
    model_fp = record["fingerprint"]
    timings["convert_seconds"] = record["seconds"]
    state = "cached" if cached else "converted"
    say(f"LM        {spec.name} -> {model_dir} ({state} in {record['seconds']:.0f} s)")
    tasks = []
    for task_spec in spec.tasks:
        task, cached = build_mc_task(task_spec, cache_dir, config.seed)
        tasks.append(task)
        state = "cached" if cached else "built"
        say(f"LM data   {task.name:18s} {task.counts} choices {list(task.choices)} {state}")
    include = write_lm_eval_yamls(tasks, cache_dir / "runs" / config.name / "lm_eval_tasks")
    limit, batch = spec.eval_limit, spec.eval_batch_size
    out: dict[str, Any] = {
        "model": spec.name,
        "tasks": [t.name for t in tasks],
        "counts": {t.name: t.counts for t in tasks},
        "lm_eval_include_path": str(include),
        "eval_limit": limit,
        "finetune": spec.finetune.model_dump(),
    }

    jobs = [(t, split) for t in tasks for split in ("validation", "test")]
    pretrained, seconds = score_lm(model_fp, model_dir, jobs, include, cache, batch, limit)
    timings["pretrained_lm_eval_seconds"] = round(seconds, 1)
    out["pretrained"] = summarize(pretrained)

    models = {"pretrained": model_fp}  # model ids of what the intervals compare
    expert_ids: dict[str, str] = {}
    label_free: list[tuple[str, str]] = []  # each search that read no labels against its peers
    experts: dict[str, Path] = {}  # none in a run for the LoRA track (`dense: false`)
    if spec.dense:  # the dense experts, Task Arithmetic of them and BMM over it, the other anchors
        out["experts"], out["indiv"] = {}, {}
        for task in tqdm(tasks, desc="LM experts", leave=False):
            path, record, cached = build_lm_expert(
                task, model_dir, model_fp, spec.finetune, spec.max_length, cache_dir
            )
            experts[task.name] = path
            expert_ids[task.name] = record["fingerprint"]
            info = record["info"]
            out["experts"][task.name] = {
                k: info[k] for k in ("steps", "epochs", "train_seconds", "loss_curve", "bytes")
            }
            say(
                f"LM expert {task.name:18s} {info['steps']} steps, loss {info['loss_curve'][0]:.3f} -> "
                f"{info['loss_curve'][-1]:.3f}, {info['train_seconds']:.0f} s {'(cached)' if cached else ''}"
            )
            own, _ = score_lm(
                record["fingerprint"],
                path,
                [(task, "validation"), (task, "test")],
                include,
                cache,
                batch,
                limit,
            )
            out["indiv"][task.name] = summarize(own)[task.name]

        sweep, best = {}, None
        work = cache_dir / "language" / "merges" / "work"
        for weight in spec.task_arithmetic_weights:
            recipe = task_arithmetic_recipe(model_dir, [experts[t.name] for t in tasks], weight)
            scores = merge_and_score_lm(
                recipe, [(t, "validation") for t in tasks], include, cache, batch, limit, work, timings
            )
            sweep[str(weight)] = round(mean([scores[(t.name, "validation")] for t in tasks]), 4)
            if best is None or sweep[str(weight)] > sweep[str(best)]:
                best = weight
            say(f"LM task_arithmetic weight {weight:<4g} validation avg {sweep[str(weight)]:.4f}")
        recipe = task_arithmetic_recipe(model_dir, [experts[t.name] for t in tasks], best)
        jobs = [(t, s) for t in tasks for s in ("validation", "test")]
        scores = merge_and_score_lm(recipe, jobs, include, cache, batch, limit, work, timings)
        out["task_arithmetic"] = {"weight": best, "validation_sweep": sweep, "scores": summarize(scores)}
        models["task_arithmetic"] = recipe_key(recipe)
        if work.exists():
            shutil.rmtree(work)
        expert_dirs = [experts[t.name] for t in tasks]
        stats = None
        # data-assisted BMM and RegMean read the experts' Grams
        needs = any(a.method == "regmean" for a in spec.anchors) or set(spec.search.settings) != {"data_free"}
        if needs and spec.search.budget > 0:
            stats = expert_statistics(cache_dir, expert_dirs, tasks, spec.max_length)
        if spec.search.budget > 0:
            anchor_dir = (
                cache_dir
                / "language"
                / "anchors"
                / f"task_arithmetic-{recipe_key(recipe).split(':')[1][:12]}"
            )
            anchor_dir.parent.mkdir(parents=True, exist_ok=True)
            anchor_dir, _ = materialise(recipe, anchor_dir)
            over = (config, cache_dir, model_dir, "task_arithmetic", anchor_dir, expert_dirs, tasks, include)
            out.update(bmm_over(over, timings, spec.search, stats))
            models.update(every_bmm_model("task_arithmetic", out))
            label_free += label_free_pairs("task_arithmetic", out)
        out["anchors"] = {}
        for anchor_spec in spec.anchors:
            anchor = tuned_anchor(
                config, cache_dir, anchor_spec, model_dir, expert_dirs, tasks, include, timings, stats=stats
            )
            out["anchors"][anchor_spec.name] = anchor
            models[anchor_spec.name] = anchor["model_id"]
            models.update(every_bmm_model(anchor_spec.name, anchor))
            label_free += label_free_pairs(anchor_spec.name, anchor)
    if spec.lora.enabled:  # the same tasks with LoRA experts: BMM against PEFT's adapter merges
        from bench.merging.language.lora_track import run_lora_track

        def lora_reached(lora: dict[str, Any], note: str) -> None:
            if checkpoint is not None:
                checkpoint({**out, "lora": lora, "reached": note})

        out["lora"] = run_lora_track(
            config, cache_dir, model_dir, model_fp, tasks, include, tuned_anchor, lora_reached
        )
    out["intervals"] = _intervals(models, expert_ids, tasks, cache, limit, label_free)
    out["timings"] = timings
    write_json(
        cache_dir / "runs" / config.name / "language.json",
        {
            "base": str(model_dir),
            "experts": {k: str(v) for k, v in experts.items()},
            "lm_eval_include_path": str(include),
            "tasks": {
                t.name: {"validation": t.lm_eval_name("validation"), "test": t.lm_eval_name("test")}
                for t in tasks
            },
        },
    )
    return out


def tuned_anchor(
    config: RunConfig,
    cache_dir: Path,
    anchor_spec,
    model_dir: Path,
    experts,
    tasks,
    include,
    timings,
    search=None,
    stats: Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """An anchor's own scale tuned on validation (as for the encoder track), its test scores, and
    BMM over it in each of ``search``'s settings (default: the language track's search, data-free);
    ``stats`` serve the data-assisted settings and a ``regmean`` anchor; ``progress`` is handed the
    anchor's entry so far once it is tuned and after each search over it."""
    spec = config.language
    search = search or spec.search
    cache = ScoreCache(cache_dir)
    limit, batch = spec.eval_limit, spec.eval_batch_size
    work = cache_dir / "language" / "merges" / "work"

    def merge_and_score(recipe, jobs, folder):
        """A lone grid point is merged straight into its kept folder, as ``tune_anchor`` asks."""
        started = time.time()
        if folder is None:
            scores = merge_and_score_lm(recipe, jobs, include, cache, batch, limit, work, {})
        else:
            folder, _ = materialise(recipe, folder)
            scores, _ = score_lm(recipe_key(recipe), folder, jobs, include, cache, batch, limit)
        return {"scores": scores, "merge_seconds": round(time.time() - started, 1)}

    tuned = tune_anchor(
        anchor_spec,
        model_dir,
        experts,
        stats,  # RegMean reads the experts' statistics
        merge_and_score,
        [(t, "validation") for t in tasks],
        cache_dir / "language",
        config.name,
    )
    if work.exists():
        shutil.rmtree(work)
    jobs = [(t, s) for t in tasks for s in ("validation", "test")]
    scores, _ = score_lm(tuned["key"], tuned["folder"], jobs, include, cache, batch, limit)
    setting = f"{tuned['parameter']}={tuned['value']}"
    say(f"LM {anchor_spec.name:<14s} {setting} validation avg {tuned['validation']:.4f}")
    out = {
        "method": anchor_spec.method,
        "model_id": tuned["key"],
        "parameter": tuned["parameter"],
        "value": tuned["value"],
        "validation_sweep": tuned["sweep"],
        "scores": summarize(scores),
    }
    if search.budget > 0 and (not search.anchors or anchor_spec.name in search.anchors):
        if progress is not None:
            progress(out)
        over = (config, cache_dir, model_dir, anchor_spec.name, tuned["folder"], experts, tasks, include)
        seen = None if progress is None else (lambda found: progress({**out, **found}))
        out.update(bmm_over(over, timings, search, stats, seen))
    return out


def bmm_over(
    over: tuple, timings, search, stats: Path | None, progress: Progress | None = None
) -> dict[str, Any]:
    """BMM over one kept anchor in each of ``search``'s settings: ``bmm`` (data-free) and
    ``bmm_settings`` (data-assisted, mix: from the experts' statistics); ``progress`` is handed what
    is found so far after each search."""
    out: dict[str, Any] = {}

    def place(found: dict[str, Any], setting: str) -> dict[str, Any]:
        if setting == "data_free":
            return {**out, "bmm": found}
        return {**out, "bmm_settings": {**out.get("bmm_settings", {}), setting: found}}

    for setting in search.settings:
        seen = None if progress is None else (lambda found, s=setting: progress(place(found, s)))
        out = place(_bmm_over_anchor(*over, timings, search, setting, stats, seen), setting)
    return out


def _bmm_over_anchor(
    config: RunConfig,
    cache_dir: Path,
    model_dir: Path,
    anchor: str,
    anchor_dir: Path,
    experts,
    tasks,
    include,
    timings,
    search_spec,
    setting: str = "data_free",
    stats: Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """BMM (``setting``) over a kept anchor merge, λ/s from ``mergekit-bmm-search`` with lm-eval;
    ``progress`` sees the labelled search's result before the label-free ones run, then each of them."""
    from bench.merging.cache import stable_key
    from bench.merging.searches import bmm_template, keyed_search, run_search, search_config

    spec = config.language
    cache = ScoreCache(cache_dir)
    limit, batch = spec.eval_limit, spec.eval_batch_size
    stats = stats if setting != "data_free" else None
    template = bmm_template(model_dir, experts, anchor_dir, setting, stats, config.gram_sharing)
    evaluator = {
        "type": "lm_eval",
        "tasks": [{"name": t.lm_eval_name("validation"), "metric": "acc"} for t in tasks],
        "include_path": str(include),
        "limit": limit,
        "batch_size": batch,
        "dtype": "float32",
    }
    search = search_config(search_spec, template, evaluator, "bo", search_spec.seeds[0])
    key = stable_key(keyed_search(search))
    folder = cache_dir / "searches" / config.name / f"language-{anchor}-{setting}-{key}"
    say(f"LM bmm    search over {anchor}, {setting} (K={search_spec.budget}) -> {folder}")
    outcome = run_search(search, folder, search_spec.threads, search_spec.workers)
    best = outcome["best_recipe"]
    jobs = [(t, s) for t in tasks for s in ("validation", "test")]
    model_id = recipe_key(best)
    scores, _ = score_lm(model_id, outcome["best_dir"], jobs, include, cache, batch, limit)
    prefix = "bmm_search" if anchor == "task_arithmetic" else f"bmm_{anchor}_search"
    prefix += "" if setting == "data_free" else f"_{setting}"
    timings[f"{prefix}_merge_seconds"] = outcome["times"]["merge"]
    timings[f"{prefix}_evaluate_seconds"] = outcome["times"]["evaluate"]
    timings[f"{prefix}_surrogate_seconds"] = outcome["times"]["surrogate"]
    # BMM at its defaults: the search's recipe with no λ or s, one merge and no trials
    work = cache_dir / "language" / "merges" / "work"
    defaults = merge_and_score_lm(template, jobs, include, cache, batch, limit, work, {})
    # λ from the evidence, s 1: one merge, no validation data (search.evidence_lambda)
    auto = None
    if search_spec.evidence_lambda:
        automatic = {**template, "parameters": {**template["parameters"], "lambda": "auto"}}
        chosen: dict[str, Any] = {}
        at_auto = merge_and_score_lm(automatic, jobs, include, cache, batch, limit, work, {}, chosen)
        auto = {"model_id": recipe_key(automatic), "scores": summarize(at_auto), **chosen}
    # a proposed no-search default for this setting (search.default_candidates): one merge
    proposed = search_spec.default_candidates.get(setting)
    candidate = None
    if proposed:
        recipe = {**template, "parameters": {**template["parameters"], **proposed}}
        found = merge_and_score_lm(recipe, jobs, include, cache, batch, limit, work, {})
        candidate = {"model_id": recipe_key(recipe), "parameters": dict(proposed), "scores": summarize(found)}
    shutil.rmtree(work, ignore_errors=True)
    cell = {
        "anchor": anchor,
        "model_id": model_id,
        "setting": setting,
        **({"candidate": candidate} if candidate else {}),
        "budget": outcome["trials"],
        "best_values": outcome["best_values"],
        "search_validation": outcome["best_validation"],
        "scores": summarize(scores),
        "search": str(folder),
        "defaults": {"model_id": recipe_key(template), "scores": summarize(defaults)},
        **({"auto": auto} if auto else {}),
    }
    if progress is not None:
        progress(cell)
    seen = None if progress is None else (lambda free: progress({"label_free": free, **cell}))
    label_free = (
        label_free_searches(
            config, cache_dir, anchor, template, tasks, experts, include, jobs, search_spec, seen
        )
        if setting == "data_free"
        else {}
    )
    for free in (search_spec or spec.search).label_free:  # every traced trial against test
        if anchor in free.trace and free.name in label_free:
            from bench.merging.language.label_free_trace import trace_lm_search

            folder = Path(label_free[free.name]["search"])
            label_free[free.name]["trace"] = trace_lm_search(
                config, cache_dir, free, folder, template, tasks, experts, include
            )
    return {**({"label_free": label_free} if label_free else {}), **cell}


def _intervals(
    models: dict[str, str], expert_ids: dict[str, str], tasks, cache, limit, extra: list[tuple[str, str]]
) -> dict[str, Any]:
    """Paired bootstrap 95 % intervals over test documents (``bench.merging.intervals``): each
    BMM against its anchor, the range (experts, each on its own task, against the pretrained
    model and Task Arithmetic), and the ``extra`` pairs (the searches that read no labels)."""
    documents = {name: test_documents(model_id, tasks, cache, limit) for name, model_id in models.items()}
    if expert_ids:  # the dense experts (a run for the LoRA track has none)
        documents["experts"] = {
            t.name: test_documents(expert_ids[t.name], [t], cache, limit)[t.name] for t in tasks
        }
    pairs = [("experts", "pretrained"), ("experts", "task_arithmetic")]
    pairs += [(name, name.removeprefix("bmm over ")) for name in models if name.startswith("bmm over ")]
    for prefix in ("bmm defaults over ", "bmm auto over ", "bmm candidate over "):  # one merge vs its anchor
        pairs += [(name, name.removeprefix(prefix)) for name in models if name.startswith(prefix)]
    pairs += [  # a proposed default (e.g. gram_sharing: input) against today's defaults
        (name, "bmm defaults over " + name.removeprefix("bmm candidate over "))
        for name in models
        if name.startswith("bmm candidate over ")
    ]
    pairs += [  # λ from the evidence against the search it would replace
        (name, "bmm over " + name.removeprefix("bmm auto over "))
        for name in models
        if name.startswith("bmm auto over ")
    ]
    pairs += extra
    out = {}
    for first, second in pairs:
        if first in documents and second in documents:
            delta, low, high = (round(v, 4) for v in paired_difference(documents[first], documents[second]))
            out[f"{first} - {second}"] = {"delta": delta, "low": low, "high": high}
    return out


def merge_and_score_lm(
    recipe, jobs, include, cache, batch, limit, work: Path, timings, chosen: dict | None = None
) -> dict:
    """Scores of ``recipe``'s merge (merged only when a score is missing); a ``lambda: auto`` merge
    puts the λ it chose per weight into ``chosen["lambda_auto"]`` (kept in the score cache)."""
    key = recipe_key(recipe)
    out = work / key.split(":")[1]
    missing = [job for job in jobs if needs_scoring(cache.get(lm_score_key(key, *job, limit)), job[1])]
    if missing and not out.exists():
        started = time.time()
        run_mergekit(recipe, out)
        timings["task_arithmetic_merge_seconds"] = round(time.time() - started, 1)
        if chosen is not None and chooses_lambda(recipe):
            cache.put({"lambda_auto": key}, {"chosen": chosen_lambdas(out)})
    found = cache.get({"lambda_auto": key}) if chosen is not None else None
    if found is not None:
        chosen["lambda_auto"] = found["chosen"]
    scores, _ = score_lm(key, out, jobs, include, cache, batch, limit)
    return scores
