"""Which device a command computes on: one rule for every entry point.

``cpu``, ``cuda`` (or ``cuda:N``) and ``auto`` (the GPU when torch sees one) mean the same
thing to ``mergekit-bmm-stats``, ``mergekit-bmm-search``, the evaluators and the benchmark,
and asking for CUDA on a machine without one is the same one line everywhere.
"""

from __future__ import annotations

import torch

from mergekit_bmm.errors import ConfigError


def resolve_device(requested: str | None, source: str = "--device") -> str:
    """``cpu`` or ``cuda[:N]`` for a requested ``cpu``/``cuda[:N]``/``auto`` (``None`` is ``auto``).

    ``source`` names where the request came from (an option, a config key) so the error says
    what to change.
    """
    if requested in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"{source} {requested}: torch sees no CUDA device on this machine (torch {torch.__version__}); "
            f"use {source} cpu, or install a CUDA build of torch"
        )
    try:
        torch.device(requested)
    except RuntimeError:
        raise ConfigError(f"{source} {requested!r} is not a device; use cpu, cuda or auto") from None
    return requested


def available_bytes(device: str | torch.device) -> int:
    """Free memory on ``device`` now: CUDA's free memory, or the system's available RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
