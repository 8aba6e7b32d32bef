"""Register the plugin's methods with mergekit, idempotently, through its public registry API.

mergekit's ``register`` raises on a duplicate name, and registration may be asked for
more than once per process (start-up hook, explicit activation, tests), so check first.
"""

from __future__ import annotations

from mergekit_bmm.merge_methods.registry import registered_names

PLUGIN_METHOD_NAMES = frozenset({"bmm", "tsv", "iso_c", "iso_cts", "wudi", "regmean", "ace"})


def plugin_methods() -> tuple:
    from mergekit_bmm.merge_methods.ace import ACEMerge
    from mergekit_bmm.merge_methods.bmm import BMMMerge
    from mergekit_bmm.merge_methods.iso_c import IsoCMerge
    from mergekit_bmm.merge_methods.iso_cts import IsoCTSMerge
    from mergekit_bmm.merge_methods.regmean import RegMeanMerge
    from mergekit_bmm.merge_methods.tsv import TSVMerge
    from mergekit_bmm.merge_methods.wudi import WUDIMerge

    return (BMMMerge(), TSVMerge(), IsoCMerge(), IsoCTSMerge(), WUDIMerge(), RegMeanMerge(), ACEMerge())


def register_all() -> tuple[str, ...]:
    """Register every plugin method not yet known to mergekit; return all their names."""
    from mergekit.merge_methods import register

    known = registered_names()
    if PLUGIN_METHOD_NAMES <= known:
        return tuple(sorted(PLUGIN_METHOD_NAMES))
    for method in plugin_methods():
        if method.spec.name not in known:
            register(method)
    return tuple(sorted(PLUGIN_METHOD_NAMES))
