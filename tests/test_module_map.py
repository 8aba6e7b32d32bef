"""The name → (layer, group, layout) map on real transformers module trees."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.pytorch_utils import Conv1D

from mergekit_bmm.core.module_map import GROUP_NAMES, classify, filter_rules, layer_index

SMALL = dict(vocab_size=64, num_hidden_layers=3, num_attention_heads=4)
DECODER = dict(hidden_size=32, intermediate_size=48, num_key_value_heads=2, **SMALL)

# leaf module name -> expected group, per naming family
LLAMA_GROUPS = {
    "q_proj": "attn_in",
    "k_proj": "attn_in",
    "v_proj": "attn_in",
    "o_proj": "attn_out",
    "gate_proj": "mlp_in",
    "up_proj": "mlp_in",
    "down_proj": "mlp_out",
}
GPT2_GROUPS = {
    "attn.c_attn": "attn_in",
    "attn.c_proj": "attn_out",
    "mlp.c_fc": "mlp_in",
    "mlp.c_proj": "mlp_out",
}
BERT_GROUPS = {
    "attention.self.query": "attn_in",
    "attention.self.key": "attn_in",
    "attention.self.value": "attn_in",
    "attention.output.dense": "attn_out",
    "intermediate.dense": "mlp_in",
    "layer.{i}.output.dense": "mlp_out",
}

FAMILIES = {
    "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(**DECODER), LLAMA_GROUPS),
    "mistral": (tf.MistralForCausalLM, tf.MistralConfig(**DECODER), LLAMA_GROUPS),
    "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(**DECODER), LLAMA_GROUPS),
    "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config(head_dim=8, **DECODER), LLAMA_GROUPS),
    "gemma": (tf.GemmaForCausalLM, tf.GemmaConfig(head_dim=8, **DECODER), LLAMA_GROUPS),
    "gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config(head_dim=8, **DECODER), LLAMA_GROUPS),
    "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4), GPT2_GROUPS),
    "bert": (tf.BertModel, tf.BertConfig(hidden_size=32, intermediate_size=48, **SMALL), BERT_GROUPS),
}


def linear_weights(model: torch.nn.Module):
    """(weight name, module) for every Linear/Conv1D weight of the model."""
    for module_name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, Conv1D)):
            yield f"{module_name}.weight", module


def expected_group(weight_name: str, groups: dict[str, str]) -> str:
    layer = layer_index(weight_name)
    for suffix, group in groups.items():
        if weight_name.endswith(suffix.format(i=layer) + ".weight"):
            return group
    raise AssertionError(f"test table has no group for {weight_name}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_body_linear_gets_its_group_and_layout(family):
    model_class, config, groups = FAMILIES[family]
    with torch.device("meta"):
        model = model_class(config)
    state = model.state_dict()
    seen_groups = set()
    classified = set()
    for name, module in linear_weights(model):
        if name not in state:
            continue  # tied lm_head
        layer = layer_index(name)
        info = classify(name, config.model_type)
        if layer is None:
            assert info is None, f"{name} is outside the layers and must keep the anchor"
            continue
        assert info is not None, f"{name} was not classified"
        assert info.layer == layer
        assert info.group.value == expected_group(name, groups)
        assert info.stored_in_out == isinstance(module, Conv1D), name
        # without model_type the group is the same; a layout that depends on it is unknown
        unnamed = classify(name)
        assert unnamed.group == info.group
        assert unnamed.stored_in_out == (None if info.stored_in_out else False)
        seen_groups.add(info.group.value)
        classified.add(name)
    assert seen_groups == set(GROUP_NAMES)
    assert len(classified) == config.num_hidden_layers * len(groups)
    for name, tensor in state.items():
        if name not in classified:
            assert classify(name, config.model_type) is None or tensor.ndim != 2, name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_recipe_filters_reproduce_the_groups(family):
    """mergekit matches `filter:` by substring, first match wins: same answer as classify."""
    model_class, config, _ = FAMILIES[family]
    with torch.device("meta"):
        names = list(model_class(config).state_dict())
    rules = filter_rules(names)
    for name in names:
        info = classify(name)
        if info is None:
            continue
        first = next(rule for rule in rules if rule.pattern in name)
        assert first.group == info.group, name


def test_layout_follows_model_type_for_shared_names():
    name = "transformer.h.0.mlp.c_fc.weight"
    assert classify(name, "gpt2").stored_in_out
    assert classify(name, "gpt_bigcode").stored_in_out is False
    assert classify("model.layers.0.mlp.c_fc.weight", "starcoder2").stored_in_out is False
    # without the architecture, GPT-2's names are not guessed: a gpt_bigcode by Hub id was solved transposed
    assert classify(name).stored_in_out is None
    assert classify("model.layers.0.mlp.down_proj.weight").stored_in_out is False


def test_expert_stacks_and_per_head_norms():
    stack = classify("model.layers.1.mlp.experts.gate_up_proj", "qwen3_moe", ndim=3)
    assert (stack.layer, stack.group.value, stack.experts, stack.stored_in_out) == (1, "mlp_in", True, False)
    down = classify("model.layers.0.mlp.experts.down_proj", "mixtral", ndim=3)
    assert (down.group.value, down.experts) == ("mlp_out", True)
    assert classify("model.layers.0.mlp.experts.down_proj", "gpt_oss", ndim=3).stored_in_out is True
    assert classify("model.layers.0.mlp.experts.down_proj", None, ndim=3).stored_in_out is None
    assert classify("model.layers.0.mlp.experts.gate_up_proj_bias", "gpt_oss", ndim=3) is None
    assert classify("model.layers.0.mlp.experts.gate_up_proj", "qwen3_moe") is None  # not 2-D
    assert classify("model.layers.0.mlp.gate.weight", "qwen3_moe") is None  # the router
    assert classify("model.layers.0.block_sparse_moe.experts.3.w2.weight", "mixtral").group.value == "mlp_out"
    assert classify("model.layers.0.self_attn.q_norm.weight", "cohere") is None  # 2-D, but a norm


@pytest.mark.parametrize(
    "name",
    [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.1.block_sparse_moe.gate.weight",
        "model.layers.1.mlp.gate.weight",
        "pooler.dense.weight",
        "model.layers.0.something_new.weight",
    ],
)
def test_non_body_or_unknown_names_are_not_solved(name):
    assert classify(name) is None
