"""``mergekit-bmm-ensemble``: a sampled ensemble scored with fixed heads, as the search scores trials."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import save_file

from mergekit_bmm.ensemble.metrics import expected_calibration_error

TESTS = Path(__file__).parent
SENTIMENT = TESTS / "fixtures" / "classification" / "toy_sentiment.jsonl"


def write_head(path: Path, hidden: int, seed: int) -> Path:
    generator = torch.Generator().manual_seed(seed)
    tensors = {"weight": 3 * torch.randn(2, hidden, generator=generator), "bias": torch.zeros(2)}
    save_file(tensors, str(path), metadata={"pooling": "mean", "labels": json.dumps(["neg", "pos"])})
    return path


@pytest.fixture(scope="module")
def sampled(tiny_llama, tmp_path_factory):
    from mergekit.options import MergeOptions

    from mergekit_bmm.sampling.run import SamplingRequest, sample_models

    out = tmp_path_factory.mktemp("ensemble") / "samples"
    recipe = {
        "merge_method": "bmm",
        "base_model": str(tiny_llama.base),
        "models": [{"model": str(path), "parameters": {"weight": 0.3}} for path in tiny_llama.experts],
        "parameters": {"anchor_method": "task_arithmetic", "lambda": 0.05},
        "dtype": "float32",
    }
    request = SamplingRequest(3, beta=1e4, name_filter="layers.3.mlp.down_proj")
    sample_models(recipe, out, request, MergeOptions(quiet=True, write_model_card=False))
    return out


def tasks_file(tmp_path: Path, nested: bool) -> Path:
    heads = [write_head(tmp_path / f"head{i}.safetensors", 64, seed=i) for i in range(2)]
    evaluator = {
        "type": "classification",
        "max_length": 16,
        "batch_size": 4,
        "tasks": [
            {"name": "first", "head": heads[0].name, "data": str(SENTIMENT), "split": "validation"},
            {"name": "second", "head": heads[1].name, "data": str(SENTIMENT), "split": "validation"},
        ],
    }
    path = tmp_path / ("search.yml" if nested else "tasks.yml")
    path.write_text(yaml.safe_dump({"recipe": "r.yml", "evaluator": evaluator} if nested else evaluator))
    return path


def manual_probabilities(folder: Path, task_file: Path, split: str):
    """Softmax of head logits per member, computed by loading each folder ourselves."""
    from transformers import AutoModel, AutoTokenizer

    from mergekit_bmm.ensemble.tasks import load_classification_tasks
    from mergekit_bmm.evaluation.classification import task_logits

    config = load_classification_tasks(task_file, split)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = {}
    for task in config.tasks:
        logits, labels = task_logits(model, tokenizer, task, 16, 4)
        out[task.name] = (torch.softmax(logits.double(), -1), labels)
    return out


def test_ensemble_report_matches_the_average_of_member_softmaxes(sampled, tmp_path):
    from mergekit_bmm.cli.ensemble import main

    task_file = tasks_file(tmp_path, nested=True)
    result = CliRunner().invoke(main, [str(sampled), "--tasks", str(task_file), "--split", "test", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "MAP acc" in result.output and "mean" in result.output
    report = json.loads((sampled / "ensemble.json").read_text())
    assert report["members"] == 3 and set(report["tasks"]) == {"first", "second"}
    members = [manual_probabilities(sampled / f"sample-{i:03d}", task_file, "test") for i in range(3)]
    for task in ("first", "second"):
        probabilities = sum(member[task][0] for member in members) / 3
        labels = members[0][task][1]
        assert len(labels) == 4  # the fixture's test split, not the file's validation split
        row = report["tasks"][task]
        assert row["ece"] == pytest.approx(expected_calibration_error(probabilities, labels), abs=1e-6)
        assert row["accuracy"] == pytest.approx((probabilities.argmax(-1) == labels).double().mean().item())
    map_probabilities = manual_probabilities(sampled / "map", task_file, "test")
    for task, (probabilities, labels) in map_probabilities.items():
        expected = expected_calibration_error(probabilities, labels)
        assert report["map"]["tasks"][task]["ece"] == pytest.approx(expected, abs=1e-6)


def test_ensemble_refusals_are_one_line(sampled, tmp_path):
    from mergekit_bmm.cli.ensemble import main

    def refused(*args):
        result = CliRunner().invoke(main, list(args))
        assert result.exit_code != 0
        message = result.output.strip()
        assert "\n" not in message and "Traceback" not in message, message
        return message

    good = tasks_file(tmp_path, nested=False)
    assert "no finished mergekit-bmm-sample run" in refused(str(tmp_path), "--tasks", str(good))
    lm = tmp_path / "lm.yml"
    lm.write_text(yaml.safe_dump({"evaluator": {"type": "lm_eval", "tasks": [{"name": "x"}]}}))
    assert "classification evaluator" in refused(str(sampled), "--tasks", str(lm))
    typo = tmp_path / "typo.yml"
    typo.write_text(good.read_text().replace("batch_size", "batch_sise"))
    assert "batch_sise" in refused(str(sampled), "--tasks", str(typo))
