"""``mergekit-bmm-publish``: check a merged folder and upload it to the Hugging Face Hub."""

from __future__ import annotations

import sys
from pathlib import Path

import click


def _mapping(values: tuple[str, ...]) -> dict[str, str]:
    mapping = {}
    for value in values:
        local, sep, repo = value.partition("=")
        if not sep or not local:
            raise click.BadParameter(f"{value!r} is not LOCAL=ORG/NAME", param_hint="--base-model-id")
        mapping[local] = repo
    return mapping


@click.command("mergekit-bmm-publish")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--repo", "repo_id", required=True, help="Hub repo to upload to: user/name or org/name.")
@click.option("--private", is_flag=True, help="Create the repo as private (only when it does not exist yet).")
@click.option("--revision", default=None, help="Branch to commit to (created if missing); default main.")
@click.option("--dry-run", is_flag=True, help="Run the checks and list what would be uploaded; send nothing.")
@click.option(
    "--base-model-id",
    "base_model_ids",
    multiple=True,
    metavar="LOCAL=ORG/NAME",
    help="Hub id of a local model folder listed in the card's base_model (repeatable; LOCAL= leaves it out).",
)
@click.option("--message", "commit_message", default=None, help="Commit message.")
def main(
    out_dir: Path,
    repo_id: str,
    private: bool,
    revision: str | None,
    dry_run: bool,
    base_model_ids: tuple[str, ...],
    commit_message: str | None,
) -> None:
    """Upload OUT_DIR (a merge made with mergekit-bmm) to the Hub as REPO.

    Refuses a folder without a model card, without its recipe, or whose weights no
    longer match the fingerprint recorded at merge time.
    """
    from mergekit_bmm.errors import BMMError, one_line
    from mergekit_bmm.publish import publish_folder

    try:
        paths = publish_folder(
            out_dir,
            repo_id,
            private=private,
            revision=revision,
            dry_run=dry_run,
            base_model_ids=_mapping(base_model_ids),
            commit_message=commit_message,
        )
    except BMMError as error:
        click.echo(one_line(error), err=True)
        sys.exit(error.exit_code)
    total = sum((out_dir / path).stat().st_size for path in paths)
    target = f"{repo_id}@{revision}" if revision else repo_id
    if dry_run:
        click.echo(
            f"dry run: checks passed; would upload {len(paths)} files ({total / 1e6:.1f} MB) to {target}:"
        )
        for path in paths:
            click.echo(f"  {path}  ({(out_dir / path).stat().st_size} bytes)")
        return
    from huggingface_hub import constants

    click.echo(
        f"uploaded {len(paths)} files ({total / 1e6:.1f} MB) to {target}: {constants.ENDPOINT}/{repo_id}"
    )


if __name__ == "__main__":
    main()
