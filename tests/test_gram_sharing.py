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


def test_split_and_fused_layouts_give_one_merge_when_inputs_share_their_gram(tmp_path):
    from mergekit_bmm.examples.architectures import make_architecture_family

    phi3 = make_architecture_family(tmp_path / "phi3", "phi3", n_experts=2)
    twin = [_llama_twin(p, tmp_path / "llama" / p.name) for p in (phi3.base, *phi3.experts)]
    _merge(phi3.base, list(phi3.experts), tmp_path / "fused", "input")
    split = _merge(twin[0], twin[1:], tmp_path / "split", "input")
    assert set(_llama_twin(tmp_path / "fused", tmp_path / "fused-as-llama").iterdir())  # the same split
    as_split = load_weights(tmp_path / "fused-as-llama")
    for name, tensor in split.items():
        assert _relative(tensor, as_split[name]) < 1e-6, name
    # each weight's own Gram (the default): the split layout solves other problems than the fused one
    per_weight = _merge(twin[0], twin[1:], tmp_path / "split-weight", "weight")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert _relative(per_weight[q], as_split[q]) > 1e-3
    assert (
        _relative(
            per_weight["model.layers.0.self_attn.o_proj.weight"],
            split["model.layers.0.self_attn.o_proj.weight"],
        )
        < 1e-6
    )


def test_a_fused_weight_is_unchanged_by_gram_sharing(tmp_path):
    """A fused weight already pools its parts; ``input`` changes nothing for it (or for GPT-2's c_attn)."""
    from mergekit_bmm.examples.architectures import make_architecture_family

    for model_type in ("phi3", "gpt2"):
        family = make_architecture_family(tmp_path / model_type, model_type, n_experts=2)
        shared = _merge(family.base, list(family.experts), tmp_path / f"{model_type}-input", "input")
        own = _merge(family.base, list(family.experts), tmp_path / f"{model_type}-weight", "weight")
        for name, tensor in own.items():
            assert _relative(shared[name], tensor) < 1e-9 or tensor.abs().max() == 0, name
