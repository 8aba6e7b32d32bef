"""``python -m bench.perf --list`` and ``python -m bench.perf NAME [--quick]``: every performance
workload on one protocol (:mod:`bench.perf.harness`), one table and one JSON each."""

from __future__ import annotations

import os
from pathlib import Path

import click

from bench.perf import workloads


def _value(text: str):
    """``--set key=value``: numbers as numbers, ``true``/``false`` as booleans, else text."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@click.command()
@click.argument("name", required=False)
@click.option("--list", "listing", is_flag=True, help="List the workloads and what each measures.")
@click.option("--quick", is_flag=True, help="The small size the test suite runs (no figure to report).")
@click.option("--rounds", type=int, default=None, help="Timed rounds (default: the size's).")
@click.option("--warmup", type=int, default=1, show_default=True, help="Rounds run first and dropped.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Models, outputs and <NAME>.json (a tmpfs path keeps the disk out of the timing).",
)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Change one size parameter.")
@click.option(
    "--redo", is_flag=True, help="Measure every group again (a run resumes from its finished groups)."
)
def main(name, listing, quick, rounds, warmup, out, overrides, redo) -> None:
    """Run one performance workload on the one protocol and print its table."""
    if listing or not name:
        for found in workloads.names():
            click.echo(f"{found:<24} {workloads.workload(found).summary}")
        return
    try:
        chosen = workloads.workload(name)
    except KeyError:
        raise click.UsageError(f"no workload {name!r}; `python -m bench.perf --list` lists them") from None
    parsed = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in chosen.sizes["full"]:
            raise click.UsageError(
                f"--set {item}: give KEY=VALUE with KEY one of {sorted(chosen.sizes['full'])}"
            )
        parsed[key] = _value(value)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bench.perf.harness import run_workload

    run_workload(chosen, "quick" if quick else "full", rounds, warmup, out, parsed, click.echo, redo)


if __name__ == "__main__":
    main()
