"""Every change the plugin makes to mergekit, in one place: each probed and version-gated.

A patch names the mergekit module it changes, the mergekit versions it was written for,
a probe, and what a user goes without when it cannot apply; it is applied only when the
installed version is one of those and the probe finds what the patch expects, so a newer
mergekit is left alone — with one warning per patch that names what is lost. :data:`APPLIED` lists
what was patched in this process.

``optional_alias_check`` (``mergekit.plan``) — mergekit 0.1.5, ``plan.py`` line 186:
``MergePlanner.plan_tensor`` tests whether an *optional* weight is present with
``[w_in.name] + (w_in.aliases or [])``, but ``WeightInfo.aliases`` is a tuple, so any
optional weight with aliases raises ``TypeError: can only concatenate list (not "tuple")
to list``. BERT's ``embeddings.position_ids`` is such a weight, so every BERT merge fails
at planning. The patch performs the same presence check correctly, skips the weight when
no input has it (as mergekit means to), and otherwise plans it as mergekit does.

``merge_wrapper`` (``mergekit.merge``) — ``run_merge(merge_config, out_path, options,
config_source)`` is where every merge starts (``mergekit-yaml`` imports it by name after the
hook has run), and the one seam cards, records and pre-flight go through, with no private
attribute of mergekit's. The wrapper first runs :func:`mergekit_bmm.recipes.preflight.check_merge`:
the method is registered, local model folders exist and are models of one hidden size, the
output folder can be written; for the plugin's own methods also that it holds no file a merge
did not write. A failed check is one line instead of mergekit's traceback. For merges made
with the plugin's methods it then runs mergekit with its public ``write_model_card`` option
off (mergekit's card asks the Hub, and its ``is_hf`` crashes offline on relative paths) and,
once the weights are written, writes the merge record, the plugin's card
(:mod:`mergekit_bmm.cards.card`; a minimal card if that fails) and ``mergekit_config.yml``
itself, as mergekit would have. Every other merge is mergekit's own, card included, except that a
recipe with ``BASE+ADAPTER`` inputs and no ``--lora-merge-cache`` gets the plugin's default LoRA
merge cache (:mod:`mergekit_bmm.io.lora_experts`) whatever its method, where mergekit would stop.

``hub_cache_first`` (``mergekit.common.ModelReference.local_path``, reached through
``mergekit.merge``) — mergekit 0.1.5 resolves a Hub id by calling ``list_repo_files`` before
``snapshot_download``, a network call even when the snapshot is cached, so every merge of Hub ids
fails under ``HF_HUB_OFFLINE=1``. The patch returns the cached snapshot (one holding weights) when
there is one; offline without one it fails in one line naming the id and ``hf download``; online
it leaves the download to mergekit.

``ordered_models`` (``mergekit.config.MergeConfiguration.referenced_models``) — mergekit 0.1.5
returns ``list(set(...))``: the models' order, and so the ids ``tokenizer_source: union`` gives
added tokens, change with ``PYTHONHASHSEED``. The patch returns the same models in the recipe's
order (base first), each once.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergekit_bmm.errors import merge_started
from mergekit_bmm.io.versions import mergekit_version
from mergekit_bmm.merge_methods import merge_findings
from mergekit_bmm.merge_methods.merge_findings import MergeFindings

LOG = logging.getLogger("mergekit_bmm")

SUPPORTED_MERGEKIT = ("0.1.5",)
APPLIED: list[str] = []
_MARK = "_mergekit_bmm_patch"
_PROBE_PATH = "/nonexistent/mergekit-bmm-patch-probe"


@dataclass(frozen=True)
class Patch:
    """One change to one mergekit module."""

    name: str
    module: str
    attribute: str  # what is replaced, e.g. "MergePlanner.plan_tensor"
    probe: Callable[[Any], bool]
    install: Callable[[Any], None]
    loses: str  # what a user of mergekit-yaml goes without when the patch cannot apply
    # A probe that finds nothing to patch can mean mergekit fixed what the patch fixes.
    absent_is_fine: bool = False

    def target(self, module: Any) -> Any:
        for part in self.attribute.split("."):
            module = getattr(module, part, None)
        return module


def _fully_loaded(module_name: str) -> Any | None:
    """The module if it has finished executing (None while it is half-way through its import)."""
    module = sys.modules.get(module_name)
    spec = getattr(module, "__spec__", None)
    if module is None or getattr(spec, "_initializing", False):
        return None
    return module


# ----------------------------------------------------------- optional_alias_check


def _any_input_present(weights_in, models) -> bool:
    from mergekit.io.tasks import LoaderCache

    for model, w_in in zip(models, weights_in):
        index = LoaderCache().get(model).index
        if any(name in index.tensor_paths for name in (w_in.name, *(w_in.aliases or ()))):
            return True
    return False


def optional_alias_bug_present(plan_module: Any = None) -> bool:
    """Run mergekit's own ``plan_tensor`` on an optional weight with tuple aliases.

    The probe model is a fake loader entry holding no tensors, so a correct mergekit
    skips the weight before touching the planner; the buggy one raises the ``TypeError``.
    """
    from types import SimpleNamespace

    from mergekit.architecture.base import WeightInfo
    from mergekit.common import ModelReference
    from mergekit.io.tasks import LoaderCache

    if plan_module is None:
        import mergekit.plan as plan_module
    planner = plan_module.MergePlanner
    original = getattr(planner.plan_tensor, "__wrapped__", planner.plan_tensor)
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


def _install_optional_alias_check(plan_module) -> None:
    planner = plan_module.MergePlanner
    original = planner.plan_tensor

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

    setattr(plan_tensor, _MARK, True)
    planner.plan_tensor = plan_tensor


# ---------------------------------------------------------------- hub_cache_first


def lists_repo_files(merge_module: Any) -> bool:
    """Whether mergekit resolves a Hub id by listing the repo's files (a network call even when
    the snapshot is cached, so ``HF_HUB_OFFLINE=1`` fails)."""
    import inspect

    local_path = getattr(getattr(merge_module, "ModelReference", None), "local_path", None)
    if local_path is None:
        return False
    names = list(inspect.signature(local_path).parameters)
    return names[:3] == ["self", "cache_dir", "ignore_lora"] and "list_repo_files" in inspect.getsource(
        local_path
    )


def _install_hub_cache_first(merge_module) -> None:
    reference_class = merge_module.ModelReference
    original = reference_class.local_path

    @functools.wraps(original)
    def local_path(self, cache_dir=None, ignore_lora=False):
        from mergekit_bmm.io.hub_models import cached_folder, is_hub_id, model_folder

        path, revision = self.model.path, self.model.revision
        if cache_dir is not None or not is_hub_id(path) or (self.lora is not None and not ignore_lora):
            return original(self, cache_dir, ignore_lora)  # mergekit's own rules (and its assertion)
        cached = cached_folder(path, revision)
        if cached is not None:
            return str(cached)
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return str(model_folder(path, revision))  # one line naming the id and how to fetch it
        return original(self, cache_dir, ignore_lora)

    setattr(local_path, _MARK, True)
    reference_class.local_path = local_path


# ----------------------------------------------------------------- ordered_models


def models_from_a_set(merge_module: Any) -> bool:
    """Whether mergekit gathers a recipe's models in a set (their order then follows the hash seed)."""
    import inspect

    method = getattr(getattr(merge_module, "MergeConfiguration", None), "referenced_models", None)
    return method is not None and "set()" in inspect.getsource(method)


def _install_ordered_models(merge_module) -> None:
    configuration = merge_module.MergeConfiguration
    original = configuration.referenced_models

    @functools.wraps(original)
    def referenced_models(self):
        """The same models, in the recipe's order (base first), each once."""
        ordered = []
        if self.base_model:
            ordered.append(self.base_model)
        for item in self.models or []:
            ordered.append(item.model)
        for piece in self.slices or []:
            ordered.extend(source.model for source in piece.sources)
        for module in (self.modules or {}).values():
            ordered.extend(item.model for item in module.models or [])
            for piece in module.slices or []:
                ordered.extend(source.model for source in piece.sources)
        found = list(dict.fromkeys(ordered))
        return found if set(found) == set(original(self)) else original(self)

    setattr(referenced_models, _MARK, True)
    configuration.referenced_models = referenced_models


# ------------------------------------------------------------------ merge_wrapper


def _has_run_merge(merge_module) -> bool:
    import inspect

    function = getattr(merge_module, "run_merge", None)
    if function is None:
        return False
    names = list(inspect.signature(function).parameters)
    return names[:4] == ["merge_config", "out_path", "options", "config_source"]


def write_plugin_card(
    out_dir: Path, merge_config: Any, config_yaml: str, findings: MergeFindings | None = None
) -> None:
    """The merge record (with what the merge found: tensors kept at the anchor, the λ ``lambda:
    auto`` chose, LoRA subspaces), the plugin's card and ``mergekit_config.yml`` of a finished merge."""
    from mergekit_bmm.cards import card

    try:
        card.record_merge(out_dir, config_yaml, findings=findings or MergeFindings())
    except Exception as error:
        LOG.warning("mergekit-bmm: could not write the merge record: %s", error)
    try:
        text = card.merge_card(config_yaml, out_dir=out_dir, name=out_dir.name)
    except Exception as error:
        LOG.warning("mergekit-bmm: could not build the full model card (%s); writing a minimal one", error)
        text = card.minimal_card(merge_config, config_yaml, out_dir.name)
    (out_dir / "README.md").write_text(text, encoding="utf-8")
    (out_dir / "mergekit_config.yml").write_text(config_yaml, encoding="utf-8")


def fetch_hub_inputs(merge_config: Any) -> None:
    """Every model and adapter the recipe names by Hub id, from the cache (fetched first when online):
    a missing one is one line naming it before mergekit reads anything."""
    from mergekit_bmm.io.hub_models import is_hub_id, model_folder

    for reference in merge_config.referenced_models():
        for part in (reference.model, reference.lora):
            if part is not None and is_hub_id(part.path):
                model_folder(part.path, part.revision)


def with_lora_cache(merge_config: Any, options: Any) -> Any:
    """``options`` with a LoRA merge cache when the recipe has ``BASE+ADAPTER`` inputs and none was
    given (mergekit stops otherwise): the default, keyed by the adapters' content
    (:mod:`mergekit_bmm.io.lora_experts`)."""
    if getattr(options, "lora_merge_cache", None):
        return options
    loras = sorted(str(m) for m in merge_config.referenced_models() if getattr(m, "lora", None) is not None)
    if not loras:
        return options
    from mergekit_bmm.io.lora_experts import default_lora_cache

    folder = default_lora_cache(loras)
    LOG.info("mergekit-bmm: LoRA experts are merged into their base once, in %s", folder)
    return options.model_copy(update={"lora_merge_cache": str(folder)})


def _install_merge_wrapper(merge_module) -> None:
    from mergekit_bmm.plugin import method_names
    from mergekit_bmm.recipes import preflight

    original = merge_module.run_merge

    @functools.wraps(original)
    def run_merge(merge_config, out_path, options, config_source=None, *args, **kwargs):
        ours = getattr(merge_config, "merge_method", None) in method_names()
        merge_started(ours)
        merge_findings.reset()
        if ours:
            fetch_hub_inputs(merge_config)
        options = with_lora_cache(merge_config, options)  # any method: mergekit stops without one
        card = ours and bool(getattr(options, "write_model_card", False))
        if card:  # written here, after the weights: mergekit's card would ask the Hub
            options = options.model_copy(update={"write_model_card": False})
        if preflight.checks_pending():
            with preflight.discarded_on_failure(out_path):
                preflight.check_merge(merge_config, out_path, guard_folder=ours)
                result = original(merge_config, out_path, options, config_source, *args, **kwargs)
        else:
            result = original(merge_config, out_path, options, config_source, *args, **kwargs)
        findings = merge_findings.drained()
        merge_findings.log_summary(findings)
        if card:  # mergekit's own rule: the recipe text, else the configuration as it ends the merge
            recipe = config_source or merge_config.to_yaml()
            write_plugin_card(Path(out_path), merge_config, recipe, findings)
        return result

    setattr(run_merge, _MARK, True)
    merge_module.run_merge = run_merge


PATCHES = (
    Patch(
        "optional_alias_check",
        "mergekit.plan",
        "MergePlanner.plan_tensor",
        optional_alias_bug_present,
        _install_optional_alias_check,
        "BERT merges may fail at planning (mergekit's optional-weight alias bug)",
        absent_is_fine=True,
    ),
    Patch(
        "merge_wrapper",
        "mergekit.merge",
        "run_merge",
        _has_run_merge,
        _install_merge_wrapper,
        "bad recipes fail with mergekit's traceback instead of one line, OUT_PATH is not guarded, and bmm "
        "merges get mergekit's generic model card (which asks the Hub) and no merge record, so "
        "mergekit-bmm-publish refuses them",
    ),
    Patch(
        "hub_cache_first",
        "mergekit.merge",
        "ModelReference.local_path",
        lists_repo_files,
        _install_hub_cache_first,
        "models named by Hub id are looked up on the Hub even when cached, so HF_HUB_OFFLINE=1 merges fail",
        absent_is_fine=True,
    ),
    Patch(
        "ordered_models",
        "mergekit.merge",
        "MergeConfiguration.referenced_models",
        models_from_a_set,
        _install_ordered_models,
        "the order of a recipe's models, and with `tokenizer_source: union` the ids of added tokens, "
        "follow PYTHONHASHSEED: the same recipe need not give the same model twice",
        absent_is_fine=True,
    ),
)
_WARNED: set[str] = set()


def _cannot_apply(patch: Patch, why: str) -> None:
    """Say once per process, as a warning, which patch could not apply and what that costs."""
    if patch.name in _WARNED:
        return
    _WARNED.add(patch.name)
    LOG.warning(
        "mergekit-bmm: %s; the %s patch is off, so %s (mergekit-bmm %s was written for mergekit %s)",
        why,
        patch.name,
        patch.loses,
        _plugin_version(),
        ", ".join(SUPPORTED_MERGEKIT),
    )


def _plugin_version() -> str:
    from mergekit_bmm import __version__

    return __version__


def is_patched(patch: Patch, module: Any) -> bool:
    return bool(getattr(patch.target(module), _MARK, False))


def _apply(patch: Patch, module: Any) -> None:
    if is_patched(patch, module):
        return
    if mergekit_version() not in SUPPORTED_MERGEKIT:
        _cannot_apply(patch, f"mergekit {mergekit_version()} is installed")
        return
    try:
        wanted = patch.probe(module)
    except Exception as error:  # never break mergekit because of a probe
        _cannot_apply(patch, f"mergekit's {patch.module}.{patch.attribute} is not as expected ({error})")
        return
    if not wanted and not patch.absent_is_fine:
        _cannot_apply(patch, f"mergekit's {patch.module}.{patch.attribute} is not as expected")
    if wanted and not is_patched(patch, module):
        patch.install(module)
        APPLIED.append(patch.name)


def apply_for(module_name: str, module: Any = None) -> None:
    """Apply the patches of ``module_name``; ``module`` is that module when the caller knows
    it has just finished executing (the start-up hook), else it is looked up."""
    module = module if module is not None else _fully_loaded(module_name)
    if module is None:
        return
    for patch in PATCHES:
        if patch.module == module_name:
            try:
                _apply(patch, module)
            except Exception as error:  # never break mergekit because of the plugin
                LOG.warning("mergekit-bmm: could not apply patch %s: %s", patch.name, error)


def apply_all() -> tuple[str, ...]:
    """Apply every patch whose module is loaded (idempotent); return the applied names."""
    for module_name in dict.fromkeys(patch.module for patch in PATCHES):
        apply_for(module_name)
    return tuple(APPLIED)
