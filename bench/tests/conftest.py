"""The benchmark's tests run offline: every model and corpus they use is made or read locally."""

from __future__ import annotations

import os

for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(name, "1")
