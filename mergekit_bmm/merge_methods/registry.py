"""What mergekit knows now: the names of its registered merge methods (anchors are checked
against them). Registration itself is the plugin's job (:mod:`mergekit_bmm.plugin`)."""

from __future__ import annotations


def registered_names() -> frozenset[str]:
    """Names of every method mergekit knows now."""
    from mergekit.merge_methods import registered_methods

    return frozenset(method.spec.name for method in registered_methods())
