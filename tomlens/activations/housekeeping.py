"""Looking after the activation store: what it holds, how much room it takes, and removing entries.

The store grows by one folder per distinct request (model x stimuli x sites x positions x ...), and
nothing in a run removes one, because the next run with the same settings reuses it. A handful of
runs fill hundreds of megabytes, so `tomlens store` lists entries (`list_entries`), sums them by
model (`usage_by_model`) and removes what a researcher names (`select_for_pruning`, then
`remove_entries`): entries written before a date, the entries a run folder read, or unfinished ones.

Removing is always safe for results: a run folder keeps its own tables, and an entry that is needed
again is recomputed (same key, same numbers). It is not safe while a process writes the entry, so
`remove_entries` takes the entry's writer lock without waiting and skips an entry that is busy.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tomlens.activations import store as st
from tomlens.errors import TomlensError
from tomlens.io import tree_bytes

KEY_LENGTH = 24  # `store.request_key` names folders with 24 hex digits


@dataclass(frozen=True)
class StoreEntry:
    """One request folder of the store: its key, the model that made it, and its size on disk."""

    key: str
    path: Path
    model: str  # the model name in the manifest's provenance ("?" for an unfinished entry)
    rows: int  # prompts cached (0 when unfinished)
    sites: str  # e.g. "resid_post x 30 layers, head_out x 30 layers"
    positions: str
    created: datetime | None  # the manifest's `created`; else the folder's modification time
    complete: bool
    bytes: int  # every file in the folder


@dataclass(frozen=True)
class ModelUsage:
    model: str
    entries: int
    bytes: int


def _entry_folders(root: Path) -> Iterator[Path]:
    """Folders of `root` named like store keys; anything else there (a user's file) is left alone."""
    if not root.is_dir():
        return
    for child in sorted(root.iterdir()):
        if child.is_dir() and len(child.name) == KEY_LENGTH and all(c in "0123456789abcdef" for c in child.name):
            yield child


def _parse_time(text: Any) -> datetime | None:
    if not isinstance(text, str):
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S.%f%z"):
        try:
            return datetime.strptime(text, fmt)
        except ValueError:
            continue
    return None


def _sites_text(manifest: dict[str, Any]) -> str:
    layers = manifest.get("layers")
    if not isinstance(layers, dict):
        return "?"
    return ", ".join(f"{kind} x {len(ls)} layers" for kind, ls in layers.items())


def read_entry(folder: Path) -> StoreEntry:
    """The entry in `folder`, read from its manifest (an unfinished folder has none)."""
    manifest = st.read_manifest(folder) or {}
    provenance = manifest.get("model")
    model = str(provenance.get("model", "?")) if isinstance(provenance, dict) else "?"
    created = _parse_time(manifest.get("created")) or datetime.fromtimestamp(folder.stat().st_mtime, UTC)
    return StoreEntry(key=folder.name, path=folder, model=model, rows=int(manifest.get("n", 0) or 0),
                      sites=_sites_text(manifest), positions=", ".join(map(str, manifest.get("positions", []))) or "?",
                      created=created, complete=st.is_complete(folder), bytes=tree_bytes(folder))


def list_entries(root: Path | None = None) -> list[StoreEntry]:
    """Every entry under the store `root` (default: `$TOMLENS_HOME/activations`), oldest first."""
    root = Path(root) if root is not None else st.default_store()
    entries = [read_entry(f) for f in _entry_folders(root)]
    return sorted(entries, key=lambda e: (e.created or datetime.min.replace(tzinfo=UTC), e.key))


def usage_by_model(entries: Iterable[StoreEntry]) -> list[ModelUsage]:
    """Entries and bytes per model, largest first."""
    totals: dict[str, list[int]] = {}
    for e in entries:
        t = totals.setdefault(e.model, [0, 0])
        t[0] += 1
        t[1] += e.bytes
    return sorted((ModelUsage(m, n, b) for m, (n, b) in totals.items()), key=lambda u: -u.bytes)


def parse_age(text: str) -> timedelta:
    """'30d', '12h', '2w' or a bare number of days, as a duration."""
    units = {"h": timedelta(hours=1), "d": timedelta(days=1), "w": timedelta(weeks=1)}
    body, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "d")
    try:
        amount = float(body)
    except ValueError:
        raise TomlensError(f"--older-than {text!r} is not an age",
                           "write a number with h, d or w, e.g. --older-than 30d (days when no unit)") from None
    if amount < 0:
        raise TomlensError(f"--older-than {text!r} is negative", "use an age of 0 or more, e.g. 30d")
    return amount * units[unit]


def store_folders_named_in(run_folder: Path, root: Path) -> set[str]:
    """Keys of the store entries a run folder's JSON files name (a result's `activations`, a cache
    result's `store`, ...): the entries that run read or wrote."""
    run_folder = Path(run_folder)
    if not run_folder.is_dir():
        raise TomlensError(f"run folder {run_folder} does not exist", "name a folder a tomlens run wrote (--out)")
    present = {f.name for f in _entry_folders(Path(root))}
    keys: set[str] = set()
    for path in run_folder.rglob("*.json"):
        try:
            text = path.read_text(encoding="utf-8")
        except OSError:
            continue
        keys |= present.intersection(re.findall(rf"(?<![0-9a-f])[0-9a-f]{{{KEY_LENGTH}}}(?![0-9a-f])", text))
    return keys


def select_for_pruning(entries: Iterable[StoreEntry], *, older_than: timedelta | None = None,
                       run_keys: set[str] | None = None, incomplete: bool = False, everything: bool = False,
                       now: datetime | None = None) -> list[StoreEntry]:
    """The entries every given criterion picks (criteria combine with AND); at least one is needed
    (`everything` is the criterion that picks all), so that a bare `prune` never empties the store."""
    if older_than is None and run_keys is None and not incomplete and not everything:
        raise TomlensError("prune needs a criterion: nothing is removed without one",
                           "add --older-than 30d, --run FOLDER or --incomplete (or --all to empty the store)")
    now = now or datetime.now(UTC)
    picked = []
    for e in entries:
        if older_than is not None and (e.created is None or now - e.created < older_than):
            continue
        if run_keys is not None and e.key not in run_keys:
            continue
        if incomplete and e.complete:
            continue
        picked.append(e)
    return picked


def _try_lock(folder: Path) -> Any:
    """The entry's writer lock, taken without waiting; None when another process holds it."""
    handle = open(folder / st.LOCK, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def remove_entries(entries: Iterable[StoreEntry]) -> tuple[list[StoreEntry], list[StoreEntry]]:
    """Delete each entry's folder; (removed, busy): an entry a live process is writing is skipped."""
    removed, busy = [], []
    for e in entries:
        if not e.path.is_dir():
            continue
        handle = _try_lock(e.path)
        if handle is None:
            busy.append(e)
            continue
        try:  # out of the store's namespace first: a writer that opens the key next makes a new folder
            doomed = e.path.with_name(f".removing-{e.key}-{os.getpid()}")
            e.path.rename(doomed)
            shutil.rmtree(doomed)
            removed.append(e)
        finally:
            handle.close()
    return removed, busy


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


__all__ = ["ModelUsage", "StoreEntry", "human_bytes", "list_entries", "parse_age", "read_entry",
           "remove_entries", "select_for_pruning", "store_folders_named_in", "usage_by_model"]
