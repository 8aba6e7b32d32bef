"""``gram_sharing: input``: the weights that read one input share one data-free Gram, so a split layout
(Llama's q/k/v and gate/up) and a fused one (Phi-3's qkv_proj and gate_up_proj) of the same weights
give the same merge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import load_weights
from safetensors.torch import save_file

pytestmark = pytest.mark.slow


def _llama_twin(phi3: Path, out: Path) -> Path:
    """The same weights as a Llama checkpoint: q/k/v and gate/up split out of the fused ones."""
    from transformers import LlamaConfig

    config = json.loads((phi3 / "config.json").read_text())
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    tensors = {}
    for name, tensor in load_weights(phi3).items():
        if name.endswith("qkv_proj.weight"):
            q, k, v = tensor.split([heads * head_dim, kv * head_dim, kv * head_dim])
            for part, value in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                tensors[name.replace("qkv_proj", part)] = value.clone()
        elif name.endswith("gate_up_proj.weight"):
            gate, up = tensor.chunk(2)
            tensors[name.replace("gate_up_proj", "gate_proj")] = gate.clone()
            tensors[name.replace("gate_up_proj", "up_proj")] = up.clone()
        else:
            tensors[name] = tensor
    llama = LlamaConfig(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=config["max_position_embeddings"],
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        architectures=["LlamaForCausalLM"],
    )
    out.mkdir(parents=True)
    llama.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def _merge(base: Path, experts: list[Path], out: Path, sharing: str) -> dict[str, torch.Tensor]:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    recipe = {
        "merge_method": "bmm",
        "base_model": str(base),
        "models": [{"model": str(e), "parameters": {"weight": 0.5}} for e in experts],
        "parameters": {
            "anchor_method": "task_arithmetic",
            "lambda": 0.1,
            "gram_sharing": sharing,
            "compute_dtype": "float64",
        },
        "dtype": "float32",
    }
    options = MergeOptions(copy_tokenizer=False, quiet=True, write_model_card=False)
    run_merge(MergeConfiguration.model_validate(recipe), str(out), options=options)
    return load_weights(out)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("sharing", ["input", "weight"])
def test_split_and_fused_layouts_give_one_merge_under_either_rule(sharing, tmp_path):
    """Phi-3's fused qkv_proj / gate_up_proj and its Llama twin (the same weights split) merge to the
    same weights: pooled over the input (``input``), or each logical weight its own Gram (``weight``)."""
    from mergekit_bmm.examples.architectures import make_architecture_family

    phi3 = make_architecture_family(tmp_path / "phi3", "phi3", n_experts=2)
    twin = [_llama_twin(p, tmp_path / "llama" / p.name) for p in (phi3.base, *phi3.experts)]
    _merge(phi3.base, list(phi3.experts), tmp_path / "fused", sharing)
    split = _merge(twin[0], twin[1:], tmp_path / "split", sharing)
    as_split = load_weights(_llama_twin(tmp_path / "fused", tmp_path / "fused-as-llama"))
    for name, tensor in split.items():
        assert _relative(tensor, as_split[name]) < 1e-6, name


def test_the_two_rules_solve_different_problems_for_inputs_read_by_several_weights(tmp_path):
    from mergekit_bmm.examples.architectures import make_architecture_family

    family = make_architecture_family(tmp_path / "llama", "llama", n_experts=2)
    pooled = _merge(family.base, list(family.experts), tmp_path / "input", "input")
    own = _merge(family.base, list(family.experts), tmp_path / "weight", "weight")
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert _relative(own[q], pooled[q]) > 1e-3
    assert _relative(own[o], pooled[o]) < 1e-9  # o_proj reads its input alone


def test_gpt2s_fused_c_attn_is_solved_part_by_part_as_a_float64_reference(tmp_path):
    """GPT-2 stores c_attn as Conv1D (in, out) with q, k, v side by side: under ``weight`` each part
    is its own regression (own Gram, own λ′), under ``input`` the three are one."""
    from references import ridge_solve

    from mergekit_bmm.examples.architectures import make_architecture_family

    family = make_architecture_family(tmp_path / "gpt2", "gpt2", n_experts=2)
    name = "transformer.h.0.attn.c_attn.weight"
    base = load_weights(family.base)[name].double().T  # (out, in)
    vectors = [load_weights(e)[name].double().T - base for e in family.experts]
    width = base.shape[0] // 3

    def solve(rows: slice) -> torch.Tensor:
        parts = [v[rows] for v in vectors]
        grams = [p.T @ p for p in parts]
        anchor = sum(0.5 * p for p in parts)
        return base[rows] + ridge_solve(sum(grams), sum(p @ g for p, g in zip(parts, grams)), anchor, 0.1)

    expected = {
        "weight": torch.cat([solve(slice(k * width, (k + 1) * width)) for k in range(3)]),
        "input": solve(slice(None)),
    }
    for sharing, reference in expected.items():
        merged = _merge(family.base, list(family.experts), tmp_path / sharing, sharing)[name].double().T
        assert _relative(merged, reference) < 1e-6, sharing


def test_the_weights_that_read_one_input_load_each_other_once(tmp_path, monkeypatch):
    """``input``: the pooled Grams of q, k and v (gate and up) are formed once per layer, and the merge
    equals one formed weight by weight."""
    from mergekit_bmm.examples.architectures import make_architecture_family
    from mergekit_bmm.merge_methods import bmm_equations

    family = make_architecture_family(tmp_path / "llama", "llama", n_experts=2)
    loads = []
    original = bmm_equations.sibling_task_vectors
    monkeypatch.setattr(bmm_equations, "sibling_task_vectors", lambda *a: loads.append(a) or original(*a))
    shared = _merge(family.base, list(family.experts), tmp_path / "shared", "input")
    assert len(loads) == 2 * 2  # per layer: attention's input, the MLP's input
    monkeypatch.setattr(bmm_equations, "_POOLED", type("Forgetful", (dict,), {"get": lambda *a: None})())
    alone = _merge(family.base, list(family.experts), tmp_path / "alone", "input")
    assert all(_relative(shared[name], alone[name]) < 1e-12 or alone[name].abs().max() == 0 for name in alone)


def test_the_weights_that_read_one_input_share_one_factorisation(tmp_path, monkeypatch):
    """``input``: q, k and v (gate and up) have one ``G + λ'I``, factored once per input; the merge
    equals one that factors every weight itself."""
    from mergekit_bmm.core import closed_form
    from mergekit_bmm.examples.architectures import make_architecture_family
    from mergekit_bmm.merge_methods import shared_factor

    family = make_architecture_family(tmp_path / "llama", "llama", n_experts=2)
    monkeypatch.setattr(shared_factor, "_KEEP", 0)  # nothing kept: every weight factors its own
    alone = _merge(family.base, list(family.experts), tmp_path / "alone", "input")
    monkeypatch.undo()
    factored = []
    original = closed_form.ridge_factor
    monkeypatch.setattr(closed_form, "ridge_factor", lambda *a: factored.append(a) or original(*a))
    shared_factor._FACTORS.clear()
    together = _merge(family.base, list(family.experts), tmp_path / "together", "input")
    assert len(factored) == 2 * 4  # per layer: one for q/k/v, o, gate/up, down (not one per weight: 7)
    assert all(torch.equal(alone[name], together[name]) for name in alone)
