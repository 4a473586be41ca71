"""Where the bundled data folders are: inside the wheel, or at the top of a source checkout."""

from __future__ import annotations

from pathlib import Path


def _bundled(name: str) -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / name, here.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"the bundled {name}/ folder is missing from this installation")


def specs_dir() -> Path:
    return _bundled("specs")


def templates_dir() -> Path:
    return _bundled("templates")
