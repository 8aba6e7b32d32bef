"""What one search is, checked before ``OUT_PATH`` is touched (recipe, space, hash), and that folder's rules.

The experiment's *definition* (the search config except its budget, the template recipe,
and fingerprints of the input models) is hashed: re-running with the same definition
resumes, a different one is refused (see :mod:`mergekit_bmm.search.experiment`).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from mergekit_bmm.core.module_map import filter_rules, outside_groups
from mergekit_bmm.errors import OutputFolderError
from mergekit_bmm.io.atomic import atomic_write_json
from mergekit_bmm.io.fingerprint import reference_fingerprint
from mergekit_bmm.io.hub_models import hub_commit
from mergekit_bmm.io.model_folder import local_model_dir, merge_names_of, model_type_of, weight_shapes_of
from mergekit_bmm.recipes.changed_defaults import keyed_recipe, relies_on_changed_default
from mergekit_bmm.recipes.parse import mergekit_configuration
from mergekit_bmm.search.config import SearchConfig, canonical_hash, load_template
from mergekit_bmm.search.space import SearchSpace, TrialRecipes


@dataclass(frozen=True)
class Experiment:
    config: SearchConfig
    template: dict[str, Any]
    weight_names: list[str]
    space: SearchSpace
    definition: dict[str, Any]
    hash: str
    recipes: TrialRecipes
    not_searched: dict[str, Any]  # what the search does not tune (the summary and report list it)
    # hashes made before a default changed (:mod:`~mergekit_bmm.recipes.changed_defaults`): the same
    # experiment's (its template states the old value: it resumes), or another merge's (it relied on
    # the old default: refused with the line that resumes it)
    same_before: str | None = None
    former_hash: str | None = None

    @property
    def accepted_hashes(self) -> tuple[str, ...]:
        """The recorded hashes under which this experiment resumes."""
        return (self.hash,) if self.same_before is None else (self.hash, self.same_before)

    @property
    def base_model(self) -> str:
        return str(self.template["base_model"])


def prepare_experiment(config: SearchConfig, cache_dir: Path | None) -> Experiment:
    """Read and check everything the search needs; ``cache_dir`` is bmm's factor cache (or None)."""
    template = load_template(config)
    base = str(template["base_model"])
    for reference in [base] + [str(item["model"]) for item in template["models"]]:
        for part in reference.split("+", 1):  # a Hub id from the cache, fetched first when online
            local_model_dir(part)
    weight_names = merge_names_of(base)  # a trial's λ filters must match the names the merge reads
    space = SearchSpace.from_config(config, template, weight_names)
    models = [base] + [str(item["model"]) for item in template["models"]]
    inputs = inputs_of(models)
    definition = definition_of(config, template, inputs, keyed=True)
    experiment_hash = canonical_hash(definition)
    before = canonical_hash(definition_of(config, template, inputs, keyed=False))
    before = None if before == experiment_hash else before
    relies = relies_on_changed_default(template)
    recipes = TrialRecipes(template, space, weight_names, cache_dir)
    _check_with_mergekit(recipes, space)
    return Experiment(
        config,
        template,
        weight_names,
        space,
        definition,
        experiment_hash,
        recipes,
        not_searched_of(base, weight_names, space),
        same_before=None if relies else before,
        former_hash=before if relies else None,
    )


def inputs_of(models: list[str]) -> dict[str, Any]:
    """The input models' fingerprints, and for Hub ids the commits searched over (local folders:
    their fingerprints say it all)."""
    inputs: dict[str, Any] = {"models": {path: reference_fingerprint(path) for path in models}}
    revisions = {path: commit for path in models if (commit := hub_commit(path))}
    if revisions:
        inputs["revisions"] = revisions
    return inputs


def definition_of(
    config: SearchConfig, template: dict[str, Any], inputs: dict[str, Any], keyed: bool
) -> dict[str, Any]:
    """What the experiment hash covers (``inputs``: the models' fingerprints and Hub commits);
    ``keyed``: with the defaults the template relies on written out
    (:mod:`~mergekit_bmm.recipes.changed_defaults`), else as hashed before they changed."""
    search = config.experiment_key()
    if keyed and isinstance(search.get("recipe"), dict):  # an inline template
        search["recipe"] = keyed_recipe(search["recipe"])
    return {"search": search, "recipe": keyed_recipe(template) if keyed else template, **inputs}


def not_searched_of(base: str, weight_names: list[str], space: SearchSpace) -> dict[str, Any]:
    """Module groups the search leaves at the recipe's λ, and 2-D weights outside every group
    (they keep the anchor's value)."""
    present = {rule.group.value for rule in filter_rules(weight_names) if rule.group is not None}
    searched = {group for entry in space.groups for group in entry.split("+")}
    return {
        "groups": {group: space.fixed_lambda for group in sorted(present - searched)},
        "anchor_kept": outside_groups(weight_shapes_of(base), model_type_of(base)),
    }


def middle_of(space: SearchSpace) -> dict[str, float]:
    """The centre of the space (geometric for λ): a valid point to check recipes with."""
    return {
        d.name: math.sqrt(d.low * d.high) if d.log_uniform else 0.5 * (d.low + d.high)
        for d in space.dimensions
    }


def _check_with_mergekit(recipes: TrialRecipes, space: SearchSpace) -> None:
    """Parse one trial recipe as mergekit would, so schema errors show before any work."""
    import yaml

    mergekit_configuration(yaml.safe_load(recipes.text(middle_of(space))), "the search's trial recipe")


# -- The ``OUT_PATH`` folder of a search: its files, its lock, and protection of other experiments.
FORMAT_VERSION = 1
LOCK_FILE = ".lock"


class RunFolder:
    """Paths inside ``OUT_PATH`` and the rules for (re)using it."""

    OWNED_FILES = (
        "experiment.json",
        "search.yml",
        "template.yml",
        "trials.jsonl",
        "summary.json",
        "best.yml",
        "anchor.yml",
        "anchor.json",
        "errors.log",
        "convergence.png",
        "lambdas.png",
        "proposer.pkl",
    )
    OWNED_DIRS = ("trials", "best", "cache", "references", ".work")

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.experiment_json = self.root / "experiment.json"
        self.search_yml = self.root / "search.yml"
        self.template_yml = self.root / "template.yml"
        self.trials_jsonl = self.root / "trials.jsonl"
        self.summary_json = self.root / "summary.json"
        self.best_yml = self.root / "best.yml"
        self.anchor_yml = self.root / "anchor.yml"
        self.anchor_json = self.root / "anchor.json"
        self.errors_log = self.root / "errors.log"
        self.convergence_png = self.root / "convergence.png"
        self.lambdas_png = self.root / "lambdas.png"
        self.proposer_pkl = self.root / "proposer.pkl"
        self.trials_dir = self.root / "trials"
        self.best_dir = self.root / "best"
        self.cache_dir = self.root / "cache"
        self.references_dir = self.root / "references"
        self.work_dir = self.root / ".work"
        self._lock: FileLock | None = None

    def trial_yaml(self, index: int) -> str:
        """A trial's recipe file, relative to the folder (as the log records it)."""
        return f"{self.trials_dir.name}/trial-{index:04d}.yml"

    # ----------------------------------------------------------------- locking
    def lock(self) -> None:
        """Hold an exclusive lock on the folder until :meth:`unlock`."""
        self.root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.root / LOCK_FILE)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise OutputFolderError(
                f"another mergekit-bmm-search is writing {self.root}; wait for it or use another OUT_PATH"
            ) from None
        self._lock = lock

    def claim(self, experiment: Experiment, force: bool, must_exist: bool) -> bool:
        """:meth:`lock` and :meth:`prepare`; a refused folder is unlocked again (free for the next
        command in this process). True when a run is being resumed."""
        self.lock()
        try:
            return self.prepare(experiment, force, must_exist)
        except Exception:
            self.unlock()
            raise

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # ------------------------------------------------------------ experiments
    def recorded_hash(self) -> str | None:
        try:
            return json.loads(self.experiment_json.read_text(encoding="utf-8")).get("experiment_hash")
        except (OSError, ValueError):
            return None

    def has_foreign_content(self) -> bool:
        """Whether the folder holds files this command did not write."""
        if not self.root.exists():
            return False
        owned = set(self.OWNED_FILES) | set(self.OWNED_DIRS) | {LOCK_FILE}
        return any(item.name not in owned and not item.name.startswith(".") for item in self.root.iterdir())

    def prepare(self, experiment: Experiment, force: bool, must_exist: bool) -> bool:
        """Check (and with ``force``, clear) the folder; True when a run is being resumed."""
        recorded = self.recorded_hash()
        if must_exist and recorded is None:
            raise OutputFolderError(
                f"--resume: {self.root} holds no search to resume (no experiment.json); "
                "drop --resume to start one"
            )
        if recorded in experiment.accepted_hashes:
            return True
        if recorded is not None and recorded == experiment.former_hash and not force:
            raise OutputFolderError(
                f"{self.root} holds a search begun when bmm's `gram_sharing` defaulted to `weight` (now "
                "`input`); add `gram_sharing: weight` to the template's parameters to resume it, or use a "
                "new OUT_PATH to search under the new default (docs/recipes.md)"
            )
        if recorded is not None and not force:
            raise OutputFolderError(
                f"{self.root} holds a different experiment (another search config, recipe or models); "
                "use a new OUT_PATH, or pass --force to replace its search results"
            )
        if recorded is None and self.has_foreign_content() and not force:
            raise OutputFolderError(
                f"{self.root} already has files that this command did not write; use a new or empty "
                "OUT_PATH, or pass --force to write the search results next to them"
            )
        self.clear_owned()
        return False

    def clear_owned(self) -> None:
        """Remove only what this command writes."""
        for name in self.OWNED_FILES:
            (self.root / name).unlink(missing_ok=True)
        for name in self.OWNED_DIRS:
            shutil.rmtree(self.root / name, ignore_errors=True)

    def record_experiment(
        self, experiment_hash: str, definition: dict[str, Any], box: dict[str, list[float]]
    ) -> None:
        """``box``: the range each kind of dimension began with (not hashed: a default box may
        change between versions, and a resumed search goes on in the one it began in)."""
        atomic_write_json(
            self.experiment_json,
            {
                "format": FORMAT_VERSION,
                "experiment_hash": experiment_hash,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "definition": definition,
                "box": box,
            },
        )

    def recorded_box(self) -> dict[str, list[float]] | None:
        """The box the recorded experiment began in; None when its folder predates the record."""
        try:
            return json.loads(self.experiment_json.read_text(encoding="utf-8")).get("box")
        except (OSError, ValueError):
            return None

    def fresh_work_dir(self) -> Path:
        """An empty ``.work`` folder for merges in progress."""
        shutil.rmtree(self.work_dir, ignore_errors=True)
        self.work_dir.mkdir()
        return self.work_dir
