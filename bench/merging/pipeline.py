"""The benchmark's stages, in order, each cached and resumable.

``run_benchmark`` builds what is missing and reuses what is cached: task data, the
pretrained encoder, heads, experts, scores of the pretrained encoder and the experts
("Indiv."), Task Arithmetic merges (weight chosen on validation, reported on test) and
the language track. It writes ``results.json``, ``results.md`` and a per-task PNG under
the results folder, and ``<cache>/runs/<name>/manifest.json`` (every path a later stage
or a search needs: base, experts, heads, task data, an evaluator block).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from bench.merging import device, report
from bench.merging.anchor_tuning import materialise, tune_anchor
from bench.merging.cache import ScoreCache, read_json, stable_key, write_json
from bench.merging.config import AnchorSpec, RunConfig, VariantSpec, limits
from bench.merging.diagnostics import cached_moved_from_anchor, expert_alignment, task_update_norms
from bench.merging.encoder import load_encoder, prepare_encoder
from bench.merging.finetune import build_expert
from bench.merging.heads import build_head
from bench.merging.merging import recipe_key, run_mergekit
from bench.merging.paired import add_intervals
from bench.merging.scoring import ScoredTask, mean, score_model
from bench.merging.searches import bmm_template, collect_stats, run_search, search_config, seed_record
from bench.merging.stage_clock import StageClock
from bench.merging.stages import STAGES
from bench.merging.tasks import build_task_data
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.search.config import default_box, recipe_gram


def say(message: str) -> None:
    tqdm.write(message)


@dataclass
class Artifacts:
    """What the stages produced, by task name."""

    encoder: Path | None = None
    encoder_fingerprint: str = ""
    tasks: dict[str, ScoredTask] = field(default_factory=dict)
    experts: dict[str, Path] = field(default_factory=dict)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    anchors: dict[str, Path] = field(default_factory=dict)
    stats: Path | None = None


class EncoderHandle:
    """Loads the pretrained encoder at most once, and only when a stage needs it."""

    def __init__(self, folder: Path, threads: int) -> None:
        self.folder, self.threads = folder, threads
        self._loaded = None

    def __call__(self):
        if self._loaded is None:
            self._loaded = load_encoder(self.folder, self.threads)
        return self._loaded


def lower_priority(niceness: int) -> None:
    """Share the machine politely: raise this process's niceness to ``niceness``."""
    try:
        current = os.nice(0)
        if current < niceness:
            os.nice(niceness - current)
    except OSError:
        pass


def run_language_only(config: RunConfig, cache_dir: Path, results_dir: Path) -> dict[str, Any]:
    """Only the language track (it can run beside the encoder track); ``language.json``."""
    import torch

    from bench.merging.language.track import run_language_track

    lower_priority(config.niceness)
    device.use(config.device)
    torch.set_num_threads(config.language.finetune.threads)
    language = run_language_track(config, Path(cache_dir).resolve())
    folder = Path(results_dir).resolve() / config.name
    write_json(folder / "language.json", language)
    say(report.language_markdown(language))
    return language


def run_benchmark(
    config: RunConfig, cache_dir: Path, results_dir: Path, until: str = "language"
) -> dict[str, Any]:
    """Run every stage up to ``until``; return the results dictionary (also written)."""
    import torch

    lower_priority(config.niceness)
    device.use(config.device)
    torch.set_num_threads(config.work_threads)
    cache_dir, results_dir = Path(cache_dir).resolve(), Path(results_dir).resolve()
    stop = STAGES.index(until)
    art = Artifacts()
    started = time.time()
    for spec in tqdm(config.tasks, desc="task data", leave=False):
        data, cached = build_task_data(spec, cache_dir, config.seed)
        art.tasks[spec.name] = ScoredTask(data=data, head=Path(), head_sha="")
        say(
            f"data      {spec.name:18s} {_counts(data.counts)}  {len(data.labels)} classes  "
            f"{'cached' if cached else 'built'}"
        )
    data_seconds = round(time.time() - started, 1)
    art.encoder, record, cached = prepare_encoder(config.encoder, cache_dir)
    art.encoder_fingerprint = record["fingerprint"]
    art.records["encoder"] = record
    say(f"encoder   {config.encoder.name} -> {art.encoder} ({'cached' if cached else 'copied'})")
    encoder = EncoderHandle(art.encoder, config.work_threads)
    clock = StageClock(cache_dir / "runs" / config.name)
    if stop >= STAGES.index("heads"):
        with clock.stage("heads"):
            _heads(config, cache_dir, art, encoder)
    if stop >= STAGES.index("experts"):
        with clock.stage("experts"):
            _experts(config, cache_dir, art)
    results = report.base_results(config, art)
    results["stage_reached"] = until
    results["machine"] = machine()
    results["timings"]["data_seconds_this_run"] = data_seconds
    if stop >= STAGES.index("scores"):
        with clock.stage("scores"):
            _scores(config, cache_dir, art, encoder, results)
    if stop >= STAGES.index("task_arithmetic"):
        with clock.stage("task_arithmetic"):
            _task_arithmetic(config, cache_dir, art, results)
    write_manifest(config, cache_dir, art)
    if stop >= STAGES.index("anchors") and config.anchors:
        with clock.stage("anchors"):
            _anchors(config, cache_dir, art, encoder, results)
    if stop >= STAGES.index("sweeps") and config.sweeps.anchor:
        with clock.stage("sweeps"):
            _sweeps(config, cache_dir, art, results, results_dir / config.name)
    # data-free searches, then the ablation (it reuses the BO search of its cell), then data-assisted
    for setting in config.search.settings:
        if stop >= STAGES.index("bmm") and config.search.anchors:
            with clock.stage("bmm"):
                _bmm(config, cache_dir, art, results, setting)
        if setting == config.ablation.setting and stop >= STAGES.index("ablation") and config.ablation.anchor:
            with clock.stage("ablation"):
                _ablation(config, cache_dir, art, results)
    if stop >= STAGES.index("variants") and config.variants:
        from bench.merging.variants import run_variants

        with clock.stage("variants"):
            run_variants(config, art, results, partial(_one_search, config, cache_dir, art))
    if stop >= STAGES.index("scores"):
        add_intervals(config, cache_dir, art, results)
    if stop >= STAGES.index("language") and config.language.enabled:
        from bench.merging.language.track import run_language_track

        with clock.stage("language"):
            results["language"] = run_language_track(config, cache_dir)
        write_json(results_dir / config.name / "language.json", results["language"])
    elif (results_dir / config.name / "language.json").is_file() and config.language.enabled:
        results["language"] = read_json(results_dir / config.name / "language.json")
    results["timings"]["this_run_seconds"] = round(time.time() - started, 1)
    _fill_clock_from_records(clock, results)
    results["stage_seconds"] = clock.table()
    report.write(results, results_dir / config.name)
    say(report.markdown(results))
    return results


def machine() -> dict[str, Any]:
    """Where the figures were made: CPU model and cores, torch, the run's device and its GPU."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if device.current() == "cuda" else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "device": device.current(),
        "gpu": gpu,
    }


def _fill_clock_from_records(clock: StageClock, results: dict[str, Any]) -> None:
    """Stages built before the clock existed, or cut short by a killed run before it wrote as it
    went, get the time their own records kept."""
    timings = results.get("timings", {})
    clock.fill_from_records("heads", timings.get("heads_seconds"))
    clock.fill_from_records("experts", timings.get("experts_seconds"))
    clock.fill_from_records("scores", timings.get("scores_seconds_this_run"))
    task_arithmetic = (results.get("anchor_runtime") or {}).get("task_arithmetic") or {}
    clock.fill_from_records("task_arithmetic", task_arithmetic.get("stage_seconds_this_run"))
    # the searches' own clocks, over all their runs: a floor for the stages that ran them
    searches = (results.get("bmm_runtime") or {}).values()
    clock.at_least("bmm", sum(cell.get("wall", 0.0) for cell in searches))
    ablation = (results.get("ablation") or {}).get("rows") or []
    clock.at_least("ablation", sum(row.get("wall", 0.0) for row in ablation if row["strategy"] != "bo"))


def _counts(counts: dict[str, int]) -> str:
    return "/".join(f"{split} {counts[split]}" for split in counts)


def _heads(config: RunConfig, cache_dir: Path, art: Artifacts, encoder: EncoderHandle) -> None:
    specs = {spec.name: spec for spec in config.tasks}
    for name in tqdm(list(art.tasks), desc="heads", leave=False):
        task = art.tasks[name]
        head, record, cached = build_head(
            task.data,
            art.encoder,
            art.encoder_fingerprint,
            config.head,
            config.max_length,
            config.eval_batch_size,
            cache_dir,
            encoder,
            specs[name].descriptions,
        )
        art.tasks[name] = ScoredTask(data=task.data, head=head, head_sha=record["fingerprint"])
        art.records[f"head/{name}"] = record
        info = record["info"]
        kind = f"C={info['C']:<6g}" if "C" in info else "zero-shot"
        say(
            f"head      {name:18s} {kind} validation {info['validation_accuracy']:.4f}  "
            f"{record['seconds']:.0f} s {'(cached)' if cached else ''}"
        )


def _experts(config: RunConfig, cache_dir: Path, art: Artifacts) -> None:
    for name in tqdm(list(art.tasks), desc="experts", leave=False):
        task = art.tasks[name]
        path, record, cached = build_expert(
            task.data,
            task.head,
            task.head_sha,
            art.encoder,
            art.encoder_fingerprint,
            config.finetune,
            config.max_length,
            cache_dir,
        )
        art.experts[name] = path
        art.records[f"expert/{name}"] = record
        info = record["info"]
        say(
            f"expert    {name:18s} {info['steps']} steps, {info['epochs']} epochs, "
            f"loss {info['loss_curve'][0]:.3f} -> {info['loss_curve'][-1]:.3f}, "
            f"{info['train_seconds']:.0f} s {'(cached)' if cached else ''}"
        )


def _scores(config: RunConfig, cache_dir: Path, art: Artifacts, encoder: EncoderHandle, results) -> None:
    cache = ScoreCache(cache_dir)
    tasks = list(art.tasks.values())
    jobs = [(task, split) for task in tasks for split in ("validation", "test")]
    started = time.time()
    pretrained = score_model(
        art.encoder_fingerprint,
        encoder,
        jobs,
        config.max_length,
        config.eval_batch_size,
        cache,
        "pretrained",
        limits(config),
    )
    report.add_row(results, "pretrained", "anchor", pretrained, {})["model_id"] = art.encoder_fingerprint
    for task in tqdm(tasks, desc="score experts", leave=False):
        path = art.experts[task.name]
        own = score_model(
            art.records[f"expert/{task.name}"]["fingerprint"],
            lambda path=path: load_encoder(path, config.work_threads),
            [(task, "validation"), (task, "test")],
            config.max_length,
            config.eval_batch_size,
            cache,
            task.name,
            limits(config),
        )
        results["indiv"][task.name] = own[(task.name, "test")]
        results["indiv_validation"][task.name] = own[(task.name, "validation")]
    results["timings"]["scores_seconds_this_run"] = round(time.time() - started, 1)


def task_arithmetic_spec(config: RunConfig) -> AnchorSpec:
    return AnchorSpec(
        name="task_arithmetic",
        method="task_arithmetic",
        grid={"model.weight": list(config.task_arithmetic.weights)},
    )


def _tune(spec: AnchorSpec, config: RunConfig, cache_dir: Path, art: Artifacts, results) -> dict[str, Any]:
    """One anchor: its grid on validation, the best merge kept and scored on test; adds its row."""
    cache = ScoreCache(cache_dir)
    tasks = list(art.tasks.values())
    experts = [art.experts[task.name] for task in tasks]
    work = cache_dir / "merges" / "work"

    def merge_and_score(recipe, jobs, folder=None):
        return _merge_and_score(recipe, jobs, config, cache, cache_dir, work, folder)

    started = time.time()
    tuned = tune_anchor(
        spec,
        art.encoder,
        experts,
        art.stats,
        merge_and_score,
        [(t, "validation") for t in tasks],
        cache_dir,
        config.name,
    )
    final = merge_and_score(
        tuned["recipe"], [(t, s) for t in tasks for s in ("validation", "test")], tuned["folder"]
    )
    if tuned["parameter"]:
        hyper = {tuned["parameter"]: tuned["value"], "validation_sweep": tuned["sweep"]}
    else:  # nothing to tune: the method's own settings
        hyper = {**spec.parameters, **spec.model_parameters, "validation_sweep": tuned["sweep"]}
    row = report.add_row(results, spec.name, "anchor", final["scores"], hyper, budget=len(tuned["sweep"]))
    row["model_id"] = final["key"]
    art.anchors[spec.name] = tuned["folder"]
    results.setdefault("anchor_runtime", {})[spec.name] = {
        "merge_seconds": tuned["merge_seconds"],
        "grid_points": len(tuned["sweep"]),
        "grid_merge_seconds": tuned["grid_merge_seconds"],
        "stage_seconds_this_run": round(time.time() - started, 1),
    }
    say(
        f"anchor    {spec.name:16s} {tuned['parameter']}={tuned['value']} validation "
        f"{100 * tuned['validation']:.1f}  sweep {tuned['sweep']}  merge {tuned['merge_seconds']} s"
    )
    if work.exists():
        shutil.rmtree(work)
    return tuned


def _task_arithmetic(config: RunConfig, cache_dir: Path, art: Artifacts, results) -> None:
    """TA over all experts at each weight on validation; the best weight also on test."""
    tuned = _tune(task_arithmetic_spec(config), config, cache_dir, art, results)
    results["timings"]["task_arithmetic_merge_seconds"] = tuned["merge_seconds"]


def _anchors(config: RunConfig, cache_dir: Path, art: Artifacts, encoder, results) -> None:
    """Activation statistics (RegMean and data-assisted BMM need them), then every anchor."""
    _stats(config, cache_dir, art, results)
    for spec in tqdm(config.anchors, desc="anchors", leave=False):
        _tune(spec, config, cache_dir, art, results)


def _stats(config: RunConfig, cache_dir: Path, art: Artifacts, results) -> None:
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


def _sweeps(config: RunConfig, cache_dir: Path, art: Artifacts, results, folder: Path) -> None:
    """Validation along one λ group or s at a time (bench/merging/sweeps.py), data-free and data-assisted."""
    from bench.merging.sweeps import run_sweeps

    spec = config.sweeps
    experts = [art.experts[task.name] for task in art.tasks.values()]
    _stats(config, cache_dir, art, {"timings": {}})
    searches = {}
    for setting in spec.settings:
        template = bmm_template(art.encoder, experts, _anchor_folder(spec.anchor, art), setting, art.stats)
        searches[setting] = _sweep_search(config, art, template)
    anchor_row = report.find_row(results, spec.anchor) if spec.anchor != "pretrained" else None
    anchor_validation = anchor_row["validation_avg"] if anchor_row else None
    folder.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results["sweeps"] = run_sweeps(spec, searches, anchor_validation, cache_dir, folder)
    say(f"sweeps    {spec.anchor}: {len(searches)} settings, {round(time.time() - started)} s -> sweeps.png")
    if spec.balance_anchors:
        _balance_sweeps(config, art, results, cache_dir, folder)


def _sweep_search(config: RunConfig, art: Artifacts, template: dict[str, Any]) -> dict[str, Any]:
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


def _balance_sweeps(config: RunConfig, art: Artifacts, results, cache_dir: Path, folder: Path) -> None:
    """Validation along one shared λ and then s, per ``task_balance``, over each balance anchor."""
    from bench.merging.sweeps import run_balance_sweeps

    spec = config.sweeps
    experts = [art.experts[task.name] for task in art.tasks.values()]
    searches = {}
    for anchor in spec.balance_anchors:
        for setting in spec.balance_settings:
            for balance in spec.balances:
                template = bmm_template(art.encoder, experts, _anchor_folder(anchor, art), setting, art.stats)
                if balance != "none":  # today's Gram: the parameter unset, as a user's recipe has it
                    template["parameters"]["task_balance"] = balance
                searches[(anchor, setting, balance)] = _sweep_search(config, art, template)
    started = time.time()
    results["balance_sweeps"] = run_balance_sweeps(spec, searches, cache_dir, folder)
    say(f"balance   {len(searches)} sweeps, {round(time.time() - started)} s -> balance.png")


def _anchor_folder(name: str, art: Artifacts) -> Path | None:
    if name == "pretrained":
        return None
    if name not in art.anchors:
        raise ConfigError(f"search anchor {name!r} is not a tuned anchor; known: {sorted(art.anchors)}")
    return art.anchors[name]


def _search_folder(config: RunConfig, cache_dir: Path, label: str, search: dict[str, Any]) -> Path:
    # the budget is left out: a larger budget extends the same search (it resumes); the default
    # box is in: a search left to the defaults is another search when they change
    key = stable_key(
        {
            "search": {k: v for k, v in search.items() if k != "budget"},
            "limits": limits(config),
            "default_box": default_box(recipe_gram(search["recipe"])),
        }
    )
    return cache_dir / "searches" / config.name / f"{label}-{key}"


def _one_search(
    config: RunConfig,
    cache_dir: Path,
    art: Artifacts,
    anchor: str,
    setting: str,
    strategy: str,
    seed: int,
    variant: VariantSpec | None = None,
) -> dict[str, Any]:
    """One ``mergekit-bmm-search``, its best model scored on validation and test; a ``variant``
    changes the main searches' blocks, budget or task balance."""
    tasks = list(art.tasks.values())
    experts = [art.experts[task.name] for task in tasks]
    if setting == "data_assisted":
        _stats(config, cache_dir, art, {"timings": {}})
    template = bmm_template(art.encoder, experts, _anchor_folder(anchor, art), setting, art.stats)
    spec = config.search
    if variant is not None:
        changes = {"blocks": variant.blocks, "budget": variant.budget, "n_initial": variant.n_initial}
        spec = spec.model_copy(update={key: value for key, value in changes.items() if value is not None})
        if variant.task_balance is not None:
            template["parameters"]["task_balance"] = variant.task_balance
    search = search_config(spec, template, evaluator_block(config, art, "validation"), strategy, seed)
    label = f"{anchor}-{setting}-{strategy}" + (f"-seed{seed}" if seed else "")
    label = f"{variant.name}-{label}" if variant is not None else label
    folder = _search_folder(config, cache_dir, label, search)
    factors = cache_dir / "factors" / config.name / f"{anchor}-{setting}"  # shared by the cell's searches
    started = time.time()
    outcome = run_search(search, folder, config.search.threads, config.search.workers, factors)
    recipe = yaml.safe_load(outcome["best_yml"].read_text(encoding="utf-8"))
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


def _bmm(config: RunConfig, cache_dir: Path, art: Artifacts, results, setting: str) -> None:
    """BMM over each anchor in one setting, λ/s from ``mergekit-bmm-search``, one search per seed."""
    cells = [(anchor, setting) for anchor in config.search.anchors]
    runtime = results.setdefault("bmm_runtime", {})
    if setting == "data_assisted":
        _stats(config, cache_dir, art, {"timings": {}})
    if "task_norms" not in results:  # how much each task weighs in the data-free Gram
        results["task_norms"] = task_update_norms(
            art.encoder, {t: art.experts[t] for t in art.tasks}, cache_dir
        )
    if art.stats is not None and "alignment" not in results:
        experts = [art.experts[task] for task in art.tasks]
        results["alignment"] = expert_alignment(art.stats, art.encoder, experts, cache_dir)
    for anchor, setting in tqdm(cells, desc="bmm searches", leave=False):
        seeds = config.search.anchor_seeds.get(anchor, config.search.seeds)
        outcomes = [_one_search(config, cache_dir, art, anchor, setting, "bo", seed) for seed in seeds]
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
        row["defaults"] = _bmm_defaults(config, cache_dir, art, anchor, setting)
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


def _bmm_defaults(
    config: RunConfig, cache_dir: Path, art: Artifacts, anchor: str, setting: str
) -> dict[str, Any]:
    """BMM at its defaults over ``anchor``: the search's recipe with no λ or s (one merge, no trials)."""
    tasks = list(art.tasks.values())
    experts = [art.experts[task.name] for task in tasks]
    recipe = bmm_template(art.encoder, experts, _anchor_folder(anchor, art), setting, art.stats)
    jobs = [(t, s) for t in tasks for s in ("validation", "test")]
    work = cache_dir / "merges" / "work"
    outcome = _merge_and_score(recipe, jobs, config, ScoreCache(cache_dir), cache_dir, work)
    scores = outcome["scores"]
    return {
        "model_id": outcome["key"],
        "avg": round(mean([scores[(t.name, "test")] for t in tasks]), 4),
        "validation_avg": round(mean([scores[(t.name, "validation")] for t in tasks]), 4),
        "per_task": {t.name: round(scores[(t.name, "test")], 4) for t in tasks},
        "merge_seconds": outcome["merge_seconds"],
    }


def _ablation(config: RunConfig, cache_dir: Path, art: Artifacts, results) -> None:
    """Shared-λ grid and random search against BO, same anchor, setting and budget K."""
    spec = config.ablation
    rows = []
    for strategy in tqdm([*spec.strategies, "bo"], desc="ablation", leave=False):
        outcome = _one_search(
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


def _merge_and_score(
    recipe,
    jobs,
    config: RunConfig,
    cache: ScoreCache,
    cache_dir: Path,
    work: Path,
    folder: Path | None = None,
):
    """Scores of a mergekit recipe (merging only if some score is not cached).

    With ``folder`` the merge is kept there (made once, see ``anchors.materialise``).
    """
    key = recipe_key(recipe)
    record_path = cache_dir / "merges" / f"{key.split(':')[1]}.json"
    merge_seconds = read_json(record_path)["merge_seconds"] if record_path.is_file() else None
    out = work / key.split(":")[1]

    def load():
        nonlocal merge_seconds
        if folder is not None:
            path, merge_seconds = materialise(recipe, folder)
        else:
            started = time.time()
            path = run_mergekit(recipe, out)
            merge_seconds = round(time.time() - started, 1)
        write_json(record_path, {"recipe": recipe, "key": key, "merge_seconds": merge_seconds})
        return load_encoder(path, config.work_threads)

    scores = score_model(
        key, load, jobs, config.max_length, config.eval_batch_size, cache, "merge", limits(config)
    )
    if out.exists() and not config.task_arithmetic.keep_models:
        shutil.rmtree(out)
    if folder is not None and merge_seconds is None:
        merge_seconds = materialise(recipe, folder)[1]
    return {"scores": scores, "merge_seconds": merge_seconds, "key": key}


def tasks_from_manifest(manifest: dict[str, Any]) -> dict[str, ScoredTask]:
    """The run's tasks with their heads, as recorded by :func:`write_manifest`."""
    from bench.merging.tasks import TaskData

    return {
        name: ScoredTask(
            data=TaskData(
                name=name,
                data=Path(manifest["data"][name]),
                labels=tuple(manifest["labels"][name]),
                counts=manifest["counts"][name],
                sha256=manifest["data_fingerprints"][name],
            ),
            head=Path(manifest["heads"][name]),
            head_sha=manifest["head_fingerprints"][name],
        )
        for name in manifest["heads"]
    }


def score_folder(
    manifest: dict[str, Any],
    model_dir: Path,
    splits: list[str],
    tasks: list[str] | None,
    cache_dir: Path,
    split_limits: dict[str, int | None] | None = None,
) -> dict[tuple[str, str], float]:
    """Scores of any encoder folder (a merge, an expert) with the run's fixed heads (cached).

    ``split_limits`` (the run's ``evaluation`` subsets) makes them comparable with the table.
    """
    from mergekit_bmm.io.fingerprint import model_fingerprint

    known = tasks_from_manifest(manifest)
    unknown = sorted(set(tasks or []) - set(known))
    if unknown:
        raise ConfigError(f"tasks {unknown} are not in run {manifest['name']}; known: {sorted(known)}")
    chosen = [known[name] for name in (tasks or list(known))]
    jobs = [(task, split) for task in chosen for split in splits]
    return score_model(
        model_fingerprint(model_dir),
        lambda: load_encoder(model_dir),
        jobs,
        manifest["max_length"],
        manifest["eval_batch_size"],
        ScoreCache(cache_dir),
        model_dir.name,
        split_limits,
    )


def evaluator_block(config: RunConfig, art: Artifacts, split: str = "validation") -> dict[str, Any]:
    """Contract A's ``evaluator:`` block for a search over this run's tasks."""
    return {
        "type": "classification",
        "max_length": config.max_length,
        "batch_size": config.eval_batch_size,
        "tasks": [
            {
                "name": task.name,
                "head": str(task.head),
                "data": str(task.data.data),
                "split": split,
                "limit": limits(config).get(split) or task.data.counts[split],
                "text_field": "text",
                "label_field": "label",
            }
            for task in art.tasks.values()
        ],
    }


def write_manifest(config: RunConfig, cache_dir: Path, art: Artifacts) -> Path:
    """``<cache>/runs/<name>/manifest.json`` and ``evaluator.yml``: the inputs of phase 2."""
    folder = cache_dir / "runs" / config.name
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {
        "name": config.name,
        "config_key": stable_key(config.model_dump(mode="json")),
        "base": str(art.encoder),
        "base_fingerprint": art.encoder_fingerprint,
        "experts": {name: str(path) for name, path in art.experts.items()},
        "heads": {name: str(task.head) for name, task in art.tasks.items() if task.head_sha},
        "head_fingerprints": {name: task.head_sha for name, task in art.tasks.items() if task.head_sha},
        "data": {name: str(task.data.data) for name, task in art.tasks.items()},
        "data_fingerprints": {name: task.data.sha256 for name, task in art.tasks.items()},
        "labels": {name: list(task.data.labels) for name, task in art.tasks.items()},
        "counts": {name: task.data.counts for name, task in art.tasks.items()},
        "max_length": config.max_length,
        "eval_batch_size": config.eval_batch_size,
    }
    write_json(folder / "manifest.json", manifest)
    if all(task.head_sha for task in art.tasks.values()):
        for split in ("validation", "test"):
            block = {"evaluator": evaluator_block(config, art, split)}
            (folder / f"evaluator-{split}.yml").write_text(
                yaml.safe_dump(block, sort_keys=False), encoding="utf-8"
            )
    return folder / "manifest.json"
