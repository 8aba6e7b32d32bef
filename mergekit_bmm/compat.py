"""Narrow compatibility patches for known bugs of the installed mergekit.

Each patch is applied only when a behavioural probe shows that the bug is present, so it
disappears by itself once mergekit is fixed; :data:`APPLIED` lists what was patched.

``optional_alias_check`` — mergekit 0.1.5, ``mergekit/plan.py`` line 186:
``MergePlanner.plan_tensor`` tests whether an *optional* weight is present with
``[w_in.name] + (w_in.aliases or [])``, but ``WeightInfo.aliases`` is a tuple, so any
optional weight with aliases raises ``TypeError: can only concatenate list (not "tuple")
to list``. BERT's ``embeddings.position_ids`` (aliased ``bert.embeddings.position_ids``)
is such a weight, so every BERT merge fails at planning. The patch performs the same
presence check correctly, skips the weight when no input has it (as mergekit means to),
and otherwise hands the tensor to the original ``plan_tensor`` with the check already
satisfied; the planned task is then given the original weight info back, so the plan is
exactly what a fixed mergekit would produce.

When ``mergekit.plan`` is itself being imported (it imports ``mergekit.merge_methods``,
whose import registers the plugin through the start-up hook), the patch is deferred; the
start-up hook calls :func:`apply` again once ``mergekit.plan`` has finished loading.
"""

from __future__ import annotations

import functools
import logging
import sys

LOG = logging.getLogger("mergekit_bmm")

APPLIED: list[str] = []

_PROBE_PATH = "/nonexistent/mergekit-bmm-compat-probe"


def _any_input_present(weights_in, models) -> bool:
    from mergekit.io.tasks import LoaderCache

    for model, w_in in zip(models, weights_in):
        index = LoaderCache().get(model).index
        if any(name in index.tensor_paths for name in (w_in.name, *(w_in.aliases or ()))):
            return True
    return False


def optional_alias_bug_present() -> bool:
    """Run mergekit's own ``plan_tensor`` on an optional weight with tuple aliases.

    The probe model is a fake loader entry holding no tensors, so a correct mergekit
    skips the weight and returns before touching the planner; the buggy one raises the
    ``TypeError`` above. Any other outcome counts as "not this bug" (no patch).
    """
    from types import SimpleNamespace

    from mergekit.architecture.base import WeightInfo
    from mergekit.common import ModelReference
    from mergekit.io.tasks import LoaderCache
    from mergekit.plan import MergePlanner

    original = getattr(MergePlanner.plan_tensor, "__wrapped__", MergePlanner.plan_tensor)
    model = ModelReference.model_validate({"model": {"path": _PROBE_PATH}})
    weight = WeightInfo(name="probe.weight", optional=True, aliases=("probe.alias",))
    loaders = LoaderCache.loaders
    loaders[model] = SimpleNamespace(index=SimpleNamespace(tensor_paths={}))
    try:
        original(None, weight, [weight], [model], None)
    except TypeError as error:
        return "concatenate list" in str(error)
    except Exception:
        return False
    finally:
        loaders.pop(model, None)
    return False


def _plan_module_ready() -> bool:
    """Import ``mergekit.plan`` unless it is half-way through its own import."""
    module = sys.modules.get("mergekit.plan")
    if module is None:
        import mergekit.plan as module
    return hasattr(module, "MergePlanner")


def _is_patched() -> bool:
    from mergekit.plan import MergePlanner

    return getattr(MergePlanner.plan_tensor, "_mergekit_bmm_patch", False)


def _patch_optional_alias_check() -> None:
    from mergekit.plan import MergePlanner

    original = MergePlanner.plan_tensor

    @functools.wraps(original)
    def plan_tensor(self, weight, weights_in, models, cfg_reader):
        if not weight.optional:
            return original(self, weight, weights_in, models, cfg_reader)
        if not _any_input_present(weights_in, models):
            logging.info(f"Skipping optional weight {weight.name}")
            return None
        planned = len(self._tensors)
        original(self, weight.model_copy(update={"optional": False}), weights_in, models, cfg_reader)
        if len(self._tensors) > planned:
            _, task = self._tensors[-1]
            self._tensors[-1] = (weight, task.model_copy(update={"output_weight": weight}))
        return None

    plan_tensor._mergekit_bmm_patch = True
    MergePlanner.plan_tensor = plan_tensor


def apply() -> tuple[str, ...]:
    """Apply every patch whose bug is present (idempotent); return the applied names."""
    if _plan_module_ready() and not _is_patched():
        try:
            present = optional_alias_bug_present()
        except Exception as error:  # never break mergekit because of a probe
            LOG.debug("mergekit-bmm: compatibility probe failed: %s", error)
            present = False
        if present and not _is_patched():
            _patch_optional_alias_check()
            APPLIED.append("optional_alias_check")
    return tuple(APPLIED)
