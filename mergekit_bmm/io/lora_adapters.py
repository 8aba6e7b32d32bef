"""A PEFT LoRA adapter's factors for one weight: ``U = (α/r)·B A`` read from ``adapter_model.safetensors``.

mergekit hands a merge method the adapter already merged into its base (dense), so the factors are
read here, from the adapter folder the recipe names (``BASE+ADAPTER``; a Hub adapter from the cache).
Only plain LoRA is read: an adapter with DoRA, ``fan_in_fan_out`` (GPT-2's Conv1D), biases,
``target_parameters``, activated LoRA or other layer types is not a ``B A`` update of an ``nn.Linear``
weight, and :func:`adapter_for` returns None for it (the merge then takes the full route).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from mergekit_bmm.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_FACTOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<side>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class Adapter:
    """One adapter folder: its settings and, per target module, the keys of its two factors."""

    folder: Path
    rank: int
    alpha: float
    rslora: bool
    rank_pattern: dict
    alpha_pattern: dict
    factors: dict  # module name -> {"A": key, "B": key}

    def scale(self, module: str) -> float:
        """``α/r`` for ``module`` (``α/√r`` with rsLoRA), per-module patterns included."""
        rank = _by_pattern(self.rank_pattern, module, self.rank)
        alpha = _by_pattern(self.alpha_pattern, module, self.alpha)
        return alpha / (math.sqrt(rank) if self.rslora else rank)

    def touches(self, weight_name: str) -> bool:
        """Whether the adapter trains the module of ``weight_name`` (norms, embeddings, biases: never)."""
        return weight_name.removesuffix(".weight") in self.factors

    def update(
        self, weight_name: str, dtype: torch.dtype = torch.float64
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(s·B, A)`` for the weight ``weight_name`` (``d_out × r``, ``r × d_in``); None when the
        adapter does not touch that module."""
        from safetensors import safe_open

        module = weight_name.removesuffix(".weight")
        keys = self.factors.get(module)
        if keys is None:
            return None
        with safe_open(str(self.folder / WEIGHTS_FILE), framework="pt") as handle:
            right = handle.get_tensor(keys["A"]).to(dtype)
            left = handle.get_tensor(keys["B"]).to(dtype)
        return left * self.scale(module), right


def _by_pattern(patterns: dict, module: str, default: float) -> float:
    """PEFT's rule: a pattern applies to a module whose name ends with it (at a dot)."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{pattern}", module):
            return value
    return default


@lru_cache(maxsize=32)
def _read(folder: str, stamp: tuple) -> Adapter | None:
    from safetensors import safe_open

    path = Path(folder)
    try:
        config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"LoRA adapter {folder}: cannot read {CONFIG_FILE} ({error})") from None
    plain = (
        config.get("peft_type", "LORA") == "LORA"
        and not config.get("use_dora")
        and not config.get("fan_in_fan_out")
        and not config.get("lora_bias")
        # LoRA on bare parameters (MoE expert stacks) and activated LoRA are not B A of a named
        # nn.Linear weight: their keys would not name the weights they change
        and not config.get("target_parameters")
        and not config.get("alora_invocation_tokens")
        and (path / WEIGHTS_FILE).is_file()
    )
    if not plain:
        return None
    factors: dict[str, dict[str, str]] = {}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as handle:
        for key in handle.keys():
            match = _FACTOR.match(key)
            if match is None:
                return None  # anything but A and B factors (embeddings, modules_to_save): not plain
            factors.setdefault(match["module"], {})[match["side"]] = key
    if any(set(keys) != {"A", "B"} for keys in factors.values()):
        return None
    return Adapter(
        folder=path,
        rank=int(config.get("r", 8)),
        alpha=float(config.get("lora_alpha", 8)),
        rslora=bool(config.get("use_rslora", False)),
        rank_pattern=dict(config.get("rank_pattern") or {}),
        alpha_pattern=dict(config.get("alpha_pattern") or {}),
        factors=factors,
    )


def adapter_for(folder: str | Path) -> Adapter | None:
    """The plain LoRA adapter in ``folder`` (read once per content), or None when it is not one."""
    path = Path(folder)
    files = [path / CONFIG_FILE, path / WEIGHTS_FILE]
    stamp = tuple((f.stat().st_size, f.stat().st_mtime_ns) if f.is_file() else None for f in files)
    return _read(str(path.resolve()), stamp)
