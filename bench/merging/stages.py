"""The benchmark's stages, in the order they run (``--until`` stops after one)."""

STAGES = (
    "data",
    "heads",
    "experts",
    "scores",
    "task_arithmetic",
    "anchors",
    "sweeps",
    "bmm",
    "ablation",
    "variants",
    "language",
)
