"""Data-assisted BMM over LoRA experts from the adapters' factors: ``C = B Z`` and, over an anchor that
sums the adapters (Task Arithmetic of them), a ``k``-row solve. Each merged weight equals the float64
closed form of the adapters' exact updates and their statistics' Grams; the full route on the dense
copies, the factor cache and a non-span anchor agree with it."""

from __future__ import annotations

import pytest
import torch
import yaml
from conftest import load_weights, relative_error
from stats_helpers import stored_grams, write_calibration
from test_lora_route import TARGETS, _exact_updates

from mergekit_bmm.cards.merge_record import read_record
from mergekit_bmm.core import closed_form, normal_equations
from mergekit_bmm.plugin.run import merge_recipe_text

pytestmark = pytest.mark.slow
F64 = torch.float64


@pytest.fixture(scope="module")
def lora_stats(tmp_path_factory):
    """A tiny Llama, three adapters on it, and statistics of each ``BASE+ADAPTER`` expert on its text."""
    from mergekit_bmm.examples.tiny_models import make_lora_adapter, make_tiny_family
    from mergekit_bmm.stats.collect import collect_statistics
    from mergekit_bmm.stats.config import parse_stats_config

    root = tmp_path_factory.mktemp("lora-data")
    family = make_tiny_family(root, "llama", n_experts=1, hidden=32, layers=2)
    adapters = [make_lora_adapter(family.base, root / f"adapter-{i}", seed=i, rank=2 + i) for i in range(3)]
    tasks = [
        {
            "name": f"task-{i}",
            "model": f"{family.base}+{adapter}",
            "data": str(write_calibration(root / f"data-{i}.jsonl", offset=5 * i)),
        }
        for i, adapter in enumerate(adapters)
    ]
    config = parse_stats_config({"tasks": tasks, "max_samples": 24, "max_length": 64})
    collect_statistics(config, root / "stats", progress=False)
    return family.base, adapters, root / "stats"


@pytest.fixture(autouse=True)
def plugin_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MERGEKIT_BMM_CACHE", str(tmp_path / "plugin-cache"))


def _recipe(base, adapters, stats, **parameters) -> str:
    return yaml.safe_dump(
        {
            "merge_method": "bmm",
            "base_model": str(base),
            "models": [{"model": f"{base}+{a}", "parameters": {"weight": 0.3}} for a in adapters],
            "parameters": {
                "anchor_method": "task_arithmetic",
                "lambda": 0.05,
                "stats": str(stats),
                **parameters,
            },
            "dtype": "float32",
        }
    )


def _free_equations(adapters, name: str, sharing: str) -> normal_equations.NormalEquations:
    """The data-free part: each weight its own rows (``weight``), or q's and v's adapters pooled, the
    weights of one input that the adapters touch (``input``, the default)."""
    vectors = _exact_updates(adapters, name.removesuffix(".weight"))
    if sharing == "weight" or "self_attn" not in name:
        return normal_equations.data_free_equations(vectors, F64)
    attention = name.rsplit(".", 2)[0]
    parts = [_exact_updates(adapters, f"{attention}.{p}") for p in ("q_proj", "v_proj")]
    pooled = [q.T @ q + v.T @ v for q, v in zip(*parts)]
    return normal_equations.pooled_equations(vectors, pooled, 1, F64)


def _expected(
    base, adapters, stats, name: str, gram: str, lam: float = 0.05, sharing: str = "input"
) -> torch.Tensor:
    vectors = _exact_updates(adapters, name.removesuffix(".weight"))
    grams = stored_grams(stats)
    task_grams = [grams[f"{base}+{adapter}"][name].double() for adapter in adapters]
    few = normal_equations.activation_equations(vectors, task_grams, F64)
    if gram == "mix":
        few = normal_equations.mix_equations(few, _free_equations(adapters, name, sharing), 0.5)
    return closed_form.merge_matrix(few, 0.3 * sum(vectors), lam)


@pytest.mark.parametrize(("gram", "sharing"), [("activations", "input"), ("mix", "input"), ("mix", "weight")])
def test_each_weight_is_the_float64_closed_form_of_the_adapters_and_their_grams(
    lora_stats, tmp_path, gram, sharing
):
    base, adapters, stats = lora_stats
    out = tmp_path / "merged"
    parameters = {"gram": gram, "epsilon": 0.5, "compute_dtype": "float64", "gram_sharing": sharing}
    merge_recipe_text(_recipe(base, adapters, stats, **parameters), out)
    merged, pre = load_weights(out), load_weights(base)
    solved = [n for n in pre if n.endswith(".weight") and any(t in n for t in TARGETS)]
    assert sorted(read_record(out).low_rank) == sorted(solved)  # the route, not the dense copies
    for name in solved:
        expected = _expected(base, adapters, stats, name, gram, sharing=sharing)
        assert relative_error(merged[name].double() - pre[name].double(), expected) < 1e-6, name
        delta = merged[name].double() - pre[name].double()  # rank ≤ Σ r_t, up to float32 storage
        assert torch.linalg.matrix_rank(delta, rtol=1e-4) <= 2 + 3 + 4
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(merged[name], pre[name])  # no adapter touches them: the base


def test_the_full_route_the_cache_and_a_ties_anchor_agree_with_it(lora_stats, tmp_path):
    base, adapters, stats = lora_stats
    runs = {
        "route": {},
        "full": {"low_rank": False},
        "cached": {"cache": str(tmp_path / "factors")},
        "ties": {"anchor_method": "ties", "density": 0.5},
        "ties full": {"anchor_method": "ties", "density": 0.5, "low_rank": False},
    }
    merged = {}
    for label, parameters in runs.items():
        merge_recipe_text(_recipe(base, adapters, stats, gram="activations", **parameters), tmp_path / label)
        merged[label] = load_weights(tmp_path / label)
    assert read_record(tmp_path / "full").low_rank == {}
    names = sorted(read_record(tmp_path / "route").low_rank)
    assert sorted(read_record(tmp_path / "ties").low_rank) == names
    for name in names:
        assert relative_error(merged["full"][name], merged["route"][name]) < 1e-5, name
        assert relative_error(merged["cached"][name], merged["route"][name]) < 1e-5, name
        assert relative_error(merged["ties full"][name], merged["ties"][name]) < 1e-5, name


@pytest.mark.parametrize("gram", ["activations", "mix"])
def test_the_cache_keeps_k_rows_and_trials_from_it_are_the_float64_closed_form(lora_stats, tmp_path, gram):
    """Over Task Arithmetic of the adapters the cache holds ``U = B·U_k``: ``B`` and ``k`` rows, not
    ``out`` rows; a trial at a new λ from it is the float64 closed form, a re-read equals the fill."""
    from safetensors import safe_open

    base, adapters, stats = lora_stats
    cache = tmp_path / "factors"
    for label, lam in (("fill", 0.05), ("reread", 0.05), ("trial", 0.2)):
        extra = {"gram": gram, "epsilon": 0.5, "cache": str(cache), "compute_dtype": "float64"}
        recipe = _recipe(base, adapters, stats, **extra)
        merge_recipe_text(recipe.replace("lambda: 0.05", f"lambda: {lam}"), tmp_path / label)
    fill, reread, trial = (load_weights(tmp_path / label) for label in ("fill", "reread", "trial"))
    pre = load_weights(base)
    names = sorted(read_record(tmp_path / "fill").low_rank)
    assert names
    for name in names:
        assert torch.equal(fill[name], reread[name]), name
        expected = _expected(base, adapters, stats, name, gram, lam=0.2)
        assert relative_error(trial[name].double() - pre[name].double(), expected) < 1e-6, name
        entry = next(cache.glob(f"{name}.*.safetensors"))
        with safe_open(str(entry), framework="pt") as handle:
            rows, anchor = handle.get_tensor("rows"), handle.get_tensor("anchor")
        assert rows.shape == (pre[name].shape[0], 2 + 3 + 4) and anchor.shape == (9, pre[name].shape[1])


@pytest.mark.parametrize("off_diagonal_scale", [1.0, 0.5])
def test_regmean_over_adapters_is_regmean_of_their_exact_updates(
    lora_stats, tmp_path, off_diagonal_scale, monkeypatch
):
    from mergekit_bmm.core.regmean import regmean_merge
    from mergekit_bmm.merge_methods import regmean

    solved = []  # the weights merged from the adapters' factors
    route = regmean.regmean_low_rank
    monkeypatch.setattr(regmean, "regmean_low_rank", lambda *a: solved.append(a) or route(*a))
    base, adapters, stats = lora_stats
    recipe = {
        "merge_method": "regmean",
        "base_model": str(base),
        "models": [{"model": f"{base}+{a}"} for a in adapters],
        "parameters": {"stats": str(stats), "off_diagonal_scale": off_diagonal_scale},
        "dtype": "float64",
    }
    merge_recipe_text(yaml.safe_dump(recipe), tmp_path / "regmean")
    merged, pre = load_weights(tmp_path / "regmean"), load_weights(base)
    grams = stored_grams(stats)
    for name in [n for n in pre if n.endswith(".weight") and any(t in n for t in TARGETS)]:
        vectors = _exact_updates(adapters, name.removesuffix(".weight"))
        task_grams = [grams[f"{base}+{adapter}"][name].double() for adapter in adapters]
        expected = regmean_merge(vectors, task_grams, off_diagonal_scale)
        assert relative_error(merged[name].double() - pre[name].double(), expected) < 1e-9, name
    assert len(solved) == 2 * len(TARGETS)


def test_q_k_and_v_share_one_factorisation_of_their_input(lora_stats, tmp_path, monkeypatch):
    """``gram: activations``: the weights that read one input have one ``G + λ'I``; it is factored once
    for them (q_proj and v_proj here) and the merge is unchanged."""
    from mergekit_bmm.core import closed_form as cf
    from mergekit_bmm.merge_methods import shared_factor

    base, adapters, stats = lora_stats
    merge_recipe_text(_recipe(base, adapters, stats, gram="activations"), tmp_path / "first")
    factored = []
    original = cf.ridge_factor
    monkeypatch.setattr(cf, "ridge_factor", lambda *a: factored.append(a) or original(*a))
    shared_factor._FACTORS.clear()
    merge_recipe_text(_recipe(base, adapters, stats, gram="activations"), tmp_path / "again")
    solved = len(read_record(tmp_path / "again").low_rank)  # q, v, down in 2 layers
    assert solved == 6 and len(factored) == 4  # q and v share theirs: 2 layers × (attention input, down)
    first, again = load_weights(tmp_path / "first"), load_weights(tmp_path / "again")
    assert all(torch.equal(first[name], again[name]) for name in first)


def test_rows_kept_in_the_adapters_input_span_solve_the_restricted_problem(lora_stats, tmp_path):
    """``low_rank_rows: adapters``: ``U = U0 + (C − U0 G) Q (QᵀGQ + λ'I)⁻¹ Qᵀ`` with ``Q`` the adapters'
    input span, against a float64 reference; every row of the update lies in that span."""
    base, adapters, stats = lora_stats
    parameters = {"gram": "activations", "low_rank_rows": "adapters", "compute_dtype": "float64"}
    merge_recipe_text(_recipe(base, adapters, stats, **parameters), tmp_path / "rows")
    merged, pre = load_weights(tmp_path / "rows"), load_weights(base)
    grams = stored_grams(stats)
    name = "model.layers.1.mlp.down_proj.weight"
    vectors = _exact_updates(adapters, name.removesuffix(".weight"))
    gram = sum(grams[f"{base}+{adapter}"][name].double() for adapter in adapters)
    cross = sum(v @ grams[f"{base}+{a}"][name].double() for v, a in zip(vectors, adapters))
    anchor = 0.3 * sum(vectors)
    rows = [torch.linalg.svd(v)[2][: torch.linalg.matrix_rank(v)] for v in vectors]  # each A_t's row span
    q, _ = torch.linalg.qr(torch.cat(rows).T)
    ridge = 0.05 * float(gram.trace()) / gram.shape[0]
    inner = q.T @ gram @ q + ridge * torch.eye(q.shape[1], dtype=F64)
    expected = anchor + torch.linalg.solve(inner, ((cross - anchor @ gram) @ q).T).T @ q.T
    delta = merged[name].double() - pre[name].double()
    assert relative_error(delta, expected) < 1e-6
    assert relative_error(delta @ q @ q.T, delta) < 1e-6  # rows in the adapters' span (float32 storage)


def test_the_adapter_out_holds_a_data_assisted_merge_exactly(lora_stats, tmp_path):
    """``mergekit-bmm-lora`` on a data-assisted recipe: the update lies in the span of the adapters'
    ``B`` (not of their ``A``), and the written adapter of rank Σ r_t reproduces the merge."""
    from safetensors.torch import load_file

    from mergekit_bmm.adapters.export import export_adapter
    from mergekit_bmm.plugin.run import merge_options

    base, adapters, stats = lora_stats
    text = _recipe(base, adapters, stats, gram="activations", compute_dtype="float64")
    merge_recipe_text(text, tmp_path / "merged")
    report = export_adapter(text, tmp_path / "adapter", merge_options(None, quiet=True), progress=False)
    assert report.modules and all(m.exact and m.rank == 2 + 3 + 4 for m in report.modules)
    merged, pre = load_weights(tmp_path / "merged"), load_weights(base)
    factors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    for module in report.modules:
        key = f"base_model.model.{module.name.removesuffix('.weight')}"
        written = factors[f"{key}.lora_B.weight"].double() @ factors[f"{key}.lora_A.weight"].double()
        assert relative_error(written, merged[module.name].double() - pre[module.name].double()) < 1e-5


def test_resident_trials_over_adapters_equal_their_merges(lora_stats, tmp_path):
    """A search's resident trials re-merge the adapters' weights from the ``k``-row factors, equal to
    the merges of the trials' recipes tensor for tensor."""
    from pathlib import Path

    from mergekit_bmm.evaluation.base import ModelLoading
    from mergekit_bmm.plugin.run import merge_options
    from mergekit_bmm.search import parse_search_config
    from mergekit_bmm.search.experiment import prepare_experiment
    from mergekit_bmm.search.resident import ParameterLookup, ResidentModel

    base, adapters, stats = lora_stats
    tests = Path(__file__).parent
    evaluator = {"type": "python", "callable": "search_objectives:per_task_scores"}
    evaluator["python_path"] = [str(tests)]
    raw = {
        "recipe": yaml.safe_load(_recipe(base, adapters, stats, gram="activations")),
        "blocks": 1,
        "evaluator": evaluator,
        "lambda_range": [1e-3, 10.0],
        "scale_range": [0.5, 1.5],
    }
    experiment = prepare_experiment(parse_search_config(raw, tests), tmp_path / "cache")
    options = merge_options(None, quiet=True, device="cpu")
    dimensions = experiment.space.dimensions
    trials = [{d.name: d.low + share * (d.high - d.low) for d in dimensions} for share in (0.3, 0.7)]
    loading = ModelLoading("auto", "float32")
    resident = ResidentModel.load(
        experiment.recipes.text(trials[0]), experiment.base_model, experiment.space, loading, options
    )
    lookup = ParameterLookup(resident.model)
    for index, values in enumerate(trials):
        resident.apply(values)
        merge_recipe_text(experiment.recipes.text(values), tmp_path / f"trial-{index}", options)
        merged = load_weights(tmp_path / f"trial-{index}")
        compared = [name for name in read_record(tmp_path / f"trial-{index}").low_rank if name in merged]
        assert compared
        for name in compared:
            assert torch.equal(lookup.get(name).to(merged[name].dtype), merged[name]), name
    reread = resident.solved[compared[0]].reload()  # what a trial reads when factors do not fit
    assert reread is not None and reread.rows is not None
