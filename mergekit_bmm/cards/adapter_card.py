"""The card of an adapter written by ``mergekit-bmm-lora``: what was merged, how exactly, the recipe."""

from __future__ import annotations

from typing import Any

from mergekit_bmm.cards.markdown import fence, table


def adapter_card(recipe_text: str, config: Any, report: Any, name: str) -> str:
    """README.md for the adapter folder (PEFT front matter; each module's rank and error)."""
    base = str(config.base_model)
    experts = [str(r) for r in config.referenced_models() if r != config.base_model]
    exact = all(module.exact for module in report.modules)
    rows = [(m.name.removesuffix(".weight"), str(m.rank), f"{m.error:.1e}") for m in report.modules]
    how = (
        "Every module's merged update lies in the span of the experts' adapters, so this adapter "
        "reproduces the merge exactly (to float32 rounding)."
        if exact
        else "Some modules' merged updates reach outside the adapters' span or were truncated: those "
        "factors are the best fit of their rank (truncated SVD); the error column says how far each is."
    )
    lines = [
        "---",
        f"base_model: {base}",
        "library_name: peft",
        "tags: [mergekit, merge, lora, bmm]",
        "---",
        f"# {name}",
        "",
        f"A LoRA adapter for `{base}`: the `{config.merge_method}` merge of {len(experts)} LoRA experts, "
        "made with mergekit and written as one adapter by `mergekit-bmm-lora`. " + how,
        "",
        "Experts: " + ", ".join(f"`{e}`" for e in experts) + ".",
        "",
        table(["module", "rank", "relative error"], rows),
        "",
        "Load it with PEFT: `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "
        "this_folder)`.",
        "",
        "## Recipe",
        "",
        fence(recipe_text, "yaml"),
        "",
    ]
    return "\n".join(lines)
