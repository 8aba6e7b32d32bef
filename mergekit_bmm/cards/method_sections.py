"""The card's "Method" section: what BMM (or another method) did, in the terms of the paper.

It states the closed form and its settings, where the anchor came from and with which
parameters, the calibration statistics behind data-assisted Grams, and λ and s per block
and module group as the merge resolved them (:mod:`mergekit_bmm.cards.recipe_view`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from mergekit_bmm.cards.markdown import model_link, table
from mergekit_bmm.cards.recipe_view import ROLE_BASE, InputModel, RecipeView, format_value, method_spec
from mergekit_bmm.errors import BMMError

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


def method_link(name: str) -> str:
    """The method's name, linked to its reference where mergekit knows one."""
    spec = method_spec(name)
    if spec is None:
        return f"`{name}`"
    pretty = spec.pretty_name or spec.name
    url = (spec.reference_url or "").strip()
    text = f"[{pretty}]({url})" if url else pretty
    return f"{text} (`{name}`)"


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
            f"The prior mean is the input checkpoint {model_link(anchor_input)} (`anchor: true`): "
            "`U0 = W_anchor − W_pre`."
        )
        return lines + [""]
    if method == PRETRAINED_ANCHOR:
        lines.append("The prior mean is the pretrained model itself (`anchor_method: pretrained`, `U0 = 0`).")
        return lines + [""]
    name = str(method or DEFAULT_ANCHOR)
    default_note = "" if method else " (the default)"
    lines.append(
        f"The prior mean `U0` is the result of {method_link(name)}{default_note} on the same experts, "
        "computed per tensor."
    )
    spec = method_spec(name)
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
        lines += ["", table(["anchor parameter", "value"], shared)]
    per_model = [p for p in spec.parameters if p.scope != ParameterScope.SHARED]
    experts = [model for model in view.inputs if model.role != ROLE_BASE]
    if per_model and experts:
        rows = []
        for model in experts:
            row = [model_link(model)]
            for parameter in per_model:
                row.append(_per_model_value(view, model, key(parameter.name), parameter))
            rows.append(row)
        header = ["model", *(f"`{key(p.name)}`" for p in per_model)]
        lines += ["", table(header, rows)]
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
        table(["task", "expert", "samples", "tokens", "data"], rows),
    ]


def bmm_sections(view: RecipeView) -> list[str]:
    """What BMM did: the closed form, its settings, the anchor, the statistics, λ and s per block."""
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
        table(
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
            table(header, rows),
            "",
        ]
    return lines


def evidence_section(chosen: Mapping[str, Mapping]) -> list[str]:
    """The λ that ``lambda: auto`` chose, per module group (empty when λ was given)."""
    if not chosen:
        return []
    from mergekit_bmm.merge_methods.chosen_lambdas import by_group, group_of

    rows = []
    for group, values in by_group(chosen).items():
        edges = [c.get("edge") for name, c in chosen.items() if group_of(name) == group]
        rows.append(
            (
                group,
                str(len(values)),
                f"{statistics.median(values):.3g}",
                f"{min(values):.3g} – {max(values):.3g}",
                str(edges.count("low")),
                str(edges.count("high") + edges.count("flat")),
            )
        )
    return [
        "### λ chosen by the evidence",
        "",
        "The recipe sets `lambda: auto`: each weight's λ maximises the marginal likelihood of the "
        "experts' outputs under BMM's prior (type-II maximum likelihood; every weight's choice and its "
        '1-nat interval are in `mergekit_bmm_merge.json`). "low edge": the experts are fitted '
        'exactly and the least regularisation allowed was used; "high edge": the anchor explains the '
        "experts and was kept.",
        "",
        table(["group", "weights", "median λ", "range", "low edge", "high edge"], rows),
        "",
    ]


def generic_method_section(view: RecipeView) -> list[str]:
    """Any other method: its name, link and parameters."""
    lines = [
        "## Method",
        "",
        f"This model was merged with {method_link(view.merge_method)} through the mergekit-bmm plugin "
        f"for [mergekit]({MERGEKIT_URL}).",
        "",
    ]
    parameters = view.config.parameters or {}
    if parameters:
        rows = [(f"`{name}`", format_value(value)) for name, value in parameters.items()]
        lines += [table(["parameter", "value"], rows), ""]
    return lines
