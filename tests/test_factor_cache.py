"""``cache:`` of bmm through the Python API: same results as the direct route, safe keys, robust files."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import reference_solve, relative_error
from mergekit.merge_methods.api import merge_tensors

from mergekit_bmm import __version__
from mergekit_bmm.core import closed_form
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.stats.store import StatsManifest, TaskStats, write_grams, write_manifest

NAME = "model.layers.1.mlp.down_proj.weight"


def inputs(shape=(48, 32), tasks=3, seed=0, dtype=torch.float32) -> list[torch.Tensor]:
    """Base + experts whose Gram is full rank and well conditioned."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=generator, dtype=torch.float64)
    experts = [
        base + 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(tasks)
    ]
    return [t.to(dtype) for t in (base, *experts)]


def bmm(tensors, name=NAME, ids=None, **parameters) -> torch.Tensor:
    """bmm through mergekit's API; a cache holds float32 factors unless ``cache_dtype`` says
    otherwise (the default, ``auto``, has its own test), so results can be held to 1e-5 of
    the direct route on ``W − W_pre``."""
    parameters = {"weight": [0.3] * (len(tensors) - 1), **parameters}
    if "cache" in parameters and parameters.get("compute_dtype") != "float64":
        parameters.setdefault("cache_dtype", "float32")
    return merge_tensors(tensors, "bmm", base_index=0, name=name, ids=ids, parameters=parameters)


def entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob("*.safetensors"))


def delta_error(got, expected, base) -> float:
    return relative_error(got.double() - base.double(), expected.double() - base.double())


@pytest.fixture
def factorisations(monkeypatch):
    """Counts eigendecompositions, i.e. cache misses of solved tensors' bases."""
    calls = []
    original = closed_form.diagonalise

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(closed_form, "diagonalise", counting)
    return calls


@pytest.mark.parametrize("lam", [0.0, 0.01, 0.1, 1.0, 10.0])
def test_cached_trials_match_the_direct_route_in_float32(tmp_path, lam):
    tensors = inputs()
    base = tensors[0]
    vectors = [t.double() - base.double() for t in tensors[1:]]
    for scale in (1.0, 0.7):
        direct = bmm(tensors, **{"lambda": lam, "scale": scale})
        cached = bmm(tensors, cache=str(tmp_path), **{"lambda": lam, "scale": scale})
        assert delta_error(cached, direct, base) <= 1e-5
        if lam > 0:
            expected = base.double() + scale * reference_solve(vectors, 0.3 * sum(vectors), lam)
            assert delta_error(cached, expected, base) <= 1e-5
    assert len(entries(tmp_path)) == 1  # every λ and s reads the same factors


def test_reading_merges_equal_the_filling_merge_and_skip_the_factorisation(tmp_path, factorisations):
    tensors = inputs(seed=1)
    first = bmm(tensors, cache=str(tmp_path), **{"lambda": 0.2, "scale": 1.1})
    assert len(factorisations) == 1
    again = bmm(tensors, cache=str(tmp_path), **{"lambda": 0.2, "scale": 1.1})
    other = bmm(tensors, cache=str(tmp_path), lambda_mode="absolute", **{"lambda": 3.0, "scale": 0.5})
    assert len(factorisations) == 1
    assert torch.equal(first, again)
    assert (
        delta_error(other, bmm(tensors, lambda_mode="absolute", **{"lambda": 3.0, "scale": 0.5}), tensors[0])
        < 1e-5
    )


def test_bfloat16_inputs_come_back_in_bfloat16(tmp_path):
    tensors = inputs(seed=10, dtype=torch.bfloat16)
    direct = bmm(tensors, **{"lambda": 0.3, "scale": 0.9})
    cached = bmm(tensors, cache=str(tmp_path), **{"lambda": 0.3, "scale": 0.9})
    assert cached.dtype == torch.bfloat16
    # Both round the same float32 W to bfloat16; they may differ by one unit in the last place.
    ulp = torch.finfo(torch.bfloat16).eps * direct.float().abs().max()
    assert (cached.float() - direct.float()).abs().max() <= 2 * ulp


def test_float64_cache_is_tighter(tmp_path):
    tensors = inputs(seed=2, dtype=torch.float64)
    for lam in (0.0, 0.05, 1.0):
        direct = bmm(tensors, compute_dtype="float64", **{"lambda": lam})
        cached = bmm(tensors, compute_dtype="float64", cache=str(tmp_path), **{"lambda": lam})
        assert delta_error(cached, direct, tensors[0]) <= 1e-12
    from safetensors import safe_open

    (basis,) = (tmp_path / "bases").glob("*.safetensors")
    with safe_open(str(basis), framework="pt") as handle:
        assert handle.get_tensor("basis").dtype == torch.float64


def _limit_reference(vectors, anchor, lam):
    """float64 MAP; at λ = 0 the λ → 0⁺ limit ``C G⁺ + U0 (I − G G⁺)``."""
    if lam > 0:
        return reference_solve(vectors, anchor, lam)
    gram = sum(v.T @ v for v in vectors)
    cross = sum(v @ v.T @ v for v in vectors)
    pseudo = torch.linalg.pinv(gram, hermitian=True)
    return cross @ pseudo + anchor @ (torch.eye(gram.shape[0], dtype=gram.dtype) - gram @ pseudo)


@pytest.mark.parametrize("lam", [0.0, 1e-9, 1e-7, 0.1, 1.0])
def test_lambda_to_zero_on_a_singular_gram(tmp_path, lam):
    # Two 4-row task vectors over 16 inputs: G has rank 8 of 16.
    tensors = inputs(shape=(4, 16), tasks=2, seed=3)
    base = tensors[0]
    vectors = [t.double() - base.double() for t in tensors[1:]]
    direct = bmm(tensors, weight=[0.5, 0.5], **{"lambda": lam})
    cached = bmm(tensors, weight=[0.5, 0.5], cache=str(tmp_path), **{"lambda": lam})
    assert torch.isfinite(cached).all()
    assert delta_error(cached, direct, base) <= 1e-5
    expected = base.double() + _limit_reference(vectors, 0.5 * sum(vectors), lam)
    assert delta_error(cached, expected, base) <= 1e-5


def cache_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in cache.rglob("*.safetensors"))


def stored_dtypes(cache: Path) -> dict[str, torch.dtype]:
    from safetensors import safe_open

    dtypes = {}
    for path in cache.rglob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            for name in ("basis", "correction", "anchor"):
                if name in handle.keys():
                    dtypes[name] = handle.get_tensor(name).dtype
    return dtypes


def test_float16_factors_halve_the_cache_at_a_small_measured_error(tmp_path):
    tensors = inputs(shape=(96, 64), tasks=4, seed=4)
    direct = bmm(tensors, **{"lambda": 0.1})
    single = bmm(tensors, cache=str(tmp_path / "f32"), cache_dtype="float32", **{"lambda": 0.1})
    half = bmm(tensors, cache=str(tmp_path / "f16"), cache_dtype="float16", **{"lambda": 0.1})
    assert delta_error(single, direct, tensors[0]) <= 1e-5
    assert 1e-5 < delta_error(half, direct, tensors[0]) <= 2e-3
    assert torch.equal(
        half, bmm(tensors, cache=str(tmp_path / "f16"), cache_dtype="float16", **{"lambda": 0.1})
    )
    weights = 96 * 64
    # Q (in × in) and the correction E·Q (out × in); the anchor, Task Arithmetic, is recomputed by
    # every merge: 4·(in/out + 1) bytes per weight in float32, half that in float16 (plus a float32
    # scale per column and the evidence's terms).
    assert cache_bytes(tmp_path / "f32") / weights == pytest.approx(4 * (64 / 96 + 1), rel=0.1)
    assert cache_bytes(tmp_path / "f16") / weights == pytest.approx(2 * (64 / 96 + 1), rel=0.2)


@pytest.mark.parametrize("spread, expected", [(1e-3, torch.int16), (0.3, torch.float32)])
def test_auto_precision_stays_within_1e_5_of_float32_factors(tmp_path, spread, expected):
    """``auto`` (the default) stores int16 where that keeps every merged weight within 1e-5
    (relative) of float32 factors for λ ≥ 1e-3 and s ≤ 2.2, float32 where it would not."""
    generator = torch.Generator().manual_seed(12)
    base = torch.randn(96, 64, generator=generator)
    tensors = [base, *(base + spread * torch.randn(96, 64, generator=generator) for _ in range(3))]
    bmm(tensors, cache=str(tmp_path / "auto"), cache_dtype="auto", **{"lambda": 0.1})
    stored = stored_dtypes(tmp_path / "auto")
    if expected == torch.int16:
        assert set(stored.values()) == {torch.int16}
    else:  # the factors that cost the fewest bytes in float32 and keep the budget
        assert torch.float32 in stored.values() and torch.int16 in stored.values()
    for lam in (1e-3, 0.1, 10.0):
        for scale in (1.0, 2.2):
            parameters = {"lambda": lam, "scale": scale}
            auto = bmm(tensors, cache=str(tmp_path / "auto"), cache_dtype="auto", **parameters).double()
            single = bmm(tensors, cache=str(tmp_path / "f32"), cache_dtype="float32", **parameters).double()
            assert relative_error(auto, single) <= 1e-5, parameters
    ratio = cache_bytes(tmp_path / "auto") / cache_bytes(tmp_path / "f32")
    assert ratio == pytest.approx(0.5, rel=0.1) if expected == torch.int16 else 0.5 < ratio <= 1.0


def test_a_stored_basis_has_a_scale_per_block_of_rows_and_products_decode_it():
    """int16 bases keep a scale per column and block of 256 rows: every entry within half its block's
    step (finer than one scale per column), and a trial's product equals the decoded basis'; a basis
    with one scale per column (caches written before) still merges as it did."""
    from dataclasses import replace

    from mergekit_bmm.merge_methods.factor_cache import precision

    generator = torch.Generator().manual_seed(3)
    basis, _ = torch.linalg.qr(torch.randn(600, 50, generator=generator, dtype=torch.float64))
    stored, scale = precision.encode(basis, precision.FIXED_POINT, blocks=True)
    assert stored.dtype == torch.int16 and scale.shape == (3, 50)  # 600 rows: two blocks of 256 and 88
    error = precision.decode(stored, scale, torch.float64) - basis
    steps = scale.double().repeat_interleave(256, dim=0)[:600]
    assert bool((error.abs() <= 0.5 * steps * (1 + 1e-6)).all())
    per_column = precision.rounding_error(basis, precision.FIXED_POINT)
    assert error.norm() < per_column.norm()
    short, short_scale = precision.encode(basis[:256], precision.FIXED_POINT, blocks=True)
    assert short_scale.shape == (50,)  # at most one block: one scale per column, as before
    correction = torch.randn(30, 50, generator=generator, dtype=torch.float64)
    factors = closed_form.EigenFactors(
        basis=stored,
        eigenvalues=torch.rand(50, generator=generator, dtype=torch.float64) + 0.1,
        correction=correction,
        anchor=torch.randn(30, 600, generator=generator, dtype=torch.float64),
        mean_eigenvalue=0.6,
        basis_scale=scale,
    )
    decoded = replace(factors, basis=factors.decoded("basis", torch.float64), basis_scale=None)
    for f in (factors, decoded):
        assert f.basis_for_product(torch.float64).dtype == torch.float64
    expected = closed_form.solve_from_factors(decoded, 0.05)
    assert relative_error(closed_form.solve_from_factors(factors, 0.05), expected) < 1e-12
    old_stored, old_scale = precision.encode(basis, precision.FIXED_POINT)  # one scale per column
    old = replace(factors, basis=old_stored, basis_scale=old_scale)
    old_decoded = replace(old, basis=old.decoded("basis", torch.float64), basis_scale=None)
    assert (
        relative_error(
            closed_form.solve_from_factors(old, 0.05), closed_form.solve_from_factors(old_decoded, 0.05)
        )
        < 1e-12
    )


def test_auto_precision_moves_the_cheapest_factors_that_keep_the_budget():
    """At the Llama-3.2-1B shape's ``down_proj`` (2048 × 8192, a basis of rank 6144) the three
    int16 shares were 1.5 % over the budget together: moving the correction alone keeps it at a
    quarter of the bytes of moving the basis, the largest share."""
    from mergekit_bmm.merge_methods.factor_cache import precision

    budget = precision.Budget(allowance=3.724e-4, weights=torch.ones(1))
    errors = {"anchor": 7.52e-5, "correction": 2.51e-4, "basis": 2.72e-4}
    sizes = {"anchor": 2048 * 8192, "correction": 2048 * 6144, "basis": 8192 * 6144}
    chosen = precision.choose(errors, budget, precision.FIXED_POINT, sizes)
    assert chosen == {"anchor": torch.int16, "correction": torch.float32, "basis": torch.int16}
    within = {"anchor": 1e-5, "correction": 1e-5, "basis": 1e-5}
    assert set(precision.choose(within, budget, precision.FIXED_POINT, sizes).values()) == {torch.int16}
    alone = precision.choose({**errors, "basis": 5e-4}, budget, precision.FIXED_POINT, sizes)
    assert alone["basis"] == torch.float32 and alone["correction"] == torch.int16


def test_a_thin_basis_when_the_gram_has_fewer_rows_than_columns(tmp_path):
    # T·out = 3·8 = 24 < in = 40: G has rank 24, so the basis keeps 24 columns.
    tensors = inputs(shape=(8, 40), tasks=3, seed=13)
    exact = [t.double() for t in tensors]
    for lam in (0.0, 1e-3, 0.01, 1.0):
        reference = bmm(exact, compute_dtype="float64", **{"lambda": lam})  # float64, direct route
        cached = bmm(tensors, cache=str(tmp_path), cache_dtype="float32", **{"lambda": lam})
        assert delta_error(cached, reference, tensors[0]) <= 1e-6
    from safetensors import safe_open

    (basis,) = (tmp_path / "bases").glob("*.safetensors")
    with safe_open(str(basis), framework="pt") as handle:
        assert tuple(handle.get_tensor("basis").shape) == (40, 24)


def stored_names(cache: Path) -> set[str]:
    """The tensors of the solved tensor's entry (bases aside)."""
    from safetensors import safe_open

    (entry,) = cache.glob("*.safetensors")
    with safe_open(str(entry), framework="pt") as handle:
        return set(handle.keys())


@pytest.mark.parametrize("cache_dtype", ["auto", "float32"])
def test_an_anchor_in_a_thin_basis_is_stored_as_its_coordinates(tmp_path, cache_dtype):
    """mergekit's ``linear`` anchor (not one the cache recomputes) lies in the span of the task
    vectors' rows, the thin data-free basis' span: the entry holds ``U0·Q`` (out × r) instead of
    ``U0`` (out × in), and merges stay within the cache's budget of the float64 direct route,
    filled = read bit for bit."""
    tensors = inputs(shape=(8, 40), tasks=3, seed=13)
    exact = [t.double() for t in tensors]
    linear = {"anchor_method": "linear", "lambda": 0.1}
    filled = bmm(tensors, cache=str(tmp_path), cache_dtype=cache_dtype, **linear)
    names = stored_names(tmp_path)
    assert "anchor_in_basis" in names and "anchor" not in names
    assert torch.equal(filled, bmm(tensors, cache=str(tmp_path), cache_dtype=cache_dtype, **linear))
    for lam in (1e-3, 0.1, 10.0):
        for scale in (1.0, 2.2):
            parameters = {"lambda": lam, "scale": scale, "anchor_method": "linear"}
            reference = bmm(exact, compute_dtype="float64", **parameters).double()
            cached = bmm(tensors, cache=str(tmp_path), cache_dtype=cache_dtype, **parameters).double()
            assert relative_error(cached, reference) <= 1e-5, parameters


@pytest.mark.parametrize("anchor", ["task_arithmetic", "marked input"])
def test_an_anchor_the_merge_recomputes_is_not_stored(tmp_path, factorisations, anchor):
    """Task Arithmetic and a marked input are ``U0`` from tensors every merge loads anyway: the entry
    stores no anchor and says so, a cached merge recomputes it exactly (within 1e-5 of the float64
    direct route, filled = read bit for bit, no second factorisation), and a reader that cannot
    recompute it finds no entry."""
    from safetensors import safe_open

    from mergekit_bmm.merge_methods.factor_cache.store import FactorCache

    tensors = inputs(seed=14)
    extra: dict = {}
    if anchor == "marked input":
        tensors = [*tensors, tensors[0] + 0.3 * (tensors[1] - tensors[0]) + 0.1 * (tensors[2] - tensors[0])]
        extra = {"weight": [0.3] * 4, "anchor": [False, False, False, True]}
    exact = [t.double() for t in tensors]
    filled = bmm(tensors, cache=str(tmp_path), **{"lambda": 0.1}, **extra)
    assert stored_names(tmp_path) & {"anchor", "anchor_in_basis"} == set()
    (entry,) = tmp_path.glob("*.safetensors")
    with safe_open(str(entry), framework="pt") as handle:
        assert handle.metadata()["anchor"] == "inputs"
    assert torch.equal(filled, bmm(tensors, cache=str(tmp_path), **{"lambda": 0.1}, **extra))
    for lam in (1e-3, 0.1, 10.0):
        for scale in (1.0, 2.2):
            parameters = {"lambda": lam, "scale": scale, **extra}
            reference = bmm(exact, compute_dtype="float64", **parameters).double()
            cached = bmm(tensors, cache=str(tmp_path), **parameters).double()
            assert delta_error(cached, reference, exact[0]) <= 1e-5, parameters
    assert len(factorisations) == 1
    with safe_open(str(entry), framework="pt") as handle:
        key = handle.metadata()["key"]  # the entry's own key
    cache = FactorCache(tmp_path)
    assert cache.load_factors(NAME, key, tuple(tensors[0].shape), torch.float32) is None
    base = tensors[0]
    if anchor == "marked input":
        anchor_now = tensors[-1] - base
    else:
        anchor_now = sum(0.3 * (expert - base) for expert in tensors[1:])
    read = cache.load_factors(NAME, key, tuple(tensors[0].shape), torch.float32, lambda: anchor_now)
    assert read is not None and read.anchor_recomputed and torch.equal(read.anchor, anchor_now)


def test_a_base_anchor_is_not_stored(tmp_path):
    """``U0 = 0`` (the pretrained model as anchor) needs no anchor in the entry at all."""
    tensors = inputs(seed=6)
    for lam in (0.01, 1.0):
        parameters = {"lambda": lam, "anchor_method": "pretrained"}
        cached = bmm(tensors, cache=str(tmp_path), **parameters)
        assert delta_error(cached, bmm(tensors, **parameters), tensors[0]) <= 1e-5
    assert stored_names(tmp_path) & {"anchor", "anchor_in_basis"} == set()


def test_an_anchor_outside_the_span_stays_dense(tmp_path):
    """A TIES anchor trims entries one by one and leaves the rows' span: it is stored dense."""
    tensors = inputs(shape=(8, 40), tasks=3, seed=13)
    parameters = {"lambda": 0.1, "anchor_method": "ties", "density": 0.5}
    cached = bmm(tensors, cache=str(tmp_path), **parameters)
    assert "anchor" in stored_names(tmp_path)
    assert delta_error(cached, bmm(tensors, **parameters), tensors[0]) <= 1e-5


def test_the_key_covers_inputs_anchor_and_solve_settings(tmp_path, factorisations):
    tensors = inputs(seed=5)
    cache = str(tmp_path)
    bmm(tensors, cache=cache)
    changed_expert = [*tensors[:2], tensors[2] + 1e-4, tensors[3]]
    marked = [*tensors, tensors[0] + 0.2 * (tensors[1] - tensors[0])]
    variants = [
        ({"tensors": changed_expert}, {}),
        ({}, {"weight": [0.2, 0.3, 0.3]}),
        ({}, {"anchor_method": "ties", "density": 0.5}),
        ({}, {"anchor_lambda": 0.5}),
        ({}, {"anchor_seed": 7}),
        ({}, {"anchor_method": "pretrained"}),
        ({"tensors": marked}, {"weight": [0.3] * 4, "anchor": [False, False, False, True]}),
        ({}, {"compute_dtype": "float64"}),
        ({}, {"cache_dtype": "float16"}),
        ({}, {"weight_layout": "in_out"}),
        ({"name": "model.layers.2.mlp.down_proj.weight"}, {}),
    ]
    # Only a new G needs a new eigendecomposition: data-free G = Σ U_tᵀU_t does not depend on
    # the anchor or the tensor's name, so those entries reuse the stored basis.
    new_gram = {0, 7, 9}  # a float16 copy (8) rounds the eigendecomposition this process holds
    for index, (call, parameters) in enumerate(variants):
        before = len(factorisations)
        merged = bmm(call.get("tensors", tensors), name=call.get("name", NAME), cache=cache, **parameters)
        assert len(entries(tmp_path)) == index + 2, parameters
        assert len(factorisations) == before + (index in new_gram), parameters
        direct = bmm(call.get("tensors", tensors), name=call.get("name", NAME), **parameters)
        tolerance = 1e-3 if parameters.get("cache_dtype") == "float16" else 1e-5
        assert delta_error(merged, direct, tensors[0]) <= tolerance, parameters
    assert len(factorisations) == 4 and len(list((tmp_path / "bases").glob("*.safetensors"))) == 5
    # λ, s and lambda_mode are applied to the factors: no new entry, no factorisation.
    bmm(tensors, cache=cache, lambda_mode="absolute", **{"lambda": 2.0, "scale": 0.3})
    assert len(entries(tmp_path)) == len(variants) + 1
    assert len(factorisations) == 4


def _stats_dir(root: Path, ids: list[str], in_features: int, seed: int, names=(NAME,)) -> Path:
    generator = torch.Generator().manual_seed(seed)
    tasks = []
    for index, model in enumerate(ids):
        activations = torch.randn(in_features, 3 * in_features, generator=generator)
        write_grams(root / "grams" / f"t{index}.safetensors", {"g": activations @ activations.T / 96})
        tasks.append(
            TaskStats(name=f"t{index}", model=model, file=f"t{index}.safetensors", samples=4, tokens=96)
        )
    manifest = StatsManifest(
        format_version=1, package_version=__version__, tasks=tasks, modules=dict.fromkeys(names, "g")
    )
    write_manifest(root, manifest)
    return root


def test_statistics_and_epsilon_are_keyed(tmp_path):
    tensors = inputs(seed=6)
    ids = ["/models/base", "/models/a", "/models/b", "/models/c"]
    stats = _stats_dir(tmp_path / "stats", ids[1:], 32, seed=0)
    cache = tmp_path / "cache"

    def both(**parameters):
        parameters = {"stats": str(stats), **parameters}
        cached = bmm(tensors, ids=ids, cache=str(cache), **parameters)
        direct = bmm(tensors, ids=ids, **parameters)
        assert delta_error(cached, direct, tensors[0]) <= 1e-5

    both(gram="activations")
    both(gram="activations", **{"lambda": 0.5})
    assert len(entries(cache)) == 1
    both(gram="mix", epsilon=0.3)
    both(gram="mix", epsilon=0.6)  # ε changes G: a new entry
    assert len(entries(cache)) == 3
    _stats_dir(stats, ids[1:], 32, seed=1)  # statistics collected again, different data
    both(gram="activations")
    assert len(entries(cache)) == 4


def test_weights_reading_one_input_share_one_basis(tmp_path, factorisations):
    """q/k/v (and gate/up) read the same input: in the activations mode their Gram is the same
    matrix, diagonalised and stored once; each keeps its own correction and anchor."""
    names = [f"model.layers.1.self_attn.{p}_proj.weight" for p in ("q", "k", "v")]
    ids = ["/models/base", "/models/a", "/models/b", "/models/c"]
    stats = _stats_dir(tmp_path / "stats", ids[1:], 32, seed=0, names=names)
    for index, (name, rows) in enumerate(zip(names, (32, 8, 8))):
        tensors = inputs(shape=(rows, 32), seed=20 + index)
        parameters = {"stats": str(stats), "gram": "activations"}
        cached = bmm(tensors, name=name, ids=ids, cache=str(tmp_path / "cache"), **parameters)
        direct = bmm(tensors, name=name, ids=ids, **parameters)
        assert delta_error(cached, direct, tensors[0]) <= 1e-5
    assert len(entries(tmp_path / "cache")) == 3
    assert len(list((tmp_path / "cache" / "bases").glob("*.safetensors"))) == len(factorisations) == 1


def test_statistics_of_a_regmean_anchor_are_keyed(tmp_path):
    tensors = inputs(seed=9)
    ids = ["/models/base", "/models/a", "/models/b", "/models/c"]
    stats = _stats_dir(tmp_path / "stats", ids[1:], 32, seed=0)
    cache = tmp_path / "cache"
    parameters = {"anchor_method": "regmean", "stats": str(stats), "lambda": 0.5}

    def check():
        cached = bmm(tensors, ids=ids, cache=str(cache), **parameters)
        assert delta_error(cached, bmm(tensors, ids=ids, **parameters), tensors[0]) <= 1e-5

    check()
    check()
    assert len(entries(cache)) == 1
    _stats_dir(stats, ids[1:], 32, seed=1)  # the anchor's statistics collected again
    check()
    assert len(entries(cache)) == 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_a_damaged_entry_is_ignored_logged_and_rewritten(tmp_path, caplog, factorisations, damage):
    tensors = inputs(seed=7)
    first = bmm(tensors, cache=str(tmp_path))
    assert torch.equal(bmm(tensors, cache=str(tmp_path)), first)  # read and verified once
    (name,) = entries(tmp_path)
    path = tmp_path / name
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) - 100])
    elif damage == "flip":
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 0x10]) + data[-4:])
    elif damage == "garbage":
        path.write_bytes(b"\x00not a safetensors file" * 10)
    else:
        path.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="mergekit_bmm"):
        again = bmm(tensors, cache=str(tmp_path))
    assert torch.equal(again, first)
    assert any("bmm cache: ignoring" in r.getMessage() and name in r.getMessage() for r in caplog.records)
    assert len(factorisations) == 1  # the Gram's stored basis was sound and is reused
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mergekit_bmm"):
        assert torch.equal(bmm(tensors, cache=str(tmp_path)), first)
    assert not caplog.records and len(factorisations) == 1  # the rewritten entry is read


def test_a_damaged_basis_is_ignored_logged_and_rebuilt(tmp_path, caplog, factorisations):
    tensors = inputs(seed=7)
    first = bmm(tensors, cache=str(tmp_path))
    (basis,) = (tmp_path / "bases").glob("*.safetensors")
    data = basis.read_bytes()
    basis.write_bytes(data[:-5] + bytes([data[-5] ^ 0x10]) + data[-4:])
    with caplog.at_level(logging.WARNING, logger="mergekit_bmm"):
        assert torch.equal(bmm(tensors, cache=str(tmp_path)), first)
    assert any(
        "bmm cache: ignoring" in r.getMessage() and basis.name in r.getMessage() for r in caplog.records
    )
    assert len(factorisations) == 1  # the eigendecomposition this process holds is stored again
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mergekit_bmm"):
        assert torch.equal(bmm(tensors, cache=str(tmp_path)), first)
    assert not caplog.records


def test_unsolved_tensors_cache_computed_anchors_only(tmp_path):
    tensors = inputs(shape=(40, 16), seed=8)
    embed = "model.embed_tokens.weight"
    first = bmm(tensors, name=embed, cache=str(tmp_path), anchor_method="ties", density=0.5)
    assert len(entries(tmp_path)) == 1
    again = bmm(tensors, name=embed, cache=str(tmp_path), anchor_method="ties", density=0.5)
    assert torch.equal(first, again)
    assert torch.equal(first, bmm(tensors, name=embed, anchor_method="ties", density=0.5))
    bmm(tensors, name=embed, cache=str(tmp_path), anchor_method="pretrained")
    bmm(tensors, name=embed, cache=str(tmp_path))  # Task Arithmetic: recomputed, not stored
    norm = [t[0] for t in tensors]
    bmm(norm, name="model.layers.0.input_layernorm.weight", cache=str(tmp_path))
    assert len(entries(tmp_path)) == 1


def test_cache_that_is_a_file_is_a_config_error(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        bmm(inputs(), cache=str(target))


def test_unknown_cache_dtype_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cache_dtype"):
        bmm(inputs(), cache=str(tmp_path), cache_dtype="bfloat16")


def test_an_unwritable_cache_only_logs(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    tensors = inputs(seed=9)
    with caplog.at_level(logging.WARNING, logger="mergekit_bmm"):
        merged = bmm(tensors, cache=str(blocker / "cache"))
    assert delta_error(merged, bmm(tensors), tensors[0]) <= 1e-5
    assert any("could not write" in r.getMessage() for r in caplog.records)
