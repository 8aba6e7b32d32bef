"""The benchmark's stages, in order, each cached and resumable.

``run_benchmark`` builds what is missing and reuses what is cached: task data, the
pretrained encoder, heads, experts, scores of the pretrained encoder and the experts
("Indiv."), Task Arithmetic merges (weight chosen on validation, reported on test) and
the language track. It writes ``results.json``, ``results.md`` and a per-task PNG under
the results folder, and ``<cache>/runs/<name>/manifest.json`` (every path a later stage
or a search needs: base, experts, heads, task data, an evaluator block). The BMM stages
(statistics, sweeps, searches, ablation) are in :mod:`bench.merging.bmm_stages`, the variants in
:mod:`bench.merging.variants`, the paired test figures in :mod:`bench.merging.paired`.
"""

from __future__ import annotations

import os
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from bench.common import cpu_model
from bench.merging import device, report
from bench.merging.anchor_tuning import tune_anchor
from bench.merging.artifacts import Artifacts, EncoderHandle, say
from bench.merging.bmm_stages import ablation_stage, bmm_stage, ensure_stats, one_search, sweeps_stage
from bench.merging.cache import ScoreCache, read_json, write_json
from bench.merging.config import AnchorSpec, RunConfig, limits
from bench.merging.encoder import load_encoder, prepare_encoder
from bench.merging.finetune import build_expert
from bench.merging.heads import build_head
from bench.merging.model_scores import merge_and_score, write_manifest
from bench.merging.paired import add_intervals
from bench.merging.scoring import ScoredTask, score_model
from bench.merging.stage_clock import StageClock
from bench.merging.stages import STAGES
from bench.merging.tasks import build_task_data
from mergekit_bmm.io.atomic import atomic_write_text


def lower_priority(niceness: int) -> None:
    """Share the machine politely: raise this process's niceness to ``niceness``."""
    try:
        current = os.nice(0)
        if current < niceness:
            os.nice(niceness - current)
    except OSError:
        pass


def run_language_only(config: RunConfig, cache_dir: Path, results_dir: Path) -> dict[str, Any]:
    """Only the language track (it can run beside the encoder track); ``language.json`` and
    ``language.md``, written at every checkpoint too (with ``reached``: how far it got)."""
    import torch

    from bench.merging.language.track import run_language_track

    lower_priority(config.niceness)
    device.use(config.device)
    torch.set_num_threads(config.language.finetune.threads)
    folder = Path(results_dir).resolve() / config.name

    def write(language: dict[str, Any]) -> str:
        from bench.merging.report.label_free import plot_language_trace

        text = report.language_markdown(language)
        folder.mkdir(parents=True, exist_ok=True)
        if plot_language_trace(language, folder / "language_label_free.png"):
            text += "\n\n![agreement against test accuracy along the search](language_label_free.png)"
        if language.get("reached"):
            text = f"In progress: {language['reached']}.\n\n{text}"
        write_json(folder / "language.json", language)
        atomic_write_text(folder / "language.md", text + "\n")
        return text

    def checkpoint(language: dict[str, Any]) -> None:
        write(language)
        say(f"report    {folder / 'language.md'} ({language['reached']})")

    language = run_language_track(config, Path(cache_dir).resolve(), checkpoint)
    say(write(language))
    return language


def run_benchmark(
    config: RunConfig,
    cache_dir: Path,
    results_dir: Path,
    until: str = "language",
    skipped: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run every stage up to ``until`` but the ``skipped`` ones (already switched off in ``config``);
    return the results dictionary (also written)."""
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
    results["stage_reached"], results["stages_skipped"] = until, list(skipped)
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

    def write_report() -> None:
        _fill_clock_from_records(clock, results)
        results["stage_seconds"] = clock.table()
        report.write(results, results_dir / config.name)

    def checkpoint(reached: str, partial_note: str | None = None) -> None:
        """The report of what has finished, at a stage boundary: a run killed later (a session that
        ends) still leaves it, saying how far it got."""
        results["stage_reached"], results["stage_partial"] = reached, partial_note
        add_intervals(config, cache_dir, art, results)
        write_report()
        how_far = f"{reached}; {partial_note}" if partial_note else reached
        say(f"report    {results_dir / config.name / 'results.md'} (up to {how_far})")

    if stop >= STAGES.index("sweeps") and config.sweeps.anchor:
        with clock.stage("sweeps"):
            sweeps_stage(config, cache_dir, art, results, results_dir / config.name)
        if stop > STAGES.index("sweeps"):
            checkpoint("sweeps")
    # data-free searches, then the ablation (it reuses the BO search of its cell), then data-assisted
    settings = config.search.settings
    for i, setting in enumerate(settings):
        done = ", ".join(settings[:i])

        def after_cell(anchor: str, setting: str = setting, done: str = done) -> None:
            # every finished cell in the report: a session that ends mid-stage leaves them (a run that
            # stops after this stage spans sessions too)
            if anchor != config.search.anchors[-1] and stop >= STAGES.index("bmm"):
                checkpoint("bmm", f"bmm: {done + '; ' if done else ''}{setting} up to {anchor}")

        if stop >= STAGES.index("bmm") and config.search.anchors:
            with clock.stage("bmm"):
                bmm_stage(config, cache_dir, art, results, setting, after_cell)
        if setting == config.ablation.setting and stop >= STAGES.index("ablation") and config.ablation.anchor:
            with clock.stage("ablation"):
                ablation_stage(config, cache_dir, art, results)
        if stop >= STAGES.index("bmm") and i < len(settings) - 1:
            reached = "ablation" if results.get("ablation") else "bmm"
            checkpoint(reached, f"bmm: {', '.join(settings[: i + 1])} searches only")
    later_stages = config.variants or config.language.enabled  # nothing after: the final report follows
    if stop > STAGES.index("ablation") and config.search.anchors and later_stages:
        checkpoint("ablation")
    intervals_current = False  # the language track adds no rows: a report right before it holds them all
    if stop >= STAGES.index("variants") and config.variants:
        from bench.merging.variants import run_variants

        with clock.stage("variants"):
            run_variants(config, art, results, partial(one_search, config, cache_dir, art))
        if stop > STAGES.index("variants") and config.language.enabled:
            checkpoint("variants")  # the language track takes an hour: keep the variants' report
            intervals_current = True
    results["stage_reached"], results["stage_partial"] = until, None
    if stop >= STAGES.index("scores") and not intervals_current:
        add_intervals(config, cache_dir, art, results)
    if stop >= STAGES.index("language") and config.language.enabled:
        from bench.merging.language.track import run_language_track

        with clock.stage("language"):
            results["language"] = run_language_track(config, cache_dir)
        write_json(results_dir / config.name / "language.json", results["language"])
    elif (results_dir / config.name / "language.json").is_file() and config.language.enabled:
        results["language"] = read_json(results_dir / config.name / "language.json")
    results["timings"]["this_run_seconds"] = round(time.time() - started, 1)
    write_report()
    say(report.markdown(results))
    return results


def machine() -> dict[str, Any]:
    """Where the figures were made: CPU model and cores, torch, the run's device and its GPU."""
    import torch

    cpu = cpu_model()
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

    def score_recipe(recipe, jobs, folder=None):
        return merge_and_score(recipe, jobs, config, cache, cache_dir, work, folder)

    started = time.time()
    tuned = tune_anchor(
        spec,
        art.encoder,
        experts,
        art.stats,
        score_recipe,
        [(t, "validation") for t in tasks],
        cache_dir,
        config.name,
    )
    final = score_recipe(
        tuned["recipe"], [(t, s) for t in tasks for s in ("validation", "test")], tuned["folder"]
    )
    if tuned["parameter"]:
        hyper = {tuned["parameter"]: tuned["value"], "validation_sweep": tuned["sweep"]}
        if tuned["grid_edge"]:  # the report says so beside the value: the grid should be widened
            hyper["grid_edge"] = tuned["grid_edge"]
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
    if tuned["grid_edge"]:
        say(
            f"anchor    {spec.name}: the best {tuned['parameter']} is the {tuned['grid_edge']} of its grid; "
            f"widen `grid` in the config's anchors to tune it fully"
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
    ensure_stats(config, cache_dir, art, results)
    for spec in tqdm(config.anchors, desc="anchors", leave=False):
        _tune(spec, config, cache_dir, art, results)
