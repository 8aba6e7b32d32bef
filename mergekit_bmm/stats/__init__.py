"""Activation statistics (per-task Grams) for data-assisted BMM and RegMean."""
