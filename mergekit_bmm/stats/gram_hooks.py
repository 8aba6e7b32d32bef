"""Streaming activation Grams of a model's body linear modules, via forward pre-hooks.

Which modules: every ``nn.Linear`` or GPT-2 ``Conv1D`` whose ``<name>.weight`` the
module map classifies (:func:`mergekit_bmm.core.module_map.classify`, the one source of
truth); the Gram is over the module's *input*, so it is ``in × in`` whatever the
storage layout. Each forward adds ``Σ x xᵀ`` over the non-padding tokens (attention
mask) in float64, ``rows`` at a time, so activations are never held beyond the batch
being processed.

Modules that read the same input tensor (q/k/v; gate/up) share one Gram: a module whose
input *is* (the same tensor object as) the input of the module called just before it
is recorded as sharing that module's Gram and adds nothing itself. The previous input
is held by reference, so an address cannot be reused by another tensor and mistaken
for a shared input; sharing that is not consecutive is simply not deduplicated.

A collector may cover only some layers (one pass of a collection under a memory budget):
modules of other layers add nothing, and the first module of a layer past its range ends
the forward early (:class:`PassComplete`), since nothing after it is needed. Keys listed
in ``keep_rows`` keep their activation rows instead of a ``d_in × d_in`` sum (smaller when
the calibration data has fewer tokens than the module has inputs).

Mixture-of-experts stacks get one Gram per expert, over the tokens the router sends to it
(:mod:`mergekit_bmm.stats.expert_hooks`); their keys are ``<stack>[e]`` and :meth:`routed`
counts every expert's tokens, zero included.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from mergekit_bmm.core.finite import all_finite
from mergekit_bmm.core.module_map import classify
from mergekit_bmm.errors import StatisticsError
from mergekit_bmm.stats import gram_storage
from mergekit_bmm.stats.expert_hooks import (
    ExpertStack,
    expert_stacks,
    routed_rows,
    routing_arguments,
    slice_key,
)
from mergekit_bmm.stats.gram_storage import StoredGram, tokens_are_smaller

ROWS_PER_UPDATE = 4096


class PassComplete(Exception):
    """Raised inside a forward once every layer of the collector's range has been seen."""


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return Conv1D


def body_linear_modules(model: nn.Module, model_type: str | None) -> dict[str, tuple[nn.Module, int]]:
    """``{weight name: (module, d_in)}`` for the 2D body modules BMM solves."""
    conv1d = _conv1d_type()
    found: dict[str, tuple[nn.Module, int]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            continue
        if isinstance(module, nn.Linear):
            d_in = weight.shape[1]
        elif conv1d is not None and isinstance(module, conv1d):
            d_in = weight.shape[0]  # Conv1D stores (in, out)
        else:
            continue
        weight_name = f"{name}.weight"
        if classify(weight_name, model_type) is not None:
            found[weight_name] = (module, d_in)
    return found


class GramCollector:
    """Accumulates ``Σ x xᵀ`` per distinct module input while registered on a model.

    Use as a context manager around the forward passes, and call :meth:`batch` with
    each batch's attention mask around its forward.
    """

    def __init__(
        self,
        model: nn.Module,
        model_type: str | None,
        dtype: torch.dtype = torch.float64,
        layers: tuple[int, int] | None = None,
        keep_rows: frozenset[str] = frozenset(),
        stop_early: bool = False,
        accumulate: bool = True,
    ):
        """``layers`` = (first, last) limits what is collected; ``stop_early`` ends each forward after
        ``last``; ``accumulate=False`` only learns which modules share an input (a probe)."""
        self.targets = body_linear_modules(model, model_type)
        if not self.targets:
            raise StatisticsError(
                f"found no linear body modules in this {model_type or 'unknown'} model that the module "
                "map knows; statistics cannot be collected for it"
            )
        self.layer_of = {name: classify(name, model_type).layer for name in self.targets}
        self.stacks = expert_stacks(model, model_type)
        self.dtype = dtype
        self.layers = layers
        self.keep_rows = keep_rows
        self.stop_early = stop_early and layers is not None
        self.accumulate = accumulate
        self.sums: dict[str, torch.Tensor] = {}
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.counts: dict[str, int] = {}
        self.shared: dict[str, str] = {}
        self._mask: torch.Tensor | None = None
        self._previous: tuple[torch.Tensor, str] | None = None
        self._handles: list = []

    def __enter__(self) -> GramCollector:
        for weight_name, (module, d_in) in self.targets.items():
            if self.layers is not None and not self.stop_early and not self._in_range(weight_name):
                continue
            handle = module.register_forward_pre_hook(self._hook(weight_name, d_in), with_kwargs=True)
            self._handles.append(handle)
        for stack in self.stacks.values():
            if self.layers is None or self._layer_in_range(stack.layer):
                handle = stack.module.register_forward_pre_hook(self._stack_hook(stack), with_kwargs=True)
                self._handles.append(handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._previous = None

    @contextmanager
    def batch(self, attention_mask: torch.Tensor) -> Iterator[None]:
        """Count the tokens where ``attention_mask`` is set during one forward."""
        self._mask = attention_mask.bool()
        try:
            yield
        finally:
            self._mask = None
            self._previous = None

    def _in_range(self, weight_name: str) -> bool:
        return self._layer_in_range(self.layer_of[weight_name])

    def _layer_in_range(self, layer: int) -> bool:
        first, last = self.layers
        return first <= layer <= last

    def _stack_hook(self, stack: ExpertStack):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            for key in stack.keys():
                self.shared.setdefault(key, key)
            for alias, key in stack.aliases.items():  # the per-expert weights of the checkpoint
                self.shared.setdefault(alias, key)
            if not self.accumulate:
                return
            if self._mask is None:
                raise StatisticsError("GramCollector: run forwards inside collector.batch(attention_mask)")
            hidden, top_k_index = routing_arguments(args, kwargs)
            routed = routed_rows(hidden.detach(), top_k_index, self._mask, stack.experts)
            for expert, rows in enumerate(routed):
                if rows.shape[0]:
                    self.add_rows(slice_key(stack.first, expert), rows, stack.d_hidden)
                    self.add_rows(slice_key(stack.down, expert), stack.inner(rows, expert), stack.d_inner)

        return hook

    def _hook(self, weight_name: str, d_in: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.layers is not None and not self._in_range(weight_name):
                if self.stop_early and self.layer_of[weight_name] > self.layers[1]:
                    raise PassComplete
                return
            inputs = args[0] if args else next(iter(kwargs.values()))
            previous = self._previous
            key = previous[1] if previous is not None and previous[0] is inputs else weight_name
            known = self.shared.setdefault(weight_name, key)
            if known != key:
                raise StatisticsError(
                    f"{weight_name} shared its input with {known} in one batch and with {key} in another; "
                    "this model's modules cannot be collected with shared Grams"
                )
            if key == weight_name:
                self._previous = (inputs, weight_name)
                if self.accumulate:
                    self._accumulate(weight_name, inputs, d_in)

        return hook

    def _token_rows(self, weight_name: str, inputs: torch.Tensor) -> torch.Tensor:
        mask = self._mask
        if mask is None:
            raise StatisticsError("GramCollector: run forwards inside collector.batch(attention_mask)")
        if inputs.ndim == 3 and inputs.shape[:2] == mask.shape:
            return inputs[mask]
        if inputs.ndim == 2 and inputs.shape[0] == mask.numel():
            return inputs[mask.reshape(-1)]
        raise StatisticsError(
            f"{weight_name} received input of shape {tuple(inputs.shape)}, which does not line up with "
            f"the attention mask {tuple(mask.shape)}; padding tokens cannot be left out for this module"
        )

    def _accumulate(self, weight_name: str, inputs: torch.Tensor, d_in: int) -> None:
        if inputs.shape[-1] != d_in:
            raise StatisticsError(
                f"{weight_name} received inputs of size {inputs.shape[-1]} but its weight has {d_in} inputs"
            )
        self.add_rows(weight_name, self._token_rows(weight_name, inputs.detach()), d_in)

    def add_rows(self, weight_name: str, rows: torch.Tensor, d_in: int) -> None:
        """Add the token rows ``rows`` (n × d_in) that key ``weight_name`` read."""
        if weight_name in self.keep_rows:
            self.rows.setdefault(weight_name, []).append(rows.to(torch.float32, copy=True))
            self.counts[weight_name] = self.counts.get(weight_name, 0) + rows.shape[0]
            return
        total = self.sums.get(weight_name)
        if total is None:
            total = torch.zeros(d_in, d_in, dtype=self.dtype, device=rows.device)
            self.sums[weight_name] = total
            self.counts[weight_name] = 0
        for start in range(0, rows.shape[0], ROWS_PER_UPDATE):
            chunk = rows[start : start + ROWS_PER_UPDATE].to(self.dtype)
            total.addmm_(chunk.T, chunk)
        self.counts[weight_name] += rows.shape[0]

    def stored_grams(self) -> Iterator[tuple[str, StoredGram]]:
        """Each collected key with its mean Gram in stored form, freeing its accumulator as it goes
        (so writing a pass never holds a second copy of its accumulators)."""
        for key in sorted(set(self.sums) | set(self.rows)):
            count = self.counts[key]
            if count == 0:
                raise StatisticsError(f"{key} saw no tokens; the calibration data is empty after padding")
            if key in self.rows:
                rows = torch.cat(self.rows.pop(key))
                if tokens_are_smaller(count, rows.shape[1]):
                    stored = gram_storage.from_rows(rows)
                else:  # an expert that received more tokens than rows save room for
                    rows = rows.to(torch.float64)
                    stored = gram_storage.from_sum(rows.T @ rows, count)
                finite = all_finite(stored.tensor)
            else:
                stored = gram_storage.from_sum(self.sums.pop(key), count)
                finite = all_finite(stored.tensor)
            if not finite:
                raise StatisticsError(
                    f"the Gram of {key} contains NaN or Inf (activations overflowed); "
                    "collect with `dtype: float32` in stats.yml"
                )
            yield key, stored

    def modules(self) -> dict[str, str]:
        """Every weight name that saw input → the key of the Gram that serves it."""
        return dict(sorted(self.shared.items()))

    def routed(self) -> dict[str, int]:
        """Each expert slice this collector saw → the tokens routed to it (zero included)."""
        keys = {key for stack in self.stacks.values() for key in stack.keys()}
        return {key: self.counts.get(key, 0) for key in sorted(keys & set(self.shared))}

    def unseen(self) -> list[str]:
        """Target modules that no forward reached (they get no Gram)."""
        return sorted(set(self.targets) - set(self.shared))
