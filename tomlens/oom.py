"""Out-of-memory as a recoverable event: the batch shrinks and the run goes on.

Every stage that batches forwards (caching, behaviour scoring, patching) catches the same errors and
halves its batch; a test simulates the error once with a hook that raises it.
"""

from __future__ import annotations

import torch

OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    {getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError}
)


def release_memory() -> None:
    """Give cached accelerator memory back before retrying with a smaller batch."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
