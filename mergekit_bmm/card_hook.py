"""Compatibility hook: merges made with the plugin's methods get mergekit-bmm's card.

mergekit 0.1.5's ``run_merge`` writes ``README.md`` itself, right after the weights, by
calling ``generate_card`` (imported by name into ``mergekit.merge``). That card knows
nothing of BMM, and its ``is_hf`` asks the Hub (``huggingface_hub.repo_exists``) about
every relative model path that exists locally, which crashes the merge offline after
the weights are written (no README, no ``mergekit_config.yml``).

:func:`install` rebinds ``mergekit.merge.generate_card`` to a wrapper that, for a recipe
whose ``merge_method`` is one the plugin registered:

* writes the merge record (weights fingerprint, recipe digest) into the output folder;
* returns :func:`mergekit_bmm.card.merge_card` — no Hub calls;
* if either step fails, logs a warning and returns :func:`mergekit_bmm.card.minimal_card`
  (still a valid card, still offline), so the card never breaks a merge.

Every other merge goes to mergekit's own ``generate_card`` untouched. The output folder
is read from ``run_merge``'s ``out_path`` local (its only caller), checked against the
``name`` it passes.

When is it installed? The plugin registers while ``mergekit.merge`` may still be
importing (the start-up hook fires on ``mergekit.merge_methods``, which ``mergekit.card``
imports), and ``from mergekit.card import generate_card`` only binds afterwards. So
:func:`install` patches at once if ``mergekit.merge`` is fully loaded, and otherwise
arranges to patch as soon as it is: a one-shot import watcher if it is not imported
yet, and the start-up hook (``mergekit_bmm_autoload``) calls :func:`install` again
once ``mergekit.merge`` has finished loading.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from pathlib import Path
from typing import Any

LOG = logging.getLogger("mergekit_bmm")

TARGET_MODULE = "mergekit.merge"
_MARK = "__mergekit_bmm_card_hook__"


def _plugin_methods() -> frozenset[str]:
    import mergekit_bmm

    return frozenset(getattr(mergekit_bmm, "REGISTERED_METHODS", ()) or ())


def _caller_out_path(name: str | None) -> Path | None:
    """``out_path`` of the ``run_merge`` frame that called us (None if not found)."""
    frame = sys._getframe(2)  # 0: here, 1: the wrapper, 2: its caller
    out_path = frame.f_locals.get("out_path") if frame is not None else None
    if not isinstance(out_path, (str, os.PathLike)):
        return None
    path = Path(out_path)
    if (name is not None and os.path.basename(os.fspath(out_path)) != name) or not path.is_dir():
        return None
    return path


def _bmm_card(config: Any, config_yaml: str, name: str | None, out_dir: Path | None) -> str:
    from mergekit_bmm import card

    if out_dir is None:
        LOG.warning(
            "mergekit-bmm: output folder unknown; the merge record (weights fingerprint) is not written"
        )
    else:
        try:
            card.record_merge(out_dir, config_yaml)
        except Exception as error:
            LOG.warning("mergekit-bmm: could not write the merge record: %s", error)
    try:
        return card.merge_card(config_yaml, out_dir=out_dir, name=name)
    except Exception as error:
        LOG.warning("mergekit-bmm: could not build the full model card (%s); writing a minimal one", error)
        return card.minimal_card(config, config_yaml, name)


def wrap(original):
    """``generate_card`` that hands the plugin's merges to mergekit-bmm's card."""
    if getattr(original, _MARK, False):
        return original

    @functools.wraps(original)
    def generate_card(config, config_yaml, name=None):
        if getattr(config, "merge_method", None) not in _plugin_methods():
            return original(config, config_yaml, name)
        out_dir = _caller_out_path(name)
        return _bmm_card(config, config_yaml, name, out_dir)

    setattr(generate_card, _MARK, True)
    generate_card.__wrapped_original__ = original
    return generate_card


def _patch(module: Any) -> bool:
    original = getattr(module, "generate_card", None)
    if original is None:
        return False
    module.generate_card = wrap(original)
    return True


def _fully_loaded(module: Any) -> bool:
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False) and hasattr(module, "generate_card")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; patches ``mergekit.merge`` once it has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        try:
            _patch(module)
        except Exception as error:  # never break mergekit because of the card
            LOG.warning("mergekit-bmm: could not install the model-card hook: %s", error)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


def install(loaded: Any = None) -> str:
    """Install the hook (idempotent); say how: "patched", "watching" or "deferred".

    ``loaded`` is ``mergekit.merge`` itself when the caller knows it has just finished
    executing (the start-up hook, from inside the import machinery).
    """
    if loaded is not None:
        return "patched" if _patch(loaded) else "deferred"
    module = sys.modules.get(TARGET_MODULE)
    if module is not None and _fully_loaded(module):
        _patch(module)
        return "patched"
    if module is None:
        if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())
        return "watching"
    return "deferred"  # mid-import: the start-up hook calls install() when it is done


def installed() -> bool:
    module = sys.modules.get(TARGET_MODULE)
    return module is not None and getattr(getattr(module, "generate_card", None), _MARK, False)
