"""``mergekit-bmm-yaml``: mergekit's own ``mergekit-yaml`` with the plugin registered.

For environments where the start-up hook is disabled (``MERGEKIT_BMM_NO_AUTOLOAD``) or
not installed; every flag of ``mergekit-yaml`` works unchanged.
"""

from __future__ import annotations

import sys

from mergekit_bmm.errors import find_bmm_error, one_line


def main() -> None:
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    import mergekit_bmm  # noqa: F401  (registers the methods)

    try:
        mergekit_yaml(standalone_mode=True)
    except Exception as error:
        ours = find_bmm_error(error)
        if ours is None:
            raise
        print(one_line(ours), file=sys.stderr)
        sys.exit(ours.exit_code)


if __name__ == "__main__":
    main()
