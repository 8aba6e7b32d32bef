"""Merges through mergekit itself (in process), so the benchmark never re-implements one.

A merge is identified by its recipe with every model path replaced by that folder's
weights fingerprint: the same merge of the same checkpoints has the same key wherever
the cache lives, and its scores are reused without merging again.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.merging import device
from bench.merging.cache import stable_key
from mergekit_bmm.io.fingerprint import model_fingerprint, reference_fingerprint


def task_arithmetic_recipe(base: Path, experts: Sequence[Path], weight: float) -> dict[str, Any]:
    return {
        "merge_method": "task_arithmetic",
        "base_model": str(base),
        "models": [{"model": str(path), "parameters": {"weight": weight}} for path in experts],
        "dtype": "float32",
    }


def _fingerprinted(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _fingerprinted(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_fingerprinted(item) for item in value]
    if isinstance(value, str) and value.startswith("/") and Path(value, "config.json").is_file():
        return model_fingerprint(value)
    if isinstance(value, str) and value.startswith("/") and "+" in value:  # BASE+ADAPTER: both
        return reference_fingerprint(value) or value
    return value


def recipe_key(recipe: dict[str, Any]) -> str:
    """``merge:<hash>`` of the recipe with model folders replaced by their fingerprints, and bmm's
    changed defaults written out (a recipe that relied on an old default made another model)."""
    import importlib.metadata

    from mergekit_bmm.recipes.changed_defaults import keyed_recipe

    version = importlib.metadata.version("mergekit")
    return "merge:" + stable_key({"recipe": _fingerprinted(keyed_recipe(recipe)), "mergekit": version}, 24)


def chooses_lambda(recipe: dict[str, Any]) -> bool:
    """Whether a bmm recipe leaves λ to the evidence (``lambda: auto``)."""
    return (recipe.get("parameters") or {}).get("lambda") == "auto"


def run_mergekit(recipe: dict[str, Any], out_dir: Path) -> Path:
    """Merge with ``mergekit.merge.run_merge`` into ``out_dir`` (replaced if present).

    A ``lambda: auto`` merge also gets its card and merge record: the record is where the λ the
    evidence chose for each weight is kept (:func:`chosen_lambdas`)."""
    from mergekit.config import MergeConfiguration
    from mergekit.io.tasks import LoaderCache
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    from mergekit_bmm.plugin import activate

    activate()

    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    LoaderCache().loaders.clear()  # mergekit never invalidates its loaders (stale data otherwise)
    config = MergeConfiguration.model_validate(copy.deepcopy(recipe))
    options = MergeOptions(
        quiet=True,
        copy_tokenizer=True,
        write_model_card=chooses_lambda(recipe),
        lazy_unpickle=False,
        device=device.current(),
    )
    run_merge(config, str(out_dir), options)
    LoaderCache().loaders.clear()
    return out_dir


def chosen_lambdas(out_dir: Path) -> dict[str, dict]:
    """weight name -> the λ ``lambda: auto`` chose for it, from the merge record in ``out_dir``."""
    from mergekit_bmm.cards.merge_record import read_record

    record = read_record(out_dir)
    return dict(record.lambda_auto) if record is not None else {}
