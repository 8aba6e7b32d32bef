"""Tiny random models of every architecture that transformers 5 and mergekit 0.1.5 both know.

One small configuration per ``model_type`` (hidden 32, 2 layers; mixtures of experts with 4
experts), built with ``AutoConfig.for_model`` and saved as transformers saves it, with
experts made the way :func:`~mergekit_bmm.examples.tiny_models.perturb_as_expert` makes them.
The architecture tests and docs/architectures.md walk this list.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from mergekit_bmm.examples.tiny_models import TinyFamily, build_tokenizer, perturb_as_expert

_DECODER: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_GPT: dict[str, Any] = dict(n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=2)
_ENCODER: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0
)
_EIGHT = dict(head_dim=8)

# model_type -> what it needs besides the vocabulary size
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": _DECODER,
    "mistral": _DECODER,
    "qwen2": _DECODER,
    "qwen3": {**_DECODER, **_EIGHT},
    "gemma": {**_DECODER, **_EIGHT},
    "gemma2": {**_DECODER, **_EIGHT},
    "gemma3_text": {**_DECODER, **_EIGHT},
    "phi3": _DECODER,
    "phi": _DECODER,
    "stablelm": _DECODER,
    "olmo2": _DECODER,
    "cohere": {**_DECODER, "use_qk_norm": True},  # mergekit's definition requires the q/k norms
    "cohere2": _DECODER,
    "granite": _DECODER,
    "glm4": {**_DECODER, **_EIGHT},
    "exaone": _DECODER,
    "starcoder2": _DECODER,
    "falcon": dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        new_decoder_architecture=True,
        tie_word_embeddings=False,  # mergekit's definition requires lm_head.weight
    ),
    "gpt2": _GPT,
    "gpt_bigcode": _GPT,
    "bert": {**_ENCODER, "max_position_embeddings": 128},
    "roberta": {**_ENCODER, "max_position_embeddings": 130, "pad_token_id": 1},
    "mixtral": {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        **_DECODER,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
    },
    "qwen3_moe": {
        **_DECODER,
        **_EIGHT,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    },
    "gpt_neox": {**_ENCODER, "max_position_embeddings": 128},
}
# the transformers class each saves as (mergekit's definitions expect these tensor names)
AUTO_CLASS = {"bert": "AutoModel", "roberta": "AutoModelForMaskedLM"}
MIXTURES_OF_EXPERTS = frozenset({"mixtral", "qwen2_moe", "qwen3_moe"})


def tiny_model(model_type: str, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised tiny model of ``model_type`` (in memory)."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, vocab_size=vocab_size, **TINY_CONFIGS[model_type])
    torch.manual_seed(seed)
    auto = getattr(transformers, AUTO_CLASS.get(model_type, "AutoModelForCausalLM"))
    return auto.from_config(config).eval()


def make_architecture_family(out_dir: str | Path, model_type: str, n_experts: int = 2) -> TinyFamily:
    """Write ``base/`` and ``expert-*/`` folders of a tiny ``model_type`` (weights and tokenizer)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out_dir).resolve()
    tokenizer = build_tokenizer()
    base = tiny_model(model_type, len(tokenizer))
    folders = [out / "base", *(out / f"expert-{chr(ord('a') + i)}" for i in range(n_experts))]
    for index, folder in enumerate(folders):
        model = base
        if index:
            model = copy.deepcopy(base)
            perturb_as_expert(model, seed=1000 + index)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return TinyFamily(base=folders[0], experts=tuple(folders[1:]), architecture=model_type)
