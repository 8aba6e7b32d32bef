"""``mergekit-bmm-yaml CONFIG_FILE OUT_PATH``: ``mergekit-yaml`` with the plugin registered and every
check made before mergekit starts.

Takes every flag of ``mergekit-yaml`` (mergekit's own option set) and merges with mergekit's
``run_merge``; for environments where the start-up hook is disabled
(``MERGEKIT_BMM_NO_AUTOLOAD``) or not installed. On top of ``mergekit-yaml`` it refuses an
output folder holding files a merge did not write unless ``--force``.
"""

from __future__ import annotations

import click

from mergekit_bmm.cli.options import apply_options, command, merge_options
from mergekit_bmm.errors import exit_on_bmm_error


@command("mergekit-bmm-yaml", merging=True)
@click.argument("config_file", metavar="CONFIG_FILE")
@click.argument("out_path", metavar="OUT_PATH")
@click.option(
    "--force",
    is_flag=True,
    help="Write into OUT_PATH although it holds files a merge did not write (other files are kept; "
    "files with a merged model's names are replaced, and named).",
)
@merge_options
def main(merge_options, config_file: str, out_path: str, force: bool) -> None:
    """Merge the recipe CONFIG_FILE into OUT_PATH, exactly as mergekit-yaml does."""
    with exit_on_bmm_error(verbose=merge_options.verbosity > 0):
        from mergekit_bmm.plugin import activate
        from mergekit_bmm.recipes.parse import load_recipe
        from mergekit_bmm.recipes.preflight import already_checked, check_merge, discarded_on_failure

        activate()
        from mergekit.merge import run_merge  # after activate(): the plugin's wrapper

        apply_options(merge_options)
        recipe = load_recipe(config_file)
        with discarded_on_failure(out_path):
            check_merge(recipe.config, out_path, guard_folder=True, force=force)
            with already_checked():
                run_merge(recipe.config, out_path, options=merge_options, config_source=recipe.text)


if __name__ == "__main__":
    main()
