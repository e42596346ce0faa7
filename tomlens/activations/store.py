"""A content-addressed activation store: one folder per request, safetensors shards, a JSON manifest.

The folder's name is a hash of everything that determines the numbers (model, revision, dtypes,
tokenizer, stimuli, sites, positions, library versions), so asking twice finds the first answer
and different requests never collide. Every file is written to a temporary name and renamed into
place, and `manifest.json` is written last: a killed run leaves no shard that loads as valid, and
a folder without a manifest is unfinished work that the next run resumes.

Folder layout:
    plan.json                 rows per shard (fixed by the first run so a resume matches it)
    shard-00000.safetensors   tensors "<kind>@<position>", [rows, layer, ...]; metadata = key, rows
    stimuli.jsonl             the full records, row order
    manifest.json             provenance, sites, layers, positions, shapes, shard list, row labels
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

FORMAT = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"
STIMULI = "stimuli.jsonl"


def default_store() -> Path:
    """`$TOMLENS_HOME/activations`, else the platform's user cache folder for tomlens."""
    from tomlens.models.paths import cache_dir

    return cache_dir() / "activations"


def request_key(request: Mapping[str, Any]) -> str:
    """A short, stable hash of a JSON-able request (sorted keys)."""
    blob = json.dumps(request, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def tensor_name(kind: str, position: str) -> str:
    return f"{kind}@{position}"


def shard_file(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _fsync_replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically: temporary name, fsync, rename."""
    tmp = _tmp_name(path)
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False, default=str))
    _fsync_replace(tmp, path)


def write_text(path: Path, text: str) -> None:
    tmp = _tmp_name(path)
    tmp.write_text(text, encoding="utf-8")
    _fsync_replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_shard(path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> None:
    """Write one shard atomically (CPU, contiguous tensors)."""
    tmp = _tmp_name(path)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp),
              metadata=dict(metadata))
    _fsync_replace(tmp, path)


def open_shard(path: Path) -> dict[str, Tensor]:
    """All tensors of a shard, memory-mapped (safetensors maps the file; pages load on first touch)."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def shard_is_valid(path: Path, metadata: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether a finished shard matches what the plan expects (metadata, names and shapes)."""
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if any(meta.get(k) != v for k, v in metadata.items()):
                return False
            if set(f.keys()) != set(shapes):
                return False
            return all(tuple(f.get_slice(n).get_shape()) == tuple(s) for n, s in shapes.items())
    except Exception:  # a damaged file is not a finished shard; it is recomputed
        return False


def is_complete(folder: Path) -> bool:
    manifest = read_json(folder / MANIFEST)
    return bool(
        manifest
        and manifest.get("complete")
        and manifest.get("format") == FORMAT
        and all((folder / s["file"]).is_file() for s in manifest.get("shards", []))
    )


def remove_stale_temps(folder: Path) -> None:
    """Delete temporary files left by processes that no longer run (never another live writer's)."""
    for tmp in folder.glob(".*.tmp"):
        m = re.search(r"\.(\d+)\.tmp$", tmp.name)
        if m and _pid_alive(int(m.group(1))) and int(m.group(1)) != os.getpid():
            continue
        tmp.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("shard-*.safetensors"))


def dtype_from_name(name: str) -> torch.dtype:
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
               "float": "float32", "fp64": "float64", "double": "float64"}
    name = aliases.get(name, name)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        from tomlens.errors import TomlensError

        raise TomlensError(f"{name!r} is not a floating-point dtype", "use float32, bfloat16 or float16")
    return dtype


def dtype_to_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
