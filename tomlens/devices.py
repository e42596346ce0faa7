"""The one dtype table and device resolver: CUDA with bf16 when present, else CPU with fp32 (fp16
on CPU is slow). Models, probes and the activation store all name dtypes and devices through it."""

from __future__ import annotations

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


def default_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: Any = None) -> torch.device:
    """`device` as a `torch.device` (None: `default_device()`), refused if it is not available here."""
    if device is None:
        return default_device()
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise TomlensError(f"unknown device {device!r}", "use 'cpu', 'cuda' or 'cuda:N'") from e
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise TomlensError(f"device {device!r} asked for, but CUDA is not available", "use device 'cpu'")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise TomlensError(f"device {device!r} asked for, but MPS is not available", "use device 'cpu'")
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
    may be freed right after). On the CPU it is a no-op copy-free move.
    """
    tensor = host if isinstance(host, torch.Tensor) else torch.tensor(host)
    return tensor.to(device, non_blocking=torch.device(device).type == "cuda")
