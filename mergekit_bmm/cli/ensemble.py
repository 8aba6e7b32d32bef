"""``mergekit-bmm-ensemble SAMPLES_DIR [OUT_PATH] --tasks TASKS``: accuracy and calibration (ECE) of a
sampled ensemble against its MAP merge."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mergekit_bmm.cli.options import apply_options, command, compute_options, force_option, output_path
from mergekit_bmm.errors import ConfigError, exit_on_bmm_error
from mergekit_bmm.io.atomic import atomic_write_json

REPORT_NAME = "ensemble.json"


def ensemble_members(samples_dir: Path) -> tuple[list[Path], Path | None]:
    """The sample folders listed by ``samples.json`` and the MAP folder, if present."""
    from mergekit_bmm.sampling.run import INCOMPLETE_MARKER, MAP_DIR, SUMMARY_NAME

    summary = samples_dir / SUMMARY_NAME
    if (samples_dir / INCOMPLETE_MARKER).exists() or not summary.is_file():
        raise ConfigError(
            f"{samples_dir} holds no finished mergekit-bmm-sample run (no {SUMMARY_NAME}); "
            "run mergekit-bmm-sample RECIPE SAMPLES_DIR first, or let it finish"
        )
    members = [samples_dir / name for name in json.loads(summary.read_text(encoding="utf-8"))["members"]]
    missing = [str(member) for member in members if not member.is_dir()]
    if missing:
        raise ConfigError(f"{missing[0]} is listed in {summary} but missing; sample again")
    map_dir = samples_dir / MAP_DIR
    return members, (map_dir if map_dir.is_dir() else None)


@command("mergekit-bmm-ensemble")
@click.argument("samples_dir", metavar="SAMPLES_DIR", type=click.Path(file_okay=False))
@output_path(required=False)
@click.option(
    "--tasks",
    "tasks_file",
    required=True,
    type=click.Path(dir_okay=False),
    help="Classification evaluator config (type: classification, tasks: …) or a search.yml using one.",
)
@click.option(
    "--split", default=None, help="Score this split of every task (e.g. test) instead of the file's."
)
@force_option(f"an earlier {REPORT_NAME} in OUT_PATH")
@compute_options
def main(
    merge_options, samples_dir: str, out_path: str | None, tasks_file: str, split: str | None, force: bool
) -> None:
    """Score the members of a mergekit-bmm-sample run in SAMPLES_DIR as one ensemble.

    The ensemble averages the members' softmax probabilities (paper eq. 13); accuracy, ECE
    (20 equal-width confidence bins) and NLL are printed per task next to the MAP merge's,
    and written to OUT_PATH/ensemble.json (default OUT_PATH: SAMPLES_DIR).
    """
    from mergekit_bmm.plugin import activate

    activate()
    from mergekit_bmm.ensemble.scoring import classification_logits_fn, evaluate_ensemble, mean_over_tasks
    from mergekit_bmm.ensemble.tasks import load_classification_tasks

    with exit_on_bmm_error():
        members, map_dir = ensemble_members(Path(samples_dir))
        config = load_classification_tasks(tasks_file, split)
        report_path = Path(out_path or samples_dir) / REPORT_NAME
        if report_path.exists() and not force:
            raise ConfigError(f"{report_path} exists; pass another OUT_PATH or --force to replace it")
        apply_options(merge_options)
        logits_fn = classification_logits_fn(config, merge_options.device)
        ensemble = evaluate_ensemble(members, logits_fn, progress=not merge_options.quiet)
        map_scores = evaluate_ensemble([map_dir], logits_fn, progress=False) if map_dir else None
    report = {
        "members": len(members),
        "tasks": {name: result.as_dict() for name, result in ensemble.items()},
        "mean": mean_over_tasks(ensemble),
        "map": None,
    }
    if map_scores:
        report["map"] = {
            "tasks": {name: result.as_dict() for name, result in map_scores.items()},
            "mean": mean_over_tasks(map_scores),
        }
    report_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(report_path, report, allow_nan=True)
    click.echo(_table(report))
    click.echo(f"\nwrote {report_path}")


def _table(report: dict) -> str:
    header = f"{'task':<20} {'examples':>8} {'acc':>7} {'ECE':>7} {'NLL':>7} │ {'MAP acc':>7} {'MAP ECE':>7}"
    lines = [f"ensemble of {report['members']} samples (20-bin ECE)", header, "─" * len(header)]
    rows = list(report["tasks"].items()) + [("mean", report["mean"])]
    for name, row in rows:
        map_row = None
        if report["map"]:
            map_row = report["map"]["mean"] if name == "mean" else report["map"]["tasks"].get(name)
        examples = f"{row['examples']:>8}" if "examples" in row else " " * 8
        tail = f"{map_row['accuracy']:>7.4f} {map_row['ece']:>7.4f}" if map_row else f"{'–':>7} {'–':>7}"
        lines.append(
            f"{name:<20} {examples} {row['accuracy']:>7.4f} {row['ece']:>7.4f} {row['nll']:>7.4f} │ {tail}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
