"""Register mergekit-bmm's methods whenever mergekit's method registry is imported.

mergekit 0.1.5 has no plugin discovery: a method exists only once something imports it
and calls ``register``. This module is imported at interpreter start-up by the
``mergekit_bmm_autoload.pth`` file that the wheel installs, so the *stock*
``mergekit-yaml`` (and any other program) sees ``merge_method: bmm`` without an extra
flag. It stays cheap: it imports nothing heavy, and only installs a one-shot import
hook that runs ``import mergekit_bmm`` right after ``mergekit.merge_methods`` has
finished executing, and installs the model-card hook (``mergekit_bmm.card_hook``) right
after ``mergekit.merge`` has (the registration happens while ``mergekit.merge`` is still
importing, too early to patch it). Set ``MERGEKIT_BMM_NO_AUTOLOAD=1`` to switch it off.

It also re-applies the plugin's compatibility patches (``mergekit_bmm.compat``) once
``mergekit.plan`` has finished executing: when a program imports ``mergekit.plan`` first,
the plugin is registered while that module is still half-loaded and cannot be patched yet.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_TRIGGER = "mergekit.merge_methods"
_CARD_TRIGGER = "mergekit.merge"
_PLAN = "mergekit.plan"


class _LoaderWrapper(importlib.abc.Loader):
    """Delegate loading to mergekit's own loader, then import the plugin."""

    def __init__(self, loader: importlib.abc.Loader, name: str = _TRIGGER) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        if self._name == _PLAN:
            if "mergekit_bmm.compat" in sys.modules:  # the plugin asked for a deferred patch
                try:
                    sys.modules["mergekit_bmm.compat"].apply()
                except Exception as error:
                    print(f"mergekit-bmm: could not apply its mergekit patches: {error}", file=sys.stderr)
            return
        try:
            import mergekit_bmm  # noqa: F401  (registers the methods)
            from mergekit_bmm.errors import install_excepthook

            install_excepthook()
            if module.__name__ == _CARD_TRIGGER:
                from mergekit_bmm import card_hook

                card_hook.install(module)
        except Exception as error:  # never break mergekit because of the plugin
            print(f"mergekit-bmm: could not register its merge methods: {error}", file=sys.stderr)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class _RegistryFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loaders of ``mergekit.merge_methods``, ``mergekit.merge``
    and ``mergekit.plan`` once each."""

    def __init__(self) -> None:
        self._pending = {_TRIGGER, _CARD_TRIGGER, _PLAN}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self._pending:
            return None
        self._pending.discard(fullname)
        if not self._pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderWrapper(spec.loader, fullname)
        return spec


def install() -> None:
    """Install the hook unless disabled or already done."""
    if os.environ.get("MERGEKIT_BMM_NO_AUTOLOAD"):
        return
    if _TRIGGER in sys.modules:
        import mergekit_bmm  # noqa: F401

        return
    if not any(isinstance(finder, _RegistryFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegistryFinder())


install()
