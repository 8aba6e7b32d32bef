"""Read the classification tasks an ensemble is scored on (the search's classification evaluator config).

Either a file holding the evaluator mapping itself (``type: classification``, ``tasks:``)
or a whole ``search.yml`` whose ``evaluator:`` is a classification evaluator, so the
search's validation tasks can be reused as they are (or with their ``split`` changed).
"""

from __future__ import annotations

from pathlib import Path

import pydantic

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.evaluation.config import ClassificationEvaluatorConfig
from mergekit_bmm.recipes.parse import read_yaml
from mergekit_bmm.search.config import one_line_validation


def load_classification_tasks(path: str | Path, split: str | None = None) -> ClassificationEvaluatorConfig:
    """The classification evaluator in ``path``; ``split`` replaces every task's split."""
    path = Path(path)
    raw = read_yaml(path, "evaluator config")
    if isinstance(raw, dict) and "evaluator" in raw:
        raw = raw["evaluator"]
    if not isinstance(raw, dict) or raw.get("type") != "classification":
        raise ConfigError(
            f"{path}: expected a classification evaluator (`type: classification` with `tasks:`), "
            "or a search config whose `evaluator:` is one; ensembles are scored with fixed heads"
        )
    try:
        config = ClassificationEvaluatorConfig.model_validate(
            raw, context={"base_dir": path.resolve().parent}
        )
    except pydantic.ValidationError as error:
        raise ConfigError(one_line_validation(error, str(path))) from None
    if split is not None:
        tasks = [task.model_copy(update={"split": split}) for task in config.tasks]
        config = config.model_copy(update={"tasks": tasks})
    return config
