"""Model cards that explain a BMM merge, so a reader can trust and reproduce it.

The card is a Hugging Face Hub model card: YAML front matter (``base_model`` naming the
base and every merged model, ``tags`` with ``mergekit``/``merge``/``bmm``,
``library_name: transformers``) and a body that states the method and the paper, the
anchor and its parameters, the Gram mode and the calibration statistics behind it, λ
and s per block and module group as the merge resolved them, the inputs' fingerprints,
and the exact recipe. For a search it adds the strategy, budget, scores per task
against the anchor's, and the convergence plot.

``mergekit-yaml`` writes it through :mod:`mergekit_bmm.plugin.card_seam`; the search calls
:func:`write_search_card`. Nothing here talks to the Hub.
"""

from __future__ import annotations

import logging
import math
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mergekit_bmm.cards.install import install_command
from mergekit_bmm.cards.merge_record import (
    RECIPE_FILE,
    RECORD_FILE,
    InputRecord,
    MergeRecord,
    make_record,
    read_record,
    write_record,
)
from mergekit_bmm.cards.recipe_view import (
    ROLE_BASE,
    InputModel,
    RecipeView,
    describe_recipe,
    format_value,
)
from mergekit_bmm.errors import BMMError, ConfigError

if TYPE_CHECKING:  # the search writes the summary; the card only reads it
    from mergekit_bmm.search.summary import SearchSummary

LOG = logging.getLogger("mergekit_bmm")

CARD_FILE = "README.md"
CARD_TAGS = ("mergekit", "merge", "bmm")
PAPER_TITLE = "Bayesian Model Merging"
PAPER_URL = "https://arxiv.org/abs/2605.12843"
MERGEKIT_URL = "https://github.com/arcee-ai/mergekit"
GROUP_MEANING = {
    "attn_in": "attention q/k/v",
    "attn_out": "attention output",
    "mlp_in": "MLP gate/up (fc1)",
    "mlp_out": "MLP down (fc2)",
}
GRAM_MEANING = {
    "data_free": "data-free: `G_t = U_tᵀU_t`, each expert's task vector stands in for its inputs",
    "activations": (
        "activations: `G_t` is the mean of `x xᵀ` over task t's calibration tokens, run through expert t"
    ),
    "mix": "mix: `G_t = ε·G_few + (1 − ε)·G_df`, few-shot activation Grams blended with the data-free ones",
}


# ---------------------------------------------------------------- inputs of a card


def _method_spec(name: str):
    """The registered method's spec, or None (the card must not fail on it)."""
    try:
        from mergekit import merge_methods

        return merge_methods.get(name).spec
    except Exception:
        return None


def _method_link(name: str) -> str:
    spec = _method_spec(name)
    if spec is None:
        return f"`{name}`"
    pretty = spec.pretty_name or spec.name
    url = (spec.reference_url or "").strip()
    text = f"[{pretty}]({url})" if url else pretty
    return f"{text} (`{name}`)"


def weight_names_for(out_dir: Path | None, view_base: str | None) -> list[str] | None:
    """Tensor names of the merged folder, else of the base (headers only)."""
    from mergekit_bmm.io.model_folder import weight_names_of

    for candidate in (out_dir, view_base):
        if candidate is None:
            continue
        try:
            return weight_names_of(str(candidate))
        except BMMError:
            continue
    return None


def view_of(recipe_text: str, out_dir: Path | None = None) -> RecipeView:
    """Parse the recipe; resolve λ/s against the merged (or base) weights' names."""
    from mergekit_bmm.recipes.parse import parse_recipe

    config = parse_recipe(recipe_text).config
    spec = _method_spec(config.merge_method)
    parameters = list(spec.parameters) if spec is not None else None
    base = config.base_model.model.path if config.base_model is not None else None
    names = weight_names_for(out_dir, base) if parameters else None
    return describe_recipe(recipe_text, names, parameters)


def input_records(view: RecipeView) -> list[InputRecord]:
    from mergekit_bmm.io.fingerprint import model_fingerprint

    return [
        InputRecord(
            model=model.reference,
            role=model.role,
            fingerprint=model_fingerprint(model.local_path) if model.local_path else "",
        )
        for model in view.inputs
    ]


def record_merge(out_dir: str | Path, recipe_text: str, view: RecipeView | None = None) -> MergeRecord:
    """Fingerprint the just-written weights and recipe into ``out_dir/mergekit_bmm_merge.json``."""
    out_dir = Path(out_dir)
    view = view or view_of(recipe_text, out_dir)
    record = make_record(out_dir, recipe_text, view.merge_method, input_records(view))
    write_record(out_dir, record)
    return record


# ---------------------------------------------------------------- rendering


def _fence(text: str, language: str = "") -> str:
    """A code block whose fence is longer than any run of backticks inside ``text``."""
    longest, run = 0, 0
    for char in text:
        run = run + 1 if char == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text.rstrip()}\n{fence}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cell(value: str) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def _model_md(model: InputModel) -> str:
    if model.hub_id:
        return f"[{model.hub_id}](https://huggingface.co/{model.hub_id})"
    return f"`{model.reference}`"


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


def _anchor_section(view: RecipeView) -> list[str]:
    from mergekit.merge_methods.base import ParameterScope

    from mergekit_bmm.merge_methods.bmm_parameters import (
        ANCHOR_PREFIX,
        DEFAULT_ANCHOR,
        OWN_NAMES,
        PRETRAINED_ANCHOR,
    )

    lines = ["### Anchor", ""]
    anchor_input = view.anchor_input
    method = view.setting("anchor_method")
    if anchor_input is not None:
        lines.append(
            f"The prior mean is the input checkpoint {_model_md(anchor_input)} (`anchor: true`): "
            "`U0 = W_anchor − W_pre`."
        )
        return lines + [""]
    if method == PRETRAINED_ANCHOR:
        lines.append("The prior mean is the pretrained model itself (`anchor_method: pretrained`, `U0 = 0`).")
        return lines + [""]
    name = str(method or DEFAULT_ANCHOR)
    default_note = "" if method else " (the default)"
    lines.append(
        f"The prior mean `U0` is the result of {_method_link(name)}{default_note} on the same experts, "
        "computed per tensor."
    )
    spec = _method_spec(name)
    if spec is None:
        return lines + [""]

    def key(parameter_name: str) -> str:
        return ANCHOR_PREFIX + parameter_name if parameter_name in OWN_NAMES else parameter_name

    shared = []
    for parameter in spec.parameters:
        if parameter.scope != ParameterScope.SHARED:
            continue
        value = view.setting(key(parameter.name))
        if value is None and parameter.name not in OWN_NAMES:
            value = view.setting(ANCHOR_PREFIX + parameter.name)
        if value is not None:
            shared.append((f"`{key(parameter.name)}`", format_value(value)))
        elif not parameter.required:
            shared.append((f"`{key(parameter.name)}`", f"{format_value(parameter.default)} (default)"))
    if shared:
        lines += ["", _table(["anchor parameter", "value"], shared)]
    per_model = [p for p in spec.parameters if p.scope != ParameterScope.SHARED]
    experts = [model for model in view.inputs if model.role != ROLE_BASE]
    if per_model and experts:
        rows = []
        for model in experts:
            row = [_model_md(model)]
            for parameter in per_model:
                row.append(_per_model_value(view, model, key(parameter.name), parameter))
            rows.append(row)
        header = ["model", *(f"`{key(p.name)}`" for p in per_model)]
        lines += ["", _table(header, rows)]
    return lines + [""]


def _per_model_value(view: RecipeView, model: InputModel, name: str, parameter: Any) -> str:
    """A per-model value with mergekit's precedence: the model's own, else the recipe-wide one."""
    value = model.parameters.get(name)
    if value is None:
        value = view.setting(name)
    if value is not None:
        return format_value(value)
    return "—" if parameter.required else f"{format_value(parameter.default)} (default)"


def _statistics_lines(view: RecipeView, gram: str) -> list[str]:
    from mergekit_bmm.stats.store import load_manifest

    stats = view.setting("stats")
    if gram not in ("activations", "mix"):
        return []
    if not stats:
        return ["", "No statistics directory (`stats:`) is set in the recipe."]
    try:
        manifest = load_manifest(str(stats))
    except BMMError as error:
        return ["", f"Statistics `{stats}` could not be read: {' '.join(str(error).split())}"]
    rows = [
        (task.name, f"`{task.model}`", str(task.samples), str(task.tokens), task.data or "—")
        for task in manifest.tasks
    ]
    total_samples = sum(task.samples for task in manifest.tasks)
    total_tokens = sum(task.tokens for task in manifest.tasks)
    return [
        "",
        f"Calibration statistics: `{stats}` ({len(manifest.tasks)} tasks, {total_samples} samples, "
        f"{total_tokens} tokens in all).",
        "",
        _table(["task", "expert", "samples", "tokens", "data"], rows),
    ]


def _bmm_sections(view: RecipeView) -> list[str]:
    gram = str(view.setting("gram", "data_free"))
    lambda_mode = str(view.setting("lambda_mode", "relative"))
    lines = [
        "## Method",
        "",
        f"This model was merged with **{PAPER_TITLE} (BMM)** ([arXiv 2605.12843]({PAPER_URL})), "
        "implemented as the `bmm` merge method of the mergekit-bmm plugin for "
        f"[mergekit]({MERGEKIT_URL}).",
        "",
        "For every 2D linear weight of the transformer body, BMM solves an anchor-regularised Bayesian "
        "regression: with task vectors `U_t = W_t − W_pre` and an anchor `U0` (the prior mean, the result "
        "of an existing merge), the posterior mean is",
        "",
        "```",
        "U = (Σ_t U_t G_t + λ'·U0) (Σ_t G_t + λ'·I)⁻¹        W = W_pre + s·U",
        "```",
        "",
        "where `G_t` is task t's input Gram matrix, λ is the prior strength per module group and block of "
        "layers, and s one scale per block. Embeddings, norms, biases and the output head take the anchor's "
        "result.",
        "",
        _table(
            ["setting", "value"],
            [
                ("Gram mode", GRAM_MEANING.get(gram, f"`{gram}`")),
                *([("ε (mix)", format_value(view.setting("epsilon", 0.5)))] if gram == "mix" else []),
                (
                    "λ mode",
                    "relative: `λ' = λ·tr(G)/d_in`" if lambda_mode == "relative" else "absolute: `λ' = λ`",
                ),
                ("compute dtype", str(view.setting("compute_dtype", "float32"))),
                ("output dtype", str(view.config.dtype or "as the base")),
            ],
        ),
        "",
    ]
    lines += _anchor_section(view)
    stats_lines = _statistics_lines(view, gram)
    if stats_lines:
        lines += ["### Calibration statistics", *stats_lines, ""]
    if view.blocks:
        rows = [
            (row.label, *(row.lambdas[group] for group in GROUP_MEANING), row.scale) for row in view.blocks
        ]
        header = ["layers", *(f"λ {group}" for group in GROUP_MEANING), "s"]
        lines += [
            "### λ and s per block",
            "",
            "Values as the merge resolved them for each block of output layers and module group ("
            + ", ".join(f"`{group}`: {meaning}" for group, meaning in GROUP_MEANING.items())
            + "); a range means the value varies inside the block.",
            "",
            _table(header, rows),
            "",
        ]
    return lines


def _generic_method_section(view: RecipeView) -> list[str]:
    lines = [
        "## Method",
        "",
        f"This model was merged with {_method_link(view.merge_method)} through the mergekit-bmm plugin "
        f"for [mergekit]({MERGEKIT_URL}).",
        "",
    ]
    parameters = view.config.parameters or {}
    if parameters:
        rows = [(f"`{name}`", format_value(value)) for name, value in parameters.items()]
        lines += [_table(["parameter", "value"], rows), ""]
    return lines


def _models_section(view: RecipeView, record: MergeRecord | None) -> list[str]:
    fingerprints = {item.model: item.fingerprint for item in (record.inputs if record else [])}
    rows = [
        (
            model.role,
            _model_md(model),
            f"`{fingerprints[model.reference]}`" if fingerprints.get(model.reference) else "—",
        )
        for model in view.inputs
    ]
    return ["## Models merged", "", _table(["role", "model", "weights fingerprint"], rows), ""]


def _search_section(summary: SearchSummary, plots: Mapping[str, str]) -> list[str]:
    evaluator = summary.evaluator.get("type", "—") if summary.evaluator else "—"
    facts = [
        ("strategy", summary.strategy),
        ("budget", format_value(summary.budget)),
        ("initial points", format_value(summary.n_initial)),
        ("seed", format_value(summary.seed)),
        ("trials completed / failed", f"{summary.completed_trials} / {summary.failed_trials}"),
        ("best trial", format_value(summary.best_trial)),
        ("best score", format_value(summary.best_score)),
        (
            "anchor score",
            format_value(summary.anchor_score) if summary.anchor_score is not None else "not evaluated",
        ),
        ("evaluator", str(evaluator)),
        ("blocks", ", ".join(f"{a}–{b - 1}" for a, b in summary.blocks) or "—"),
        ("groups searched", ", ".join(summary.groups) or "—"),
    ]
    lines = [
        "## Search",
        "",
        "λ per block and group and s per block were chosen by `mergekit-bmm-search`, which scores each "
        "candidate merge on a validation set (Gaussian-process Bayesian optimisation with expected "
        "improvement for the `bo` strategy).",
        "",
        _table(["search", "value"], facts),
        "",
    ]
    staged = (getattr(summary, "fidelity", None) or {}).get("description")
    if staged:  # how the search spent its validation examples (cheap-then-full evaluation)
        lines += [staged[0].upper() + staged[1:] + ".", ""]
    changes = getattr(summary, "box_changes", None) or []
    if changes:
        lines += ["The search box widened where the best point sat on an edge:", ""]
        lines += [
            f"- search box widened: `{change['dimension']}` "
            f"[{change['old_low']:.4g}, {change['old_high']:.4g}] → "
            f"[{change['low']:.4g}, {change['high']:.4g}] after trial {change['after_trial']}"
            for change in changes
        ]
        lines.append("")
    anchor = summary.anchor_per_task or {}
    tasks = list(dict.fromkeys([*summary.best_per_task, *anchor]))
    if tasks:
        scores = [*summary.best_per_task.values(), *anchor.values(), summary.best_score, summary.anchor_score]
        places = _decimal_places([value for value in scores if value is not None])

        def score(value: float | None) -> str:
            return "—" if value is None else f"{value:.{places}f}"

        def delta(best: float | None, base: float | None) -> str:
            return "—" if best is None or base is None else f"{best - base:+.{places}f}"

        rows = [
            (
                task,
                score(summary.best_per_task.get(task)),
                score(anchor.get(task)),
                delta(summary.best_per_task.get(task), anchor.get(task)),
            )
            for task in tasks
        ]
        if summary.best_score is not None:
            overall = summary.anchor_score
            rows.append(
                ("**overall**", score(summary.best_score), score(overall), delta(summary.best_score, overall))
            )
        lines += ["Scores per task (this model against the anchor merge):", ""]
        lines += [_table(["task", "BMM (this model)", "anchor", "Δ"], rows), ""]
        if summary.anchor_per_task is None:
            lines += ["The anchor was not evaluated (`mergekit-bmm-search --eval-anchor` adds it).", ""]
    verdict = summary.anchor_verdict()
    if verdict:
        lines += [f"**{verdict}**", ""]
    for title, file_name in plots.items():
        lines += [f"![{title}]({file_name})", ""]
    return lines


def _decimal_places(values: Sequence[float], digits: int = 4) -> int:
    """Decimals that show ``digits`` significant digits of the largest value: one precision for a
    column of scores and their differences."""

    largest = max((abs(value) for value in values if value), default=1.0)
    return max(digits - 1 - math.floor(math.log10(largest)), 0)


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
    search: SearchSummary | None = None,
    plots: Mapping[str, str] | None = None,
) -> str:
    """The whole card (front matter + body) as text."""
    experts = view.experts
    base = view.base
    intro = f"A merge of {len(experts)} fine-tuned model{'s' if len(experts) != 1 else ''}"
    intro += f" of {_model_md(base)}" if base is not None else ""
    intro += f", made with mergekit's `{view.merge_method}` method"
    intro += " chosen by a hyperparameter search." if search is not None else "."
    lines = ["---", front_matter(view).rstrip(), "---", f"# {name}", "", intro, ""]
    lines += _bmm_sections(view) if view.merge_method == "bmm" else _generic_method_section(view)
    lines += _models_section(view, record)
    if search is not None:
        lines += _search_section(search, plots or {})
    lines += [
        "## Reproduce",
        "",
        f"The recipe below (also in `{RECIPE_FILE}`) reproduces this model with the stock mergekit command "
        "once the plugin is installed; local model folders in it are those of the machine that made the "
        "merge (use the models listed above).",
        "",
        _fence(f"{install_command()}\nmergekit-yaml {RECIPE_FILE} ./merged", "bash"),
        "",
        _fence(recipe_text, "yaml"),
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
            _fence(recipe_text, "yaml"),
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


def write_search_card(best_dir: Path, summary: SearchSummary, search_out: Path) -> Path:
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
