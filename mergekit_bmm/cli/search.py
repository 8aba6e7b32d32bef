"""``mergekit-bmm-search``: tune a bmm recipe's per-block λ and s on a validation score."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click

from mergekit_bmm.errors import find_bmm_error, one_line


def _echo(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(message, file=sys.stderr)


@click.command("mergekit-bmm-search", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("search_file", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder for the results."
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the search in --out (running the same command again does too); "
    "SEARCH_FILE may be left out, the copy kept in --out is used.",
)
@click.option("--force", is_flag=True, help="Replace the search results of a different experiment in --out.")
@click.option(
    "--eval-anchor", is_flag=True, help="Also score the anchor merge BMM starts from (a reference line)."
)
@click.option("--skip-best", is_flag=True, help="Do not merge best.yml into --out/best at the end.")
@click.option("--no-cache", is_flag=True, help="Do not pass bmm a λ-independent cache under --out/cache.")
@click.option(
    "--budget",
    type=click.IntRange(min=1),
    default=None,
    help="Override search.yml's budget (e.g. to extend a search).",
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="Device for merging and evaluating (cpu, cuda, cuda:1, ...).",
)
@click.option(
    "--num-threads",
    "-j",
    type=click.IntRange(min=1),
    default=None,
    help="CPU threads for torch and BLAS (default: their choice; 1 helps on a busy shared machine).",
)
@click.option(
    "--push-to-hub",
    "push_to_hub",
    default=None,
    metavar="USER/NAME",
    help="Upload --out/best (with its model card) to this Hub repo when the search finishes.",
)
@click.option("--private", is_flag=True, help="With --push-to-hub: create the repo as private.")
@click.option(
    "--base-model-id",
    "base_model_ids",
    multiple=True,
    metavar="LOCAL=ORG/NAME",
    help="With --push-to-hub: Hub id of a local model folder named in the recipe (repeatable).",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
def main(
    search_file: str | None,
    out_dir: str,
    resume: bool,
    force: bool,
    eval_anchor: bool,
    skip_best: bool,
    no_cache: bool,
    budget: int | None,
    device: str,
    num_threads: int | None,
    push_to_hub: str | None,
    private: bool,
    base_model_ids: tuple[str, ...],
    quiet: bool,
) -> None:
    """Bayesian optimisation of BMM's λ (per block and module group) and s (per block).

    SEARCH_FILE is a search.yml naming the bmm recipe to tune, the space, the budget, the
    strategy (bo, random, grid) and the evaluator (python, lm_eval, classification).
    """
    # A scheduler's SIGTERM stops the search like Ctrl-C: the trial in flight is dropped,
    # the summary and plots are written, and the same command resumes.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    if num_threads is not None:
        import skopt  # noqa: F401  (loads the BLAS libraries the limit below must reach)
        import torch
        from threadpoolctl import threadpool_limits  # BLAS threads of the GP fits

        torch.set_num_threads(num_threads)
        threadpool_limits(limits=num_threads)
    try:
        publish = _publish_plan(push_to_hub, private, base_model_ids, skip_best)
        finished = _run(
            search_file, out_dir, resume, force, eval_anchor, skip_best, no_cache, budget, device, quiet
        )
        if publish is not None and finished:
            publish(Path(out_dir) / "best")
    except KeyboardInterrupt:
        click.echo(
            f"mergekit-bmm-search: interrupted; finished trials are kept in {out_dir}/trials.jsonl. "
            "Run the same command again to resume.",
            err=True,
        )
        sys.exit(130)
    except Exception as error:
        ours = find_bmm_error(error)
        if ours is None:
            raise
        click.echo(one_line(ours), err=True)
        sys.exit(ours.exit_code)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _publish_plan(repo_id, private, base_model_ids, skip_best):
    """Check a --push-to-hub request before the search starts; return the upload step."""
    if repo_id is None:
        return None
    from mergekit_bmm.cli.publish_command import _mapping
    from mergekit_bmm.errors import ConfigError
    from mergekit_bmm.publish import preflight, publish_folder

    if skip_best:
        raise ConfigError("--push-to-hub uploads --out/best: drop --skip-best")
    preflight(repo_id)
    mapping = _mapping(base_model_ids)

    def publish(best_dir: Path) -> None:
        paths = publish_folder(best_dir, repo_id, private=private, base_model_ids=mapping)
        click.echo(f"uploaded {len(paths)} files of {best_dir} to {repo_id}")

    return publish


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _run(
    search_file, out_dir, resume, force, eval_anchor, skip_best, no_cache, budget, device, quiet
) -> None:
    from transformers.utils import logging as hf_logging

    from mergekit_bmm.errors import ConfigError
    from mergekit_bmm.search import SearchOptions, load_search_config, run_search

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if search_file is None:
        if not resume:
            raise ConfigError("give a search.yml (or --resume to continue the search kept in --out)")
        search_file = str(Path(out_dir) / "search.yml")
        if not Path(search_file).exists():
            raise ConfigError(
                f"--resume: {out_dir} holds no search.yml; give the search.yml you started with"
            )
    config = load_search_config(search_file)
    if budget is not None:
        config = config.model_copy(update={"budget": budget})
        if config.strategy == "bo" and budget < config.n_initial:
            raise ConfigError(f"--budget {budget} is smaller than n_initial ({config.n_initial})")
    options = SearchOptions(
        device=device,
        eval_anchor=eval_anchor,
        skip_best=skip_best,
        use_cache=not no_cache,
        force=force,
        resume=resume,
        progress=not quiet,
    )
    result = run_search(config, out_dir, options, echo=_echo)
    click.echo(result.report)
    return result.summary.get("status") == "finished"


if __name__ == "__main__":
    main()
