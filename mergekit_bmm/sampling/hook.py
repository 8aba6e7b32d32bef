"""A listener the ``bmm`` kernel tells about every tensor it solves, while one is active.

Sampling must see exactly the λ', s, Gram and layout that mergekit resolved for each
tensor (slices, filters, per-block values). Rather than re-deriving them, the sampler
runs mergekit's own merge and listens: the kernel reports each solved tensor here, and
does nothing extra when no listener is active.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


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

    def weight(self, task_vector: torch.Tensor) -> torch.Tensor:
        """``W_pre + s·U`` in storage layout and dtype: the kernel's own output formula."""
        oriented = task_vector.T if self.transposed else task_vector
        return (self.base + self.scale * oriented).to(self.storage_dtype)


Listener = Callable[[SolvedTensor], None]

_listener: Listener | None = None
_lock = threading.Lock()


def active() -> bool:
    return _listener is not None


def report(solved: SolvedTensor) -> None:
    listener = _listener
    if listener is not None:
        listener(solved)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Make ``listener`` receive every solved tensor for the duration (one at a time)."""
    global _listener
    with _lock:
        if _listener is not None:
            raise RuntimeError("another sampler is already listening to the bmm kernel in this process")
        _listener = listener
    try:
        yield
    finally:
        _listener = None
