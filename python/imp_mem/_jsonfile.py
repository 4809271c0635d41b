"""A JSON cache file shared by processes: read, changed and written back
under an exclusive lock (``fcntl.flock`` on a ``.lock`` file beside it), the
new contents written to a temporary file and renamed over the old, so a
reader without the lock sees the old file or the new one, and two writers
never lose each other's entries."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from imp_mem.errors import ImpMemWarning


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Holds the exclusive lock of `path` (where the platform has flock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not Linux
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def read(path: Path) -> Any:
    """The file's JSON, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def update(path: Path, change: Callable[[Any], Any], *, prefix: str = ".cache-") -> Any:
    """Reads `path` (None if missing or unreadable), passes it to `change`,
    and writes what that returns, all under the file's lock. Returns it."""
    with locked(path):
        data = change(read(path))
        fd, tmp = tempfile.mkstemp(prefix=prefix, dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, sort_keys=True, indent=1)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return data


def warn_not_remembered(what: str, exc: BaseException, setting: str) -> None:
    """Warns (`ImpMemWarning`, at the caller's caller) that `what` was
    measured but its cache could not be written: the cache only saves the
    next start a measurement, so the work goes on. `setting` names what
    points the cache at a writable path."""
    warnings.warn(
        f"{what} was not remembered ({exc}); the next start measures again. Set {setting} to a "
        "writable path",
        ImpMemWarning,
        stacklevel=3,
    )
