"""Warnings about mergekit's own code that a user cannot act on, kept off their screen.

mergekit 0.1.5 sets ``config.torch_dtype`` on every merged model's config
(``mergekit.merge._model_out_config``), and transformers 5 answers each merge with
"`torch_dtype` is deprecated! Use `dtype` instead!". The filter drops that message only when
mergekit's merge module is the caller, so the same notice about the user's own code still shows.
"""

from __future__ import annotations

import logging
import sys
from pathlib import PurePath

TRANSFORMERS_CONFIG_LOGGER = "transformers.configuration_utils"
DEPRECATED_DTYPE = "`torch_dtype` is deprecated! Use `dtype` instead!"
MERGEKIT_CALLER = ("mergekit", "merge.py")


class _MergekitDtypeNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != DEPRECATED_DTYPE:
            return True
        frame = sys._getframe(1)
        while frame is not None:
            if PurePath(frame.f_code.co_filename).parts[-2:] == MERGEKIT_CALLER:
                return False
            frame = frame.f_back
        return True


def quiet_mergekit_notices() -> None:
    """Install the filter once per process."""
    logger = logging.getLogger(TRANSFORMERS_CONFIG_LOGGER)
    if not any(isinstance(existing, _MergekitDtypeNotice) for existing in logger.filters):
        logger.addFilter(_MergekitDtypeNotice())
