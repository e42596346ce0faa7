"""Which runs this machine has made: an index of finished run folders, and a listing built from it.

A run's folder is wherever `--out` put it, so nothing but a record kept at save time can list them
later. Every finished save (`tomlens.runs.files.finish_save`) appends the folder to
`$TOMLENS_HOME/runs.jsonl`, one JSON line, under a file lock. `list_runs` reads the index (and any
folders a caller names), folds a stage's folder into the experiment it belongs to, drops folders
that no longer exist, and describes each run from its own files: name, models, stages, verdict,
size and time. The index is a convenience: failing to write it never fails a run.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from tomlens.io import tree_bytes

INDEX = "runs.jsonl"
# A single command's folder written from Python (no `tomlens` argv in its manifest) says which
# command it is by a file only that command writes.
SIGNATURES: tuple[tuple[str, str], ...] = (
    ("audit.json", "audit"), ("probes.json", "probe"), ("pairs.jsonl", "pairs"), ("checks.json", "validate"),
    ("prompts.parquet", "behave"),
)


@dataclass(frozen=True)
class RunEntry:
    """One past run, as `tomlens runs` prints it."""

    folder: Path
    name: str
    kind: str  # "experiment", or the command that wrote a single stage (probe, patch, ...)
    models: tuple[str, ...]
    stages: tuple[str, ...]  # finished stages (an experiment's), or the one stage
    unfinished: tuple[str, ...]  # an experiment's stages with no result.json
    verdict: str
    bytes: int
    time: datetime


def index_path() -> Path:
    """`$TOMLENS_RUN_INDEX` if set (the test suite points it at a temporary file), else
    `$TOMLENS_HOME/runs.jsonl`."""
    import os

    from tomlens.models.paths import cache_dir

    return Path(os.environ["TOMLENS_RUN_INDEX"]) if os.environ.get("TOMLENS_RUN_INDEX") else cache_dir() / INDEX


@contextmanager
def _locked(path: Path, mode: str) -> Iterator[IO[str]]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, mode, encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield handle
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def record_run(folder: Path) -> None:
    """Append `folder` to the index; an index that cannot be written is skipped without a word,
    because a run's results do not depend on it."""
    line = json.dumps({"folder": str(Path(folder).resolve()), "time": datetime.now(UTC).isoformat()})
    try:
        with _locked(index_path(), "a") as handle:
            handle.write(line + "\n")
    except OSError:
        pass


def _folders_in(text: str) -> list[Path]:
    folders = []
    for line in text.splitlines():
        try:
            folders.append(Path(json.loads(line)["folder"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut short by a full disk: the rest still reads
    return folders


def _roots(folders: Iterable[Path]) -> list[Path]:
    """The run root of each folder still on disk, once each, in order."""
    return list(dict.fromkeys(run_root(f.resolve()) for f in folders if f.is_dir()))


def indexed_roots(extra: Iterable[Path] = ()) -> list[Path]:
    """The run roots the index names, plus `extra` folders; the index is rewritten to exactly those
    (folders deleted since dropped, stages folded into their experiment) in one locked read and
    write, so a run recorded meanwhile waits for the lock instead of being lost. An index this
    process cannot write is read as it is."""
    path = index_path()
    extra = list(extra)
    try:
        with _locked(path, "a+") as handle:
            handle.seek(0)
            roots = _roots([*_folders_in(handle.read()), *extra])
            handle.seek(0)
            handle.truncate()
            handle.write("".join(json.dumps({"folder": str(f)}) + "\n" for f in roots))
            return roots
    except OSError:
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        return _roots([*_folders_in(text), *extra])


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _is_experiment(folder: Path) -> bool:
    return isinstance(_read(folder / "config.json").get("models"), list)


def run_root(folder: Path) -> Path:
    """The experiment `folder` is a stage of (`<out>/<stage>`, `<out>/<model>/<stage>`), else itself."""
    for parent in (folder.parent, folder.parent.parent):
        if _is_experiment(parent):
            return parent
    return folder


def found_under(root: Path, depth: int = 4) -> list[Path]:
    """Finished run folders (holding result.json) under `root`, at most `depth` levels down."""
    found: list[Path] = []
    if not root.is_dir():
        return found
    for level in range(depth + 1):
        found += [p.parent for p in root.glob("/".join(["*"] * level + ["result.json"]))]
    return found


def _model_name(manifest: dict[str, Any]) -> str | None:
    model = manifest.get("model")
    return str(model.get("model")) if isinstance(model, dict) and model.get("model") else None


def _stage_verdict(folder: Path) -> str | None:
    """What a stage's result.json says against a finding: withheld, or an audit's shortcuts."""
    result = _read(folder / "result.json")
    if result.get("withheld"):
        return "withheld"
    if result.get("forced"):
        return "forced"
    verdict = result.get("verdict")
    if isinstance(verdict, str) and verdict.startswith("SHORTCUTS"):
        return "shortcuts"
    return None


def _command(folder: Path) -> str:
    argv = _read(folder / "manifest.json").get("argv")
    if isinstance(argv, list) and len(argv) > 1 and str(argv[0]).endswith(("tomlens", "__main__.py")):
        return str(argv[1])
    return next((cmd for name, cmd in SIGNATURES if (folder / name).exists()), "run")


def _times(folders: Iterable[Path]) -> datetime:
    stamps = [(f / "result.json").stat().st_mtime for f in folders if (f / "result.json").is_file()]
    return datetime.fromtimestamp(max(stamps, default=0.0), UTC)


def describe_experiment(root: Path) -> RunEntry:
    from tomlens.runs.experiment import STAGES

    config, manifest = _read(root / "config.json"), _read(root / "manifest.json")
    models = [m for m in config.get("models", []) if isinstance(m, dict)]
    names = tuple(str(m.get("name", "?")) for m in models)
    planned = [s for s in STAGES if s in config]
    per_model = [m.get("stages", {}) for m in manifest.get("models", []) if isinstance(m, dict)]
    # An experiment stopped before its manifest: its stages are `<root>/<stage>` or `<root>/<model>/<stage>`.
    folders = [Path(p) for stages in per_model for p in stages.values()] or \
        [f for s in planned for f in (root / s, *root.glob(f"*/{s}"))]
    done = tuple(dict.fromkeys(f.name for f in folders if (f / "result.json").is_file()))
    unfinished = tuple(s for s in planned if s not in done)
    verdicts = sorted({f"{f.name} {v}" for f in folders if (v := _stage_verdict(f))})
    verdict = "; ".join(verdicts) or ("finished" if not unfinished else "unfinished")
    return RunEntry(root, str(config.get("name") or root.name), "experiment", names, done, unfinished,
                    verdict, tree_bytes(root), _times(folders))


def describe_single(folder: Path) -> RunEntry:
    manifest = _read(folder / "manifest.json")
    command = _command(folder)
    name = _model_name(manifest)
    return RunEntry(folder, folder.name, command, (name,) if name else (), (command,), (),
                    _stage_verdict(folder) or "finished", tree_bytes(folder), _times([folder]))


def list_runs(extra: Iterable[Path] = ()) -> list[RunEntry]:
    """Every indexed run still on disk, plus finished runs under the `extra` folders, newest first."""
    roots = indexed_roots(f for root in extra for f in found_under(Path(root)))
    entries = [describe_experiment(r) if _is_experiment(r) else describe_single(r) for r in roots]
    return sorted(entries, key=lambda e: e.time, reverse=True)


__all__ = ["RunEntry", "describe_experiment", "describe_single", "found_under", "index_path", "indexed_roots",
           "list_runs", "record_run", "run_root"]
