"""Resident trials: the model is loaded once, and every trial is merged into it in place.

At start the search loads the base checkpoint once (transformers, the class and dtype the
evaluator asks for) and runs mergekit's plan of the first trial's recipe in memory
(:func:`~mergekit_bmm.plugin.run.merge_recipe_in_memory`). That pass fills or reads
bmm's factor cache, puts every output tensor into the model (tensors bmm does not solve
keep those values: the anchor's), and — through the kernel's observer — hands over each
solved tensor's λ-independent factors and ``W_pre``. A trial is then, per solved tensor,
``W = W_pre + s·U(λ)``: one product on the model's device in float32
(:func:`~mergekit_bmm.core.closed_form.weight_from_factors`, the kernel's own
arithmetic), rounded to the dtype mergekit would save and copied into the parameter.
Nothing is written to disk and nothing is read back.

Memory: the model, ``W_pre`` of the solved tensors, and the factors. Factors are kept
resident while they fit the budget (``--max-memory``, else half the memory free after
the model is loaded); the others are read back from the cache each trial (an anchor the cache
does not store, recomputed by the first merge from its inputs, stays in memory). Peak memory does
not grow with the number of trials: each tensor's temporaries are freed before the next.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mergekit_bmm.core.closed_form import EigenFactors, weight_from_factors
from mergekit_bmm.core.evidence import lambda_text
from mergekit_bmm.core.module_map import classify, layer_index
from mergekit_bmm.devices import available_bytes
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.evaluation.base import ModelLoading, load_model, load_tokenizer
from mergekit_bmm.io.model_folder import model_type_of
from mergekit_bmm.merge_methods import observer
from mergekit_bmm.merge_methods.finite import checked_output
from mergekit_bmm.plugin import run as recipe_run
from mergekit_bmm.search.experiment import Experiment, middle_of
from mergekit_bmm.search.fidelity import evaluate_trial
from mergekit_bmm.search.space import SearchSpace
from mergekit_bmm.search.trials import DiskTrials, PlannedTrial, TrialOutcome, TrialRunner, run_stages

LOG = logging.getLogger("mergekit_bmm.search")
GB = 1024**3


def _size(count: int) -> str:
    """Bytes in GB, or in MB below a tenth of a GB (tiny models would all read 0.00 GB)."""
    return f"{count / GB:.2f} GB" if count >= GB / 10 else f"{count / 1024**2:.1f} MB"


class ResidentUnsupported(Exception):
    """This search cannot run its trials in memory; the message says why (it runs them on disk)."""


@dataclass
class SolvedParameter:
    """One solved tensor of the resident model and what re-merging it needs."""

    name: str
    target: torch.Tensor  # the model's parameter data, overwritten in place
    base: torch.Tensor  # W_pre as the kernel saw it (the recipe's dtype), on the model's device
    factors: EigenFactors | None  # None: read back from the cache each trial
    factor_bytes: int
    held_bytes: int  # kept in memory even when the factors are read back each trial
    reload: Callable[[], EigenFactors | None]
    transposed: bool
    lambda_mode: str
    out_dtype: torch.dtype
    block: int
    group: str

    def factors_now(self, device: torch.device) -> EigenFactors:
        if self.factors is not None:
            return self.factors
        factors = self.reload()
        if factors is None:
            raise RuntimeError(f"the cached factors of {self.name} are gone; run the search again")
        return factors.to(device)


@dataclass(frozen=True)
class MemoryPlan:
    """What stays resident, in bytes, and where."""

    device: str
    model_bytes: int
    model_dtype: str
    base_bytes: int
    factor_bytes: int
    resident_factor_bytes: int
    solved: int
    streamed: int
    budget_bytes: int

    def describe(self) -> str:
        where = "GPU memory" if self.device.startswith("cuda") else "RAM"
        lines = [
            f"resident trials on {self.device}: model {_size(self.model_bytes)} ({self.model_dtype}), "
            f"W_pre of {self.solved} solved tensors {_size(self.base_bytes)}, "
            f"factors {_size(self.factor_bytes)}"
        ]
        if self.streamed:
            lines.append(
                f"  the factors do not fit the {_size(self.budget_bytes)} budget: "
                f"{self.solved - self.streamed} tensors keep theirs in {where} "
                f"({_size(self.resident_factor_bytes)}), {self.streamed} are read from the cache "
                "each trial (no checkpoint is written)"
            )
        else:
            lines.append(f"  all factors stay in {where} (budget {_size(self.budget_bytes)})")
        return "\n".join(lines)


def tensor_bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def factor_bytes(factors: EigenFactors) -> int:
    return sum(tensor_bytes(value) for value in vars(factors).values() if isinstance(value, torch.Tensor))


def held_bytes(factors: EigenFactors) -> int:
    """What a tensor read back each trial still keeps: an anchor its cache entry does not store
    (recomputed by the merge from its inputs, which trials do not load) stays in memory."""
    return tensor_bytes(factors.anchor) if factors.anchor_recomputed else 0


class ParameterLookup:
    """Checkpoint tensor name → the model's tensor holding it (prefixes as transformers maps them)."""

    def __init__(self, model: Any) -> None:
        self.state = model.state_dict(keep_vars=True)
        self.prefix = getattr(model, "base_model_prefix", "") or ""

    def get(self, name: str) -> torch.Tensor | None:
        candidates = [name, f"{self.prefix}.{name}"]
        if self.prefix and name.startswith(self.prefix + "."):
            candidates.append(name[len(self.prefix) + 1 :])
        key = next((candidate for candidate in candidates if candidate in self.state), None)
        return None if key is None else self.state[key].data


class ResidentModel:
    """A model held in memory whose solved tensors are re-merged for each trial."""

    def __init__(self, model: Any, tokenizer: Any, space: SearchSpace, device: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.space = space
        self.device = torch.device(device)
        self.solved: dict[str, SolvedParameter] = {}
        self.plan: MemoryPlan | None = None

    @classmethod
    def load(
        cls,
        first_recipe: str,
        base_model: str,
        space: SearchSpace,
        loading: ModelLoading,
        options: Any,
        budget_bytes: int | None = None,
    ) -> ResidentModel:
        """Load the base once and merge ``first_recipe`` (a trial's recipe, with ``cache:``) into it."""
        if any(dimension.kind == "epsilon" for dimension in space.dimensions):
            raise ResidentUnsupported("ε changes the Gram, so each trial needs new factors")
        device = str(options.device)
        model = load_model(base_model, loading.class_name, device, loading.dtype)
        resident = cls(model, load_tokenizer(base_model), space, device)
        budget = budget_bytes if budget_bytes is not None else available_bytes(device) // 2
        resident._fill(first_recipe, base_model, options, budget)
        return resident

    def _fill(self, recipe_text: str, base_model: str, options: Any, budget: int) -> None:
        from mergekit.common import dtype_from_name

        model_type = model_type_of(base_model)
        lookup = ParameterLookup(self.model)
        reported: dict[str, tuple[observer.FactoredTensor, EigenFactors | None, int]] = {}
        kept = 0
        unplaced: list[str] = []

        def on_factored(report: observer.FactoredTensor) -> None:
            nonlocal kept
            size = factor_bytes(report.factors)
            keep = kept + size <= budget
            kept += size if keep else held_bytes(report.factors)
            reported[report.name] = (report, report.factors.to(self.device) if keep else None, size)

        def on_tensor(name: str, value: torch.Tensor, out_dtype: str | None) -> None:
            target = lookup.get(name)
            if target is None:
                unplaced.append(name)
                return
            if target.shape != value.shape:
                raise ResidentUnsupported(
                    f"{name} has shape {tuple(value.shape)} in the merge "
                    f"but {tuple(target.shape)} in the model"
                )
            dtype = dtype_from_name(out_dtype) if out_dtype else value.dtype
            with torch.no_grad():
                target.copy_(value.to(dtype))
            # a stack solved expert by expert, a fused weight part by part: its pieces were reported
            prefix = f"{name}["
            parts = [name] + [part for part in reported if part.startswith(prefix)]
            info = classify(name, model_type, value.ndim)
            for part in parts:
                if part not in reported:
                    continue
                report, factors, size = reported.pop(part)
                piece = report.piece
                if piece is not None and not piece.is_view:
                    raise ResidentUnsupported(
                        f"{name} interleaves its parts, which cannot be re-merged in place"
                    )
                self.solved[part] = SolvedParameter(
                    name=part,
                    target=target if piece is None else piece.take(target),
                    base=report.base.to(self.device),
                    factors=factors,
                    factor_bytes=size,
                    held_bytes=held_bytes(report.factors),
                    reload=report.reload,
                    transposed=report.transposed,
                    lambda_mode=report.lambda_mode,
                    out_dtype=dtype,
                    block=self.space.block_of(layer_index(name)),
                    group=info.group.value,
                )

        with observer.listening(on_factored=on_factored):
            recipe_run.merge_recipe_in_memory(recipe_text, options, on_tensor)
        if not self.solved:
            raise ResidentUnsupported("the merge solved no tensor through bmm's factor cache")
        if reported:  # a solved tensor the loaded model does not hold: trials would not re-solve it
            raise ResidentUnsupported(
                f"{next(iter(reported))} was solved but has no place in the loaded model"
            )
        if unplaced:
            LOG.info(
                "resident trials: %d merged tensors are not part of the evaluated model (e.g. %s)",
                len(unplaced),
                unplaced[0],
            )
        self.plan = self._memory_plan(budget)

    def _memory_plan(self, budget: int) -> MemoryPlan:
        parameters = list(self.model.parameters()) + list(self.model.buffers())
        solved = list(self.solved.values())
        return MemoryPlan(
            device=str(self.device),
            model_bytes=sum(tensor_bytes(t) for t in parameters),
            model_dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."),
            base_bytes=sum(tensor_bytes(p.base) for p in solved),
            factor_bytes=sum(p.factor_bytes for p in solved),
            resident_factor_bytes=sum(
                p.factor_bytes if p.factors is not None else p.held_bytes for p in solved
            ),
            solved=len(solved),
            streamed=sum(p.factors is None for p in solved),
            budget_bytes=budget,
        )

    @torch.no_grad()
    def apply(self, values: Mapping[str, float]) -> None:
        """Merge the trial ``values`` into the model's solved tensors, in place."""
        settings = self.space.settings(values)
        for name, solved in self.solved.items():
            block = settings[solved.block]
            factors = solved.factors_now(self.device)
            ridge = factors.ridge(block.lambdas[solved.group], solved.lambda_mode)
            weight = weight_from_factors(factors, solved.base, ridge, block.scale, solved.transposed)
            hint = f"lambda {lambda_text(block.lambdas[solved.group])}, scale {block.scale:g}"
            solved.target.copy_(checked_output(weight.to(solved.out_dtype), name, "bmm", hint))
            del weight, factors

    def state(self) -> dict[str, torch.Tensor]:
        """The solved tensors as they are now (for checks and tests)."""
        return {name: solved.target for name, solved in self.solved.items()}


class ResidentTrials:
    """Runs trials on a :class:`ResidentModel`: merge in place, then score the live model."""

    def __init__(self, resident: ResidentModel, evaluator: Any, fidelity: Any = None) -> None:
        self.resident = resident
        self.evaluator = evaluator
        self.fidelity = fidelity

    def run(self, trial: PlannedTrial) -> TrialOutcome:
        resident = self.resident

        def evaluate() -> Any:
            return evaluate_trial(
                self.evaluator, resident.model, resident.tokenizer, trial.incumbent, self.fidelity
            )

        return run_stages(
            f"trial {trial.index}",
            [("merge", lambda: resident.apply(trial.values)), ("evaluate", evaluate)],
        )

    def close(self) -> None:
        self.resident = None


# -- Where a search's trials run: in a resident model (the default when it can), or on disk.
@dataclass
class RunnerChoice:
    runner: TrialRunner
    mode: str  # "memory" | "disk"
    note: str = ""
    startup_seconds: float = 0.0
    memory_plan: dict[str, Any] | None = None


def memory_obstacle(experiment: Experiment, evaluator: Any, use_cache: bool) -> str | None:
    """Why trials cannot run in a resident model (None: they can)."""
    if getattr(evaluator, "loading", None) is None:
        return "the evaluator scores folders (python evaluator with `input: folder`)"
    if not use_cache:
        return "--no-cache: resident trials are built from bmm's factor cache"
    if any(dimension.kind == "epsilon" for dimension in experiment.space.dimensions):
        return "ε is searched, and it changes the Gram: each trial needs new factors"
    return None


def choose_runner(
    experiment: Experiment,
    evaluator: Any,
    work_dir: Path,
    merge_options: Any,
    echo: Callable[[str], None],
    mode: str,
    use_cache: bool,
    max_memory: int | None = None,
    fidelity: Any = None,
) -> RunnerChoice:
    """The runner for ``mode`` (``auto``, ``memory`` or ``disk``); ``fidelity`` is search.yml's
    ``fidelity:`` section (staged evaluation, :mod:`mergekit_bmm.search.fidelity`)."""
    disk = DiskTrials(evaluator, work_dir, merge_options, fidelity)
    if mode == "disk":
        return RunnerChoice(disk, "disk")
    obstacle = memory_obstacle(experiment, evaluator, use_cache)
    if obstacle is not None:
        if mode == "memory":
            raise ConfigError(f"trials: memory is not possible here: {obstacle}; use trials: disk")
        return RunnerChoice(disk, "disk", f"trials run on disk: {obstacle}")
    echo("loading the resident model and its factors (the first run of a search fills bmm's cache) ...")
    started = time.perf_counter()
    first = experiment.recipes.text(middle_of(experiment.space))
    try:
        resident = ResidentModel.load(
            first, experiment.base_model, experiment.space, evaluator.loading, merge_options, max_memory
        )
    except ResidentUnsupported as error:
        if mode == "memory":
            raise ConfigError(f"trials: memory is not possible here: {error}; use trials: disk") from None
        return RunnerChoice(disk, "disk", f"trials run on disk: {error}")
    seconds = time.perf_counter() - started
    plan = resident.plan
    echo(plan.describe() + f"\n  ready in {seconds:.1f} s")
    return RunnerChoice(ResidentTrials(resident, evaluator, fidelity), "memory", "", seconds, vars(plan))
