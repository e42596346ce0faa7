"""Finished chunks of a patching sweep on disk, so a stopped sweep resumes from what finished.

A sweep's chunks live in `<out>/.partial/<key>/`, where `key` hashes everything that decides the
numbers (model provenance, the pairs, the sweep settings): a changed command gets another folder
and never reuses stale chunks. Each chunk is one safetensors file written to a temporary name,
synced and renamed into place, and its metadata names the key and the chunk: a killed writer
leaves at most a temporary file, which is never read, and a file that fails to open, belongs to
another key or chunk, or has other shapes than expected is treated as missing and recomputed.
`manifest.json` beside the chunks records the settings for a reader. The folder is removed once
the sweep's final outputs are written.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from tomlens.io import atomic_path, json_key, write_atomic

PARTIAL = ".partial"


def _settings_key(settings: Mapping[str, Any]) -> str:
    """A short, stable hash of JSON-able settings (sorted keys)."""
    return json_key(settings, 20)


class Checkpoints:
    """Chunk files of one sweep (one `key`) under `root/.partial/key/`."""

    def __init__(self, root: str | Path, settings: Mapping[str, Any]):
        self.key = _settings_key(settings)
        self.settings = dict(settings)
        self.folder = Path(root) / PARTIAL / self.key
        self.saved = 0  # chunks written by this process
        self.loaded = 0  # chunks read back

    @classmethod
    def at(cls, folder: str | Path) -> Checkpoints:
        """The checkpoints in an existing `.partial/<key>` folder (to inspect what a run left)."""
        folder = Path(folder)
        manifest = json.loads((folder / "manifest.json").read_text())
        store = cls(folder.parent.parent, manifest["settings"])
        if store.key != folder.name:
            raise ValueError(f"{folder} holds checkpoints of key {manifest['key']}, not of its own name")
        return store

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}.safetensors"

    def load(self, name: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Tensor] | None:
        """The chunk's tensors if a finished chunk of this key and name with exactly these tensor
        shapes is on disk, else None (missing, damaged or not this sweep's: recompute it)."""
        path = self._path(name)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                if meta.get("key") != self.key or meta.get("chunk") != name or set(f.keys()) != set(shapes):
                    return None
                if any(tuple(f.get_slice(n).get_shape()) != tuple(s) for n, s in shapes.items()):
                    return None
                out = {n: f.get_tensor(n) for n in shapes}
        except Exception:  # noqa: BLE001 - a damaged file is not a finished chunk
            return None
        self.loaded += 1
        return out

    def save(self, name: str, tensors: Mapping[str, Tensor]) -> None:
        """Write one chunk atomically (temporary name, fsync, rename)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        manifest = self.folder / "manifest.json"
        if not manifest.exists():
            write_atomic(json.dumps({"key": self.key, "settings": self.settings}, indent=1, default=str), manifest)
        with atomic_path(self._path(name)) as tmp:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp),
                      metadata={"key": self.key, "chunk": name})
        self.saved += 1

    def count(self) -> int:
        """Chunk files on disk (finished or not yet checked)."""
        return len(list(self.folder.glob("*.safetensors"))) if self.folder.is_dir() else 0

    def clear(self) -> None:
        """Remove this sweep's chunks (after its final outputs are written), and `.partial` if empty."""
        shutil.rmtree(self.folder, ignore_errors=True)
        try:
            self.folder.parent.rmdir()
        except OSError:
            pass
