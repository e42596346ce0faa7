"""Probe directions on disk: one safetensors file of tensors plus a JSON file saying what they are.

Patching and steering read these back: `coef` / `intercept` apply the probe to raw activations,
`direction` is the unit vector to add or project out, `mass_mean` the difference of class means.
Tensors are named `<target>/<kind>/<position>/<what>` and shaped `[layer, k, d]` or
`[layer, head, k, d]`. Files are written under a temporary name and renamed, so a killed run
leaves nothing that loads as finished.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from tomlens.errors import TomlensError


def _sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def save_directions(path: str | Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, Any]) -> Path:
    """Write `tensors` to `path` (.safetensors) and `metadata` to the `.json` next to it."""
    from tomlens.io import atomic_path, write_json

    path = Path(path)
    if path.suffix != ".safetensors":
        raise TomlensError(f"direction file {path} must end in .safetensors", "rename the output path")
    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    with atomic_path(path) as tmp:  # tensors first: a sidecar is never newer than the tensors it describes
        save_file(flat, str(tmp), metadata={"format": "tomlens-directions", "version": "1"})
    write_json(dict(metadata), _sidecar(path))
    return path


def load_directions(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Read back what `save_directions` wrote: the tensors and the metadata."""
    path = Path(path)
    if not path.exists():
        raise TomlensError(f"no direction file at {path}", "run `tomlens probe` first, or check the path")
    tensors = load_file(str(path))
    side = _sidecar(path)
    meta = json.loads(side.read_text(encoding="utf-8")) if side.exists() else {}
    return {k: v.clone() for k, v in tensors.items()}, meta


def direction_name(target: str, kind: str, position: str, what: str) -> str:
    return f"{target}/{kind}/{position}/{what}"


def unit_norm(v: Tensor) -> Tensor:
    return v / v.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(v.dtype).tiny)
