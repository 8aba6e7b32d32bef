"""Per-expert activation Grams of mixture-of-experts stacks, from the tokens the router sends.

transformers 5 holds a MoE layer's experts as one module (``mlp.experts``) with 3-D stacks
``gate_up_proj`` (E, 2I, H) — or ``up_proj`` where experts have no gate — and ``down_proj``
(E, H, I), and calls it as ``experts(hidden_states, top_k_index, top_k_weights)`` once the
router has chosen. A forward pre-hook on that module therefore sees the routing exactly as the
model does it (its top-k, its normalisation), whatever kernel then runs the experts. For each
expert e:

* ``gate_up_proj[e]`` reads the hidden states of the tokens routed to e;
* ``down_proj[e]`` reads ``act(gate)·up`` of those tokens, recomputed here from the expert's own
  weights with the module's own gating function (``_apply_gate``), in the forward's dtype.

Router weights do not enter the Grams: each routed, non-padding token counts once. A token's
router weight scales the expert's whole output after ``down_proj``, the same for every candidate
weight, and the gate/up projection is followed by a nonlinearity, so the weight-free second
moment is the one Gram both projections share a definition of — the dense rule ("the inputs the
module reads") restricted to the tokens it reads. The Grams are keyed ``<stack>[e]``, as the
merge names an expert's slice; every expert's routed-token count is kept (zero included).

Checkpoints on disk mostly keep one 2-D weight per expert (Mixtral's
``block_sparse_moe.experts.3.w1.weight``, Qwen-MoE's ``mlp.experts.3.gate_proj.weight``), which
transformers fuses into the stacks when it loads them. :func:`checkpoint_names` reads transformers'
own conversion mapping backwards, so the statistics also name each slice's Gram under the
per-expert weights it becomes (gate and up both read the hidden states: one Gram).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mergekit_bmm.core.module_map import classify
from mergekit_bmm.errors import StatisticsError

LOG = logging.getLogger("mergekit_bmm.stats")


def slice_key(stack: str, index: int) -> str:
    """The name of expert ``index`` of ``stack``, as the merge names the slice it solves."""
    return f"{stack}[{index}]"


@dataclass(frozen=True)
class ExpertStack:
    """One MoE experts module: its two stacks and how an expert's hidden layer is formed."""

    module_name: str
    module: nn.Module
    layer: int
    first: str  # the stack that reads the hidden states (gate_up_proj, or up_proj)
    down: str  # the stack that reads the expert's hidden layer
    experts: int
    d_hidden: int
    d_inner: int
    transposed: bool
    aliases: dict[str, str]  # per-expert checkpoint weight name -> slice key (checkpoint_names)

    def keys(self) -> list[str]:
        return [slice_key(stack, e) for stack in (self.first, self.down) for e in range(self.experts)]

    def d_in(self, stack: str) -> int:
        return self.d_hidden if stack == self.first else self.d_inner

    def inner(self, rows: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert ``expert``'s hidden layer for ``rows`` (what its ``down_proj`` reads)."""
        module = self.module
        projection = self.first.rsplit(".", 1)[1]
        out = _linear(rows, getattr(module, projection)[expert], self.transposed)
        bias = getattr(module, f"{projection}_bias", None) if getattr(module, "has_bias", False) else None
        if bias is not None:
            out = out + bias[expert]
        if projection == "up_proj":
            return module.act_fn(out)
        gate: Callable[[torch.Tensor], torch.Tensor] | None = getattr(module, "_apply_gate", None)
        if gate is not None:
            return gate(out)
        gate_part, up = out.chunk(2, dim=-1)
        return module.act_fn(gate_part) * up


def _linear(rows: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    return rows @ weight.to(rows.dtype) if transposed else rows @ weight.to(rows.dtype).T


def expert_stacks(model: nn.Module, model_type: str | None) -> dict[str, ExpertStack]:
    """``{module name: ExpertStack}`` for every experts module whose stacks the merge solves."""
    found = {}
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        down = params.get("down_proj")
        first = "gate_up_proj" if "gate_up_proj" in params else "up_proj" if "up_proj" in params else None
        if down is None or down.ndim != 3 or first is None or params[first].ndim != 3:
            continue
        info = classify(f"{name}.down_proj", model_type, 3)
        if info is None:
            continue
        if first == "up_proj" and "gate_proj" in params:
            LOG.warning("%s keeps gate and up as separate stacks; its experts get no per-expert Grams", name)
            continue
        if not hasattr(module, "act_fn"):
            LOG.warning("%s has no act_fn to form its experts' hidden layer; no per-expert Grams", name)
            continue
        transposed = bool(getattr(module, "is_transposed", False))
        experts, *shape = down.shape
        d_hidden, d_inner = (shape[1], shape[0]) if transposed else (shape[0], shape[1])
        stacks = (f"{name}.{first}", f"{name}.down_proj")
        aliases = {k: v for stack in stacks for k, v in checkpoint_names(stack, model_type, experts).items()}
        found[name] = ExpertStack(
            name, module, info.layer, *stacks, experts, d_hidden, d_inner, transposed, aliases
        )
    return found


def _conversions(model_type: str | None) -> tuple[list[tuple[str, str]], list[Any]]:
    """transformers' checkpoint conversion mapping for ``model_type``: plain renames (checkpoint
    substring, loaded substring) and the rules that stack per-expert weights (MergeModulelist)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        mapping = get_checkpoint_conversion_mapping(model_type) or [] if model_type else []
    except Exception:  # an older transformers without the mapping: stacked names only
        return [], []
    renames = [
        (source, target)
        for rule in mapping
        if not getattr(rule, "operations", None)
        for source, target in zip(rule.source_patterns, rule.target_patterns)
        if "*" not in source and "(" not in source
    ]
    stacking = [
        rule
        for rule in mapping
        if "MergeModulelist" in [type(op).__name__ for op in getattr(rule, "operations", None) or []]
    ]
    return renames, stacking


def stacked_names(names: Iterable[str], model_type: str | None) -> set[str]:
    """The stacks (``...experts.down_proj``) that a checkpoint's per-expert weights load into."""
    renames, stacking = _conversions(model_type)
    found = set()
    for name in names:
        for old, new in renames:
            name = name.replace(old, new, 1)
        for rule in stacking:
            for source in rule.source_patterns:
                match = re.search(re.escape(source).replace(r"\*", r"\d+") + "$", name)
                if match:
                    found.add(name[: match.start()] + rule.target_patterns[0])
    return found


def checkpoint_names(stack: str, model_type: str | None, experts: int) -> dict[str, str]:
    """Per-expert checkpoint weight name → the slice key of ``stack`` it is loaded into, from
    transformers' checkpoint conversion mapping for ``model_type`` (empty when it has none)."""
    renames, stacking = _conversions(model_type)
    names = {}
    for rule in stacking:
        targets = [target for target in rule.target_patterns if stack.endswith(target)]
        if not targets:
            continue
        prefix = stack[: -len(targets[0])]
        for source in rule.source_patterns:
            for expert in range(experts):
                name = prefix + source.replace("*", str(expert))
                for old, new in renames:  # loading renamed `old` to `new`: undo it
                    name = name.replace(new, old, 1)
                names[name] = slice_key(stack, expert)
    return names


def stack_accumulators(stack: ExpertStack, tokens: int, top_k: int) -> tuple[int, frozenset[str]]:
    """Bytes one pass's accumulators take for ``stack`` over ``tokens`` tokens routed to ``top_k``
    experts each, and the keys that keep token rows (all of a projection's, when the rows of every
    routed token take less room than E float64 sums)."""
    total, rows = 0, set()
    routed = tokens * min(top_k, stack.experts)
    for projection in (stack.first, stack.down):
        d_in = stack.d_in(projection)
        sums = stack.experts * d_in * d_in * 8
        kept = routed * d_in * 4
        if kept < sums:  # what a pass holds; each expert's Gram is stored in the smaller form after
            rows.update(slice_key(projection, e) for e in range(stack.experts))
            total += kept
        else:
            total += sums
    return total, frozenset(rows)


def routing_arguments(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states, top-k expert indices) from an experts module's call."""
    values = list(args) + [kwargs[k] for k in ("hidden_states", "top_k_index") if k in kwargs]
    if len(values) < 2 or not all(isinstance(v, torch.Tensor) for v in values[:2]):
        raise StatisticsError(
            "an experts module was called without (hidden_states, top_k_index); per-expert statistics "
            "need transformers' MoE calling convention"
        )
    return values[0], values[1]


def routed_rows(
    hidden: torch.Tensor, top_k_index: torch.Tensor, mask: torch.Tensor, experts: int
) -> list[torch.Tensor]:
    """For each expert, the hidden states of the non-padding tokens the router sent to it."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_mask = mask.reshape(-1)
    if hidden.shape[0] != flat_mask.numel() or top_k_index.numel() % max(hidden.shape[0], 1):
        raise StatisticsError(
            f"an experts module received {hidden.shape[0]} tokens but the batch has {flat_mask.numel()}; "
            "padding tokens cannot be left out of its statistics"
        )
    chosen = top_k_index.reshape(hidden.shape[0], -1)
    return [hidden[(chosen == e).any(dim=-1) & flat_mask] for e in range(experts)]
