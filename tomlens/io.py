"""Atomic writers for result tables and JSON: a killed run never leaves a file that looks finished."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and math.isnan(x):
        return None
    if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 0) == 0:
        return _jsonable(x.item())
    if isinstance(x, Path):
        return str(x)
    return x


def write_json(obj: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp(path)
    tmp.write_text(json.dumps(_jsonable(obj), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def write_table(df: pd.DataFrame, path: str | Path) -> Path:
    """Parquet for `.parquet`, CSV otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp(path)
    if path.suffix == ".parquet":
        df.to_parquet(tmp, index=False)
    else:
        df.to_csv(tmp, index=False)
    tmp.replace(path)
    return path


def read_table(path: str | Path) -> pd.DataFrame:
    path = Path(path)
    return pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
