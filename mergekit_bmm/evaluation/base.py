"""What every evaluator shares: the interface, the device, and loading a merged model.

An evaluator turns a merged model into per-task scores (higher is better); the search's
score is their (weighted) mean, paper eq. 10. It scores a model folder (``evaluate``),
and, when it declares how it loads a model (``loading``), a live model object too
(``evaluate_model``): the search's resident trials hand it the model they merged in
place, with no folder in between. Raising or returning NaN marks a trial failed; a
:class:`~mergekit_bmm.errors.BMMError` (a misconfigured evaluator) stops the search
instead, since every later trial would fail the same way.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from mergekit_bmm.errors import ConfigError


@dataclass(frozen=True)
class ModelLoading:
    """How an evaluator loads a model: a transformers class and a dtype.

    ``class_name`` ``auto`` is the checkpoint's own architecture (``architectures`` in
    its config.json, e.g. ``LlamaForCausalLM``).
    """

    class_name: str = "auto"
    dtype: str = "float32"


@dataclass(frozen=True)
class TaskExamples:
    """One task's examples as a staged evaluation sees them: how many, and a stratum
    (e.g. the label) per example for a stratified subsample."""

    count: int
    strata: tuple[int, ...] | None = None


class ExampleScoring(Protocol):
    """An evaluator that scores single examples (per-example scores in [0, 1] whose mean is
    the task's score), so a search can score a trial on part of its examples first
    (:mod:`mergekit_bmm.search.fidelity`)."""

    weights: dict[str, float]
    scores_examples: bool  # False: this configuration can only be scored as a whole

    def examples(self) -> dict[str, TaskExamples]: ...

    def example_scorer(self, model: Any, tokenizer: Any) -> Callable[[str, Sequence[int]], list[float]]: ...


class Evaluator(Protocol):
    """Scores merged models; ``weights`` weigh the tasks in the mean."""

    weights: dict[str, float]
    loading: ModelLoading | None  # None: it can only score a folder

    def evaluate(self, model_dir: Path) -> dict[str, float]: ...

    def evaluate_model(self, model: Any, tokenizer: Any) -> dict[str, float]: ...


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_class(class_name: str, model_dir: Path | str | None = None) -> Any:
    """The transformers class named ``class_name`` (``auto``: the checkpoint's own architecture)."""
    import transformers

    if class_name == "auto":
        from mergekit_bmm.io.model_folder import model_config

        architectures = getattr(model_config(model_dir), "architectures", None) or []
        if not architectures:
            raise ConfigError(
                f"{model_dir}/config.json names no architecture; set the evaluator's load_model "
                "(e.g. AutoModelForCausalLM)"
            )
        class_name = architectures[0]
    found = getattr(transformers, class_name, None)
    if found is None or not hasattr(found, "from_pretrained"):
        raise ConfigError(
            f"evaluator load_model: transformers has no model class {class_name!r}; "
            "use e.g. AutoModel, AutoModelForCausalLM or AutoModelForSequenceClassification"
        )
    return found


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def load_model(model_dir: Path, class_name: str, device: str, dtype: str = "float32") -> Any:
    """A transformers model from a local folder, in eval mode, on ``device``."""
    found = model_class(class_name, model_dir)
    model = found.from_pretrained(str(model_dir), dtype=_DTYPES[dtype])
    return model.to(device).eval()


def evaluate_folder(
    evaluator: Any, model_dir: Path, device: str, score: Callable[[Any, Any], Any] | None = None
) -> Any:
    """Load ``model_dir`` as ``evaluator.loading`` says and score it with ``score(model, tokenizer)``
    (default: ``evaluator.evaluate_model``)."""
    loading = evaluator.loading
    model = load_model(model_dir, loading.class_name, device, loading.dtype)
    tokenizer = load_tokenizer(model_dir)
    try:
        return (score or evaluator.evaluate_model)(model, tokenizer)
    finally:
        del model, tokenizer
        release_memory()


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer saved with the merged model (mergekit copies the base model's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def release_memory() -> None:
    """Free a dropped model's memory now (call after deleting the references).

    A full collection costs up to a second in a process that imported torch,
    transformers and mergekit; it is worth it only after a model was loaded.
    """
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
