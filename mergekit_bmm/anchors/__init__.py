"""Moved: the merges' pure-torch math is :mod:`mergekit_bmm.core` (same function names).

``from mergekit_bmm.anchors import tsv_merge`` keeps working and warns once; write
``from mergekit_bmm.core import tsv_merge``.
"""

import warnings

from mergekit_bmm.core import *  # noqa: F403
from mergekit_bmm.core import __all__  # noqa: F401

warnings.warn(
    "mergekit_bmm.anchors moved to mergekit_bmm.core (same names): import from mergekit_bmm.core",
    DeprecationWarning,
    stacklevel=2,
)
