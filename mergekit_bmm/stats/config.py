"""``stats.yml``: which calibration data runs through which expert, validated once.

```yaml
max_samples: 128          # defaults for every task (each task may override them)
max_length: 512
tasks:
  - name: math
    model: /models/expert-math      # a local folder, or a Hub id (ORG/NAME)
    revision: main                  # optional, Hub experts only: branch, tag or commit
    data: /data/math.jsonl          # JSONL, a datasets save_to_disk folder, or a Hub data set id
    data_config: default            # optional, Hub data sets only: datasets.load_dataset's config
    data_revision: main             # optional, Hub data sets only
    text_field: text
    chat_template: false            # render each sample with the tokenizer's chat template
    split: train                    # optional: only lines/rows of this split
```

Relative ``model`` and ``data`` paths are taken relative to the file itself; the
manifest records them resolved (and Hub references with the commit they resolved to).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io.hub_ids import looks_like_repo_id

TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
DEFAULT_MAX_SAMPLES = 128
DEFAULT_MAX_LENGTH = 512
ForwardDtype = Literal["float32", "bfloat16", "float16"]


class TaskConfig(BaseModel):
    """One expert and its calibration data."""

    model_config = ConfigDict(extra="forbid")

    name: str
    model: str
    data: str
    revision: str | None = None
    data_config: str | None = None
    data_revision: str | None = None
    text_field: str | None = None
    chat_template: bool | None = None
    max_samples: int | None = Field(default=None, ge=1)
    max_length: int | None = Field(default=None, ge=1)
    split: str | None = None  # JSONL: keep lines whose `split` field is this; datasets: that split

    @field_validator("name")
    @classmethod
    def _file_safe(cls, name: str) -> str:
        if not TASK_NAME.match(name):
            raise ValueError(
                f"task name {name!r} must start with a letter or digit and use only letters, digits, "
                "'_', '-' and '.' (it names the task's Gram file)"
            )
        return name


class StatsConfig(BaseModel):
    """The whole ``stats.yml``: task-level values override the top-level defaults."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[TaskConfig] = Field(min_length=1)
    text_field: str = "text"
    chat_template: bool = False
    max_samples: int = Field(default=DEFAULT_MAX_SAMPLES, ge=1)
    max_length: int = Field(default=DEFAULT_MAX_LENGTH, ge=1)
    batch_size: int = Field(default=8, ge=1)
    dtype: ForwardDtype = "float32"

    @model_validator(mode="after")
    def _fill_and_check(self, info: ValidationInfo) -> StatsConfig:
        folder = Path((info.context or {}).get("folder", "."))
        names: set[str] = set()
        models: dict[str, str] = {}
        for task in self.tasks:
            if task.name in names:
                raise ValueError(f"task name {task.name!r} appears twice")
            names.add(task.name)
            if _is_local(task.data, folder) or "/" not in task.data or not looks_like_repo_id(task.data):
                task.data = str(_resolve(task.data, folder))
                for key in ("data_config", "data_revision"):
                    if getattr(task, key) is not None:
                        raise ValueError(f"task {task.name!r}: `{key}` applies to Hub data sets only")
            if _is_local(task.model, folder):
                task.model = str(_resolve(task.model, folder))
                if task.revision is not None:
                    raise ValueError(f"task {task.name!r}: `revision` applies to Hub experts only")
            if task.model in models:
                raise ValueError(
                    f"tasks {models[task.model]!r} and {task.name!r} use the same model {task.model}; "
                    "a merge reads one Gram per expert, so give each expert one task"
                )
            models[task.model] = task.name
            task.text_field = task.text_field if task.text_field is not None else self.text_field
            task.chat_template = task.chat_template if task.chat_template is not None else self.chat_template
            task.max_samples = task.max_samples if task.max_samples is not None else self.max_samples
            task.max_length = task.max_length if task.max_length is not None else self.max_length
        return self


def _is_local(reference: str, folder: Path) -> bool:
    """Paths, not Hub repo ids (``org/name``), are resolved."""
    return reference.startswith(("/", ".", "~")) or (folder / reference).exists()


def _resolve(reference: str, folder: Path) -> Path:
    candidate = Path(reference).expanduser()
    return (candidate if candidate.is_absolute() else folder / candidate).resolve()


def _first_error(error: pydantic.ValidationError) -> str:
    detail = error.errors()[0]
    where = ".".join(str(part) for part in detail.get("loc", ()))
    message = detail.get("msg", "invalid value").removeprefix("Value error, ")
    if detail.get("type") == "extra_forbidden":
        message = "unknown key (check its spelling)"
    return f"{where}: {message}" if where else message


def load_stats_config(path: str | Path) -> StatsConfig:
    """Read and validate ``stats.yml``; relative paths are resolved against its folder."""
    from mergekit_bmm.recipes.parse import read_yaml

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"statistics config {path} does not exist")
    raw = read_yaml(path, "statistics config")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be a mapping with a `tasks:` list")
    return parse_stats_config(raw, path.resolve().parent, source=str(path))


def parse_stats_config(raw: dict, folder: str | Path = ".", source: str = "stats config") -> StatsConfig:
    """Validate a ``stats.yml`` mapping; relative paths are resolved against ``folder``."""
    try:
        return StatsConfig.model_validate(raw, context={"folder": str(Path(folder).resolve())})
    except pydantic.ValidationError as error:
        raise ConfigError(f"{source}: {_first_error(error)}") from None
