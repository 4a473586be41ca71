"""Cache directories that only the current user can write.

The program cache and the simulator's cache read back what they find (derived programs; shared
libraries that are loaded into the process), so a directory that another user can write, or
that another user owns, would let that user choose what this process runs or computes. Such a
directory is not used. Missing components of a path are created with mode 0700.
"""

from __future__ import annotations

import os
import stat
import threading
import warnings
from pathlib import Path

_warned: set = set()
_lock = threading.Lock()


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def unsafe_reason(path: Path, st: os.stat_result | None = None) -> str | None:
    """Why ``path`` (an existing file or directory) must not be trusted, or ``None``: it is
    not owned by the current user, or its group or other write bit is set."""
    st = os.stat(path) if st is None else st
    uid = _uid()
    if uid is not None and st.st_uid != uid:
        return f"it is owned by uid {st.st_uid}, not by the current user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"other users can write to it (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def make_private(path: Path) -> None:
    """Create ``path`` and its missing parents with mode 0700 (existing ones are left alone)."""
    missing = []
    p = Path(path)
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for p in reversed(missing):
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:  # created meanwhile by another process: checked by the caller
            pass


def prepare(path: Path) -> tuple[str | None, bool]:
    """Create ``path`` if missing and check it: ``(reason, unsafe)`` where ``reason`` is ``None``
    for a directory this user owns, can write, and no other user can write; ``unsafe`` tells a
    directory other users control from one that merely cannot be used (not creatable, not
    writable, not a directory)."""
    try:
        make_private(path)
        st = os.stat(path)
    except OSError as e:
        return f"it cannot be created ({e.strerror or e})", False
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory", False
    why = unsafe_reason(path, st)
    if why is not None:
        return why, True
    if not os.access(path, os.W_OK | os.X_OK):
        return "it is not writable", False
    return None, False


def warn_once(what: str, path: Path, why: str, instead: str) -> None:
    """One ``RuntimeWarning`` per directory and reason in a process."""
    key = (what, str(path), why)
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(f"mlx-recgen: the {what} {path} is not used: {why}; {instead}",
                  RuntimeWarning, stacklevel=3)


__all__ = ["make_private", "prepare", "unsafe_reason", "warn_once"]
