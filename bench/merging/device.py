"""The device a benchmark run computes on, chosen once per run.

``device:`` in the run config (or ``--device``) says where experts are trained, models
scored, merges computed and searches run: ``cpu`` (the default), ``cuda``, or ``auto``
(the GPU when torch sees one). Every stage reads :func:`current`, so one switch moves the
whole run; the figures a run writes name the machine they came from.
"""

from __future__ import annotations

import os

from mergekit_bmm.devices import resolve_device

_current = "cpu"


def use(requested: str) -> str:
    """Make ``requested`` (resolved) the run's device; return it."""
    global _current
    _current = resolve_device(requested)
    if _current == "cuda":  # deterministic cuBLAS, as torch.use_deterministic_algorithms asks
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return _current


def current() -> str:
    """The run's device: ``cpu`` or ``cuda``."""
    return _current


def cache_key() -> dict[str, str]:
    """What a trained model's cache key adds for the device: nothing on the CPU (keys made
    before the device was a setting stay valid), ``{"device": "cuda"}`` on a GPU, whose
    kernels give other weights."""
    return {} if _current == "cpu" else {"device": _current}
