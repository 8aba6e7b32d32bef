"""``mergekit-bmm-publish MODEL_DIR REPO_ID``: check a merged folder and upload it to the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path

import click

from mergekit_bmm.cli.options import HubOptions, command, hub_options, moved_option
from mergekit_bmm.errors import exit_on_bmm_error


@command("mergekit-bmm-publish")
@click.argument("model_dir", metavar="MODEL_DIR", type=click.Path(path_type=Path))
@click.argument("repo_id", metavar="REPO_ID", required=False)
@moved_option("--repo", lambda ctx, value: f"REPO_ID is positional now: {ctx.info_name} MODEL_DIR {value}")
@hub_options
def main(model_dir: Path, repo_id: str | None, hub: HubOptions) -> None:
    """Upload MODEL_DIR (a merge made with mergekit-bmm, or a statistics folder made by
    mergekit-bmm-stats) to the Hub repo REPO_ID (user/name).

    Refuses a merged folder without a model card, without its recipe, or whose weights no
    longer match the fingerprint recorded at merge time; a statistics folder gets its card
    written and is refused if a part file is missing or malformed.
    """
    if repo_id is None:
        raise click.UsageError("missing REPO_ID: the Hub repo to upload to (user/name)")
    with exit_on_bmm_error():
        report_upload(model_dir, repo_id, hub)


def report_upload(folder: Path, repo_id: str, hub: HubOptions) -> None:
    """Upload (or, with ``--dry-run``, check) ``folder`` and say what was sent or would be."""
    from mergekit_bmm.cards.publish import publish_folder
    from mergekit_bmm.cards.stats_card import is_statistics_folder, publish_statistics

    if is_statistics_folder(folder):
        if hub.base_model_ids:
            raise click.UsageError("--base-model-id applies to merged models, not to statistics folders")
        arguments = {k: v for k, v in hub.upload_arguments().items() if k != "base_model_ids"}
        plan = publish_statistics(folder, repo_id, **arguments)
    else:
        plan = publish_folder(folder, repo_id, **hub.upload_arguments())
    target = f"{repo_id}@{hub.revision}" if hub.revision else repo_id
    if hub.dry_run:
        click.echo(
            f"dry run: checks passed; would upload {len(plan.paths)} files "
            f"({plan.total_bytes / 1e6:.1f} MB) to {target}:"
        )
        for path in plan.paths:
            click.echo(f"  {path}  ({plan.size(path)} bytes)")
        click.echo("\nthe card's front matter on the Hub would be:\n---")
        click.echo(plan.front_matter + "\n---")
        if plan.problem:
            click.echo(f"\nnote: a real upload would stop now: {plan.problem}")
        return
    from huggingface_hub import constants

    click.echo(
        f"uploaded {len(plan.paths)} files ({plan.total_bytes / 1e6:.1f} MB) to {target}: "
        f"{constants.ENDPOINT}/{repo_id}"
    )


if __name__ == "__main__":
    main()
