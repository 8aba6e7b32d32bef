"""Why a search box fits or not: validation score along one λ group, or s, at a time.

Around a reference point (every λ at ``reference_lambda``, ``s`` at ``reference_scale``),
each λ group in turn, then ``s``, runs over a grid, for data-free and data-assisted BMM over
one anchor. Every point is a resident trial of the project's search (one model merged in
place from cached factors) scored by the benchmark's classification evaluator on the
validation subsets, so the numbers are those a search sees. Each point also records how
large the merged task vector is against the anchor's, ``‖U‖ / ‖U0‖`` per group: an
activation Gram averages the experts where their inputs overlap, and the sweeps show what
``s`` that leaves to make up.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from bench.merging import device
from bench.merging.cache import read_json, stable_key, write_json
from bench.merging.config import SweepSpec
from bench.merging.report.plots import _pyplot, _save, drawn_once
from bench.merging.searches import keyed_search
from mergekit_bmm.core.module_map import GROUP_NAMES

SETTING_LABELS = {"data_free": "data-free", "data_assisted": "data-assisted"}


def _norm_ratios(resident, scale: float) -> dict[str, float]:
    """Per group, ‖U‖ / ‖U0‖ over its solved tensors (U = (W − W_pre)/s)."""
    merged: dict[str, float] = {}
    anchor: dict[str, float] = {}
    for solved in resident.solved.values():
        factors = solved.factors_now(resident.device)
        update = (solved.target.double() - solved.base.double()) / scale
        merged[solved.group] = merged.get(solved.group, 0.0) + float(update.square().sum())
        prior = factors.decoded("anchor", torch.float64)
        anchor[solved.group] = anchor.get(solved.group, 0.0) + float(prior.square().sum())
    return {group: math.sqrt(merged[group] / anchor[group]) for group in merged if anchor.get(group)}


def sweep_setting(
    spec: SweepSpec,
    search: dict[str, Any],
    cache: Path,
    progress: str = "",
    done: Path | None = None,
    shared_lambda: bool = False,
) -> dict[str, Any]:
    """Every point of one setting's sweeps (a resident model, scored on validation).

    Each λ group in turn, then ``s``; with ``shared_lambda`` one λ for every group at once
    (``along: lambda``), then ``s``. ``done`` (JSONL) keeps each finished point as it is scored:
    an interrupted sweep resumes there.
    """
    from tqdm.auto import tqdm

    from mergekit_bmm.evaluation import make_evaluator
    from mergekit_bmm.evaluation.config import weighted_mean
    from mergekit_bmm.plugin.run import merge_options
    from mergekit_bmm.search.config import parse_search_config
    from mergekit_bmm.search.experiment import prepare_experiment
    from mergekit_bmm.search.resident import ResidentModel

    config = parse_search_config(search, cache)
    experiment = prepare_experiment(config, cache)
    evaluator = make_evaluator(config.evaluator, device.current())
    reference = {d.name: spec.reference_lambda for d in experiment.space.dimensions if d.kind == "lambda"}
    reference["block0.scale"] = spec.reference_scale
    resident = ResidentModel.load(
        experiment.recipes.text(reference),
        experiment.base_model,
        experiment.space,
        evaluator.loading,
        merge_options(None, quiet=True, device=device.current()),
    )
    points = [("reference", None, reference)]
    if shared_lambda:
        for value in spec.lambdas:
            points.append(
                ("lambda", value, {**reference, **{f"block0.{g}": value for g in experiment.space.groups}})
            )
    else:
        for group in experiment.space.groups:
            for value in spec.lambdas:
                points.append((group, value, {**reference, f"block0.{group}": value}))
    for value in spec.scales:
        points.append(("scale", value, {**reference, "block0.scale": value}))
    finished = finished_points(done)
    rows = []
    for along, value, values in tqdm(points, desc=progress, leave=False):
        if (along, value) in finished:
            rows.append(finished[(along, value)])
            continue
        resident.apply(values)
        per_task = evaluator.evaluate_model(resident.model, resident.tokenizer)
        rows.append(
            {
                "along": along,
                "value": value,
                "values": values,
                "validation": weighted_mean(per_task, evaluator.weights),
                "per_task": per_task,
                "norm_ratio": _norm_ratios(resident, values["block0.scale"]),
            }
        )
        if done is not None:
            with open(done, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(rows[-1]) + "\n")
    del resident
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"reference": reference, "points": rows}


def finished_points(done: Path | None) -> dict[tuple[str, Any], dict[str, Any]]:
    """Points an interrupted sweep already scored (a torn last line is ignored)."""
    if done is None or not done.is_file():
        return {}
    finished = {}
    for line in done.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        finished[(row["along"], row["value"])] = row
    return finished


def run_sweeps(
    spec: SweepSpec,
    searches: dict[str, dict[str, Any]],
    anchor_validation: float | None,
    cache_dir: Path,
    results_folder: Path,
) -> dict[str, Any]:
    """Both settings' sweeps (cached by their search definitions), ``sweeps.png`` and the data."""
    out: dict[str, Any] = {"anchor": spec.anchor, "anchor_validation": anchor_validation, "settings": {}}
    previous = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        _sweep_settings(spec, searches, cache_dir, out)
    finally:
        torch.set_num_threads(previous)
    plot_sweeps(out, results_folder / "sweeps.png")
    return out


def _sweep_settings(spec: SweepSpec, searches: dict[str, dict[str, Any]], cache_dir: Path, out) -> None:
    for setting, search in searches.items():
        key = stable_key({"spec": spec.model_dump(exclude={"threads"}), "search": keyed_search(search, True)})
        path = cache_dir / "sweeps" / f"{spec.anchor}-{setting}-{key}.json"
        if path.is_file():
            out["settings"][setting] = read_json(path)
            continue
        factors = cache_dir / "sweeps" / f"factors-{spec.anchor}-{setting}"
        done = path.with_name(path.stem + ".points.jsonl")
        result = sweep_setting(spec, search, factors, progress=f"sweeps {setting}", done=done)
        write_json(path, result)
        out["settings"][setting] = result


@drawn_once
def plot_sweeps(sweeps: dict[str, Any], path: Path) -> Path:
    """One panel per λ group and one for s: validation accuracy (top) and ‖U‖/‖U0‖ (bottom)."""
    plt = _pyplot()

    panels = [
        g
        for g in GROUP_NAMES
        if any(p["along"] == g for s in sweeps["settings"].values() for p in s["points"])
    ]
    panels.append("scale")
    fig, axes = plt.subplots(2, len(panels), figsize=(3.3 * len(panels), 5.6), sharey="row", squeeze=False)
    colors = {"data_free": "#1f77b4", "data_assisted": "#d62728"}
    for column, along in enumerate(panels):
        top, bottom = axes[0][column], axes[1][column]
        for setting, result in sweeps["settings"].items():
            points = [p for p in result["points"] if p["along"] == along]
            xs = [p["value"] for p in points]
            label = SETTING_LABELS[setting]
            top.plot(
                xs, [100 * p["validation"] for p in points], marker="o", color=colors[setting], label=label
            )
            group = along if along != "scale" else None
            ratios = [
                p["norm_ratio"].get(group) if group else sum(p["norm_ratio"].values()) / len(p["norm_ratio"])
                for p in points
            ]
            bottom.plot(xs, ratios, marker=".", color=colors[setting], label=label)
        if sweeps.get("anchor_validation") is not None:
            top.axhline(100 * sweeps["anchor_validation"], color="gray", linestyle="--", label="anchor")
        for ax in (top, bottom):
            if along != "scale":
                ax.set_xscale("log")
        top.set_title(f"λ ({along})" if along != "scale" else "s", fontsize=10)
        bottom.set_xlabel("λ (relative)" if along != "scale" else "s")
        bottom.axhline(1.0, color="gray", linewidth=0.8)
    axes[0][0].set_ylabel("validation accuracy (%) ↑")
    axes[1][0].set_ylabel("‖U‖ / ‖U0‖ (anchor = 1)")
    axes[0][0].legend(fontsize=7, loc="lower left")
    reference = next(iter(sweeps["settings"].values()))["reference"]
    fig.suptitle(
        f"BMM over {sweeps['anchor']}: one dimension at a time around λ = "
        f"{next(v for k, v in reference.items() if 'scale' not in k):g}, s = {reference['block0.scale']:g}",
        fontsize=11,
    )
    return _save(fig, path, dpi=110)


def run_balance_sweeps(
    spec: SweepSpec,
    searches: dict[tuple[str, str, str], dict[str, Any]],
    cache_dir: Path,
    results_folder: Path,
) -> dict[str, Any]:
    """Per (anchor, setting, task balance): validation along one shared λ, then s; ``balance.png``."""
    out: dict[str, Any] = {"reference_lambda": spec.reference_lambda, "reference_scale": spec.reference_scale}
    cells: dict[str, Any] = out.setdefault("cells", {})
    previous = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        for (anchor, setting, balance), search in searches.items():
            grid = {"lambdas": spec.lambdas, "scales": spec.scales, "reference": spec.reference_lambda}
            key = stable_key(
                {
                    "kind": "balance",
                    "grid": grid,
                    "scale": spec.reference_scale,
                    "search": keyed_search(search, True),
                }
            )
            path = cache_dir / "sweeps" / f"balance-{anchor}-{setting}-{balance}-{key}.json"
            if path.is_file():
                result = read_json(path)
            else:
                factors = cache_dir / "sweeps" / f"factors-{anchor}-{setting}"  # keys tell balances apart
                done = path.with_name(path.stem + ".points.jsonl")
                label = f"balance {anchor} {setting} {balance}"
                result = sweep_setting(spec, search, factors, label, done, shared_lambda=True)
                write_json(path, result)
            cells.setdefault(f"{anchor}/{setting}", {})[balance] = result
    finally:
        torch.set_num_threads(previous)
    plot_balance(out, results_folder / "balance.png")
    return out


def _best(points: list[dict[str, Any]]) -> dict[str, Any]:
    return max(points, key=lambda point: point["validation"])


def balance_markdown(results: dict[str, Any]) -> str:
    """Per cell and balance: validation at the reference point and at the best point of the sweeps."""
    sweeps = results["balance_sweeps"]
    lines = [
        f"Reference point: every λ {sweeps['reference_lambda']:g}, s {sweeps['reference_scale']:g}; the best "
        "point is over the shared-λ and s sweeps (validation %).",
        "",
        "| anchor / setting | task balance | at the reference | best along λ (λ) | best along s (s) | "
        "best vs none |",
        "|---|---|---|---|---|---|",
    ]
    for cell, balances in sweeps["cells"].items():
        none_best = _best(balances["none"]["points"])["validation"] if "none" in balances else None
        for balance, result in balances.items():
            points = result["points"]
            reference = next(p for p in points if p["along"] == "reference")
            along_lambda = _best([p for p in points if p["along"] == "lambda"] or [reference])
            along_scale = _best([p for p in points if p["along"] == "scale"] or [reference])
            best = _best(points)["validation"]
            versus = f"{100 * (best - none_best):+.1f}" if none_best is not None else "—"
            lines.append(
                f"| {cell} | {balance} | {100 * reference['validation']:.1f} | "
                f"{100 * along_lambda['validation']:.1f} ({along_lambda['value']}) | "
                f"{100 * along_scale['validation']:.1f} ({along_scale['value']}) | {versus} |"
            )
    return "\n".join(lines)


@drawn_once
def plot_balance(sweeps: dict[str, Any], path: Path) -> Path:
    """A row per anchor and setting: validation along the shared λ (left) and s (right), per balance."""
    plt = _pyplot()

    cells = list(sweeps["cells"])
    fig, axes = plt.subplots(len(cells), 2, figsize=(8.5, 3.0 * len(cells)), squeeze=False, sharey="row")
    for row, cell in enumerate(cells):
        for column, along in enumerate(("lambda", "scale")):
            ax = axes[row][column]
            for balance, result in sweeps["cells"][cell].items():
                points = [p for p in result["points"] if p["along"] == along]
                ax.plot(
                    [p["value"] for p in points],
                    [100 * p["validation"] for p in points],
                    marker="o",
                    label=balance,
                )
            if along == "lambda":
                ax.set_xscale("log")
            ax.set_title(f"{cell}: {'shared λ' if along == 'lambda' else 's'}", fontsize=9)
            ax.set_xlabel("λ (relative, every group)" if along == "lambda" else "s")
        axes[row][0].set_ylabel("validation accuracy (%) ↑")
    axes[0][0].legend(fontsize=7, title="task_balance", title_fontsize=7)
    return _save(fig, path, dpi=110)
