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

# Stages nothing later depends on: a run may leave them out (``--skip``) to reach the searches sooner.
SKIPPABLE = ("sweeps", "ablation", "variants", "language")
