"""Scoring through fixed heads: file formats, pooling, and logits against a float64 reference."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import relative_error

from mergekit_bmm.errors import ConfigError, TensorInputError
from mergekit_bmm.evaluation.classification import (
    ClassificationTask,
    accuracy,
    load_examples,
    load_head,
    save_head,
    task_logits,
)

TEXTS = ["the quick brown fox", "a dog", "model merging combines experts fine-tuned from one model", "yes"]


@pytest.fixture(scope="module")
def tiny_encoder():
    from mergekit_bmm.examples.tiny_models import make_base

    model, tokenizer = make_base("bert", hidden=32, layers=2, seed=3)
    return model.eval(), tokenizer


def write_task(tmp_path, labels, splits=None):
    path = tmp_path / "task.jsonl"
    with open(path, "w", encoding="utf-8") as handle:
        for i, (text, label) in enumerate(zip(TEXTS, labels)):
            record = {"text": text, "label": label}
            if splits:
                record["split"] = splits[i]
            handle.write(json.dumps(record) + "\n")
    return path


def reference_logits(model, tokenizer, texts, weight, bias, max_length, pooling):
    """One example at a time (no padding at all), pooled and projected in float64."""
    rows = []
    with torch.no_grad():
        for text in texts:
            encoded = tokenizer([text], truncation=True, max_length=max_length, return_tensors="pt")
            hidden = model(**encoded).last_hidden_state[0].double()
            pooled = hidden[0] if pooling == "cls" else hidden.mean(dim=0)
            rows.append(pooled @ weight.double().T + bias.double())
    return torch.stack(rows)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_task_logits_match_unbatched_float64_reference(tiny_encoder, tmp_path, pooling):
    model, tokenizer = tiny_encoder
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(3, 32, generator=generator), torch.randn(3, generator=generator)
    head = save_head(tmp_path / "head.safetensors", weight, bias, ["a", "b", "c"], pooling)
    data = write_task(tmp_path, [0, 1, 2, 1])
    task = {"name": "t", "head": str(head), "data": str(data)}
    logits, labels = task_logits(model, tokenizer, task, max_length=8, batch_size=3)
    expected = reference_logits(model, tokenizer, TEXTS, weight, bias, 8, pooling)
    assert logits.dtype == torch.float32 and logits.shape == (4, 3)
    assert relative_error(logits, expected) < 1e-5
    assert labels.tolist() == [0, 1, 2, 1]
    assert accuracy(logits, labels) == float((expected.argmax(-1) == labels).double().mean())


def test_l2_head_scores_scaled_cosines_against_float64_reference(tiny_encoder, tmp_path):
    """A zero-shot head: unit class embeddings times a scale, applied to unit pooled states."""
    model, tokenizer = tiny_encoder
    generator = torch.Generator().manual_seed(1)
    embeddings = torch.nn.functional.normalize(torch.randn(3, 32, generator=generator), dim=-1)
    head = save_head(
        tmp_path / "zs.safetensors", 20 * embeddings, torch.zeros(3), ["a", "b", "c"], normalize="l2"
    )
    assert load_head(head).normalize == "l2"
    task = {"name": "t", "head": str(head), "data": str(write_task(tmp_path, [0, 1, 2, 1]))}
    logits, _ = task_logits(model, tokenizer, task, max_length=8, batch_size=3)
    pooled = reference_logits(model, tokenizer, TEXTS, torch.eye(32), torch.zeros(32), 8, "mean")
    expected = 20 * torch.nn.functional.cosine_similarity(
        pooled.unsqueeze(1), embeddings.double().unsqueeze(0), dim=-1
    )
    assert relative_error(logits, expected) < 1e-5
    assert logits.abs().max() <= 20 + 1e-4
    with pytest.raises(ConfigError, match="normalize"):
        save_head(tmp_path / "bad.safetensors", embeddings, torch.zeros(3), ["a", "b", "c"], normalize="l1")


def test_head_round_trip_and_metadata(tmp_path):
    path = save_head(
        tmp_path / "h.safetensors", torch.ones(2, 4, dtype=torch.float64), torch.zeros(2), ["x", "y"]
    )
    head = load_head(path)
    assert head.weight.dtype == torch.float32 and head.labels == ("x", "y") and head.pooling == "mean"
    assert head.normalize == "none"  # heads written before `normalize` existed read the same way
    with pytest.raises(ConfigError, match="one label per class"):
        save_head(tmp_path / "bad.safetensors", torch.ones(2, 4), torch.zeros(2), ["only-one"])
    with pytest.raises(ConfigError, match="cannot read classification head"):
        load_head(tmp_path / "missing.safetensors")


def test_split_and_limit_select_examples(tmp_path):
    data = write_task(tmp_path, [0, 1, 0, 1], ["train", "test", "test", "test"])
    texts, labels = load_examples(
        ClassificationTask(name="t", head=str(data), data=str(data), split="test", limit=3)
    )
    assert texts == TEXTS[1:4] and labels.tolist() == [1, 0, 1]
    texts, labels = load_examples(
        ClassificationTask(name="t", head=str(data), data=str(data), split="test", limit=2)
    )
    assert len(texts) == 2 and set(texts) <= set(TEXTS[1:4])  # a fixed subset, in file order
    with pytest.raises(ConfigError, match="no examples with split 'validation'"):
        load_examples({"name": "t", "head": str(data), "data": str(data), "split": "validation"})


def test_label_outside_head_and_wrong_hidden_size_are_clear_errors(tiny_encoder, tmp_path):
    model, tokenizer = tiny_encoder
    data = write_task(tmp_path, [0, 1, 5, 1])
    head = save_head(tmp_path / "h.safetensors", torch.zeros(2, 32), torch.zeros(2), ["a", "b"])
    with pytest.raises(ConfigError, match="label 5 is outside the head's 2 classes"):
        task_logits(model, tokenizer, {"name": "t", "head": str(head), "data": str(data)})
    data = write_task(tmp_path, [0, 1, 0, 1])
    wide = save_head(tmp_path / "w.safetensors", torch.zeros(2, 64), torch.zeros(2), ["a", "b"])
    with pytest.raises(TensorInputError, match="hidden size 64"):
        task_logits(model, tokenizer, {"name": "t", "head": str(wide), "data": str(data)})


def test_rows_of_mixed_length_are_batched_with_little_padding():
    """A staged evaluation scores a few dozen random rows at a time: they are split into
    batches of similar length (each row once), not padded to the longest of them all."""
    from mergekit_bmm.evaluation.classification import length_batches

    lengths = [random_length % 48 + 1 for random_length in range(7, 7 + 64 * 13, 13)]
    batches = length_batches(lengths, 64)
    assert sorted(i for batch in batches for i in batch) == list(range(64))
    padded = sum(len(batch) * max(lengths[i] for i in batch) for batch in batches)
    assert padded < 1.3 * sum(lengths) < 64 * max(lengths)
    assert all(len(batch) <= 64 for batch in length_batches([5] * 200, 64))
