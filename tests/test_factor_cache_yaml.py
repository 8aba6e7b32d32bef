"""``cache:`` through the stock ``mergekit-yaml``: trials with new λ/s read the factors; stale or damaged
entries are never used."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import load_weights, relative_error
from references import expected_bmm_merge
from safetensors.torch import save_file
from test_yaml_merge import recipe as plain_recipe
from test_yaml_merge import run, write

from mergekit_bmm.core.module_map import classify


def recipe(family, **parameters) -> dict:
    """float32 factors when cached, so merges can be held to 1e-5 of uncached ones on
    ``W − W_pre`` (the default precision, ``auto``, is tested in test_factor_cache.py)."""
    if "cache" in parameters:
        parameters.setdefault("cache_dtype", "float32")
    return plain_recipe(family, **parameters)


pytestmark = pytest.mark.slow


def merge_in_process(config: dict, out: Path) -> None:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    run_merge(
        MergeConfiguration.model_validate(config),
        str(out),
        options=MergeOptions(copy_tokenizer=False, quiet=True, write_model_card=False),
    )


def assert_same_merge(got_dir: Path, expected: dict, base: dict, tolerance: float) -> None:
    """Every tensor agrees; solved ones compared on ``W − W_pre`` (what the solve produces)."""
    got = load_weights(got_dir)
    assert set(got) == set(expected)
    for name, value in expected.items():
        if classify(name, "llama") is not None and value.ndim == 2:
            error = relative_error(
                got[name].double() - base[name].double(), value.double() - base[name].double()
            )
        else:
            error = relative_error(got[name], value)
        assert error <= tolerance, (name, error)


def stamps(cache: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in cache.glob("*.safetensors")}


def test_trials_with_new_lambda_and_scale_read_the_cache_and_match_uncached_merges(tiny_llama, tmp_path):
    cache = tmp_path / "cache"
    base = load_weights(tiny_llama.base)
    trials = [{"lambda": 0.3, "scale": 1.0}, {"lambda": 1.0, "scale": 0.8}]
    for index, settings in enumerate(trials):
        merge_in_process(recipe(tiny_llama, **settings), tmp_path / f"uncached-{index}")

    for index, settings in enumerate(trials):
        path = write(tmp_path, recipe(tiny_llama, cache=str(cache), **settings))
        result = run("mergekit-yaml", path, tmp_path / f"trial-{index}", "--no-copy-tokenizer")
        assert result.returncode == 0, result.stderr[-2000:]
        if index == 0:
            filled = stamps(cache)
            # 4 layers × 7 solved weights; the Task Arithmetic anchors of embed_tokens and lm_head are
            # recomputed by every merge, not stored
            assert len(filled) == 4 * 7
        assert stamps(cache) == filled  # the second trial only reads: nothing recomputed or rewritten
        expected = load_weights(tmp_path / f"uncached-{index}")
        assert_same_merge(tmp_path / f"trial-{index}", expected, base, 1e-5)


def test_damaged_entries_are_ignored_logged_and_rebuilt(tiny_llama, tmp_path, caplog):
    cache = tmp_path / "cache"
    config = recipe(tiny_llama, cache=str(cache), **{"lambda": 0.5})
    merge_in_process(config, tmp_path / "first")
    filled = stamps(cache)
    names = sorted(filled)
    truncated, flipped = cache / names[0], cache / names[1]
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    data = bytearray(flipped.read_bytes())
    data[-3] ^= 0x40
    flipped.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="mergekit_bmm"):
        merge_in_process(config, tmp_path / "again")
    warnings = [r.getMessage() for r in caplog.records if "bmm cache: ignoring" in r.getMessage()]
    assert len(warnings) == 2 and all(any(n in w for w in warnings) for n in names[:2])
    after = stamps(cache)
    assert sorted(name for name in after if after[name] != filled[name]) == names[:2]
    first, again = load_weights(tmp_path / "first"), load_weights(tmp_path / "again")
    assert all(torch.equal(first[name], again[name]) for name in first)


def test_an_expert_rewritten_in_place_invalidates_the_cache(tiny_llama, tmp_path):
    family_dir = tmp_path / "family"
    shutil.copytree(tiny_llama.base.parent, family_dir)
    family = type(tiny_llama)(
        base=family_dir / tiny_llama.base.name,
        experts=tuple(family_dir / p.name for p in tiny_llama.experts),
        architecture=tiny_llama.architecture,
    )
    cache = tmp_path / "cache"
    settings = {"lambda": 0.3, "cache": str(cache)}
    merge_in_process(recipe(family, **settings), tmp_path / "before")
    filled = stamps(cache)

    # The "same" expert, fine-tuned again: every weight moves.
    target = family.experts[0] / "model.safetensors"
    weights = load_weights(family.experts[0])
    generator = torch.Generator().manual_seed(42)
    changed = {
        k: (v + 0.01 * v.std() * torch.randn(v.shape, generator=generator)).contiguous()
        for k, v in weights.items()
    }
    save_file(changed, str(target), metadata={"format": "pt"})

    result = run(
        "mergekit-yaml",
        write(tmp_path, recipe(family, **settings)),
        tmp_path / "after",
        "--no-copy-tokenizer",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "bmm cache: ignoring" not in result.stderr  # stale entries are not even opened
    after = stamps(cache)
    assert set(filled) < set(after) and len(after) == 2 * len(filled)
    expected = expected_bmm_merge(family, (0.3,) * 3, lambda n: 0.3, lambda n: 1.0, "llama")
    assert_same_merge(tmp_path / "after", expected, load_weights(family.base), 1e-5)
