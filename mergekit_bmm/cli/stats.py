"""``mergekit-bmm-stats STATS_YML OUT_PATH``: collect activation Grams per task."""

from __future__ import annotations

import logging
import os

import click

from mergekit_bmm.cli.options import (
    ByteSize,
    apply_options,
    command,
    compute_options,
    force_option,
    output_path,
)
from mergekit_bmm.errors import exit_on_bmm_error


@command("mergekit-bmm-stats")
@click.argument("config_path", metavar="STATS_YML", type=click.Path(dir_okay=False))
@output_path()
@force_option("tasks in OUT_PATH that were collected differently")
@click.option(
    "--max-memory",
    "max_memory",
    type=ByteSize(),
    default=None,
    help="Memory the Gram accumulators may take on the device, e.g. 8GB or 8GiB (the expert's weights "
    "come on top). When they do not all fit, the data runs once per group of layers. "
    "Default: 60% of the memory free once the expert is loaded.",
)
@compute_options
def main(merge_options, config_path: str, out_path: str, force: bool, max_memory: int | None) -> None:
    """Run each task's calibration data through its expert and store per-module Grams in OUT_PATH.

    Re-running skips tasks that are already collected with the same checkpoint and
    settings and finishes a task's remaining passes, so an interrupted run resumes where
    it stopped.
    """
    quiet = merge_options.quiet
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.ERROR if quiet else logging.INFO, format="%(message)s")
    apply_options(merge_options)
    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    from tqdm.contrib.logging import logging_redirect_tqdm

    from mergekit_bmm.stats.collect import collect_statistics, describe
    from mergekit_bmm.stats.config import load_stats_config

    with exit_on_bmm_error():
        config = load_stats_config(config_path)
        with logging_redirect_tqdm():
            manifest = collect_statistics(
                config,
                out_path,
                device=merge_options.device,
                force=force,
                progress=not quiet,
                max_memory=max_memory,
            )
    click.echo(describe(manifest, out_path))
    click.echo(f"statistics written to {out_path}")


if __name__ == "__main__":
    main()
