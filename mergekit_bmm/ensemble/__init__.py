"""Scoring sampled models as one ensemble: accuracy and calibration (ECE)."""
