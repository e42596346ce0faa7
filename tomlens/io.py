"""Atomic writers and content hashes shared by every package: a killed run never leaves a file
that looks finished, and the same content always gets the same key.

Every writer takes the object first and the path second (as `json.dump` and `torch.save` do).
Temporary files are `.<name>.<pid>.tmp` beside the target, so a cleaner can tell a live
writer's file from one left by a process that died (`tomlens.activations.store.remove_stale_temps`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pandas is imported by the table functions only: stimuli and models load without it
    import pandas as pd


def temp_path(path: str | Path) -> Path:
    """The temporary name a writer of `path` in this process uses."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@contextmanager
def atomic_path(path: str | Path, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path`; once the block finishes, it is (fsynced and) renamed
    onto `path`. If the block raises, the temporary file is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(data: bytes | str, path: str | Path) -> Path:
    """Write bytes, or text as UTF-8, to `path` atomically."""
    with atomic_path(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
    return Path(path)


def jsonable(x: Any) -> Any:
    """Plain JSON values: dict keys as strings, tuples as lists, NaN as null, 0-d arrays and
    tensors as numbers, paths as strings."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and math.isnan(x):
        return None
    if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 0) == 0:
        return jsonable(x.item())
    if isinstance(x, Path):
        return str(x)
    return x


def write_json(obj: Any, path: str | Path, *, indent: int = 2) -> Path:
    """Write `obj` as JSON atomically (NaN as null; what JSON has no type for as its `str`)."""
    return write_atomic(json.dumps(jsonable(obj), indent=indent, ensure_ascii=False, default=str) + "\n", path)


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_table(df: pd.DataFrame, path: str | Path) -> Path:
    """Parquet for `.parquet`, CSV otherwise."""
    path = Path(path)
    with atomic_path(path) as tmp:
        if path.suffix == ".parquet":
            df.to_parquet(tmp, index=False)
        else:
            df.to_csv(tmp, index=False)
    return path


def read_table(path: str | Path) -> pd.DataFrame:
    import pandas as pd

    path = Path(path)
    return pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)


def write_jsonl(rows: Iterable[Mapping[str, Any]], path: str | Path) -> Path:
    """One JSON object per line, atomically."""
    with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return Path(path)


# --- content hashes -------------------------------------------------------------------------


def tree_bytes(folder: str | Path) -> int:
    """Bytes of every file under `folder` (a run folder, a store entry), for listings of sizes."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def sha256_hex(data: bytes | str, length: int | None = None) -> str:
    """sha256 of bytes (or UTF-8 text) as hex, cut to `length` digits when given."""
    digest = hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()
    return digest if length is None else digest[:length]


def json_key(obj: Any, length: int = 24) -> str:
    """A short, stable hash of a JSON-able object (sorted keys, compact; `str` for other values):
    request keys of the activation store and of patching checkpoints."""
    return sha256_hex(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str), length)


def records_hash(records: Iterable[Mapping[str, Any]], length: int = 16) -> str:
    """A content hash over records in order (one sorted-key JSON line each): stimuli and pairs."""
    h = hashlib.sha256()
    for record in records:
        h.update(json.dumps(record, sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()[:length]


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
