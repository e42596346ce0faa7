"""What library code says to the person running it: plans, progress notes, stop messages.

Library modules never `print`. They call `say` (INFO: plans, progress, results) or `warn` (WARNING:
something the user should act on or know went differently: another process holds a store, a batch
halved out of memory, a job left running), both through the `tomlens` logger. INFO goes to whatever
`sys.stdout` is at the time and WARNING to the current `sys.stderr` through `tqdm.write`, so a
message never garbles a progress bar, and the CLI, a notebook and pytest's capture all see them. A
caller who wants tomlens quiet or elsewhere uses the standard `logging` API:
`logging.getLogger("tomlens").setLevel(logging.WARNING)`, or removes `STDOUT_HANDLER` /
`STDERR_HANDLER` and adds a handler of their own.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

logger = logging.getLogger("tomlens")


class _CurrentStdout(logging.StreamHandler[TextIO]):
    """A stream handler bound to the *current* `sys.stdout`, not the one at import time."""

    @property
    def stream(self) -> TextIO:
        return sys.stdout

    @stream.setter
    def stream(self, _value: TextIO) -> None:  # logging.StreamHandler.__init__ assigns it
        pass


class _CurrentStderr(logging.Handler):
    """Warnings to the *current* `sys.stderr`, written the way tqdm keeps its bars intact."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging's contract: a handler never raises into the caller
            self.handleError(record)


STDOUT_HANDLER = _CurrentStdout()
STDOUT_HANDLER.setFormatter(logging.Formatter("%(message)s"))
STDOUT_HANDLER.addFilter(lambda record: record.levelno < logging.WARNING)
STDERR_HANDLER = _CurrentStderr(level=logging.WARNING)
STDERR_HANDLER.setFormatter(logging.Formatter("%(message)s"))
if not logger.handlers:
    logger.addHandler(STDOUT_HANDLER)
    logger.addHandler(STDERR_HANDLER)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # one copy of each message, not a second through the root logger


def say(*parts: object, sep: str = " ") -> None:
    """Tell the user `parts` (joined like `print`), flushed at once: plans and stop messages must
    appear before the long work they announce."""
    logger.info(sep.join(str(p) for p in parts))
    STDOUT_HANDLER.flush()


def warn(*parts: object, sep: str = " ") -> None:
    """Tell the user `parts` on stderr (joined like `print`), above any progress bar."""
    logger.warning(sep.join(str(p) for p in parts))


__all__ = ["STDERR_HANDLER", "STDOUT_HANDLER", "logger", "say", "warn"]
