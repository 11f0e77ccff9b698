"""Other libraries' warnings and log lines, kept off gradclip's stderr while they read for it.

gradclip calls into a library (transformers, to rebuild a model's parameter
order from ``config.json``) for one fact. What that library says meanwhile
(a config key it would set differently, a deprecation) is about its own use
of the file, not gradclip's report; on gradclip's stderr it reads as
gradclip's warning, and CI logs fill with it. Failures still reach the
caller as exceptions, which the layout reports in its own words.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def silenced(*loggers: str) -> Iterator[None]:
    """No Python warning, and nothing below CRITICAL from the named loggers (and their
    children, which inherit the level), until the block ends; each level is put back."""
    saved = [(logging.getLogger(name), logging.getLogger(name).level) for name in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger, _ in saved:
            logger.setLevel(logging.CRITICAL)
        try:
            yield
        finally:
            for logger, level in saved:
                logger.setLevel(level)
