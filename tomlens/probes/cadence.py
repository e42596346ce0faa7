"""How often an iterative probe loop (Newton steps, pivoted Cholesky columns) asks the host anything.

On an accelerator every question the host asks of a device tensor (`.item()`, `bool(t)`,
`.tolist()`, `nonzero`) makes it wait until every queued kernel has run: a solver that asked after
each Newton step whether it had converged ran as short bursts with the GPU idle between them. So
there the loops ask every `ACCELERATOR_EVERY` steps, and what the host used to decide after each
step (which problems still run, which need a damped factorisation or a shorter step) is computed
on the device as masks; a pivoted Cholesky factorisation computes every column there and reads
its rank once at the end. On the CPU a question costs nothing, and deciding on the host after every
step saves work (finished problems leave the batch at once), so loops there ask after every step.
Both schedules give the same numbers: between questions, finished problems stand still.
"""

from __future__ import annotations

import torch

from tomlens.errors import TomlensError

ACCELERATOR_EVERY = 4  # Newton steps between questions on a GPU: most warm-started fits take 3-5


def check_every(device: torch.device | str, every: int | None = None) -> int:
    """Steps between host questions: `every` when given, else 1 on the CPU and
    `ACCELERATOR_EVERY` elsewhere."""
    if every is not None:
        if int(every) < 1:
            raise TomlensError(f"check_every = {every}", "use 1 (ask after every step) or more")
        return int(every)
    return 1 if torch.device(device).type == "cpu" else ACCELERATOR_EVERY

