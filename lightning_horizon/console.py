"""Where the package's lines go: above Lightning's progress bar, and the ones that need saying once, once.

Lightning's progress bar (tqdm) redraws its line with a carriage return and no newline, so a line written to the
terminal while it is open lands on the bar's line (``...train_loss=7.09]step 10: 4,792 tok/s``). The handler here
lets tqdm lift its open bars, writes the line to stderr, and lets tqdm draw them again: what ``tqdm.write`` and
Lightning's own ``progress_bar_callback.print`` do. With no bar open it is a plain stderr handler. The package's
logger gets it unless the user set up logging (then their handlers decide, as for Lightning's own lines).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

_said: set[str] = set()


class AboveProgressBars(logging.StreamHandler):
    """A stderr handler whose lines never land on a progress bar's line (the bars are lifted, then drawn again).

    The stream is looked up at each line, not kept: a progress display that redirects ``sys.stderr`` (Rich) or a
    test's capture sees the line.
    """

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always the current sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        # Lightning's bar class: tqdm keeps the open bars per class (a subclass may hold its own set); with none
        # open this is a plain write
        from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

        with Tqdm.external_write_mode(file=sys.stderr):  # clears bars on stdout too: a terminal mixes both
            super().emit(record)


def install(logger: logging.Logger) -> None:
    """Print ``logger``'s INFO lines above any progress bar, unless the user set up logging themselves."""
    logger.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers() and not any(isinstance(h, AboveProgressBars) for h in logger.handlers):
        logger.addHandler(AboveProgressBars())
        logger.propagate = False


def info_once(logger: logging.Logger, line: str) -> None:
    """Log ``line`` at INFO unless this process logged the same line before (a later validate, test or predict,
    a second Trainer with the same settings)."""
    if line not in _said:
        _said.add(line)
        logger.info(line)


__all__ = ["AboveProgressBars", "info_once", "install"]
