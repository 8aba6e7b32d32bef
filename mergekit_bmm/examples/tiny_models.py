"""Tiny base models and "fine-tuned" experts generated locally, for the demo and tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a few embedded
sentences and the weights are random. Each expert is the base plus a low-rank update
in every 2D body weight (fine-tuning deltas are approximately low-rank) and a little
dense noise everywhere, so anchors, Grams and merges behave like on real checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

ARCHITECTURES = ("llama", "qwen2", "mistral", "gpt2", "bert")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Model merging combines experts fine-tuned from one pretrained model.",
    "Bayesian model merging solves a ridge regression anchored at an existing merge.",
    "A Gaussian process proposes the next regularisation strengths to try.",
    "Calibration data gives activation statistics for each linear module.",
    "Positive reviews praise the acting; negative reviews complain about the plot.",
    "Le chat dort sur le canapé. El perro corre en el parque. Der Hund schläft.",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } < > ? ! , . ; :",
]


@dataclass(frozen=True)
class TinyFamily:
    """Paths of a generated base model and its experts."""

    base: Path
    experts: tuple[Path, ...]
    architecture: str


def build_tokenizer(vocab_size: int = 320):
    """A small byte-level BPE tokenizer with BOS/EOS/PAD, trained offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def tiny_config(architecture: str, vocab_size: int, hidden: int, layers: int):
    """A small transformers config of ``architecture`` (4 heads; Llama-likes: 2 KV heads, MLP 2·hidden)."""
    import transformers as tf

    heads = 4
    common = dict(vocab_size=vocab_size, num_hidden_layers=layers, num_attention_heads=heads)
    if architecture in ("llama", "mistral", "qwen2"):
        cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config}[architecture]
        return cls(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=architecture == "qwen2",
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            **common,
        )
    if architecture == "gpt2":
        return tf.GPT2Config(
            vocab_size=vocab_size,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=256,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    if architecture == "bert":
        return tf.BertConfig(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            max_position_embeddings=256,
            pad_token_id=0,
            **common,
        )
    raise ValueError(f"unknown tiny architecture {architecture!r}; choose one of {ARCHITECTURES}")


def _model_class(architecture: str):
    import transformers as tf

    return {
        "llama": tf.LlamaForCausalLM,
        "mistral": tf.MistralForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "gpt2": tf.GPT2LMHeadModel,
        "bert": tf.BertModel,
    }[architecture]


def make_base(architecture: str = "llama", hidden: int = 64, layers: int = 4, seed: int = 0):
    """A randomly initialised tiny model and its tokenizer (in memory)."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = tiny_config(architecture, len(tokenizer), hidden, layers)
    model = _model_class(architecture)(config).eval()
    return model, tokenizer


def perturb_as_expert(
    model: torch.nn.Module, seed: int, rank: int = 4, strength: float = 0.05, noise: float = 0.005
) -> None:
    """Turn ``model`` (in place) into a synthetic expert: low-rank deltas plus noise.

    2D weights (and each expert of a 3-D expert stack) move by ``strength`` (relative to
    their spread) along a rank-``rank`` update; every tensor also gets dense noise ``noise``
    times its spread.
    """
    device = next(model.parameters()).device  # a model made on a GPU is perturbed there (8B shapes)
    generator = torch.Generator(device=device).manual_seed(seed)
    draw = {"generator": generator, "device": device}
    with torch.no_grad():
        for _, parameter in model.named_parameters():
            spread = parameter.std() if parameter.numel() > 1 else parameter.abs().mean()
            delta = noise * float(spread or 1.0) * torch.randn(parameter.shape, **draw)
            if parameter.ndim in (2, 3) and min(parameter.shape[-2:]) > rank:
                # one update per matrix; a mixture-of-experts stack (E, out, in) gets one per expert
                stack = parameter.shape[:-2]
                left = torch.randn(*stack, parameter.shape[-2], rank, **draw)
                right = torch.randn(*stack, rank, parameter.shape[-1], **draw)
                # entries of left @ right / sqrt(rank) are ~N(0, 1)
                delta += strength * parameter.std() * (left @ right) / rank**0.5
            parameter.add_(delta.to(parameter.dtype))


def make_tiny_family(
    out_dir: str | Path,
    architecture: str = "llama",
    n_experts: int = 3,
    hidden: int = 64,
    layers: int = 4,
    seed: int = 0,
    expert_names: Sequence[str] | None = None,
) -> TinyFamily:
    """Write ``base/`` and ``expert-*/`` model folders (safetensors + tokenizer)."""
    import copy

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per tiny shard is noise
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    base, tokenizer = make_base(architecture, hidden, layers, seed)
    names = list(expert_names or [f"expert-{chr(ord('a') + i)}" for i in range(n_experts)])
    base_path = out / "base"
    base.save_pretrained(base_path)
    tokenizer.save_pretrained(base_path)
    experts = []
    for index, name in enumerate(names):
        expert = copy.deepcopy(base)
        perturb_as_expert(expert, seed=1000 * (seed + 1) + index)
        path = out / name
        expert.save_pretrained(path)
        tokenizer.save_pretrained(path)
        experts.append(path)
    return TinyFamily(base=base_path, experts=tuple(experts), architecture=architecture)


def make_lora_adapter(
    base: str | Path,
    folder: str | Path,
    seed: int,
    rank: int = 2,
    targets: Sequence[str] = ("q_proj", "v_proj", "down_proj"),
    alpha: float | None = None,
    spread: float = 0.05,
) -> Path:
    """A PEFT LoRA adapter for ``base`` with random, non-zero factors (a synthetic LoRA expert)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(
        r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(targets), init_lora_weights=False
    )
    adapted = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_" in name:
                parameter.copy_(spread * torch.randn(parameter.shape, generator=generator))
    adapted.save_pretrained(folder)
    return Path(folder)
