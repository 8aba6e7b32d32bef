"""Every performance workload, by name: each module defines ``WORKLOAD`` (a ``harness.Workload``)."""

from __future__ import annotations

import importlib
import pkgutil

from bench.perf.harness import Workload


def names() -> list[str]:
    return sorted(module.name for module in pkgutil.iter_modules(__path__) if not module.name.startswith("_"))


def workload(name: str) -> Workload:
    """The workload ``name`` (its module imported now: listing the others imports nothing heavy)."""
    if name not in names():
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{name}").WORKLOAD
