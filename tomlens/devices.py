"""The one dtype table and device resolver: CUDA with bf16 when present, else CPU with fp32 (fp16
on CPU is slow). Models, probes and the activation store all name dtypes and devices through it.

Where a caller names no device, `$TOMLENS_DEVICE` ("cpu", "cuda", "cuda:1") decides before the
hardware does: one setting pins every load, fit and CLI subprocess of a session to one device.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tomlens.errors import TomlensError

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}


DEVICE_ENV = "TOMLENS_DEVICE"


def default_device() -> torch.device:
    """The device used where the caller names none: `$TOMLENS_DEVICE` when set ("cpu", "cuda",
    "cuda:1"; refused if unknown or not available here), else CUDA when present, else CPU.

    Why a variable and not only the hardware: a GPU machine's default (CUDA, and with it bf16)
    changes every number; the test suite, which compares with CPU fp32 numbers, sets it to "cpu",
    and a subprocess (a CLI run) inherits it, as does a user's whole session."""
    chosen = os.environ.get(DEVICE_ENV, "").strip()
    if chosen:
        return _available(chosen, f"{DEVICE_ENV}={chosen!r}",
                          f"set {DEVICE_ENV} to 'cpu', 'cuda' or 'cuda:N' (a device this machine has), or unset it")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: Any = None) -> torch.device:
    """`device` as a `torch.device` (None: `default_device()`), refused if it is not available here."""
    if device is None:
        return default_device()
    return _available(device, f"device {device!r}", "use 'cpu', 'cuda' or 'cuda:N' (a device this machine has)")


def _available(device: Any, asked: str, fix: str) -> torch.device:
    """`device` parsed, or a TomlensError naming what asked for it (`asked`) when it is unknown or
    this machine lacks it (no CUDA, fewer GPUs than its index, no MPS)."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise TomlensError(f"unknown device: {asked}", fix) from e
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise TomlensError(f"{asked} asked for, but CUDA is not available", f"{fix}; 'cpu' works everywhere")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise TomlensError(f"{asked} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)",
                           f"{fix}; CUDA devices count from cuda:0")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise TomlensError(f"{asked} asked for, but MPS is not available", f"{fix}; 'cpu' works everywhere")
    return resolved


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A floating-point dtype from a `torch.dtype` or a name in `DTYPES` ("bf16", "torch.float32", ...)."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise TomlensError(f"dtype {dtype} is not a floating-point type", "use bf16, fp16 or fp32")
        return dtype
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in DTYPES:
        raise TomlensError(f"unknown dtype {dtype!r}", f"use one of {', '.join(sorted(DTYPES))}")
    return DTYPES[key]


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`parse_dtype(dtype)`, or for None the default of `device`: bf16 on CUDA, fp32 elsewhere."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return parse_dtype(dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32: the name manifests and `parse_dtype` use."""
    return str(dtype).removeprefix("torch.")


def to_device(host: Any, device: torch.device | str) -> torch.Tensor:
    """A host tensor (or nested list) moved to `device` without making the host wait.

    A plain `.to("cuda")` or `torch.tensor(..., device="cuda")` from the host ends in a stream
    synchronize: the host waits for every queued kernel before it can go on. `non_blocking=True`
    from host memory queues the copy instead (CUDA stages pageable memory at once, so the source
    may be freed right after; a table of many megabytes may still wait while it is staged, which
    is why the hot loops move small index tables and keep large data on the device). On the CPU it
    is a no-op copy-free move.
    """
    tensor = host if isinstance(host, torch.Tensor) else torch.tensor(host)
    return tensor.to(device, non_blocking=torch.device(device).type == "cuda")
