"""How far a merge went from its anchor: the figure the report uses to explain a small Δ."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertModel

from bench.merging.diagnostics import cached_moved_from_anchor, moved_from_anchor


def _save(model: BertModel, folder) -> None:
    model.save_pretrained(str(folder))


@pytest.fixture()
def base_and_anchor(tmp_path):
    config = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
    )
    torch.manual_seed(0)
    base = BertModel(config)
    _save(base, tmp_path / "base")
    anchor = BertModel(config)
    anchor.load_state_dict(base.state_dict())
    with torch.no_grad():
        for name, weight in anchor.named_parameters():
            if "encoder.layer" in name and weight.ndim == 2:
                weight.add_(0.01 * torch.randn_like(weight))
    _save(anchor, tmp_path / "anchor")
    return config, base, anchor, tmp_path


def test_the_anchor_itself_has_not_moved_and_twice_its_task_vector_moved_by_one(base_and_anchor):
    config, base, anchor, root = base_and_anchor
    kept = moved_from_anchor(root / "anchor", root / "anchor", root / "base")
    assert set(kept) == {"attn_in", "attn_out", "mlp_in", "mlp_out"}
    assert all(value == 0 for value in kept.values())
    doubled = BertModel(config)
    pre, theirs = base.state_dict(), anchor.state_dict()
    doubled.load_state_dict({name: pre[name] + 2 * (theirs[name] - pre[name]) for name in pre})
    _save(doubled, root / "doubled")
    moved = moved_from_anchor(root / "doubled", root / "anchor", root / "base")
    assert moved == pytest.approx(dict.fromkeys(kept, 1.0), abs=1e-3)


def test_the_figure_is_kept_per_merge_recipe(base_and_anchor, monkeypatch):
    """A report run again reads each merge's figures from the cache instead of three state dicts."""
    import bench.merging.diagnostics as diagnostics

    _, _, _, root = base_and_anchor
    (root / "anchor" / "mergekit_config.yml").write_text("merge_method: bmm  # the recipe of this merge\n")
    first = cached_moved_from_anchor(root / "anchor", root / "anchor", root / "base", root / "cache")
    assert len(list((root / "cache" / "moved").glob("*.json"))) == 1
    monkeypatch.setattr(diagnostics, "moved_from_anchor", lambda *a: pytest.fail("not from the cache"))
    assert cached_moved_from_anchor(root / "anchor", root / "anchor", root / "base", root / "cache") == first


def test_task_vector_cosines_say_how_far_the_experts_pull_apart(base_and_anchor, monkeypatch):
    """An expert twice along the anchor's update is aligned with it (+1), one along its opposite is
    opposed (−1); the figure is kept per set of checkpoints."""
    import bench.merging.diagnostics as diagnostics

    config, base, anchor, root = base_and_anchor
    pre, theirs = base.state_dict(), anchor.state_dict()
    for label, factor in (("twice", 2.0), ("opposite", -1.0)):
        expert = BertModel(config)
        expert.load_state_dict({name: pre[name] + factor * (theirs[name] - pre[name]) for name in pre})
        _save(expert, root / label)
    experts = {"anchor": root / "anchor", "twice": root / "twice", "opposite": root / "opposite"}
    found = diagnostics.task_vector_cosines(root / "base", experts, root / "cache")
    assert found["pairs"]["anchor / twice"] == pytest.approx(1.0, abs=1e-4)
    assert found["pairs"]["anchor / opposite"] == pytest.approx(-1.0, abs=1e-4)
    assert found["most_opposed"]["cosine"] == pytest.approx(-1.0, abs=1e-4)
    assert found["mean"] == pytest.approx(-1 / 3, abs=1e-3)
    monkeypatch.setattr(diagnostics, "load_state_dict", lambda *a: pytest.fail("not from the cache"))
    assert diagnostics.task_vector_cosines(root / "base", experts, root / "cache") == found
