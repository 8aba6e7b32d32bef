"""``mergekit-bmm-stats stats.yml --out STATS_DIR``: collect activation Grams per task."""

from __future__ import annotations

import logging
import os
import sys

import click

from mergekit_bmm.errors import BMMError, one_line


@click.command("mergekit-bmm-stats")
@click.argument("config_path", metavar="STATS_YML", type=click.Path(dir_okay=False))
@click.option(
    "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Statistics directory."
)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="cpu, cuda (or cuda:N), or auto (CUDA when available).",
)
@click.option("--force", is_flag=True, help="Replace tasks in --out that were collected differently.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def main(config_path: str, out_dir: str, device: str, force: bool, quiet: bool) -> None:
    """Run each task's calibration data through its expert and store per-module Grams.

    Re-running skips tasks that are already collected with the same checkpoint and
    settings, so an interrupted run resumes where it stopped.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(message)s")
    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    from tqdm.contrib.logging import logging_redirect_tqdm

    from mergekit_bmm.stats.collect import collect_statistics, describe
    from mergekit_bmm.stats.config import load_stats_config

    try:
        config = load_stats_config(config_path)
        with logging_redirect_tqdm():
            manifest = collect_statistics(config, out_dir, device=device, force=force, progress=not quiet)
    except BMMError as error:
        click.echo(one_line(error), err=True)
        sys.exit(error.exit_code)
    click.echo(describe(manifest))
    click.echo(f"statistics written to {out_dir}")


if __name__ == "__main__":
    main()
