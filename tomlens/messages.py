"""What library code says to the person running it: plans, progress notes, stop messages.

Library modules never `print`; they call `say`, which logs to the `tomlens` logger at INFO. That
logger writes bare messages to whatever `sys.stdout` is at the time (so the CLI, a notebook and
pytest's capture all see them as before), and a caller who wants tomlens quiet or elsewhere uses
the standard `logging` API: `logging.getLogger("tomlens").setLevel(logging.WARNING)`, or removes
`STDOUT_HANDLER` and adds a handler of their own.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

logger = logging.getLogger("tomlens")


class _CurrentStdout(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler bound to the *current* `sys.stdout`, not the one at import time."""

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stdout

    @stream.setter
    def stream(self, _value: TextIO) -> None:  # logging.StreamHandler.__init__ assigns it
        pass


STDOUT_HANDLER = _CurrentStdout()
STDOUT_HANDLER.setFormatter(logging.Formatter("%(message)s"))
if not logger.handlers:
    logger.addHandler(STDOUT_HANDLER)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # one copy of each message, not a second through the root logger


def say(*parts: object, sep: str = " ") -> None:
    """Tell the user `parts` (joined like `print`), flushed at once: plans and stop messages must
    appear before the long work they announce."""
    logger.info(sep.join(str(p) for p in parts))
    STDOUT_HANDLER.flush()


__all__ = ["STDOUT_HANDLER", "logger", "say"]
