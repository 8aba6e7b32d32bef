"""How mergekit learns about the plugin: registration and the narrow mergekit patches.

mergekit 0.1.5 has no plugin discovery. Two routes lead here:

* the start-up hook (``mergekit_bmm_autoload``, installed as a ``.pth`` file) calls
  :func:`on_module_loaded` as each of mergekit's modules that the plugin touches finishes
  importing, so the stock ``mergekit-yaml`` knows ``bmm``;
* programs and the plugin's own commands call :func:`activate` explicitly.

Nothing here imports mergekit until one of those is called.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

REGISTRY_MODULE = "mergekit.merge_methods"


def activate() -> tuple[str, ...]:
    """Register the plugin's methods and apply every mergekit patch; return the method names.

    Idempotent. Imports mergekit's merge pipeline first, so every patch finds its target.
    """
    import mergekit.merge  # noqa: F401  (loads mergekit.plan, .card and .merge_methods too)

    from mergekit_bmm.plugin import patches
    from mergekit_bmm.plugin.log_filters import quiet_mergekit_notices
    from mergekit_bmm.plugin.registration import register_all

    names = register_all()
    patches.apply_all()
    quiet_mergekit_notices()
    return names


def on_module_loaded(module: ModuleType) -> None:
    """What the start-up hook runs once one of mergekit's modules has finished executing."""
    from mergekit_bmm.plugin import patches

    if module.__name__ == REGISTRY_MODULE and not _plugin_mid_import():
        from mergekit_bmm.plugin.log_filters import quiet_mergekit_notices
        from mergekit_bmm.plugin.registration import register_all

        register_all()
        quiet_mergekit_notices()
        if running_mergekit_command():
            from mergekit_bmm.errors import install_excepthook

            install_excepthook()
    patches.apply_for(module.__name__, module)


def _plugin_mid_import() -> bool:
    """Whether one of the plugin's own modules is half-way through its import.

    Then one of them imported mergekit, and registering now would import the plugin's
    methods in a circle; the plugin's own code calls :func:`activate` before it merges.
    """
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if name.startswith("mergekit_bmm.") and getattr(spec, "_initializing", False):
            return True
    return False


def running_mergekit_command() -> bool:
    """Whether this process is one of mergekit's console commands (``mergekit-yaml``, ...).

    Only there does the plugin show its errors as one line through ``sys.excepthook``;
    other programs keep Python's own handling.
    """
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return program.startswith("mergekit-") and not program.startswith("mergekit-bmm-")


def method_names() -> frozenset[str]:
    """Names of the merge methods this plugin registers."""
    from mergekit_bmm.plugin.registration import PLUGIN_METHOD_NAMES

    return PLUGIN_METHOD_NAMES
