"""An example ``type: python`` evaluator: how well the merge reproduces each expert.

With no labelled data at hand, a merge can still be scored by how closely it predicts
what each expert predicts on some text: per expert ``t``, the score is minus the mean
token ``KL(p_t || p_merged)`` over ``texts``, in millinats (0 = the expert's own
next-token distributions; higher is better). The search maximises the mean over
experts. It works for any causal LM; the defaults suit the tiny generated models.

    evaluator:
      type: python
      callable: mergekit_bmm.examples.tiny_objective:expert_agreement
      args: {experts: {a: /models/expert-a, b: /models/expert-b}}

It takes the live model (``input: model``, the default), so the search's trials never
touch the disk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import torch

DEFAULT_TEXTS = (
    "Model merging combines experts fine-tuned from one pretrained model.",
    "A Gaussian process proposes the next regularisation strengths to try.",
    "Positive reviews praise the acting; negative reviews complain about the plot.",
    "The quick brown fox jumps over the lazy dog.",
)


def _batch(tokenizer: Any, texts: Sequence[str]) -> dict[str, torch.Tensor]:
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer(list(texts), return_tensors="pt", padding=True)


@torch.inference_mode()
def _log_probs(model: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    device = next(model.parameters()).device
    logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
    return torch.log_softmax(logits.float(), dim=-1).cpu()


@lru_cache(maxsize=16)
def _expert_log_probs(path: str, texts: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = _batch(tokenizer, texts)
    return _log_probs(model, batch), batch["attention_mask"]


def expert_agreement(
    model: Any,
    tokenizer: Any,
    experts: Mapping[str, str],
    texts: Sequence[str] = DEFAULT_TEXTS,
) -> dict[str, float]:
    """Per expert: minus the mean token KL(expert || merged) on ``texts``, in millinats."""
    texts = tuple(texts)
    merged = _log_probs(model, _batch(tokenizer, texts))
    scores = {}
    for name, path in experts.items():
        reference, mask = _expert_log_probs(str(path), texts)
        kl = (reference.exp() * (reference - merged)).sum(dim=-1)  # [batch, tokens]
        mean_kl = (kl * mask).sum() / mask.sum()
        scores[str(name)] = -1000.0 * float(mean_kl)
    return scores
