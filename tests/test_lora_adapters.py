"""Which adapters the low-rank route reads: plain LoRA only. Anything whose keys would not name the
``nn.Linear`` weights it changes is refused here, so the merge takes the full route over the dense
copies instead of keeping the base for a weight the adapter did change."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mergekit_bmm.io.lora_adapters import adapter_for

KEY = "base_model.model.model.layers.0.self_attn.q_proj"


def _adapter(folder, key=KEY, **config):
    folder.mkdir()
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, **config})
    )
    tensors = {f"{key}.lora_A.weight": torch.ones(2, 8), f"{key}.lora_B.weight": torch.ones(8, 2)}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_a_plain_adapter_touches_its_targets_only(tmp_path):
    adapter = adapter_for(_adapter(tmp_path / "plain"))
    assert adapter is not None
    assert adapter.touches("model.layers.0.self_attn.q_proj.weight")
    assert not adapter.touches("model.layers.0.self_attn.k_proj.weight")
    assert not adapter.touches("model.norm.weight")
    left, right = adapter.update("model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(left @ right, 2.0 * torch.full((8, 8), 2.0))  # α/r = 2, B A = 2


@pytest.mark.parametrize(
    "config",
    [
        {"use_dora": True},
        {"fan_in_fan_out": True},
        {"lora_bias": True},
        {"target_parameters": ["feed_forward.experts.gate_up_proj"]},
        {"alora_invocation_tokens": [1, 2]},
    ],
)
def test_adapters_that_are_not_b_times_a_of_a_named_weight_are_not_read(tmp_path, config):
    assert adapter_for(_adapter(tmp_path / "other", **config)) is None


def test_adapters_whose_modules_are_not_weights_of_the_base_are_not_read(tmp_path):
    """Module names that do not line up with the checkpoint's (a renamed model, a wrapper's prefix):
    the route could not tell which weights the adapter changes, so it is not taken."""
    from mergekit.common import ModelReference
    from mergekit.merge_methods.base import TensorEntry, TensorGroup

    from mergekit_bmm.examples.tiny_models import make_tiny_family
    from mergekit_bmm.merge_methods.lora_route import plain_adapters

    base = make_tiny_family(tmp_path / "family", "llama", n_experts=1, hidden=32, layers=1).base
    renamed = "base_model.model.model.language_model.layers.0.self_attn.q_proj"
    adapters = {
        "lines up": _adapter(tmp_path / "good"),
        "renamed": _adapter(tmp_path / "renamed", key=renamed),
    }
    found = {}
    for label, adapter in adapters.items():
        group = TensorGroup((TensorEntry(ModelReference.parse(str(base)), torch.zeros(1), is_base=True),))
        expert = TensorEntry(ModelReference.parse(f"{base}+{adapter}"), torch.zeros(1))
        found[label] = plain_adapters(group, [expert])
    assert found["lines up"] is not None and found["renamed"] is None
