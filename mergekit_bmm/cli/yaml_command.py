"""``mergekit-bmm-yaml``: mergekit's own ``mergekit-yaml`` with the plugin registered.

For environments where the start-up hook is disabled (``MERGEKIT_BMM_NO_AUTOLOAD``) or
not installed; every flag of ``mergekit-yaml`` works unchanged.
"""

from __future__ import annotations

from mergekit_bmm.errors import exit_on_bmm_error


def main() -> None:
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    import mergekit_bmm  # noqa: F401  (registers the methods)

    with exit_on_bmm_error():
        mergekit_yaml(standalone_mode=True)


if __name__ == "__main__":
    main()
