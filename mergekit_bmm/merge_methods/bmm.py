"""``merge_method: bmm`` — the mergekit adapter over :mod:`mergekit_bmm.core.closed_form`.

Per output tensor: 2D weights of the transformer body's linear modules get the
anchor-regularised closed form ``W = W_pre + s·U``; a mixture-of-experts stack (E, out, in)
gets it once per expert, each slice its own weight with its own Grams and anchor slice;
every other tensor (embeddings, ``lm_head``, norms, biases, routers, names the module map
does not know) gets the anchor's result unchanged, and is counted for the end-of-merge
summary (:mod:`~mergekit_bmm.merge_methods.kept_at_anchor`). Inputs arrive one tensor at a
time through mergekit's lazy loader, so memory stays at one module's tensors (T experts +
base + anchor).

With ``cache: DIR`` the λ-independent eigen factors of each solved tensor are stored
once (:mod:`~mergekit_bmm.merge_methods.factor_cache.store`, built by
:mod:`~mergekit_bmm.merge_methods.factor_cache.fill`, keyed by
:mod:`~mergekit_bmm.merge_methods.factor_cache.key`) and every later merge with any λ and s is a
single product per tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from mergekit.merge_methods.base import (
    BasePolicy,
    GroupMergeMethod,
    InputContract,
    MergeMethodSpec,
    OptionalTensorPolicy,
    TensorEntry,
    TensorGroup,
)

from mergekit_bmm.core import closed_form, normal_equations
from mergekit_bmm.core.low_rank import LowRankUpdate, low_rank_factors
from mergekit_bmm.core.low_rank_data import FactoredEquations
from mergekit_bmm.core.module_map import ModuleInfo, classify
from mergekit_bmm.errors import TensorInputError
from mergekit_bmm.io.model_folder import model_config_of, model_type_of
from mergekit_bmm.merge_methods import chosen_lambdas, kept_at_anchor, merge_findings
from mergekit_bmm.merge_methods import observer as solved_tensors
from mergekit_bmm.merge_methods.anchor_result import anchor_result
from mergekit_bmm.merge_methods.bmm_anchor import (
    AnchorSource,
    PieceAnchor,
    StackAnchor,
    resolve_anchor_method,
    split_entries,
)
from mergekit_bmm.merge_methods.bmm_equations import normal_equations_for
from mergekit_bmm.merge_methods.bmm_parameters import BMMSettings, build_spec
from mergekit_bmm.merge_methods.factor_cache import key as cache_key
from mergekit_bmm.merge_methods.factor_cache.fill import fill_exact_factors, fill_factors, thin_rank
from mergekit_bmm.merge_methods.factor_cache.store import FactorCache
from mergekit_bmm.merge_methods.finite import check_finite, checked_base, checked_output
from mergekit_bmm.merge_methods.lora_data_route import cached_row_factors, factored_equations, solve_factored
from mergekit_bmm.merge_methods.lora_route import lora_updates, sibling_updates, span_anchor, touched
from mergekit_bmm.merge_methods.observer import FactoredTensor, SolvedTensor
from mergekit_bmm.merge_methods.pieces import (
    Piece,
    Rows,
    assemble,
    fused_parts,
    no_routed_token,
    piece_group,
    pieces_of,
)
from mergekit_bmm.merge_methods.shared_factor import shared_factor, shared_input_key
from mergekit_bmm.merge_methods.shared_inputs import sibling_names, sibling_rows

LOG = logging.getLogger("mergekit_bmm")

PRETTY_NAME = "Bayesian Model Merging (BMM)"
REFERENCE_URL = "https://arxiv.org/abs/2605.12843"


def stored_in_out(weight_layout: str, info: ModuleInfo, name: str, model: Any) -> bool:
    """Whether ``name`` is stored (in, out): the recipe's ``weight_layout``, else the checkpoint's
    architecture; refused in one line when neither says (a guess could solve it transposed)."""
    if weight_layout != "auto":
        return weight_layout == "in_out"
    if info.stored_in_out is None:
        raise TensorInputError(
            f"bmm: cannot tell whether {name} is stored (out, in) or (in, out): the architecture of "
            f"{model} is unknown (its config.json could not be read, locally or from the Hub cache); "
            "make it readable, or set `weight_layout: out_in` (nn.Linear) or `in_out` (GPT-2's Conv1D) "
            "under the recipe's parameters"
        )
    return info.stored_in_out


class BMMMerge(GroupMergeMethod):
    """The registered ``bmm`` method."""

    _contract = InputContract(base=BasePolicy.REQUIRED, min_non_base=1)

    def __init__(self) -> None:
        self._spec_cache: tuple[tuple[int, ...], MergeMethodSpec] | None = None

    @property
    def spec(self) -> MergeMethodSpec:
        # Rebuilt when methods are (un)registered: anchors' parameters are forwarded.
        from mergekit.merge_methods import registered_methods

        others = tuple(method for method in registered_methods() if method is not self)
        key = tuple(id(method) for method in others)
        if self._spec_cache is None or self._spec_cache[0] != key:
            spec = build_spec(
                others,
                PRETTY_NAME,
                REFERENCE_URL,
                self._contract,
                OptionalTensorPolicy.PASSTHROUGH_BASE_SINGLETON,
            )
            self._spec_cache = (key, spec)
        return self._spec_cache[1]

    def merge_group(self, group: TensorGroup, /, **parameters: Any) -> torch.Tensor:
        settings = BMMSettings.from_parameters(parameters)
        merged = self._merge_group(group, settings, parameters)
        hint = (
            f"lambda {settings.lambda_text}, scale {settings.scale:g}, "
            f"anchor {settings.anchor_method or 'default'}"
            "; the values overflow the output dtype: use a smaller scale, or check the inputs"
        )
        return checked_output(merged, group.metadata.name or "", "bmm", hint)

    def _merge_group(
        self, group: TensorGroup, settings: BMMSettings, parameters: dict[str, Any]
    ) -> torch.Tensor:
        tasks, anchor_entry = split_entries(group, parameters.get("anchor"))
        method_name = resolve_anchor_method(settings.anchor_method, anchor_entry)
        base = group.base.tensor
        name = group.metadata.name or ""
        info = classify(name, model_type_of(group.base.id), base.ndim)
        cache = FactorCache(settings.cache) if settings.cache else None
        source = AnchorSource(
            group, tuple(tasks), anchor_entry, method_name, parameters, settings.anchor_seed
        )
        if info is None or not tasks:
            kind = "no_experts" if info is not None else kept_at_anchor.kind_of(name, base.ndim)
            kept_at_anchor.note(name, kind)
            return anchor_result(settings, source, cache).to(base.dtype)
        if not info.experts and no_routed_token(settings, name, tasks):
            kept_at_anchor.note(name, "no_routed_tokens")  # a checkpoint's per-expert weight
            return anchor_result(settings, source, cache).to(base.dtype)
        transpose = stored_in_out(settings.weight_layout, info, name, group.base.id)
        # each expert of a stack, and each logical weight of a fused one (its own data-free Gram, as
        # if stored split), solved as a weight of its own
        parts = self.fused_parts(settings, name, base, info.experts, transpose, group.base.id)
        if info.experts or parts:
            pieces = pieces_of(tuple(base.shape), parts, info.experts, transpose)
            return self._merge_pieces(group, source, settings, transpose, cache, pieces)
        equations, siblings = normal_equations_for, ()
        if settings.gram_sharing == "input" and settings.gram != "activations":  # one Gram per input
            siblings = sibling_names(name, info, group.base.id, model_type_of(group.base.id))
            equations = partial(normal_equations_for, siblings=siblings, transpose=transpose)
        solve = _Solve(name, group, tuple(tasks), source, settings, transpose, equations, siblings=siblings)
        return solve.direct() if cache is None else solve.cached(cache)

    def _merge_pieces(
        self,
        group: TensorGroup,
        source: AnchorSource,
        settings: BMMSettings,
        transpose: bool,
        cache: FactorCache | None,
        pieces: Sequence[Piece],
    ) -> torch.Tensor:
        """Each piece (an expert of an (E, out, in) stack, a part of a fused weight) solved as its own
        weight; the anchor is computed once for the whole tensor (only if a piece needs it) and cut.
        Data-assisted modes read an expert's Grams of its routed tokens; an expert no task's token
        reached keeps the anchor."""
        whole = StackAnchor(lambda: anchor_result(settings, source, cache))
        task_ids = {task.id for task in source.tasks}
        solved = []
        for piece in pieces:
            part = piece_group(group, piece)
            tasks = tuple(entry for entry in part.entries if entry.id in task_ids)
            anchor = PieceAnchor(source, part, tasks, piece, whole)
            name = part.metadata.name
            if piece.index is not None and no_routed_token(settings, name, tasks):  # an expert
                kept_at_anchor.note(name, "no_routed_tokens")
                solved.append((piece, anchor.weight(settings.compute_dtype).to(group.base.tensor.dtype)))
                continue
            solve = _Solve(name, part, tasks, anchor, settings, transpose, normal_equations_for, piece)
            solved.append((piece, solve.direct() if cache is None else solve.cached(cache)))
        return assemble(solved)

    @staticmethod
    def fused_parts(
        settings: BMMSettings, name: str, base: torch.Tensor, experts: bool, transpose: bool, model: Any
    ) -> list[tuple[str, Rows]] | None:
        """The logical weights of a fused weight, where the rule gives each its own Gram: data-free
        Grams per weight (``gram_sharing: weight``). With one input Gram (``activations``, or
        ``gram_sharing: input``) the joint solve already equals the part-by-part one."""
        if settings.gram == "activations" or settings.gram_sharing != "weight":
            return None
        matrix = base[0] if experts else base
        rows = matrix.shape[1] if transpose else matrix.shape[0]
        return fused_parts(name, model_config_of(model), rows)


@dataclass(frozen=True)
class _Solve:
    """One weight's closed form, solved directly or through the factor cache.

    Both routes end in :meth:`_output`, the one place that tells a listening sampler
    (:mod:`~mergekit_bmm.merge_methods.observer`) what was solved; the cached route also
    hands its factors to a listening search.
    """

    name: str
    group: TensorGroup
    tasks: tuple[TensorEntry, ...]
    source: AnchorSource
    settings: BMMSettings
    transpose: bool
    equations_for: Callable[..., normal_equations.NormalEquations]
    piece: Piece | None = None  # an expert of a stack, or a part of a fused weight
    siblings: tuple[str, ...] = ()  # gram_sharing: input: the other weights that read this one's input

    def orient(self, matrix: torch.Tensor) -> torch.Tensor:
        return matrix.T if self.transpose else matrix

    @property
    def base(self) -> torch.Tensor:
        return self.group.base.tensor

    def _problem(self) -> tuple[normal_equations.NormalEquations, torch.Tensor, torch.Tensor]:
        """``G``, ``C`` and the prior ``U0`` from the inputs (checked for NaN/Inf), and ``W_pre``."""
        check_finite(self.group)
        dtype = self.settings.compute_dtype
        base_c = self.base.to(dtype)
        prior = self._prior()
        data_route = self.low_rank_data()  # LoRA experts, data-assisted: C from the factors
        if data_route is not None and data_route[1] is not None:
            merge_findings.note_low_rank(self.name, sum(update.rank for update in data_route[0]))
            return data_route[1].dense(), prior, base_c
        task_vectors = [self.orient(entry.tensor.to(dtype) - base_c) for entry in self.tasks]
        return self.equations_for(self.settings, self.group, self.tasks, task_vectors), prior, base_c

    def _prior(self) -> torch.Tensor:
        """``U0 = W_anchor − W_pre`` in the compute dtype, oriented like the solve."""
        dtype = self.settings.compute_dtype
        return self.orient(self.source.weight(dtype) - self.base.to(dtype))

    def low_rank_updates(self) -> list[LowRankUpdate] | None:
        """The experts' LoRA factors for this weight, or None for the full route (:mod:`.lora_route`)."""
        return lora_updates(self.settings, self.group, self.tasks, self.name, self.transpose, self.piece)

    def data_route_updates(self) -> list[LowRankUpdate] | None:
        args = (self.settings, self.group, self.tasks, self.name, self.transpose, self.piece)
        return lora_updates(*args, data_assisted=True)

    def low_rank_data(self) -> tuple[list[LowRankUpdate], FactoredEquations | None] | None:
        """The data-assisted route over LoRA experts (:mod:`.lora_data_route`): the factors and the
        factored equations (None when no adapter touches the weight), or None for the full route."""
        updates = self.data_route_updates()
        if not updates:
            return None if updates is None else ([], None)
        d_in = self.orient(self.base).shape[1]
        pooled = self.siblings and self.settings.gram == "mix"  # their rows join each data-free G_t
        siblings = sibling_updates(self.group, self.tasks, self.siblings) if pooled else ()
        return updates, factored_equations(
            self.settings, self.name, self.tasks, updates, d_in, self.base.device, siblings
        )

    def _direct_low_rank_data(
        self, updates: list[LowRankUpdate], equations: FactoredEquations
    ) -> torch.Tensor:
        dtype = self.settings.compute_dtype
        base_c = self.base.to(dtype)
        span = span_anchor(self.source, tuple(self.orient(self.base).shape))
        prior = self._prior
        merge_findings.note_low_rank(self.name, sum(update.rank for update in updates))
        shared = shared_input_key(self.settings, self.name, self.tasks)  # q/k/v: one factorisation
        merged, ridge = solve_factored(equations, updates, span, prior, self.settings, shared)
        return self._output(merged.to(dtype), base_c, lambda: ridge, dtype, gram=equations.gram)

    def _low_rank_factors(self, updates: list[LowRankUpdate]) -> closed_form.EigenFactors:
        """The exact (float64) eigen factors from the adapters' factors; the prior from the anchor.
        Inputs checked for NaN/Inf: the base and any dense input (the factors were checked when read)."""
        dense = tuple(e for e in self.group.entries if getattr(e.id, "lora", None) is None)
        check_finite(TensorGroup(dense, self.group.metadata))
        prior = span_anchor(self.source, tuple(self.orient(self.base).shape))
        if prior is None:
            dtype = self.settings.compute_dtype  # the anchor as the full route computes it
            prior = self.orient(self.source.weight(dtype) - self.base.to(dtype))
        if not self.siblings:
            return low_rank_factors(updates, prior, experts=len(self.tasks))
        shared = sibling_updates(self.group, self.tasks, self.siblings)  # their rows join each G_t
        rows = self.orient(self.base).shape[0] + sibling_rows(self.group.base.id, self.siblings)
        return low_rank_factors(updates, prior, experts=len(self.tasks), siblings=shared, rows=rows)

    def keeps_anchor(self, updates: list[LowRankUpdate] | None) -> bool:
        """No adapter touches this weight and the anchor is its value: it reads its input alone, no
        adapter touches the weights it pools with, or the anchor sums the adapters (all zero here); a
        dense anchor is solved against a pool that adapters moved."""
        if updates != []:
            return False
        if not self.siblings or span_anchor(self.source, tuple(self.base.shape)) is not None:
            return True
        return not touched(self.group, self.tasks, self.siblings)

    def untouched(self) -> torch.Tensor:
        """No expert's adapter touches this weight: the anchor's value, counted as kept (the base
        itself when the anchor sums the adapters' updates, all zero here)."""
        kept_at_anchor.note(self.name, "no_experts")
        if span_anchor(self.source, tuple(self.base.shape)) is not None:  # adapters known to skip it
            return checked_base(self.group)
        check_finite(self.group)
        return self.source.weight(self.settings.compute_dtype).to(self.base.dtype)

    def direct(self) -> torch.Tensor:
        settings = self.settings
        updates = self.low_rank_updates()
        if self.keeps_anchor(updates):
            return self.untouched()
        if updates is not None:
            factors = self._low_rank_factors(updates)  # k-sized parts in float64
            merge_findings.note_low_rank(self.name, factors.rank)
            ridge = self._chosen_ridge(factors)
            solved = factors.to(settings.compute_dtype)  # the product W_pre + s·U in the compute dtype
            if not solved_tensors.active():
                return closed_form.weight_from_factors(solved, self.base, ridge, settings.scale)
            merged = closed_form.solve_from_factors(solved, ridge)
            eigen = solved.complete_eigen(merged.dtype)
            base_c = self.base.to(settings.compute_dtype)
            return self._output(merged, base_c, lambda: ridge, settings.compute_dtype, eigen=eigen)
        data_route = self.low_rank_data()
        if data_route is not None:
            updates, factored = data_route
            return self.untouched() if factored is None else self._direct_low_rank_data(updates, factored)
        equations, prior, base_c = self._problem()
        if settings.lambda_auto:
            return self._direct_auto(equations, prior, base_c)
        merged = self._shared_solve(equations, prior)
        ridge = lambda: closed_form.effective_ridge(settings.lam, equations, settings.lambda_mode)  # noqa: E731
        return self._output(merged, base_c, ridge, settings.compute_dtype, gram=equations.gram)

    def _shared_solve(self, equations: normal_equations.NormalEquations, prior: torch.Tensor) -> torch.Tensor:
        """The closed form; q/k/v (gate/up) with one ``G`` share one factorisation (keyed by ``G`` too)."""
        settings, key = self.settings, shared_input_key(self.settings, self.name, self.tasks)
        if key is None and self.siblings:  # one Gram pooled by gram_sharing: input (its tasks: in G)
            key = (str(self.group.base.id), *sorted((*self.siblings, self.name)))
        ridge = closed_form.effective_ridge(settings.lam, equations, settings.lambda_mode)
        factor = shared_factor(key, equations.gram, ridge) if key is not None else None
        return factor.solve(equations.cross, prior) if factor else closed_form.solve(equations, prior, ridge)

    def _direct_auto(
        self, equations: normal_equations.NormalEquations, prior: torch.Tensor, base_c: torch.Tensor
    ) -> torch.Tensor:
        """``lambda: auto`` without a cache: ``G`` diagonalised in float64 (the evidence needs its
        eigenvalues), the evidence's λ', and the solve from those factors."""
        rank = thin_rank(self.settings, len(self.tasks), *prior.shape)
        factors = closed_form.eigen_factors(equations, prior, torch.float64, rank)
        ridge = self._chosen_ridge(factors)
        merged = closed_form.solve_from_factors(factors, ridge).to(self.settings.compute_dtype)
        eigen = factors.complete_eigen(merged.dtype) if solved_tensors.active() else None
        return self._output(merged, base_c, lambda: ridge, self.settings.compute_dtype, eigen=eigen)

    def _chosen_ridge(self, factors: closed_form.EigenFactors) -> float:
        """λ' for this weight: the recipe's λ, or the evidence's choice (recorded) for ``auto``."""
        if not self.settings.lambda_auto:
            return factors.ridge(self.settings.lam, self.settings.lambda_mode)
        choice = factors.evidence_choice()
        chosen_lambdas.note(self.name, choice)
        return choice.ridge

    def cached(self, cache: FactorCache) -> torch.Tensor:
        settings, dtype = self.settings, self.settings.compute_dtype
        if settings.low_rank_rows == "adapters" and self.data_route_updates() is not None:
            return self.direct()  # a k × k solve: cheaper than reading any cache entry
        key = cache_key.factor_key(settings, self.source, self.transpose)
        shape = tuple(self.orient(self.base).shape)
        updates = self.low_rank_updates()
        if self.keeps_anchor(updates):
            return self.untouched()
        if updates is not None:
            key = cache_key.with_route(key, "low_rank/3")  # 3: a Task Arithmetic anchor from the factors
        # an anchor the merge recomputes cheaply is not stored (the base, a marked input, Task Arithmetic)
        recomputed = self._prior if updates is None and self.source.recomputed_cheaply else None
        factors = cached_row_factors(cache, key, self) if updates is None else None  # k rows, data route
        factors = factors or cache.load_factors(self.name, key, shape, dtype, recomputed)
        if factors is not None and settings.lambda_auto and factors.evidence is None:
            factors = None  # an entry from before the evidence was stored: filled again
        if factors is None and updates is not None:
            exact = self._low_rank_factors(updates)
            factors = fill_exact_factors(cache, self.name, key, exact, self.orient(self.base), settings)
        if updates is not None and factors is not None:
            merge_findings.note_low_rank(self.name, factors.rank)  # Σ r_t, or the pooled input's
        if factors is None:
            # Factorised once in float64: the cached route is then at least as accurate as
            # the direct one (see closed_form.eigen_factors); trials solve in `dtype`.
            equations, prior, base_c = self._problem()
            rank = thin_rank(settings, len(self.tasks), *prior.shape)
            factors = fill_factors(
                cache, self.name, key, equations, prior, self.orient(base_c), settings, rank, bool(recomputed)
            )
            del equations, prior
        # A cache hit does not re-check the inputs for NaN/Inf: they were checked when the
        # entry was built, and its key ties it to that content.
        factors = factors.to(self.base.device)
        if solved_tensors.wants_factors():  # the search's resident trials are listening
            reload = partial(cached_row_factors, cache, key, self, False)  # the LoRA data route's k rows
            if factors.rows is None:  # an anchor the merge recomputed is held, not recomputed
                held = (lambda anchor=factors.anchor: anchor) if factors.anchor_recomputed else None
                reload = partial(cache.load_factors, self.name, key, shape, dtype, held)
            found = (self.name, factors, self.base, self.transpose, settings.lambda_mode, reload, self.piece)
            solved_tensors.report_factors(FactoredTensor(*found))
        ridge = self._chosen_ridge(factors)
        if not solved_tensors.active():
            return closed_form.weight_from_factors(factors, self.base, ridge, settings.scale, self.transpose)
        # The sampler gets G's eigen factors instead of G: no second eigendecomposition.
        merged = closed_form.solve_from_factors(factors, ridge)
        eigen = factors.complete_eigen(merged.dtype)
        return self._output(merged, self.base.to(merged.dtype), lambda: ridge, merged.dtype, eigen=eigen)

    def _output(
        self,
        merged: torch.Tensor,
        base_c: torch.Tensor,
        ridge: Callable[[], float],
        compute_dtype: torch.dtype,
        gram: torch.Tensor | None = None,
        eigen: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``W_pre + s·U`` in the base's dtype; a listening sampler is told the solve."""
        if solved_tensors.active():  # mergekit-bmm-sample is listening
            solved_tensors.report(
                SolvedTensor(
                    self.name,
                    gram,
                    ridge(),
                    merged,
                    base_c,
                    self.settings.scale,
                    self.transpose,
                    self.base.dtype,
                    compute_dtype,
                    eigen=eigen,
                    piece=self.piece,
                )  # fmt: skip
            )
        return (base_c + self.settings.scale * self.orient(merged)).to(self.base.dtype)
