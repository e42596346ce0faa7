"""Where tomlens keeps converted models, and how a folder is written so a kill never leaves half of one."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import platformdirs

STALE_TMP_SECONDS = 3600.0  # a temp folder this old belongs to a conversion that was killed


def cache_dir() -> Path:
    """The tomlens cache root: `$TOMLENS_HOME` if set, else the platform's user cache folder."""
    env = os.environ.get("TOMLENS_HOME")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("tomlens"))


def models_dir() -> Path:
    return cache_dir() / "models"


def _remove_stale_temps(final: Path) -> None:
    now = time.time()
    for old in final.parent.glob(f".{final.name}.tmp-*"):
        try:
            if now - old.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; when the block succeeds, it replaces `final` by rename.

    Why: a conversion killed halfway must never leave a folder that later loads as a model.
    Readers check a marker file written last, so even the short gap while a stale folder is
    swapped out only makes a concurrent reader convert again, never load half a folder.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the final folder should not be
    try:
        yield tmp
        if final.exists():
            trash = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():  # another process finished first: keep its folder
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
