"""Every recipe shipped in configs/ merges the tiny models once its paths are filled in."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from conftest import load_weights

pytestmark = pytest.mark.slow

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yml"))


def fill_paths(text: str, family) -> str:
    """Point the placeholder /models/... paths at the tiny family."""
    text = text.replace("/models/base", str(family.base))
    for path in family.experts:
        text = text.replace(f"/models/{path.name}", str(path))
    return text


@pytest.mark.parametrize("config_path", CONFIGS, ids=lambda p: p.name)
def test_shipped_recipe_merges(config_path, tiny_llama, tmp_path):
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    raw = yaml.safe_load(fill_paths(config_path.read_text(), tiny_llama))
    if raw.get("merge_method") != "bmm" and "bmm" not in config_path.name:
        pytest.skip("not a bmm recipe")
    if (raw.get("parameters") or {}).get("stats"):
        pytest.skip("needs a statistics directory (covered by the data-assisted tests)")
    run_merge(
        MergeConfiguration.model_validate(raw),
        str(tmp_path / "out"),
        options=MergeOptions(copy_tokenizer=False, quiet=True, write_model_card=False),
    )
    merged = load_weights(tmp_path / "out")
    base = load_weights(tiny_llama.base)
    assert set(merged) == set(base)
    assert all(torch.isfinite(t.float()).all() for t in merged.values())
    changed = [n for n in merged if not torch.equal(merged[n].float(), base[n].to(merged[n].dtype).float())]
    assert changed, "the merge returned the base unchanged"
