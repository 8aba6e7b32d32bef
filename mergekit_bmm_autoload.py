"""Let the stock ``mergekit-yaml`` (and any program) see ``merge_method: bmm``.

mergekit 0.1.5 has no plugin discovery: a method exists only once something registers
it. The wheel installs ``mergekit_bmm_autoload.pth``, which imports this module at
interpreter start-up. All it does then is put one import finder on ``sys.meta_path``;
it imports nothing else. The finder wraps the loaders of the three mergekit modules the
plugin touches and, right after each has finished executing, hands it to
``mergekit_bmm.plugin.on_module_loaded``: ``mergekit.merge_methods`` (register the
methods), ``mergekit.plan`` and ``mergekit.merge`` (the patches listed in
``mergekit_bmm.plugin.patches``). Once all three have loaded the finder removes itself.
Set ``MERGEKIT_BMM_NO_AUTOLOAD=1`` to switch it off (then call
``mergekit_bmm.plugin.activate()`` or use ``mergekit-bmm-yaml``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

WATCHED = ("mergekit.merge_methods", "mergekit.plan", "mergekit.merge")


class _ThenNotify(importlib.abc.Loader):
    """Delegate loading to mergekit's own loader, then tell the plugin."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        try:
            from mergekit_bmm.plugin import on_module_loaded

            on_module_loaded(module)
        except Exception as error:  # never break mergekit because of the plugin
            print(f"mergekit-bmm: could not register with mergekit: {error}", file=sys.stderr)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class _MergekitFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of each watched module once."""

    def __init__(self) -> None:
        self._pending = set(WATCHED)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self._pending:
            return None
        self._pending.discard(fullname)
        if not self._pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenNotify(spec.loader)
        return spec


def install() -> None:
    """Install the finder unless disabled, already there, or mergekit is already loaded."""
    if os.environ.get("MERGEKIT_BMM_NO_AUTOLOAD"):
        return
    if WATCHED[0] in sys.modules:
        from mergekit_bmm.plugin import activate

        activate()
        return
    if not any(isinstance(finder, _MergekitFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MergekitFinder())


install()
