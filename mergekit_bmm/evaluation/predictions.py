"""A model's predicted distributions on tokenised texts, the way the label-free evaluator reads them.

Three kinds of model output, one interface (``[positions, outcomes]`` log-probabilities per text):

- ``causal_lm``: the next-token distribution at every token of the text;
- ``head``: an encoder's pooled state through a classification head file (one position per text);
- ``classifier``: a model with its own classification head (``...ForSequenceClassification``).

Texts go through the model in batches of similar length, right-padded, so a text's result does
not depend on the batch it lands in.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.evaluation.classification import Head, length_batches, pad_rows, pooled_encoded

KINDS = ("causal_lm", "head", "classifier")


def kind_of(config: Any, head: Head | None) -> str:
    """How a checkpoint's outputs are read: by its head file, or by its architecture."""
    if head is not None:
        return "head"
    from mergekit_bmm.stats.collect import is_decoder

    if is_decoder(config):
        return "causal_lm"
    architectures = getattr(config, "architectures", None) or []
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        return "classifier"
    raise ConfigError(
        f"{getattr(config, '_name_or_path', 'the expert')} is an encoder without a classification head "
        "(architectures: " + (", ".join(architectures) or "none") + "); give the task a `head:` file"
    )


@torch.inference_mode()
def log_probs_per_text(
    model: Any,
    kind: str,
    rows: Sequence[Sequence[int]],
    indices: Sequence[int],
    pad_id: int,
    batch_size: int,
    head: Head | None = None,
    last_only: bool = False,
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(index, [positions, outcomes] float32 log-probabilities)`` for every text in ``indices``, on the
    model's device (a GPU keeps a large vocabulary's distributions where they were computed);
    ``last_only``: a causal LM's last position alone (what it predicts after the whole text)."""
    device = next(model.parameters()).device
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        if kind == "head":
            assert head is not None
            chosen = [{"input_ids": list(rows[i])} for i in indices]
            pooled = pooled_encoded(model, chosen, pad_id, batch_size, head.pooling)
            logits = head.logits(pooled)
            for position, index in enumerate(indices):
                yield index, torch.log_softmax(logits[position : position + 1], dim=-1)
            return
        lengths = [len(rows[i]) for i in indices]
        for batch in length_batches(lengths, batch_size):
            chosen = [indices[b] for b in batch]
            padded = pad_rows([{"input_ids": list(rows[i])} for i in chosen], pad_id)
            inputs = {key: value.to(device) for key, value in padded.items()}
            extra = {"use_cache": False} if kind == "causal_lm" else {}
            logits = model(**inputs, **extra).logits
            for row, index in enumerate(chosen):
                if kind == "causal_lm":
                    end = len(rows[index])
                    own = logits[row, end - 1 : end] if last_only else logits[row, :end]
                else:
                    own = logits[row : row + 1]
                yield index, torch.log_softmax(own.float(), dim=-1)  # on the model's device
    finally:
        model.train(was_training)
