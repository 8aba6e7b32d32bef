"""Data-assisted merging of mixture-of-experts models: one Gram per expert, from routed tokens.

Tiny Mixtral and Qwen3-MoE experts: the statistics collector's per-expert Grams are checked
against a float64 recomputation from the routers' own decisions (hooked on a separate run of
each expert); data-assisted ``bmm`` and ``regmean`` then solve every expert of every stack
against a float64 closed form built from those Grams; an expert no token reached keeps the
anchor; ``mergekit-bmm-sample`` draws every expert of a stack from its own posterior.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import load_weights, relative_error
from references import ridge_solve
from stats_helpers import write_calibration

from mergekit_bmm.examples.architectures import make_architecture_family
from mergekit_bmm.stats.collect import collect_statistics
from mergekit_bmm.stats.config import parse_stats_config
from mergekit_bmm.stats.store import read_task_grams

pytestmark = pytest.mark.slow

WEIGHTS, LAMBDA = (0.6, 0.4), 0.05


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe(request, tmp_path_factory):
    """(family, statistics folder, stats config) of a tiny MoE with two experts."""
    root = tmp_path_factory.mktemp(request.param)
    family = make_architecture_family(root / "models", request.param)
    tasks = []
    for index, expert in enumerate(family.experts):
        data = write_calibration(root / f"{expert.name}.jsonl", lines=24, offset=5 * index)
        tasks.append({"name": expert.name, "model": str(expert), "data": str(data)})
    config = parse_stats_config({"tasks": tasks, "max_samples": 24, "max_length": 64})
    collect_statistics(config, root / "stats", progress=False)
    return family, root / "stats", config


def routed_reference(config, task_index: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Per-expert mean Grams (float64) and routed-token counts, recomputed from each router's own
    top-k choice on every calibration text run alone (no padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergekit_bmm.stats.plan import plan_tasks, task_samples
    from mergekit_bmm.stats.samples import tokenize_samples

    plan = plan_tasks(config)[task_index]
    model = AutoModelForCausalLM.from_pretrained(plan.model.path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(plan.model.path)
    sequences = tokenize_samples(tokenizer, task_samples(plan), None, plan.task.max_length)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def add(key: str, rows: torch.Tensor) -> None:
        sums[key] = sums.get(key, 0) + rows.T @ rows
        counts[key] = counts.get(key, 0) + rows.shape[0]

    def on_route(router_name: str, experts: torch.nn.Module):
        stack = router_name.rsplit(".", 1)[0] + ".experts"

        def hook(module, args, output):
            hidden = args[0].reshape(-1, args[0].shape[-1]).double()
            chosen = output[-1].reshape(hidden.shape[0], -1)
            gate_up = experts.gate_up_proj.double()
            for e in range(gate_up.shape[0]):
                rows = hidden[(chosen == e).any(-1)]
                counts.setdefault(f"{stack}.gate_up_proj[{e}]", 0)
                counts.setdefault(f"{stack}.down_proj[{e}]", 0)
                if rows.shape[0]:
                    gate, up = (rows @ gate_up[e].T).chunk(2, dim=-1)
                    add(f"{stack}.gate_up_proj[{e}]", rows)
                    add(f"{stack}.down_proj[{e}]", experts.act_fn(gate) * up)

        return hook

    modules = dict(model.named_modules())
    handles = [
        module.register_forward_hook(on_route(name, modules[name.rsplit(".", 1)[0] + ".experts"]))
        for name, module in modules.items()
        if name.endswith("mlp.gate")
    ]
    with torch.inference_mode():
        for sequence in sequences:
            model(input_ids=torch.tensor([sequence]), use_cache=False)
    for handle in handles:
        handle.remove()
    return {key: total / counts[key] for key, total in sums.items()}, counts


def test_each_experts_gram_is_the_routed_tokens_gram_in_float64(moe):
    family, stats, config = moe
    manifest = json.loads((stats / "manifest.json").read_text())
    for index, task in enumerate(manifest["tasks"]):
        expected, counts = routed_reference(config, index)
        assert task["routed"] == counts  # every expert of every stack, zero included
        stored = read_task_grams(stats, task["name"])
        for key, gram in expected.items():
            assert relative_error(stored[key], gram) < 1e-5, key
        modules = manifest["modules"]  # the checkpoint's per-expert weights name the same Grams
        per_expert = [
            name for name in modules if ".experts.1." in name and name.startswith("model.layers.1.")
        ]
        assert len(per_expert) == 3 and {modules[name] for name in per_expert} == {
            "model.layers.1.mlp.experts.gate_up_proj[1]",
            "model.layers.1.mlp.experts.down_proj[1]",
        }
        layers = {key.split(".mlp")[0] for key in counts}
        top_k = 2
        for layer in layers:  # each token goes to top_k experts
            routed = sum(n for key, n in counts.items() if key.startswith(layer) and "down_proj" in key)
            assert routed == top_k * task["tokens"]


def stacked_weights(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint as mergekit hands it to a method: experts as (E, out, in) stacks (transformers'
    own conversion of the per-expert weights on disk)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def moe_recipe(family, method: str, stats: Path, **parameters) -> dict:
    return {
        "merge_method": method,
        "base_model": str(family.base),
        "models": [{"model": str(p), "parameters": {"weight": w}} for p, w in zip(family.experts, WEIGHTS)],
        "parameters": {"stats": str(stats), **parameters},
        "dtype": "float64",
    }


def merge(config: dict, out: Path) -> dict[str, torch.Tensor]:
    import yaml

    from mergekit_bmm.plugin.run import merge_recipe_text

    merge_recipe_text(yaml.safe_dump(config), out, source="test")
    return load_weights(out)


def expert_grams(stats: Path, family, key: str) -> list[torch.Tensor]:
    """Each task's Gram of expert slice ``key`` as the merge reads it: share of tokens × mean."""
    manifest = json.loads((stats / "manifest.json").read_text())
    grams = []
    for task in manifest["tasks"]:
        count = task["routed"][key]
        mean = read_task_grams(stats, task["name"]).get(key)
        grams.append(torch.zeros(1) if not count else mean.double() * count / task["tokens"])
    return grams


def test_data_assisted_bmm_solves_each_expert_with_its_routed_grams(moe, tmp_path):
    family, stats, _ = moe
    config = moe_recipe(
        family, "bmm", stats, gram="activations", anchor_method="task_arithmetic", compute_dtype="float64"
    )
    config["parameters"]["lambda"] = LAMBDA
    merged = merge(config, tmp_path / "bmm")
    base = stacked_weights(family.base)
    experts = [stacked_weights(path) for path in family.experts]
    stacks = [name for name, tensor in base.items() if tensor.ndim == 3]
    assert stacks
    for name in stacks:
        for e in range(base[name].shape[0]):
            w_pre = base[name][e].double()
            vectors = [expert[name][e].double() - w_pre for expert in experts]
            anchor = sum(w * v for w, v in zip(WEIGHTS, vectors))
            grams = expert_grams(stats, family, f"{name}[{e}]")
            gram = sum(grams)
            cross = sum(v @ g for v, g in zip(vectors, grams))
            expected = w_pre + ridge_solve(gram, cross, anchor, LAMBDA)
            assert relative_error(merged[name][e], expected) < 1e-9, f"{name}[{e}]"


def test_regmean_solves_each_expert_with_its_routed_grams(moe, tmp_path):
    family, stats, _ = moe
    merged = merge(moe_recipe(family, "regmean", stats, off_diagonal_scale=1.0), tmp_path / "regmean")
    base = stacked_weights(family.base)
    experts = [stacked_weights(path) for path in family.experts]
    name = next(name for name, tensor in base.items() if tensor.ndim == 3 and "down_proj" in name)
    for e in range(base[name].shape[0]):
        grams = expert_grams(stats, family, f"{name}[{e}]")
        weights = sum(expert[name][e].double() @ g for expert, g in zip(experts, grams))
        expected = torch.linalg.solve(sum(grams), weights.T).T
        assert relative_error(merged[name][e], expected) < 1e-8


def test_an_expert_no_token_reached_keeps_the_anchor_and_says_so(moe, tmp_path):
    import shutil

    from mergekit_bmm.cards.merge_record import read_record

    family, stats, _ = moe
    silent = tmp_path / "stats"
    shutil.copytree(stats, silent)
    manifest = json.loads((silent / "manifest.json").read_text())
    name = "model.layers.1.mlp.experts.down_proj"
    for task in manifest["tasks"]:
        task["routed"][f"{name}[2]"] = 0
    (silent / "manifest.json").write_text(json.dumps(manifest))
    config = moe_recipe(
        family, "bmm", silent, gram="mix", anchor_method="task_arithmetic", compute_dtype="float64"
    )
    merged = merge(config, tmp_path / "out")
    base = stacked_weights(family.base)
    experts = [stacked_weights(path) for path in family.experts]
    anchor = base[name][2].double() + sum(
        w * (x[name][2].double() - base[name][2].double()) for w, x in zip(WEIGHTS, experts)
    )
    assert relative_error(merged[name][2], anchor) < 1e-12
    assert relative_error(merged[name][1], anchor) > 1e-6  # its neighbours are solved
    assert read_record(tmp_path / "out").kept_at_anchor["no_routed_tokens"] == [f"{name}[2]"]


def test_sampling_draws_every_expert_of_a_stack(moe, tmp_path):
    from mergekit_bmm.sampling.run import SamplingRequest, sample_models

    family, stats, _ = moe
    config = moe_recipe(family, "bmm", stats, gram="activations", anchor_method="task_arithmetic")
    config["dtype"] = "float32"
    request = SamplingRequest(samples=2, seed=0, beta=50.0, name_filter="experts.down_proj")
    summary = sample_models(config, tmp_path / "samples", request)
    stack = "model.layers.0.mlp.experts.down_proj"
    assert f"{stack}[0]" in {record.name for record in summary.tensors}
    first, second = (load_weights(tmp_path / "samples" / member) for member in summary.members)
    map_weights = load_weights(tmp_path / "samples" / "map")
    assert first[stack].shape == map_weights[stack].shape and first[stack].ndim == 3
    for e in range(first[stack].shape[0]):  # each expert drawn, each differently
        assert relative_error(first[stack][e], map_weights[stack][e]) > 1e-6
        assert relative_error(first[stack][e], second[stack][e]) > 1e-6
    untouched = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(first[untouched], map_weights[untouched])


def test_statistics_without_per_expert_grams_say_to_collect_them_again(moe, tmp_path):
    """Statistics collected before per-expert Grams existed (no expert slices in the manifest): one line."""
    import shutil

    from mergekit_bmm.errors import StatisticsError

    family, stats, _ = moe
    old = tmp_path / "stats"
    shutil.copytree(stats, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["modules"] = {k: v for k, v in manifest["modules"].items() if "experts" not in k}
    for task in manifest["tasks"]:
        task.pop("routed")
    (old / "manifest.json").write_text(json.dumps(manifest))
    config = moe_recipe(family, "bmm", old, gram="activations")
    with pytest.raises(
        StatisticsError, match="before mergekit-bmm-stats recorded each expert's routed tokens"
    ):
        merge(config, tmp_path / "out")
