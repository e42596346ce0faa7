"""The one list syntax of sites and positions, kept below every package that reads it (`patching`
parses `--positions` with it, `runs` every config's sites and positions), so each layer imports it
downward."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["split_items"]


def split_items(values: str | Sequence[str]) -> list[str]:
    """The one list syntax of sites and positions: items separated by commas and/or spaces. A
    layer list stays with its site: `resid_post:0,4,8,head_out` is `resid_post:0,4,8` and `head_out`."""
    items: list[str] = []
    for value in [values] if isinstance(values, str) else list(values):
        for word in value.split():
            for piece in (p for p in word.split(",") if p):
                if items and ":" in items[-1] and re.fullmatch(r"\d+(-\d+)?", piece):
                    items[-1] += "," + piece
                else:
                    items.append(piece)
    return items
