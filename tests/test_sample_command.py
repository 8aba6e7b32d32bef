"""``mergekit-bmm-sample`` on tiny models: layout, exact MAP at β = ∞, the right noise, refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import load_weights

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.sampling.posterior import RowPosterior
from mergekit_bmm.sampling.run import INCOMPLETE_MARKER, SamplingRequest, sample_models

pytestmark = pytest.mark.slow

TARGET = "model.layers.3.mlp.down_proj.weight"
LAMBDA, SCALE = 0.05, 1.3
Z = 5.0


def recipe(family, experts=None, lam=LAMBDA, **extra):
    experts = family.experts if experts is None else experts
    return {
        "merge_method": "bmm",
        "base_model": str(family.base),
        "models": [{"model": str(path), "parameters": {"weight": 0.3}} for path in experts],
        "parameters": {"anchor_method": "task_arithmetic", "lambda": lam, "scale": SCALE, **extra},
        "dtype": "float32",
    }


def options():
    from mergekit.options import MergeOptions

    return MergeOptions(quiet=True, write_model_card=False)


def reference_precision(family):
    """β-free part of Σ_row⁻¹ for TARGET, in float64 from the checkpoints: G + λ'I."""
    base = load_weights(family.base)[TARGET].double()
    vectors = [load_weights(path)[TARGET].double() - base for path in family.experts]
    gram = sum(u.T @ u for u in vectors)
    ridge = LAMBDA * gram.trace().item() / gram.shape[0]
    return gram + ridge * torch.eye(gram.shape[0], dtype=torch.float64), gram, ridge


def noise_of(sample_dir: Path, map_dir: Path, name=TARGET) -> torch.Tensor:
    """U_sample − U_MAP = (W_sample − W_MAP)/s."""
    return (load_weights(sample_dir)[name].double() - load_weights(map_dir)[name].double()) / SCALE


def assert_standard_normal(values: torch.Tensor) -> None:
    n = values.numel()
    assert abs(values.mean().item()) <= Z / math.sqrt(n), values.mean()
    assert abs(values.var().item() - 1) <= Z * math.sqrt(2 / n), values.var()


@pytest.fixture(scope="module")
def posterior_run(tiny_llama, tmp_path_factory):
    """Three posterior samples of TARGET, noise about 30% of U_MAP's size."""
    _, gram, ridge = reference_precision(tiny_llama)
    rms_at_1 = RowPosterior.from_gram(gram, ridge, 1.0).rms_std()
    base = load_weights(tiny_llama.base)[TARGET].double()
    u_ta = sum(0.3 * (load_weights(p)[TARGET].double() - base) for p in tiny_llama.experts)
    beta = (rms_at_1 / (0.3 * u_ta.pow(2).mean().sqrt().item())) ** 2
    out = tmp_path_factory.mktemp("posterior") / "samples"
    summary = sample_models(
        recipe(tiny_llama),
        out,
        SamplingRequest(3, beta=beta, name_filter="layers.3.mlp.down_proj"),
        options(),
    )
    return out, summary, beta


def test_posterior_noise_has_covariance_beta_inverse_gram_plus_ridge(tiny_llama, posterior_run):
    """Whitened by chol(β(G + λ'I)) (float64 reference), the noise of every sample is i.i.d. N(0, 1)."""
    out, summary, beta = posterior_run
    precision, _, ridge = reference_precision(tiny_llama)
    whitener = torch.linalg.cholesky(beta * precision)
    noises = torch.stack([noise_of(out / member, out / "map") for member in summary.members])
    assert_standard_normal(noises @ whitener)
    assert [record.name for record in summary.tensors] == [TARGET]
    assert summary.tensors[0].ridge == pytest.approx(ridge, rel=1e-4)
    assert summary.tensors[0].scale == SCALE


def test_only_filtered_tensors_differ_and_folders_share_the_rest(tiny_llama, posterior_run):
    from transformers import AutoModelForCausalLM

    out, summary, _ = posterior_run
    map_weights = load_weights(out / "map")
    assert set(map_weights) == set(load_weights(tiny_llama.base))
    for member in summary.members:
        folder = out / member
        weights = load_weights(folder)
        assert set(weights) == set(map_weights)
        assert [n for n in weights if not torch.equal(weights[n], map_weights[n])] == [TARGET]
        assert not (folder / "model.safetensors").exists()
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        assert index[TARGET] == "sampled.safetensors" and len(index) == len(map_weights)
        for shard in set(index.values()) - {"sampled.safetensors"}:
            assert (folder / shard).stat().st_ino == (out / "map" / shard).stat().st_ino  # hard link
    # what a sample adds on disk: its own sampled shard and small files
    assert summary.disk["bytes_per_sample"] < 0.1 * summary.disk["map_bytes"]
    model = AutoModelForCausalLM.from_pretrained(out / summary.members[1])
    state = model.state_dict()
    assert torch.equal(state[TARGET], load_weights(out / summary.members[1])[TARGET])
    assert torch.equal(
        state["model.layers.0.self_attn.q_proj.weight"], map_weights["model.layers.0.self_attn.q_proj.weight"]
    )
    written = json.loads((out / "samples.json").read_text())
    assert written["members"] == summary.members and written["mode"] == "posterior"
    assert not (out / INCOMPLETE_MARKER).exists()


def test_samples_are_reproducible_and_do_not_depend_on_their_number(tiny_llama, posterior_run, tmp_path):
    out, summary, beta = posterior_run
    again = tmp_path / "again"
    sample_models(
        recipe(tiny_llama),
        again,
        SamplingRequest(2, beta=beta, name_filter="layers.3.mlp.down_proj"),
        options(),
    )
    for member in ("sample-000", "sample-001"):
        assert torch.equal(load_weights(again / member)[TARGET], load_weights(out / member)[TARGET])
    assert not torch.equal(load_weights(out / "sample-000")[TARGET], load_weights(out / "sample-001")[TARGET])


def test_beta_infinity_returns_the_map_merge_exactly(tiny_llama, tmp_path):
    """Every solved tensor sampled at β = ∞ equals a plain mergekit merge of the recipe, bit for bit."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge

    config = {**recipe(tiny_llama), "out_dtype": "bfloat16"}  # solved in float32, written in bf16
    run_merge(MergeConfiguration.model_validate(config), str(tmp_path / "plain"), options=options())
    plain = load_weights(tmp_path / "plain")
    summary = sample_models(config, tmp_path / "inf", SamplingRequest(2, beta=math.inf), options())
    assert len(summary.tensors) == 4 * 7  # every 2D body weight of the 4-layer Llama
    for folder in ["map", *summary.members]:
        weights = load_weights(tmp_path / "inf" / folder)
        assert set(weights) == set(plain)
        assert all(torch.equal(weights[name], plain[name]) for name in plain), folder
        assert weights[TARGET].dtype == torch.bfloat16


def test_iid_baseline_through_the_command(tiny_llama, posterior_run, tmp_path):
    """``--iid-sigma σ``: U = U_MAP + σ·Z with i.i.d. Z, printed summary, one folder layout."""
    from mergekit_bmm.cli.sample import main

    posterior_out, _, _ = posterior_run
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe(tiny_llama)))
    sigma = 2e-3
    result = CliRunner().invoke(
        main,
        [
            str(path),
            str(tmp_path / "iid"),
            "--samples",
            "2",
            "--iid-sigma",
            str(sigma),
            "--filter",
            "layers.3.mlp.down_proj",
            "--quiet",
            "--no-write-model-card",
        ],
    )
    assert result.exit_code == 0, result.output
    assert TARGET in result.output and "iid sigma" in result.output
    noises = torch.stack(
        [noise_of(tmp_path / "iid" / m, tmp_path / "iid" / "map") for m in ("sample-000", "sample-001")]
    )
    assert_standard_normal(noises / sigma)
    # same seed, same Z: the baseline differs from the posterior only by the covariance
    posterior_noise = noise_of(posterior_out / "sample-000", posterior_out / "map")
    assert not torch.allclose(posterior_noise, noises[0])


def test_refusals(tiny_llama, tmp_path):
    from mergekit_bmm.cli.sample import main

    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe(tiny_llama)))
    runner = CliRunner()

    def refused(*args):
        result = runner.invoke(main, [str(path), str(tmp_path / "out"), *args])
        assert result.exit_code != 0
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("mergekit-bmm: error:"), result.output
        return lines[0]

    assert "--beta must be a number > 0" in refused("--beta", "0")
    assert "--beta must be a number > 0" in refused("--beta", "-2")
    assert "--samples must be an integer >= 1" in refused("--samples", "0", "--beta", "1")
    assert "exactly one of --beta" in refused("--samples", "2")
    assert "exactly one of --beta" in refused("--beta", "1", "--iid-sigma", "0.1")
    assert "matches none of the 28 tensors bmm solves" in refused("--beta", "1", "--filter", "lm_head")
    assert not (tmp_path / "out").exists()

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    assert "did not write (mine.txt)" in refused("--beta", "1")
    assert "did not write (mine.txt)" in refused("--beta", "1", "--force")
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep me"

    not_bmm = tmp_path / "ta.yml"
    not_bmm.write_text(yaml.safe_dump({**recipe(tiny_llama), "merge_method": "task_arithmetic"}))
    with pytest.raises(ConfigError, match="needs a `merge_method: bmm` recipe"):
        sample_models(not_bmm, tmp_path / "x", SamplingRequest(1, beta=1.0))


def test_improper_posterior_refused_and_nothing_left_behind(tiny_llama, tmp_path):
    """λ = 0 with one expert: G = U₁ᵀU₁ has rank 64 of 128 for down_proj."""
    config = recipe(tiny_llama, experts=tiny_llama.experts[:1], lam=0.0)
    with pytest.raises(ConfigError, match="improper"):
        sample_models(
            config, tmp_path / "out", SamplingRequest(2, beta=1.0, name_filter="down_proj"), options()
        )
    assert not (tmp_path / "out").exists()


def test_posterior_uses_the_activation_gram_and_refuses_foreign_statistics(tiny_llama, tmp_path):
    """``gram: activations``: Σ_row = β⁻¹(Σ_t G_t + λ'I)⁻¹ with the statistics' Grams."""
    from mergekit_bmm.io.fingerprint import model_fingerprint
    from mergekit_bmm.stats.store import StatsManifest, TaskStats, write_grams, write_manifest

    generator = torch.Generator().manual_seed(5)
    base = load_weights(tiny_llama.base)
    names = [n for n, t in base.items() if t.ndim == 2 and ".layers." in n and "norm" not in n]

    def write_stats(directory, fingerprint_of):
        grams, tasks = {}, []
        for path in tiny_llama.experts:
            task_grams = {}
            for name in names:
                x = torch.randn(base[name].shape[1], 300, generator=generator, dtype=torch.float64)
                task_grams[name] = x @ x.T / 300
            grams[path] = task_grams
            write_grams(directory / "grams" / f"{path.name}.safetensors", task_grams)
            tasks.append(
                TaskStats(
                    name=path.name,
                    model=str(path),
                    fingerprint=fingerprint_of(path),
                    file=f"{path.name}.safetensors",
                    samples=30,
                    tokens=300,
                )
            )
        write_manifest(
            directory,
            StatsManifest(
                format_version=1, package_version="test", tasks=tasks, modules={n: n for n in names}
            ),
        )
        return grams

    grams = write_stats(tmp_path / "stats", model_fingerprint)
    config = recipe(tiny_llama, gram="activations", stats=str(tmp_path / "stats"))
    gram = sum(g[TARGET].float().double() for g in grams.values())
    ridge = LAMBDA * gram.trace().item() / gram.shape[0]
    beta = 1e4
    summary = sample_models(
        config, tmp_path / "out", SamplingRequest(2, beta=beta, name_filter=TARGET), options()
    )
    assert summary.tensors[0].ridge == pytest.approx(ridge, rel=1e-4)
    whitener = torch.linalg.cholesky(beta * (gram + ridge * torch.eye(gram.shape[0], dtype=torch.float64)))
    noises = torch.stack([noise_of(tmp_path / "out" / m, tmp_path / "out" / "map") for m in summary.members])
    assert_standard_normal(noises @ whitener)

    write_stats(tmp_path / "foreign", lambda path: model_fingerprint(tiny_llama.base))
    foreign = recipe(tiny_llama, gram="activations", stats=str(tmp_path / "foreign"))
    with pytest.raises(Exception) as caught:
        sample_models(
            foreign, tmp_path / "out2", SamplingRequest(2, beta=beta, name_filter=TARGET), options()
        )
    from mergekit_bmm.errors import StatisticsError, find_bmm_error

    assert isinstance(find_bmm_error(caught.value), StatisticsError)
    assert "different checkpoint" in str(find_bmm_error(caught.value))
    assert not (tmp_path / "out2").exists()


def test_finished_run_replaced_only_with_force(tiny_llama, tmp_path):
    out = tmp_path / "samples"
    request = SamplingRequest(1, beta=1e9, name_filter="layers.3.mlp.down_proj")
    sample_models(recipe(tiny_llama), out, request, options())
    first = (out / "sample-000" / "sampled.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="holds an earlier sample run.*--force"):
        sample_models(recipe(tiny_llama), out, request, options())
    again = SamplingRequest(1, beta=1e9, name_filter="layers.3.mlp.down_proj", seed=1)
    sample_models(recipe(tiny_llama), out, again, options(), force=True)
    assert sorted(p.name for p in out.iterdir()) == ["map", "sample-000", "samples.json"]
    assert (out / "sample-000" / "sampled.safetensors").read_bytes() != first
