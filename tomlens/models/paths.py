"""Where tomlens keeps converted models, and how a folder is written so a kill never leaves half of one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """The tomlens cache root: `$TOMLENS_HOME` if set, else the platform's user cache folder."""
    env = os.environ.get("TOMLENS_HOME")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("tomlens"))


def models_dir() -> Path:
    return cache_dir() / "models"


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success rename it to `final` in one step.

    Why: a conversion killed halfway must never leave a folder that later loads as a model.
    If another process finished `final` first, its folder wins and ours is discarded.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the final folder should not be
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
