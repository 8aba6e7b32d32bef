"""``mergekit-bmm-search SEARCH_YML OUT_PATH``: tune a bmm recipe's per-block λ and s on a validation
score."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click

from mergekit_bmm.cli.options import (
    ByteSize,
    HubOptions,
    apply_options,
    command,
    force_option,
    hub_options,
    merge_options,
)
from mergekit_bmm.cli.options import output_path as output_argument
from mergekit_bmm.errors import exit_on_bmm_error


def _echo(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(message, file=sys.stderr)


def _warnings_only(message: str) -> None:
    """``--quiet``: progress lines go; warnings stay (an error is its own one line)."""
    if message.startswith("warning:"):
        _echo(message)


@command("mergekit-bmm-search", merging=True)
@click.argument("search_file", metavar="SEARCH_YML", required=False, type=click.Path())
@output_argument(required=False, shown="OUT_PATH")  # optional in `--resume OUT_PATH`
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the search in OUT_PATH (running the same command again does too); "
    "`mergekit-bmm-search --resume OUT_PATH` uses the copy of search.yml kept there.",
)
@force_option("the search results of a different experiment in OUT_PATH")
@click.option("--eval-anchor", is_flag=True, help="Also score the anchor merge BMM starts from.")
@click.option("--skip-best", is_flag=True, help="Do not merge best.yml into OUT_PATH/best at the end.")
@click.option("--no-cache", is_flag=True, help="Do not give bmm a λ-independent factor cache.")
@click.option("--budget", type=click.IntRange(min=1), default=None, help="Override search.yml's budget.")
@click.option(
    "--full-eval",
    is_flag=True,
    help="Score every trial on every validation example (turns off search.yml's `fidelity:`, "
    "cheap-then-full evaluation and early stopping).",
)
@click.option(
    "--trials",
    type=click.Choice(["auto", "memory", "disk"]),
    default=None,
    help="Where trials run (overrides search.yml): memory = one resident model merged in place; "
    "disk = mergekit writes each trial's folder.",
)
@click.option(
    "--max-memory",
    type=ByteSize(),
    default=None,
    help="Memory resident trials may keep factors in (e.g. 8GB; default: half the free memory).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Trials run at once (overrides parallel.workers): one per GPU, or the CPU split.",
)
@click.option(
    "--backend",
    type=click.Choice(["local", "ray"]),
    default=None,
    help="Where workers run: local processes, or Ray actors (pip install 'mergekit-bmm[ray]').",
)
@click.option(
    "--ray-address",
    default=None,
    metavar="ADDRESS",
    help="Ray cluster to join: auto, ray://host:port (default: a local one for the run).",
)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="bmm's factor cache (default: OUT_PATH/cache); searches over the same inputs may share one.",
)
@click.option(
    "--best-adapter",
    is_flag=True,
    help="Also write the best merge as one PEFT LoRA adapter in OUT_PATH/best-adapter "
    "(LoRA experts only: as mergekit-bmm-lora does).",
)
@click.option(
    "--push-to-hub",
    "push_to_hub",
    default=None,
    metavar="REPO_ID",
    help="Upload OUT_PATH/best (with its model card) to this Hub repo when the search finishes.",
)
@hub_options
@merge_options
def main(
    merge_options,
    search_file,
    out_path,
    resume,
    force,
    push_to_hub,
    best_adapter: bool,
    hub: HubOptions,
    **switches,
) -> None:
    """Bayesian optimisation of BMM's λ (per block and module group) and s (per block).

    SEARCH_YML names the bmm recipe to tune, the space, the budget, the strategy (bo, random,
    grid) and the evaluator (python, lm_eval, classification); results go to OUT_PATH. The
    merges take mergekit's own options (listed below).
    """
    if resume and out_path is None and search_file is not None:
        search_file, out_path = None, search_file  # `--resume OUT_PATH`
    if out_path is None:
        raise click.UsageError("missing OUT_PATH: the folder for the search's results")
    # A scheduler's SIGTERM stops the search like Ctrl-C: the trials in flight are dropped,
    # the summary and plots are written, and the same command resumes.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    _limit_threads(merge_options)
    interrupted = (
        f"interrupted; finished trials are kept in {out_path}/trials.jsonl. Run the same command again "
        "to resume."
    )
    try:
        with exit_on_bmm_error(verbose=merge_options.verbosity > 0, interrupted=interrupted):
            publish = _publish_plan(push_to_hub, hub, switches["skip_best"])
            finished = _run(merge_options, search_file, out_path, resume, force, switches)
            if best_adapter and finished:
                _write_best_adapter(Path(out_path), merge_options)
            if publish is not None and finished:
                publish(Path(out_path) / "best")
    finally:
        signal.signal(signal.SIGTERM, previous)


def _write_best_adapter(out: Path, merge_options) -> None:
    """``best.yml`` as one LoRA adapter in ``OUT_PATH/best-adapter`` (replaced: it follows best.yml)."""
    from mergekit_bmm.cli.lora import write_adapter

    folder = out / "best-adapter"
    report = write_adapter(out / "best.yml", folder, merge_options, None, force=True)
    _echo(f"best adapter: {folder} ({len(report.modules)} modules, worst error {report.worst:.1e})")


def _limit_threads(merge_options) -> None:
    """mergekit's ``-j`` for torch, and for the BLAS of the surrogate's fits too."""
    apply_options(merge_options)
    if merge_options.num_threads is not None:
        import skopt  # noqa: F401  (loads the BLAS libraries the limit below must reach)
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=merge_options.num_threads)


def _publish_plan(repo_id: str | None, hub: HubOptions, skip_best: bool):
    """Check a --push-to-hub request before the search starts; return the upload step."""
    if repo_id is None:
        return None
    from mergekit_bmm.cards.publish import preflight
    from mergekit_bmm.cli.publish import report_upload
    from mergekit_bmm.errors import ConfigError

    if skip_best:
        raise ConfigError("--push-to-hub uploads OUT_PATH/best: drop --skip-best")
    if not hub.dry_run:
        preflight(repo_id)

    def publish(best_dir: Path) -> None:
        report_upload(best_dir, repo_id, hub)

    return publish


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _run(merge_options, search_file, out_path, resume, force, switches) -> bool:
    from transformers.utils import logging as hf_logging

    from mergekit_bmm.errors import ConfigError
    from mergekit_bmm.search import SearchOptions, load_search_config, run_search

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if search_file is None:
        if not resume:
            raise ConfigError("give a search.yml (or --resume OUT_PATH to continue the search kept there)")
        search_file = str(Path(out_path) / "search.yml")
        if not Path(search_file).exists():
            raise ConfigError(
                f"--resume: {out_path} holds no search.yml; give the search.yml you started with"
            )
    config = load_search_config(search_file)
    if switches["full_eval"]:
        config = config.model_copy(update={"fidelity": config.fidelity.model_copy(update={"enabled": False})})
    budget = switches["budget"]
    if budget is not None:
        config = config.model_copy(update={"budget": budget})
        if config.strategy == "bo" and budget < config.n_initial:
            raise ConfigError(f"--budget {budget} is smaller than n_initial ({config.n_initial})")
    options = SearchOptions(
        device=merge_options.device,
        eval_anchor=switches["eval_anchor"],
        skip_best=switches["skip_best"],
        use_cache=not switches["no_cache"],
        force=force,
        resume=resume,
        progress=not merge_options.quiet,
        merge_options=merge_options,
        trials=switches["trials"],
        max_memory=switches["max_memory"],
        workers=switches["workers"],
        backend=switches["backend"],
        address=switches["ray_address"],
        cache_dir=switches["cache_dir"],
    )
    result = run_search(config, out_path, options, echo=_warnings_only if merge_options.quiet else _echo)
    click.echo(result.report)
    return result.summary.status == "finished"


if __name__ == "__main__":
    main()
