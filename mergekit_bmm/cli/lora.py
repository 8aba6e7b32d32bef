"""``mergekit-bmm-lora RECIPE OUT_PATH``: a merge of LoRA experts written as one PEFT adapter."""

from __future__ import annotations

from pathlib import Path

import click

from mergekit_bmm.cli.options import apply_options, command, force_option, merge_options, output_path
from mergekit_bmm.errors import OutputFolderError, exit_on_bmm_error


@command("mergekit-bmm-lora", merging=True)
@click.argument("recipe", metavar="RECIPE", type=click.Path(dir_okay=False))
@output_path()
@click.option(
    "--rank",
    type=click.IntRange(min=1),
    default=None,
    help="Truncate every module to this rank by SVD (default: exact, rank ≤ the adapters' ranks summed).",
)
@force_option("an adapter written earlier in OUT_PATH")
@merge_options
def main(merge_options, recipe: str, out_path: str, rank: int | None, force: bool) -> None:
    """Merge RECIPE (experts `BASE+ADAPTER` on its base_model) and write the result to OUT_PATH as one
    PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors, README.md), with each module's
    rank and relative error printed."""
    from mergekit_bmm.plugin import activate

    activate()
    apply_options(merge_options)
    with exit_on_bmm_error():
        report = write_adapter(Path(recipe), Path(out_path), merge_options, rank, force)
    for module in report.modules:
        how = "exact" if module.exact else "best fit"
        click.echo(f"{module.name:<56} rank {module.rank:>4}  error {module.error:.1e}  ({how})")
    click.echo(f"adapter: {report.out_dir} ({len(report.modules)} modules, worst error {report.worst:.1e})")


def write_adapter(recipe: Path, out: Path, options, rank: int | None, force: bool):
    from mergekit_bmm.adapters.export import export_adapter
    from mergekit_bmm.cards.adapter_card import adapter_card
    from mergekit_bmm.recipes.parse import parse_recipe

    written = [out / name for name in ("adapter_config.json", "adapter_model.safetensors", "README.md")]
    if out.exists() and not out.is_dir():
        raise OutputFolderError(f"OUT_PATH {out} is a file; give a folder")
    if any(path.exists() for path in written) and not force:
        raise OutputFolderError(f"{out} already holds an adapter; pass --force to replace it")
    text = recipe.read_text(encoding="utf-8")
    report = export_adapter(text, out, options, rank, source=str(recipe), progress=not options.quiet)
    config = parse_recipe(text, str(recipe)).config
    (out / "README.md").write_text(adapter_card(text, config, report, out.name), encoding="utf-8")
    return report
