"""Register the plugin's methods with mergekit, idempotently.

mergekit's ``register`` raises on a duplicate name, and the plugin may be imported more
than once per process (start-up hook, explicit import, tests), so check first.
"""

from __future__ import annotations

from mergekit.merge_methods import registry
from mergekit.merge_methods.base import MergeMethod


def plugin_methods() -> tuple[MergeMethod, ...]:
    from mergekit_bmm.methods.bmm import BMMMerge
    from mergekit_bmm.methods.iso_c import IsoCMerge
    from mergekit_bmm.methods.iso_cts import IsoCTSMerge
    from mergekit_bmm.methods.regmean import RegMeanMerge
    from mergekit_bmm.methods.tsv import TSVMerge
    from mergekit_bmm.methods.wudi import WUDIMerge

    return (BMMMerge(), TSVMerge(), IsoCMerge(), IsoCTSMerge(), WUDIMerge(), RegMeanMerge())


def register_all() -> tuple[str, ...]:
    """Register every plugin method not yet known to mergekit; return all their names.

    Also applies the compatibility patches for known mergekit bugs (``compat``), which
    every merge the plugin takes part in needs.
    """
    from mergekit_bmm import compat

    compat.apply()
    names = []
    for method in plugin_methods():
        name = method.spec.name
        if name not in registry._METHODS:
            registry.register(method)
        names.append(name)
    return tuple(names)
