"""The evaluators: classification heads, lm-eval with a local task, Python callables."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mergekit_bmm.errors import ConfigError, TensorInputError
from mergekit_bmm.evaluation.classification import (
    ClassificationEvaluator,
    ClassificationTask,
    accuracy,
    load_examples,
    task_logits,
)
from mergekit_bmm.evaluation.config import ClassificationEvaluatorConfig, PythonEvaluatorConfig, weighted_mean
from mergekit_bmm.evaluation.python_callable import PythonEvaluator, as_per_task

TESTS = Path(__file__).parent
REPO = TESTS.parent
SENTIMENT = TESTS / "fixtures" / "classification" / "toy_sentiment.jsonl"


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from mergekit_bmm.examples.tiny_models import make_base

    model, tokenizer = make_base("bert", hidden=32, layers=2, seed=3)
    path = tmp_path_factory.mktemp("bert") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_head(path: Path, hidden: int, classes: int = 2, pooling: str = "mean", seed: int = 0) -> Path:
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        "weight": torch.randn(classes, hidden, generator=generator),
        "bias": torch.randn(classes, generator=generator) * 0.1,
    }
    labels = json.dumps([f"class{i}" for i in range(classes)])
    save_file(tensors, str(path), metadata={"pooling": pooling, "labels": labels})
    return path


def load(model_dir: Path):
    from transformers import AutoModel, AutoTokenizer

    return AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(
        model_dir
    )


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_task_logits_match_one_example_at_a_time_in_float64(tiny_bert, tmp_path, pooling):
    head = write_head(tmp_path / "head.safetensors", 32, pooling=pooling)
    task = ClassificationTask(name="sentiment", head=str(head), data=str(SENTIMENT))
    model, tokenizer = load(tiny_bert)
    logits, labels = task_logits(model, tokenizer, task, max_length=16, batch_size=5)

    texts = [json.loads(line)["text"] for line in SENTIMENT.read_text().splitlines()]
    tensors = {k: v.double() for k, v in load_file(str(head)).items()}
    model64 = model.double()
    expected = []
    with torch.no_grad():
        for text in texts:  # unpadded, so pooling needs no mask
            ids = tokenizer(text, truncation=True, max_length=16, return_tensors="pt")
            hidden = model64(**ids).last_hidden_state[0]
            pooled = hidden.mean(dim=0) if pooling == "mean" else hidden[0]
            expected.append(pooled @ tensors["weight"].T + tensors["bias"])
    expected = torch.stack(expected)
    assert logits.dtype == torch.float32 and logits.shape == (12, 2)
    relative = ((logits.double() - expected).norm() / expected.norm()).item()
    assert relative < 1e-5, relative
    assert labels.tolist() == [json.loads(line)["label"] for line in SENTIMENT.read_text().splitlines()]
    assert accuracy(logits, labels) == pytest.approx((expected.argmax(-1) == labels).double().mean().item())


def test_split_and_limit_choose_a_fixed_subset(tmp_path, tiny_bert):
    head = write_head(tmp_path / "head.safetensors", 32)
    task = ClassificationTask(name="s", head=str(head), data=str(SENTIMENT), split="validation", limit=5)
    texts, labels = load_examples(task, 2)
    validation = [json.loads(line) for line in SENTIMENT.read_text().splitlines()]
    validation = [row["text"] for row in validation if row["split"] == "validation"]
    assert len(validation) == 8 and len(texts) == 5 and set(texts) <= set(validation)
    assert texts == [t for t in validation if t in texts]  # file order kept
    assert load_examples(task, 2)[0] == texts  # the same subset every time
    fraction = ClassificationTask(name="s", head=str(head), data=str(SENTIMENT), split="test", limit=0.5)
    assert len(load_examples(fraction, 2)[0]) == 2


def test_classification_evaluator_scores_accuracy_per_task(tiny_bert, tmp_path):
    heads = [write_head(tmp_path / f"h{i}.safetensors", 32, seed=i) for i in range(2)]
    config = ClassificationEvaluatorConfig(
        type="classification",
        tasks=[
            {"name": "first", "head": str(heads[0]), "data": str(SENTIMENT)},
            {
                "name": "second",
                "head": str(heads[1]),
                "data": str(SENTIMENT),
                "split": "validation",
                "weight": 3,
            },
        ],
        max_length=16,
        batch_size=4,
    )
    evaluator = ClassificationEvaluator(config, "cpu")
    scores = evaluator.evaluate(tiny_bert)
    model, tokenizer = load(tiny_bert)
    for task in config.tasks:
        logits, labels = task_logits(model, tokenizer, task, 16, 4)
        assert scores[task.name] == pytest.approx(accuracy(logits, labels))
    assert weighted_mean(scores, evaluator.weights) == pytest.approx(
        (scores["first"] + 3 * scores["second"]) / 4
    )


def test_classification_refuses_wrong_heads_and_labels(tiny_bert, tmp_path):
    model, tokenizer = load(tiny_bert)
    wide = write_head(tmp_path / "wide.safetensors", 48)
    with pytest.raises(TensorInputError, match="hidden size 48"):
        task_logits(model, tokenizer, ClassificationTask(name="t", head=str(wide), data=str(SENTIMENT)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine", "label": 1}\n{"text": "odd", "label": 7}\n')
    head = write_head(tmp_path / "head.safetensors", 32)
    with pytest.raises(ConfigError, match="line 2: label 7 is outside the head's 2 classes"):
        load_examples(ClassificationTask(name="t", head=str(head), data=str(bad)), 2)
    with pytest.raises(ConfigError, match="no examples with split 'train'"):
        load_examples(ClassificationTask(name="t", head=str(head), data=str(SENTIMENT), split="train"), 2)


def test_python_callable_results_and_errors(tiny_bert, tmp_path):
    assert as_per_task(0.5, "f") == {"score": 0.5}
    assert as_per_task({"a": torch.tensor(0.25), "b": 1}, "f") == {"a": 0.25, "b": 1.0}
    with pytest.raises(ConfigError, match="returned str"):
        as_per_task("high", "f")
    with pytest.raises(ConfigError, match="cannot import 'no_such_module'"):
        PythonEvaluator(PythonEvaluatorConfig(type="python", callable="no_such_module:f"), "cpu")
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        PythonEvaluator(PythonEvaluatorConfig(type="python", callable="search_objectives:nope"), "cpu")

    module = tmp_path / "my_eval.py"
    module.write_text(
        "def score(model, tokenizer, bonus=0.0):\n"
        "    return {'params': sum(p.numel() for p in model.parameters()) + bonus, 'vocab': len(tokenizer)}\n"
        "def files(model_dir, bonus=0.0):\n"
        "    return len(list(model_dir.iterdir())) + bonus\n"
    )
    config = PythonEvaluatorConfig(
        type="python",
        callable="my_eval:score",
        load_model="AutoModel",
        args={"bonus": 0.5},
        python_path=[str(tmp_path)],
    )
    evaluator = PythonEvaluator(config, "cpu")
    scores = evaluator.evaluate(tiny_bert)
    model, tokenizer = load(tiny_bert)
    expected = {"params": sum(p.numel() for p in model.parameters()) + 0.5, "vocab": float(len(tokenizer))}
    assert scores == expected
    assert evaluator.evaluate_model(model, tokenizer) == expected  # a live model, no folder
    folder = config.model_copy(update={"callable": "my_eval:files", "input": "folder"})
    assert PythonEvaluator(folder, "cpu").evaluate(tiny_bert) == {
        "score": len(list(tiny_bert.iterdir())) + 0.5
    }


def test_a_python_evaluator_with_examples_scores_single_examples(tiny_bert, tmp_path):
    (tmp_path / "per_example.py").write_text(
        "def examples(n=4, bad=None):\n"
        "    return bad if bad is not None else {'odd': [i % 2 for i in range(n)], 'all': n}\n"
        "def score(model, tokenizer, task, indices, n=4, bad=None):\n"
        "    return [float(i % 2) if task == 'odd' else 1.0 for i in indices]\n"
    )
    config = PythonEvaluatorConfig(
        type="python",
        callable="per_example:score",
        examples="per_example:examples",
        load_model="AutoModel",
        python_path=[str(tmp_path)],
    )
    evaluator = PythonEvaluator(config, "cpu")
    assert evaluator.scores_examples
    assert evaluator.examples()["odd"].strata == (0, 1, 0, 1) and evaluator.examples()["all"].count == 4
    model, tokenizer = load(tiny_bert)
    assert evaluator.example_scorer(model, tokenizer)("odd", [1, 2, 3]) == [1.0, 0.0, 1.0]
    assert evaluator.evaluate_model(model, tokenizer) == {"odd": 0.5, "all": 1.0}
    for bad, message in (([], "returned list"), ({"t": 0}, "positive count"), ({"t": ["x"]}, "int labels")):
        with pytest.raises(ConfigError, match=message):
            PythonEvaluator(config.model_copy(update={"args": {"bad": bad}}), "cpu")
    (tmp_path / "wrong_count.py").write_text(
        "def score(model, tokenizer, task, indices):\n    return [1.0]\n"
    )
    wrong = config.model_copy(update={"callable": "wrong_count:score"})
    with pytest.raises(ConfigError, match="returned 1 scores for 3 examples"):
        PythonEvaluator(wrong, "cpu").example_scorer(model, tokenizer)("odd", [0, 1, 2])
    with pytest.raises(ValueError, match="does not work with `input: folder`"):
        PythonEvaluatorConfig(type="python", callable="a:b", examples="a:c", input="folder")


@pytest.mark.slow
def test_lm_eval_local_task_scores_like_lm_eval_itself(tiny_llama, monkeypatch):
    """Offline lm-eval on a local task: our evaluator reports what lm-eval's own hf model does."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from mergekit_bmm.evaluation.config import LMEvalEvaluatorConfig
    from mergekit_bmm.evaluation.lm_harness import LMEvalEvaluator

    monkeypatch.chdir(REPO)  # the task YAML's data_files is relative to the working directory
    include = str(TESTS / "fixtures" / "lm_eval")
    config = LMEvalEvaluatorConfig(
        type="lm_eval", tasks=["toy_choice"], include_path=include, limit=6, batch_size=4
    )
    scores = LMEvalEvaluator(config, "cpu").evaluate(tiny_llama.base)
    assert set(scores) == {"toy_choice"}
    reference = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={tiny_llama.base},dtype=float32",
        tasks=["toy_choice"],
        task_manager=TaskManager(include_path=include, include_defaults=False),
        limit=6,
        batch_size=4,
        device="cpu",
        log_samples=False,
        bootstrap_iters=0,
    )
    expected = reference["results"]["toy_choice"]["acc,none"]
    assert scores["toy_choice"] == pytest.approx(expected)
    assert any(math.isclose(scores["toy_choice"], k / 6) for k in range(7))

    f1 = config.model_copy(update={"tasks": [config.tasks[0].model_copy(update={"metric": "f1"})]})
    with pytest.raises(ConfigError, match="has no metric 'f1'; it reports: acc,none"):
        LMEvalEvaluator(f1, "cpu").extract(reference)


def test_a_zero_shot_head_is_scaled_unit_description_embeddings(tiny_bert, tmp_path):
    """Each row is scale · the unit embedding of its class's description (the class name if none)."""
    from mergekit_bmm.evaluation.classification import load_head, pooled_features
    from mergekit_bmm.evaluation.zero_shot import build_zero_shot_head, class_descriptions

    texts = class_descriptions(("pos", "neg_review"), {"pos": "a happy text"})
    assert texts == ["a happy text", "neg review"]
    path = build_zero_shot_head(tiny_bert, tmp_path / "head.safetensors", ["pos", "neg_review"],
                                {"pos": "a happy text"}, max_length=16)  # fmt: skip
    head = load_head(str(path))
    assert head.labels == ("pos", "neg_review") and head.normalize == "l2"
    assert torch.allclose(head.weight.norm(dim=-1), torch.full((2,), 20.0), atol=1e-4)
    model, tokenizer = load(tiny_bert)
    one = pooled_features(model, tokenizer, texts[1:], 16, 1).double()
    assert torch.allclose(head.weight[1].double(), 20 * one[0] / one[0].norm(), atol=1e-5)
    with pytest.raises(ConfigError, match="descriptions name classes"):
        class_descriptions(("pos", "neg"), {"neutral": "x"})
