"""Where a search trial's time goes: merge / evaluate / surrogate (GP), per strategy.

Runs ``mergekit-bmm-search``'s loop in-process on a tiny generated Llama family with the
example evaluator (loads the merged model, one forward pass per expert comparison), and
prints the mean seconds per trial of each part. Random search (no surrogate) is the
baseline measured in the same run. A second table compares the merge route the search
uses (``run_merge`` into a folder, then loading it) with mergekit's in-memory route
(planning + executor straight into a loaded model), on the same recipe.

    python bench/search_overhead.py [--budget 20] [--hidden 64] [--layers 4] [--blocks 2]
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import click
import torch


def _search(family, strategy: str, budget: int, blocks: int, acq_optimizer: str, out: Path):
    from mergekit_bmm.search import SearchOptions, parse_search_config, run_search

    experts = {path.name: str(path) for path in family.experts}
    raw = {
        "recipe": {
            "merge_method": "bmm",
            "base_model": str(family.base),
            "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in family.experts],
            "parameters": {"anchor_method": "task_arithmetic"},
            "dtype": "float32",
        },
        "blocks": blocks,
        "budget": budget,
        "n_initial": min(8, budget),
        "strategy": strategy,
        "acq_optimizer": acq_optimizer,
        "lambda_range": [1e-3, 100],
        "evaluator": {
            "type": "python",
            "callable": "mergekit_bmm.examples.tiny_objective:expert_agreement",
            "load_model": "AutoModelForCausalLM",
            "args": {"experts": experts},
        },
    }
    config = parse_search_config(raw, out.parent)
    started = time.perf_counter()
    result = run_search(config, out, SearchOptions(device="cpu", progress=False, skip_best=True, plots=False))
    return result, time.perf_counter() - started, config


def _resume_costs(config, finished: Path) -> list[tuple[str, float]]:
    """Seconds to resume ``finished`` and run one more trial: from the proposer's snapshot, and
    by replaying the whole log through a fresh optimiser (snapshot removed)."""
    from mergekit_bmm.search import SearchOptions, run_search

    longer = config.model_copy(update={"budget": config.budget + 1})
    rows = []
    for label, keep in (("snapshot (proposer.pkl)", True), ("replay of trials.jsonl", False)):
        folder = finished.with_name(f"{finished.name}-resume-{'snapshot' if keep else 'replay'}")
        shutil.copytree(finished, folder)
        if not keep:
            (folder / "proposer.pkl").unlink()
        options = SearchOptions(device="cpu", progress=False, skip_best=True, plots=False)
        started = time.perf_counter()
        result = run_search(longer, folder, options)
        new = result.records[-1].time
        rows.append((label, time.perf_counter() - started - new["merge"] - new["evaluate"]))
    return rows


def _in_memory_merge(text: str, model):
    """The recipe merged into an already loaded model, through the package's in-memory merge
    (mergekit's own plan and executor; no files)."""
    from mergekit.options import MergeOptions

    from mergekit_bmm.plugin.run import merge_recipe_in_memory

    parameters = dict(model.named_parameters())

    def into_model(name: str, tensor, out_dtype) -> None:
        if name in parameters:
            with torch.no_grad():
                parameters[name].copy_(tensor)

    merge_recipe_in_memory(text, MergeOptions(quiet=True), into_model)


def _merge_routes(family, work: Path, repeats: int) -> list[tuple[str, float, float]]:
    from transformers import AutoModelForCausalLM

    from mergekit_bmm.io.model_folder import weight_names_of
    from mergekit_bmm.plugin.run import merge_recipe_text as merge_text
    from mergekit_bmm.search import parse_search_config
    from mergekit_bmm.search.space import SearchSpace, TrialRecipes

    recipe = {
        "merge_method": "bmm",
        "base_model": str(family.base),
        "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in family.experts],
        "parameters": {"anchor_method": "task_arithmetic"},
        "dtype": "float32",
    }
    config = parse_search_config(
        {"recipe": recipe, "blocks": 2, "evaluator": {"type": "python", "callable": "a:b"}}, work
    )
    names = weight_names_of(str(family.base))
    space = SearchSpace.from_config(config, recipe, names)
    text = TrialRecipes(recipe, space, names).text(
        {n: 0.05 if "scale" not in n else 1.1 for n in space.names}
    )

    disk, memory = [], []
    for index in range(repeats):
        out = work / f"disk-{index}"
        start = time.perf_counter()
        merge_text(text, out)
        on_disk = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        disk.append(time.perf_counter() - start)
        shutil.rmtree(out)
    model = AutoModelForCausalLM.from_pretrained(family.base, dtype=torch.float32)
    for _ in range(repeats):
        start = time.perf_counter()
        _in_memory_merge(text, model)
        memory.append(time.perf_counter() - start)
    same = all(
        torch.equal(a, b)
        for a, b in zip(on_disk.state_dict().values(), model.state_dict().values(), strict=True)
    )
    return [
        ("run_merge to a folder + from_pretrained (used)", statistics.median(disk), 1.0),
        (
            f"in-memory plan + Executor into a model ({'bit-identical' if same else 'DIFFERENT'})",
            statistics.median(memory),
            statistics.median(memory) / statistics.median(disk),
        ),
    ]


@click.command()
@click.option("--budget", default=20, show_default=True)
@click.option("--hidden", default=64, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--blocks", default=2, show_default=True)
@click.option("--repeats", default=5, show_default=True, help="merges per route in the second table")
def main(budget: int, hidden: int, layers: int, blocks: int, repeats: int) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    from mergekit_bmm.examples.tiny_models import make_tiny_family

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    work = Path(tempfile.mkdtemp(prefix="bmm-search-bench-"))
    family = make_tiny_family(work / "models", "llama", n_experts=3, hidden=hidden, layers=layers)
    dims = blocks * 5
    click.echo(
        f"tiny Llama: hidden {hidden}, {layers} layers, 3 experts; {dims}-dimensional space "
        f"({blocks} blocks); K = {budget}; torch threads {torch.get_num_threads()}"
    )
    runs = [("random", "auto"), ("grid", "auto"), ("bo", "sampling"), ("bo", "lbfgs")]
    rows = []
    for strategy, acq in runs:
        result, wall, config = _search(family, strategy, budget, blocks, acq, work / f"{strategy}-{acq}")
        if (strategy, acq) == ("bo", "sampling"):
            resumed = _resume_costs(config, work / f"{strategy}-{acq}")
        records = result.records
        mean = {k: statistics.mean(r.time[k] for r in records) for k in ("merge", "evaluate", "surrogate")}
        last = statistics.mean(r.time["surrogate"] for r in records[-5:])
        label = strategy if strategy != "bo" else f"bo (EI, acq_optimizer={acq})"
        rows.append((label, mean, last, wall / len(records), result.summary.best_score))
    baseline = rows[0][3]
    header = (
        f"{'strategy':<34} {'merge':>7} {'evaluate':>9} {'GP':>7} {'GP last5':>9} {'wall/trial':>11}"
        f" {'vs random':>10} {'GP share':>9} {'best score':>11}"
    )
    click.echo("\nseconds per trial (means over the K trials)")
    click.echo(header)
    click.echo("-" * len(header))
    for label, mean, last, per_trial, best in rows:
        click.echo(
            f"{label:<34} {mean['merge']:>7.3f} {mean['evaluate']:>9.3f} {mean['surrogate']:>7.3f}"
            f" {last:>9.3f} {per_trial:>11.3f} {per_trial / baseline:>9.2f}x"
            f" {mean['surrogate'] / per_trial:>8.1%} {best:>11.4f}"
        )
    click.echo(
        "wall/trial includes writing the trial YAML, the log line (fsync) and summary.json; "
        "GP = ask + tell (fit and acquisition)."
    )

    click.echo(f"\nresuming the finished bo (sampling) search of {budget} trials for one more trial")
    header = f"{'optimiser state from':<30} {'seconds':>8} {'per logged trial':>17} {'ratio':>7}"
    click.echo(header)
    click.echo("-" * len(header))
    for label, seconds in resumed:
        click.echo(f"{label:<30} {seconds:>8.2f} {seconds / budget:>17.3f} {seconds / resumed[0][1]:>6.1f}x")
    click.echo("seconds: the resumed run's wall time less the new trial's merge and evaluation.")

    click.echo(f"\nmerge route, median of {repeats} merges of one trial recipe")
    header = f"{'route':<68} {'seconds':>8} {'ratio':>7}"
    click.echo(header)
    click.echo("-" * len(header))
    for label, seconds, ratio in _merge_routes(family, work, repeats):
        click.echo(f"{label:<68} {seconds:>8.3f} {ratio:>6.2f}x")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    click.echo(f"\npeak RSS of this process: {peak:.0f} MiB")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
