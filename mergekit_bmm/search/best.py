"""The search's answer: ``best.yml`` (the best trial's recipe), ``best/`` (that recipe merged) and its card.

``best.yml`` is the scored trial's recipe without bmm's factor cache (a machine-local path and
only a speed-up), and ``best/`` is mergekit's merge of exactly that text, so ``mergekit-yaml
best.yml OUT`` rebuilds it bit for bit anywhere; it equals the scored trial to float rounding. It
is merged into a staging folder and moved into place, and kept when it already holds the
current best recipe. Kept apart from ``summary`` (which the model card reads) because it merges.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

from mergekit_bmm.cards.card import write_search_card
from mergekit_bmm.io.atomic import atomic_write_text
from mergekit_bmm.plugin import run as recipe_run
from mergekit_bmm.search.experiment import RunFolder
from mergekit_bmm.search.log import TrialRecord
from mergekit_bmm.search.space import TrialRecipes, text_sha256
from mergekit_bmm.search.summary import SearchSummary


class BestModel:
    """Writes ``best.yml`` and ``best/`` for the best trial so far."""

    def __init__(self, folder: RunFolder, recipes: TrialRecipes, echo: Callable[[str], None]) -> None:
        self.folder = folder
        self.recipes = recipes
        self.echo = echo

    def trial_text(self, record: TrialRecord) -> str:
        """A logged trial's recipe: its file, or rebuilt from its values if the file is gone."""
        path = self.folder.root / record.yaml
        if path.exists():
            text = path.read_text(encoding="utf-8")
            if text_sha256(text) == record.yaml_sha256:
                return text
        text = self.recipes.text(record.values)
        if text_sha256(text) != record.yaml_sha256:
            self.echo(
                f"note: trial {record.trial}'s recipe was rebuilt from its values "
                "and differs from the logged hash"
            )
        atomic_write_text(path, text)
        return text

    def write_recipe(self, best: TrialRecord, completed: int, final: bool = False) -> None:
        so_far = "" if final else " so far"
        header = (
            f"# Best of {completed} trials{so_far}: trial {best.trial}, score {best.score:.6g}\n"
            f"# (mergekit-bmm-search, {self.folder.root}).\n"
            "# Rebuild the model: mergekit-yaml best.yml OUT_DIR\n"
        )
        atomic_write_text(self.folder.best_yml, header + self.best_text(best))

    def best_text(self, best: TrialRecord) -> str:
        """What ``best.yml`` holds and ``best/`` is merged from: the trial's portable recipe."""
        self.trial_text(best)  # the trial's own file, restored if it went missing
        return self.recipes.portable_text(best.values)

    def is_current(self, best: TrialRecord | None) -> bool:
        """Whether ``best/`` holds the merge of ``best``'s recipe (and not an older one)."""
        marker = self.folder.best_dir / "mergekit_config.yml"
        return (
            best is not None
            and marker.exists()
            and marker.read_text(encoding="utf-8") == self.best_text(best)
        )

    def merge(self, best: TrialRecord, options: Any) -> None:
        """Merge the best recipe into ``best/`` unless it is already there."""
        if self.is_current(best):
            return
        self.echo(f"merging the best recipe (trial {best.trial}) into {self.folder.best_dir} ...")
        staging = self.folder.work_dir / "best"
        shutil.rmtree(staging, ignore_errors=True)
        recipe_run.merge_recipe_text(
            self.best_text(best), staging, recipe_run.merge_options(options, write_model_card=True)
        )
        shutil.rmtree(self.folder.best_dir, ignore_errors=True)
        staging.rename(self.folder.best_dir)

    def write_card(self, summary: SearchSummary, best: TrialRecord | None) -> None:
        """The Hub model card of ``best/`` (search results included); never fatal."""
        if not self.folder.best_dir.is_dir() or not self.is_current(best):
            return
        try:
            write_search_card(self.folder.best_dir, summary, self.folder.root)
        except Exception as error:  # a card must never cost the search its results
            text = " ".join(str(error).split())
            self.echo(f"warning: could not write the model card of {self.folder.best_dir}: {text}")
