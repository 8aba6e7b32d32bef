"""Collection passes under a memory budget: which layers each pass over the data accumulates.

Every distinct module input needs an accumulator for the whole pass: a float64 ``d × d``
sum, or the float32 activation rows when there are fewer tokens than inputs. When they do
not all fit the budget, consecutive layers are grouped so that each group's accumulators
fit, and the calibration data runs once per group; a pass stops its forward after its last
layer, so ``P`` passes cost about ``(P + 1) / 2`` full forwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mergekit_bmm.devices import available_bytes
from mergekit_bmm.errors import ConfigError
from mergekit_bmm.stats.gram_storage import tokens_are_smaller

# What the default budget leaves of the memory that is free once the expert is loaded:
# the forward's activations, the tokenised data and one Gram being written need the rest.
DEFAULT_SHARE = 0.6


def describe_size(size: int) -> str:
    if size >= 10**8:
        return f"{size / 1e9:.2f} GB"
    return f"{size / 1e6:.1f} MB" if size >= 10**5 else f"{size} bytes"


def default_budget(device: torch.device) -> int:
    """The budget when ``--max-memory`` is not given: a share of what is free now."""
    return int(DEFAULT_SHARE * available_bytes(device))


def accumulator_bytes(d_in: int, tokens: int) -> int:
    """What one distinct input's accumulator takes for a pass over ``tokens`` tokens."""
    return tokens * d_in * 4 if tokens_are_smaller(tokens, d_in) else d_in * d_in * 8


@dataclass(frozen=True)
class Pass:
    """One pass over the data: layers ``first``..``last`` and what their accumulators take."""

    first: int
    last: int
    bytes: int


def plan_passes(layer_bytes: Mapping[int, int], budget: int) -> list[Pass]:
    """Consecutive layers grouped greedily so that each group's accumulators fit ``budget``."""
    passes: list[Pass] = []
    first = last = None
    total = 0
    for layer in sorted(layer_bytes):
        size = layer_bytes[layer]
        if size > budget:
            raise ConfigError(
                f"--max-memory {describe_size(budget)} is less than layer {layer}'s accumulators alone "
                f"({describe_size(size)}); raise --max-memory to at least {describe_size(size)}"
            )
        if first is not None and total + size > budget:
            passes.append(Pass(first, last, total))
            first, total = None, 0
        first = layer if first is None else first
        last, total = layer, total + size
    if first is not None:
        passes.append(Pass(first, last, total))
    return passes
