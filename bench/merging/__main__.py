"""``python -m bench.merging run CONFIG``: run the merging benchmark (cached, resumable)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Before torch starts OpenMP: waiting threads sleep instead of spinning. Two runs side by side on a
# 2-core CPU (the encoder and language tracks, bench/README.md) fine-tuned 3-6x faster so (measured).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import click  # noqa: E402

from bench.merging.stages import SKIPPABLE, STAGES  # noqa: E402
from mergekit_bmm.errors import BMMError, find_bmm_error, one_line  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@click.group()
def main() -> None:
    """The mergekit-bmm merging benchmark (see bench/README.md)."""


@main.command()
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=REPO / "bench" / ".cache",
    show_default=True,
    help="Where task data, heads, experts and scores are cached (outside git).",
)
@click.option(
    "--results-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=REPO / "bench" / "results",
    show_default=True,
    help="results.json, results.md and plots go to <results-dir>/<name>/.",
)
@click.option(
    "--until",
    type=click.Choice(STAGES),
    default=STAGES[-1],
    show_default=True,
    help="Stop after this stage.",
)
@click.option(
    "--skip",
    "skipped",
    multiple=True,
    type=click.Choice(SKIPPABLE),
    help="Leave out this optional stage (repeatable); the report lists it as skipped.",
)
@click.option(
    "--language-only",
    is_flag=True,
    help="Run only the language track (writes language.json; the full report picks it up).",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda", "auto"]),
    default=None,
    help="Train, score, merge and search here (default: the config's `device`, itself cpu by default).",
)
def run(
    config: Path,
    cache_dir: Path,
    results_dir: Path,
    until: str,
    skipped: tuple[str, ...],
    language_only: bool,
    device: str | None,
) -> None:
    """Build what is missing, reuse what is cached, write the results."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(variable, "1")
    from bench.merging.config import load_config, skip_stages
    from bench.merging.pipeline import run_benchmark, run_language_only

    try:
        loaded = load_config(config)
        if device is not None:
            loaded = loaded.model_copy(update={"device": device})
        loaded = skip_stages(loaded, skipped)
        if language_only:
            run_language_only(loaded, cache_dir, results_dir)
        else:
            run_benchmark(loaded, cache_dir, results_dir, until, skipped)
    except Exception as error:
        ours = error if isinstance(error, BMMError) else find_bmm_error(error)
        if ours is None:
            raise
        click.echo(one_line(ours), err=True)
        sys.exit(ours.exit_code)


@main.command()
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("model", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option(
    "--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=REPO / "bench" / ".cache"
)
@click.option("--split", "splits", multiple=True, default=["validation"], show_default=True)
@click.option("--task", "tasks", multiple=True, help="Score only these tasks (default: all).")
def score(
    config: Path, model: Path, cache_dir: Path, splits: tuple[str, ...], tasks: tuple[str, ...]
) -> None:
    """Score an encoder folder (e.g. a merge) with a finished run's heads."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(variable, "1")
    from bench.merging.cache import read_json
    from bench.merging.config import load_config
    from bench.merging.model_scores import score_folder
    from mergekit_bmm.errors import ConfigError

    try:
        run_config = load_config(config)
        name = run_config.name
        manifest_path = Path(cache_dir) / "runs" / name / "manifest.json"
        if not manifest_path.is_file():
            raise ConfigError(
                f"no finished run {name!r} in {cache_dir}; run `python -m bench.merging run` first"
            )
        from bench.merging.config import limits

        scores = score_folder(
            read_json(manifest_path),
            model.resolve(),
            list(splits),
            list(tasks) or None,
            cache_dir,
            limits(run_config),
        )
    except BMMError as error:
        click.echo(one_line(error), err=True)
        sys.exit(error.exit_code)
    for split in splits:
        values = {task: value for (task, s), value in scores.items() if s == split}
        cells = "  ".join(f"{task} {100 * value:.1f}" for task, value in values.items())
        click.echo(f"{split:10s} avg {100 * sum(values.values()) / len(values):.1f}  {cells}")


@main.command()
@click.argument(
    "results", nargs=-1, required=True, type=click.Path(dir_okay=False, exists=True, path_type=Path)
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="curve.md, .png, .json here",
)
def curve(results: tuple[Path, ...], out: Path) -> None:
    """The curve against the number of tasks, from finished runs' results.json (e.g. zeroshot8/12/16)."""
    from bench.merging.report.curve import write_curve

    click.echo(f"wrote {write_curve(list(results), out)}")


if __name__ == "__main__":
    main()
