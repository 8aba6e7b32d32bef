"""KnOTS, the LoRA track's SVD-aligned peer: the alignment is exact, TIES behaves as the authors' code."""

from __future__ import annotations

import pytest
import torch

from bench.merging.language.knots import align, knots_model, knots_updates, ties_masked_mean


def factors(seed: int, d_out: int = 12, d_in: int = 9, rank: int = 2):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(d_out, rank, generator=generator, dtype=torch.float64),
        torch.randn(rank, d_in, generator=generator, dtype=torch.float64),
    )


def test_the_alignment_is_the_svd_of_the_concatenated_updates_and_rebuilds_every_task():
    updates = [factors(seed) for seed in range(3)]
    dense = torch.cat([left @ right for left, right in updates], dim=1)  # d_out × T·d_in
    aligned = align(updates)
    expected = torch.linalg.svdvals(dense)
    expected = expected[expected > 1e-5]
    found = torch.linalg.norm(torch.cat(aligned.tasks, dim=1), dim=1)  # rows of S V: the singular values
    assert torch.allclose(found, expected, rtol=1e-10)
    assert torch.allclose(aligned.basis.T @ aligned.basis, torch.eye(len(expected), dtype=torch.float64))
    for (left, right), task in zip(updates, aligned.tasks):
        assert torch.allclose(aligned.basis @ task, left @ right, atol=1e-10)


def test_ties_keeps_the_elected_sign_and_averages_the_entries_that_agree():
    rows = torch.tensor([[1.0, -2.0, 0.5, 0.25], [3.0, 1.0, -0.1, 0.2]], dtype=torch.float64)
    # signs by the sum (+, −, +, +); the mean over the entries that agree
    expected = torch.tensor([2.0, -2.0, 0.5, 0.225], dtype=torch.float64)
    assert torch.allclose(ties_masked_mean(rows, 1.0, 1.0), expected)
    assert torch.allclose(ties_masked_mean(rows, 0.5, 1.0), 0.5 * expected)
    # a share of 0.5 as the authors' code counts it (k = d − int(d·K), keep |x| ≥ the k-th smallest):
    # 3 of 4 per task, so 0.25 and -0.1 drop
    expected = torch.tensor([2.0, -2.0, 0.5, 0.2], dtype=torch.float64)
    assert torch.allclose(ties_masked_mean(rows, 1.0, 0.5), expected)


def test_dare_drops_about_its_rate_and_rescales_what_it_keeps():
    rows = torch.ones(1, 20000, dtype=torch.float64)
    merged = ties_masked_mean(rows, 1.0, 1.0, dare=0.8, seed=3)
    assert abs(float((merged != 0).double().mean()) - 0.2) < 0.02
    assert torch.allclose(merged[merged != 0], torch.full_like(merged[merged != 0], 5.0))
    assert torch.equal(merged, ties_masked_mean(rows, 1.0, 1.0, dare=0.8, seed=3))


@pytest.mark.slow
def test_one_adapter_merged_by_knots_is_that_adapter_added_to_the_base(tmp_path):
    from safetensors.torch import load_file

    from mergekit_bmm.examples.tiny_models import make_lora_adapter, make_tiny_family
    from mergekit_bmm.io.lora_adapters import adapter_for

    family = make_tiny_family(tmp_path / "llama", "llama", n_experts=1)
    adapters = [make_lora_adapter(family.base, tmp_path / f"lora-{seed}", seed) for seed in (0, 1)]
    read = [adapter_for(path) for path in adapters]
    alone = knots_updates(read[:1], 1.0, 1.0)
    name = "model.layers.0.self_attn.q_proj"
    left, right = read[0].update(f"{name}.weight")
    assert torch.allclose(alone[name], left @ right, atol=1e-10)
    from bench.merging.language.lora_track import saved_model

    build = lambda: knots_model(family.base, adapters, 0.5, 1.0, 0.0)  # noqa: E731
    out = saved_model(tmp_path / "merged", family.base, build)
    base, merged = (
        load_file(str(family.base / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    both = knots_updates(read, 0.5, 1.0)
    delta = merged[f"{name}.weight"].double() - base[f"{name}.weight"].double()
    assert torch.allclose(delta, both[name], atol=1e-6)
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
