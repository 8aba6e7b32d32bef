"""Merging a recipe through mergekit, as ``mergekit-yaml`` would: to a folder, or in memory.

The search, the benchmark and the tests merge recipe *text*: the exact YAML that is
written next to the result, so ``mergekit-yaml`` on that file rebuilds the same model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mergekit_bmm.merge_methods import merge_findings
from mergekit_bmm.recipes.parse import parse_recipe

IN_MEMORY = "/nonexistent/mergekit-bmm-in-memory"  # the plan names a folder; nothing is written there
QUIET_LOGGERS = ("mergekit", "mergekit.merge", "mergekit.plan", "mergekit.graph", "mergekit.card")


def quiet_mergekit() -> None:
    """Keep mergekit's per-merge INFO lines out of a long run's output."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def merge_options(options: Any = None, **overrides: Any) -> Any:
    """``mergekit.options.MergeOptions``: ``options`` (default: mergekit-yaml's) with ``overrides``."""
    from mergekit.options import MergeOptions

    base = options if options is not None else MergeOptions(copy_tokenizer=True)
    return base.model_copy(update={key: value for key, value in overrides.items() if value is not None})


def merge_recipe_text(
    text: str, out_dir: str | Path, options: Any = None, source: str = "the recipe"
) -> None:
    """Merge the recipe ``text`` into ``out_dir`` with mergekit's ``run_merge``.

    A fresh configuration is parsed from the text every time (mergekit's planner mutates
    the one it is given), and mergekit's loader cache is cleared so inputs are read as
    they are now. ``options`` default to ``mergekit-yaml``'s (quiet, tokenizer copied).
    """
    from mergekit.io.tasks import LoaderCache

    from mergekit_bmm.plugin import activate

    activate()
    from mergekit.merge import run_merge  # after activate(): the plugin's wrapper

    quiet_mergekit()
    LoaderCache().loaders.clear()
    config = parse_recipe(text, source).config
    run_merge(config, str(out_dir), options=options or merge_options(quiet=True), config_source=text)


def merge_recipe_in_memory(
    text: str,
    options: Any,
    on_tensor: Callable[[str, Any, str | None], None],
    source: str = "the recipe",
) -> None:
    """Merge the recipe ``text`` with mergekit's planner and executor, writing nothing.

    ``on_tensor(name, tensor, out_dtype)`` receives each output tensor as soon as it is
    computed (on ``options.device`` when ``low_cpu_memory``, else the CPU), with the dtype
    mergekit would save it in; memory stays at mergekit's working set. The plan is the one
    ``run_merge`` builds (``MergePlanner.plan_to_disk``); only its tensor tasks run.
    """
    from mergekit.architecture import get_architecture_info
    from mergekit.graph import Executor
    from mergekit.io.tasks import LoaderCache, SaveTensor
    from mergekit.plan import MergePlanner

    from mergekit_bmm.plugin import activate
    from mergekit_bmm.plugin.patches import fetch_hub_inputs, with_lora_cache

    activate()
    quiet_mergekit()
    merge_findings.reset()  # a search merges many times: the tallies must not grow with its trials
    config = parse_recipe(text, source).config
    fetch_hub_inputs(config)  # as a merge through mergekit-yaml does: Hub ids from the cache
    options = with_lora_cache(config, options)  # and BASE+ADAPTER experts merged once
    loaders = LoaderCache()
    loaders.loaders.clear()
    loaders.setup(options=options)
    if config.tokenizer_source is not None or config.tokenizer is not None:
        raise ValueError("recipes that build a tokenizer cannot be merged in memory")
    arch_info = get_architecture_info(config, options)
    out_config = config.base_model.config(trust_remote_code=options.trust_remote_code)
    planner = MergePlanner(config, arch_info, options=options, out_model_config=out_config)
    saves = [task for task in planner.plan_to_disk(out_path=IN_MEMORY) if isinstance(task, SaveTensor)]
    by_task = {save.tensor_task: save for save in saves}
    storage = options.device if options.low_cpu_memory else "cpu"
    executor = Executor(list(by_task), math_device=options.device, storage_device=storage)
    for task, value in executor.run(quiet=True):
        save = by_task[task]
        if value is None:
            if not save.optional:
                raise RuntimeError(f"No value for required tensor {save.tensor_name}")
            continue
        on_tensor(save.tensor_name, value, save.dtype)
