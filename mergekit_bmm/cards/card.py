"""Model cards that explain a BMM merge, so a reader can trust and reproduce it.

The card is a Hugging Face Hub model card: YAML front matter (``base_model`` naming the
base and every merged model, ``tags`` with ``mergekit``/``merge``/``bmm``,
``library_name: transformers``) and a body that states the method and the paper, the
anchor and its parameters, the Gram mode and the calibration statistics behind it, λ
and s per block and module group as the merge resolved them, the inputs' fingerprints,
and the exact recipe. For a search it adds the strategy, budget, scores per task
against the anchor's, and the convergence plot.

This module assembles and writes the card; the sections that explain the method and the
search are :mod:`~mergekit_bmm.cards.method_sections` and :mod:`~mergekit_bmm.cards.search_section`.
``mergekit-yaml`` writes it through the plugin's wrapper around ``run_merge``
(:mod:`mergekit_bmm.plugin.patches`); the search calls :func:`write_search_card`. Nothing here
talks to the Hub.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mergekit_bmm.cards.install import install_command
from mergekit_bmm.cards.markdown import fence, model_link, table
from mergekit_bmm.cards.merge_record import RECIPE_FILE, RECORD_FILE, MergeRecord, read_record, record_merge
from mergekit_bmm.cards.method_sections import (
    PAPER_TITLE,
    PAPER_URL,
    bmm_sections,
    evidence_section,
    generic_method_section,
)
from mergekit_bmm.cards.recipe_view import InputModel, RecipeView, view_of
from mergekit_bmm.cards.search_section import SearchFacts, search_section
from mergekit_bmm.errors import ConfigError

LOG = logging.getLogger("mergekit_bmm")

CARD_FILE = "README.md"
CARD_TAGS = ("mergekit", "merge", "bmm")
__all__ = [
    "CARD_FILE", "PAPER_URL", "merge_card", "minimal_card", "record_merge", "render_card", "write_merge_card",
    "write_search_card",
]  # fmt: skip


def front_matter(view: RecipeView, extra_tags: Sequence[str] = ()) -> str:
    """The card's YAML metadata, serialised by huggingface_hub itself."""
    from huggingface_hub import ModelCardData

    base_models = []
    for model in view.inputs:
        if model.card_id not in base_models:
            base_models.append(model.card_id)
    tags = list(dict.fromkeys([*CARD_TAGS, *extra_tags]))
    data = ModelCardData(
        base_model=base_models,
        base_model_relation="merge",
        library_name="transformers",
        tags=tags,
    )
    return data.to_yaml()


def models_section(view: RecipeView, record: MergeRecord | None) -> list[str]:
    """Each input with its role and weights' fingerprint."""
    fingerprints = {item.model: item.fingerprint for item in (record.inputs if record else [])}
    rows = [
        (
            model.role,
            model_link(model),
            f"`{fingerprints[model.reference]}`" if fingerprints.get(model.reference) else "—",
        )
        for model in view.inputs
    ]
    return ["## Models merged", "", table(["role", "model", "weights fingerprint"], rows), ""]


def default_title(view: RecipeView) -> str:
    """A title that says what the merge is: the method (and anchor) and the models merged."""
    method = "BMM" if view.merge_method == "bmm" else f"`{view.merge_method}`"
    anchor = view.setting("anchor_method", None) if view.merge_method == "bmm" else None
    names = [_short_name(model) for model in view.experts]
    merged = " + ".join(names) if len(names) <= 4 else f"{' + '.join(names[:3])} + {len(names) - 3} more"
    title = f"{method} merge of {merged}" if names else f"{method} merge"
    return title + (f" ({anchor} anchor)" if anchor else "")


def _short_name(model: InputModel) -> str:
    if model.hub_id:
        return model.hub_id
    return Path(model.reference.rstrip("/")).name or model.reference


def render_card(
    view: RecipeView,
    recipe_text: str,
    *,
    name: str,
    record: MergeRecord | None = None,
    search: SearchFacts | None = None,
    plots: Mapping[str, str] | None = None,
) -> str:
    """The whole card (front matter + body) as text."""
    experts = view.experts
    base = view.base
    intro = f"A merge of {len(experts)} fine-tuned model{'s' if len(experts) != 1 else ''}"
    intro += f" of {model_link(base)}" if base is not None else ""
    intro += f", made with mergekit's `{view.merge_method}` method"
    intro += " chosen by a hyperparameter search." if search is not None else "."
    lines = ["---", front_matter(view).rstrip(), "---", f"# {name}", "", intro, ""]
    lines += bmm_sections(view) if view.merge_method == "bmm" else generic_method_section(view)
    lines += evidence_section(record.lambda_auto if record is not None else {})
    lines += models_section(view, record)
    if search is not None:
        lines += search_section(search, plots or {})
    lines += [
        "## Reproduce",
        "",
        f"The recipe below (also in `{RECIPE_FILE}`) reproduces this model with the stock mergekit command "
        "once the plugin is installed; local model folders in it are those of the machine that made the "
        "merge (use the models listed above).",
        "",
        fence(f"{install_command()}\nmergekit-yaml {RECIPE_FILE} ./merged", "bash"),
        "",
        fence(recipe_text, "yaml"),
        "",
    ]
    if record is not None:
        lines += [
            f"Weights fingerprint at merge time: `{record.weights_fingerprint}` (with each weight file's "
            f"SHA-256 in `{RECORD_FILE}`; `mergekit-bmm-publish` refuses weights that no longer match).",
            "",
        ]
    return "\n".join(lines)


def merge_card(recipe_text: str, out_dir: str | Path | None = None, name: str | None = None) -> str:
    """The card for a merge whose weights are in ``out_dir`` (when known)."""
    out = Path(out_dir) if out_dir is not None else None
    view = view_of(recipe_text, out)
    record = read_record(out) if out is not None else None
    return render_card(view, recipe_text, name=name or default_title(view), record=record)


def minimal_card(config: Any, recipe_text: str, name: str | None) -> str:
    """A valid card that needs nothing but the recipe (used if the full card fails)."""
    import os

    from huggingface_hub import ModelCardData

    base = config.base_model
    others = sorted(
        (reference for reference in config.referenced_models() if reference != base),
        key=lambda reference: (recipe_text.find(reference.model.path), reference.model.path),
    )
    models = []
    for reference in ([base] if base is not None else []) + others:
        path = reference.model.path
        path = os.path.abspath(path) if os.path.isdir(path) else path
        if path not in models:
            models.append(path)
    data = ModelCardData(
        base_model=models, base_model_relation="merge", library_name="transformers", tags=list(CARD_TAGS)
    )
    return "\n".join(
        [
            "---",
            data.to_yaml().rstrip(),
            "---",
            f"# {name or f'`{config.merge_method}` merge'}",
            "",
            f"A merge made with mergekit's `{config.merge_method}` method "
            f"({PAPER_TITLE}, [arXiv 2605.12843]({PAPER_URL})).",
            "",
            "## Reproduce",
            "",
            fence(recipe_text, "yaml"),
            "",
        ]
    )


# ---------------------------------------------------------------- writers


def _recipe_of(folder: Path, fallback: Path | None = None) -> str:
    for path in (folder / RECIPE_FILE, fallback):
        if path is not None and path.is_file():
            return path.read_text(encoding="utf-8")
    raise ConfigError(f"{folder} has no {RECIPE_FILE} (the recipe); re-run the merge with mergekit-yaml")


def write_merge_card(out_dir: str | Path, recipe_text: str | None = None) -> Path:
    """Write README.md, the merge record and (if missing) the recipe for a merged folder.

    The record fingerprints the weights as they are *now*: call it right after the merge
    (``mergekit-yaml`` does this itself through the card hook).
    """
    out = Path(out_dir)
    text = recipe_text if recipe_text is not None else _recipe_of(out)
    view = view_of(text, out)
    recipe_path = out / RECIPE_FILE
    if not recipe_path.exists():
        recipe_path.write_text(text, encoding="utf-8")
    record = record_merge(out, text, view)
    card = render_card(view, text, name=default_title(view), record=record)
    path = out / CARD_FILE
    path.write_text(card, encoding="utf-8")
    return path


def _copy_plot(source_dir: Path, reference: str | None, target_dir: Path) -> str | None:
    """Copy a plot into the model folder; return its name there (None if missing)."""
    if not reference:
        return None
    source = Path(reference)
    if not source.is_absolute():
        source = source_dir / source
    if not source.is_file():
        LOG.warning("mergekit-bmm: plot %s not found; the card will not show it", source)
        return None
    target = target_dir / source.name
    if source.resolve() != target.resolve():
        shutil.copyfile(source, target)
    return source.name


def write_search_card(best_dir: Path, summary: SearchFacts, search_out: Path) -> Path:
    """Write ``best_dir/README.md`` for the best model of a search.

    ``summary`` is the search's (:mod:`mergekit_bmm.search.summary`; from a finished run:
    ``read_summary(search_out)``); the recipe is ``best_dir``'s ``mergekit_config.yml``
    (written by the merge), else the search's ``best.yml``, which is then copied in so the
    folder is self-contained. Plots are copied into ``best_dir``. The merge record is
    (re)written for the weights as they are now, so call it right after the search has
    written ``best_dir``.
    """
    best_dir, search_out = Path(best_dir), Path(search_out)
    if not best_dir.is_dir():
        raise ConfigError(f"{best_dir} is not a folder; point at the search's best model")
    best_recipe = search_out / summary.best_recipe if summary.best_recipe else None
    text = _recipe_of(best_dir, best_recipe)
    view = view_of(text, best_dir)
    if not (best_dir / RECIPE_FILE).exists():
        (best_dir / RECIPE_FILE).write_text(text, encoding="utf-8")
    record = record_merge(best_dir, text, view)
    plots = {}
    for title, reference in (
        ("Convergence of the search", summary.convergence_plot),
        ("λ per block and group", summary.lambda_plot),
    ):
        copied = _copy_plot(search_out, reference, best_dir)
        if copied:
            plots[title] = copied
    card = render_card(view, text, name=default_title(view), record=record, search=summary, plots=plots)
    path = best_dir / CARD_FILE
    path.write_text(card, encoding="utf-8")
    return path
