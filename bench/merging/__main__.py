"""``python -m bench.merging run CONFIG``: run the merging benchmark (cached, resumable)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from mergekit_bmm.errors import BMMError, find_bmm_error, one_line

REPO = Path(__file__).resolve().parents[2]


@click.group()
def main() -> None:
    """The mergekit-bmm merging benchmark (see README, "Benchmark")."""


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
    type=click.Choice(["data", "heads", "experts", "scores", "task_arithmetic", "language"]),
    default="language",
    show_default=True,
    help="Stop after this stage.",
)
def run(config: Path, cache_dir: Path, results_dir: Path, until: str) -> None:
    """Build what is missing, reuse what is cached, write the results."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(variable, "1")
    from bench.merging.config import load_config
    from bench.merging.pipeline import run_benchmark

    try:
        run_benchmark(load_config(config), cache_dir, results_dir, until)
    except Exception as error:
        ours = error if isinstance(error, BMMError) else find_bmm_error(error)
        if ours is None:
            raise
        click.echo(one_line(ours), err=True)
        sys.exit(ours.exit_code)


if __name__ == "__main__":
    main()
