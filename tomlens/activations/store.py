"""A content-addressed activation store: one folder per request, safetensors shards, a JSON manifest.

The folder's name is a hash of everything that determines the numbers (model, revision, dtypes,
tokenizer, stimuli, sites, positions, library versions), so asking twice finds the first answer
and different requests never collide. Every file is written to a temporary name and renamed into
place, and `manifest.json` is written last: a killed run leaves no shard that loads as valid, and
a folder without a manifest is unfinished work that the next run resumes.

Prompts run in one order, sorted by token length (little padding), and shard `i` holds the stretch
`[start, stop)` of that order: a shard is written whenever enough rows or enough minutes of work are
pending, so shards differ in size, and a resume carries on from where the last finished shard
stops. Inside a shard, rows are in the caller's order and the tensor `rows` names them.

Folder layout:
    shard-00000.safetensors   tensors "<kind>@<position>" [rows, layer, ...] and "rows" [rows];
                              metadata = key, shard index, start, stop
    stimuli.jsonl             the full records, row order
    manifest.json             provenance, sites, layers, positions, shapes, shard list, row labels
"""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from tomlens.errors import TomlensError
from tomlens.io import atomic_path, json_key, read_json
from tomlens.messages import warn

FORMAT = 2  # 2: shards are stretches of the length-sorted order and carry their row indices
MANIFEST = "manifest.json"
STIMULI = "stimuli.jsonl"
LOCK = ".lock"  # flock target: one writer per request folder
ROWS = "rows"  # int64 tensor in every shard: the caller's index of each of its rows (no "@": no clash)


class DamagedStore(TomlensError):
    """A finished store whose shards are missing, truncated or not the ones its manifest lists."""


def default_store() -> Path:
    """`$TOMLENS_HOME/activations`, else the platform's user cache folder for tomlens."""
    from tomlens.models.paths import cache_dir

    return cache_dir() / "activations"


def request_key(request: Mapping[str, Any]) -> str:
    """A short, stable hash of a JSON-able request (sorted keys)."""
    return json_key(request, 24)


def tensor_name(kind: str, position: str) -> str:
    return f"{kind}@{position}"


def shard_file(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest, or None when it is missing or damaged (then the store is unfinished)."""
    try:
        return read_json(folder / MANIFEST)
    except (OSError, ValueError):
        return None


def write_shard(path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> None:
    """Write one shard atomically (CPU, contiguous tensors)."""
    with atomic_path(path) as tmp:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata=dict(metadata))


def shard_meta(key: str, index: int, start: int, stop: int | None = None) -> dict[str, str]:
    """The metadata that ties a shard to its request and to its place in the run order (without
    `stop`: what a resume expects of the shard that continues at `start`)."""
    meta = {"key": key, "shard": str(index), "start": str(start), "format": str(FORMAT)}
    return meta if stop is None else {**meta, "stop": str(stop)}


def read_finished_shard(
    path: Path,
    expected: Mapping[str, str],
    shapes: Callable[[int], Mapping[str, tuple[int, ...]]],
    *,
    load: bool = False,
) -> tuple[int, int, Tensor, dict[str, Tensor] | None] | None:
    """`(start, stop, rows, tensors)` of a finished shard whose metadata has `expected`'s values and
    whose tensors have `shapes(stop - start)` plus `rows`; None for anything else (missing,
    truncated, another request's), which is never loaded: the caller recomputes it or refuses the
    store. `load=True` also returns the shard's tensors (without `rows`), read through the same
    open file as the checks, so what is checked is what is loaded."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if any(meta.get(k) != v for k, v in expected.items()):
                return None
            start, stop = int(meta["start"]), int(meta["stop"])
            want = {**shapes(stop - start), ROWS: (stop - start,)}
            if stop <= start or set(f.keys()) != set(want):
                return None
            if any(tuple(f.get_slice(n).get_shape()) != tuple(s) for n, s in want.items()):
                return None
            rows = f.get_tensor(ROWS)
            tensors = {n: f.get_tensor(n) for n in want if n != ROWS} if load else None
    except Exception:  # a damaged file is not a finished shard (safetensors refuses a truncated one)
        return None
    return (start, stop, rows, tensors) if rows.dtype == torch.int64 else None


def check_writable(folder: str | os.PathLike[str]) -> None:
    """Refuse a store folder this process cannot write (or, not made yet, cannot make), with one
    error naming it and the way out. Called before any work (a caller that loads a model calls it
    first), so a read-only store is not found out as a bare PermissionError after the model has
    loaded. Even a finished request needs it: its reader takes the writer's lock file."""
    folder = Path(folder)
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _not_writable(folder, existing)


def _not_writable(folder: Path, blocked: Path) -> TomlensError:
    where = "" if blocked == folder else f" ({blocked} is not writable)"
    return TomlensError(f"cannot write to the activation store {folder}{where}",
                        "choose a store folder you can write (--store DIR, or store = \"DIR\" in the settings), "
                        f"or give yourself write permission on it (chmod u+w {blocked})")


@contextmanager
def writer_lock(folder: Path) -> Iterator[None]:
    """Hold the folder's lock while a request is resumed and written: two processes caching the
    same request (two probe runs on one stimulus file, jobs sharing a store) take turns instead of
    deleting or overwriting each other's shards. The second one then finds the store finished.
    A lock taken on a folder that `tomlens store prune` removed meanwhile (the lock file it waited
    on is no longer the folder's) is let go and taken again on the folder as it is now."""
    while True:
        handle = _open_lock(folder)
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                warn(f"tomlens: another process is caching {folder.name}; waiting for it")
                fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                if not _still_the_folders(handle, folder):
                    continue
                yield
                return
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _open_lock(folder: Path) -> Any:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return open(folder / LOCK, "a+")  # closed by the caller's `with`
    except PermissionError:
        raise _not_writable(folder, folder if folder.exists() else folder.parent) from None


def _still_the_folders(handle: Any, folder: Path) -> bool:
    """Whether the locked file is still `folder`'s lock file (a pruned folder's is gone)."""
    try:
        return os.fstat(handle.fileno()).st_ino == os.stat(folder / LOCK).st_ino
    except FileNotFoundError:
        return False


def is_complete(folder: Path) -> bool:
    manifest = read_manifest(folder)
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


def remove_shards_from(folder: Path, index: int) -> None:
    """Delete shards numbered `index` and up: left by an earlier run, they do not continue this one."""
    for path in folder.glob("shard-*.safetensors"):
        m = re.fullmatch(r"shard-(\d+)\.safetensors", path.name)
        if m and int(m.group(1)) >= index:
            path.unlink(missing_ok=True)


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

