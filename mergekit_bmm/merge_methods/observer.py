"""A listener the ``bmm`` kernel tells about every tensor it solves, while one is active.

Sampling and the search's resident trials must see exactly the λ', s, Gram, factors and
layout that mergekit resolved for each tensor (slices, filters, per-block values). Rather
than re-deriving them, they run mergekit's own merge and listen: the kernel reports each
solved tensor here, and does nothing extra when no listener is active.

Two kinds of report: :class:`SolvedTensor` (the MAP solution with its Gram, for the
posterior sampler) and :class:`FactoredTensor` (the λ-independent factors of a cached
merge, for trials that re-merge in memory). A listener names the kinds it takes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mergekit_bmm.core.closed_form import EigenFactors
from mergekit_bmm.merge_methods.pieces import Piece


@dataclass(frozen=True)
class SolvedTensor:
    """One tensor as the kernel solved it; matrices in the solve's (out, in) orientation."""

    name: str
    gram: torch.Tensor | None  # G, or None when ``eigen`` = (Λ, Q) of G is given instead
    ridge: float
    merged: torch.Tensor
    base: torch.Tensor
    scale: float
    transposed: bool
    storage_dtype: torch.dtype
    compute_dtype: torch.dtype
    eigen: tuple[torch.Tensor, torch.Tensor] | None = None
    piece: Piece | None = None  # a piece of the stored tensor (named ``tensor[label]``): merge_methods.pieces

    def weight(self, task_vector: torch.Tensor) -> torch.Tensor:
        """``W_pre + s·U`` in storage layout and dtype: the kernel's own output formula."""
        oriented = task_vector.T if self.transposed else task_vector
        return (self.base + self.scale * oriented).to(self.storage_dtype)


@dataclass(frozen=True)
class FactoredTensor:
    """A solved tensor's cached factors: with them any λ and s is one product.

    ``base`` is ``W_pre`` as the kernel saw it (the recipe's dtype, storage layout);
    ``reload`` reads the factors back from the cache (for callers that cannot keep them).
    """

    name: str
    factors: EigenFactors
    base: torch.Tensor
    transposed: bool
    lambda_mode: str
    reload: Callable[[], EigenFactors | None]
    piece: Piece | None = None


@dataclass(frozen=True)
class Listener:
    """What to call for each kind of report (None: not interested)."""

    on_solved: Callable[[SolvedTensor], None] | None = None
    on_factored: Callable[[FactoredTensor], None] | None = None


_listener: Listener | None = None
_lock = threading.Lock()


def active() -> bool:
    """Whether anyone takes :class:`SolvedTensor` reports."""
    listener = _listener
    return listener is not None and listener.on_solved is not None


def wants_factors() -> bool:
    """Whether anyone takes :class:`FactoredTensor` reports."""
    listener = _listener
    return listener is not None and listener.on_factored is not None


def report(solved: SolvedTensor) -> None:
    listener = _listener
    if listener is not None and listener.on_solved is not None:
        listener.on_solved(solved)


def report_factors(factored: FactoredTensor) -> None:
    listener = _listener
    if listener is not None and listener.on_factored is not None:
        listener.on_factored(factored)


@contextmanager
def listening(
    on_solved: Callable[[SolvedTensor], None] | None = None,
    on_factored: Callable[[FactoredTensor], None] | None = None,
) -> Iterator[None]:
    """Receive the kernel's reports for the duration (one listener per process at a time)."""
    global _listener
    with _lock:
        if _listener is not None:
            raise RuntimeError("another listener is already attached to the bmm kernel in this process")
        _listener = Listener(on_solved, on_factored)
    try:
        yield
    finally:
        _listener = None
