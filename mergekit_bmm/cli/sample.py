"""``mergekit-bmm-sample RECIPE OUT_PATH``: S merged models from a bmm recipe's posterior (or the i.i.d.
baseline)."""

from __future__ import annotations

import math

import click

from mergekit_bmm.cli.options import (
    apply_options,
    command,
    force_option,
    merge_options,
    moved_option,
    output_path,
)
from mergekit_bmm.errors import exit_on_bmm_error


@command("mergekit-bmm-sample", merging=True)
@click.argument("recipe", metavar="RECIPE", type=click.Path(dir_okay=False))
@output_path()
@click.option("--samples", "-S", type=int, default=10, show_default=True, help="Number of merged models.")
@click.option("--beta", type=float, default=None, help="Posterior noise precision β > 0 (inf: the MAP).")
@click.option("--iid-sigma", type=float, default=None, help="Baseline instead: U_MAP + σ·N(0, I).")
@click.option(
    "--filter",
    "name_filter",
    default=None,
    help="Sample only tensors whose name contains this (default: every tensor bmm solves).",
)
@force_option("an earlier run of this command in OUT_PATH (map/, sample-*/, samples.json)")
@moved_option("--seed", lambda ctx, value: f"use mergekit's --random-seed {value}")
@merge_options
def main(
    merge_options,
    recipe: str,
    out_path: str,
    samples: int,
    beta: float | None,
    iid_sigma: float | None,
    name_filter: str | None,
    force: bool,
) -> None:
    """Draw merged models around the MAP merge of a `merge_method: bmm` RECIPE into OUT_PATH
    (map/ and sample-000/ …); --random-seed seeds the draws (default 0).

    Posterior (paper App. B): every row of U ~ N(u_MAP, β⁻¹(G + λ'I)⁻¹), W = W_pre + s·U,
    with G, λ' and s exactly as the recipe's merge resolves them per tensor.
    """
    from mergekit_bmm.plugin import activate

    activate()
    from mergekit_bmm.sampling.run import SamplingRequest, sample_models

    apply_options(merge_options)
    seed = merge_options.random_seed
    with exit_on_bmm_error():
        request = SamplingRequest(samples, beta, iid_sigma, name_filter, seed or 0)
        summary = sample_models(recipe, out_path, request, merge_options, force=force)
    _print_summary(summary, out_path)


def _print_summary(summary, out_dir: str) -> None:
    posterior = summary.mode == "posterior"
    label = "posterior std" if posterior else "iid sigma"
    header = (
        f"{'sampled tensor':<44} {'shape':>11} {'ridge λ′':>9} {'rms U_MAP':>9} {label:>13} {'ratio':>7}"
        + (f" {'std at β=1':>10}" if posterior else "")
    )
    click.echo("\n" + header)
    click.echo("-" * len(header))
    for record in summary.tensors:
        ratio = record.noise_std / record.map_rms if record.map_rms > 0 else math.inf
        shape = "×".join(map(str, record.shape))
        at_one = f" {record.posterior_std_at_beta_1:>10.3g}" if record.posterior_std_at_beta_1 else ""
        click.echo(
            f"{record.name:<44} {shape:>11} {record.ridge:>9.3g} {record.map_rms:>9.3g} "
            f"{record.noise_std:>13.3g} {ratio:>7.3f}{at_one}"
        )
    click.echo(f"\n{label}: rms over entries of the std of U − U_MAP (U: the task vector, W = W_pre + s·U);")
    click.echo("ratio: that std over rms(U_MAP).")
    if posterior:
        click.echo("The std scales as 1/sqrt(β): for a ratio r take β = (std at β=1 / (r · rms U_MAP))².")
    disk = summary.disk
    click.echo(
        f"Wrote {out_dir}/map (MAP merge, {disk['map_bytes'] / 1e6:.1f} MB) and {summary.samples} samples "
        f"({summary.members[0]} …), {disk['bytes_per_sample'] / 1e6:.2f} MB each on top of the "
        f"{disk['shared_bytes'] / 1e6:.1f} MB they share ({summary.link_mode}s)."
    )


if __name__ == "__main__":
    main()
