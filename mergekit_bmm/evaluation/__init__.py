"""Scoring merged models: classification heads over an encoder's pooled features."""
