"""Timing a forward to say beforehand how long work will take, and writing a duration for people.

One implementation for every stage (decoding's estimate, validation's plan, patching's plan), so
that each synchronises the GPU before reading the clock (CUDA kernels run asynchronously: without
it a timed forward reads as nearly free) and spells durations the same way. It sits below every
layer (it imports only torch), so behaviour, patching and runs may all call it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def synchronise() -> None:
    """Wait for queued GPU work on every visible GPU (a model on cuda:1 queues there, not on the
    current device); a no-op without CUDA."""
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


def time_call(fn: Callable[[], Any], *, warm_up: bool = True) -> float:
    """Seconds of one call of `fn` (e.g. `lambda: model(ids)`) under `torch.no_grad`, after one
    untimed warm-up call (the first pays for allocation and kernel choice), synchronising the GPU
    around the timed call."""
    with torch.no_grad():
        if warm_up:
            fn()
        synchronise()
        t0 = time.perf_counter()
        fn()
        synchronise()
        return time.perf_counter() - t0


def format_seconds(s: float) -> str:
    """"12 s", "7 min", "2.5 h": the rough duration printed before long work."""
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


__all__ = ["format_seconds", "synchronise", "time_call"]
