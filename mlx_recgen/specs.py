"""Loading specs: the bundled ones by name, a user's from a Python file."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import linecache
from pathlib import Path

from .errors import SpecError
from .resources import specs_dir


def list_specs() -> list:
    """Names of the bundled specs."""
    return sorted(p.stem for p in specs_dir().glob("*.py") if not p.stem.startswith("_"))


# (resolved path, recurrence name or None) -> (sha256 of the file's bytes, the recurrence): a
# file edited since it was loaded is loaded again.
_cache: dict = {}


def load_spec(name_or_path):
    """A ``Recurrence`` from a bundled spec name (``"ssd"``) or a user's file (``"my_spec.py"``).

    A file must define exactly one recurrence at module level, or name one with
    ``path.py:name``. A file is run once per content: loading it again returns the same
    recurrence until the file changes."""
    from .function import Recurrence

    text = str(name_or_path)
    attr = None
    if ":" in text and not Path(text).exists():
        text, attr = text.rsplit(":", 1)
    path = Path(text)
    if path.suffix != ".py":
        if text not in list_specs():
            raise ValueError(f"unknown spec '{text}'; bundled specs are {list_specs()}, or pass a "
                             "path to a .py file")
        path = specs_dir() / f"{text}.py"
    if not path.is_file():
        raise FileNotFoundError(f"spec file not found: {path}")
    key = (str(path.resolve()), attr)
    source = path.read_bytes()
    digest = hashlib.sha256(source).hexdigest()
    if key in _cache and _cache[key][0] == digest:
        return _cache[key][1]
    module_name = f"mlx_recgen_spec_{path.stem}_{abs(hash(key))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader_spec)
    # compiled from the bytes just read, not through the loader: its bytecode cache trusts a
    # file's mtime in whole seconds and its size, so it would run an edit of the same size
    # made within the second as the old text
    linecache.checkcache(str(path))  # errors quote the body's lines from the text that runs
    exec(compile(source, str(path), "exec"), vars(module))
    found = {k: v for k, v in vars(module).items() if isinstance(v, Recurrence)}
    if attr is not None:
        if attr not in found:
            raise SpecError(attr, f"{path} defines no recurrence named '{attr}' (found {list(found)})")
        rec = found[attr]
    elif not found:
        raise SpecError(path.stem, f"{path} defines no recurrence (no module-level object made "
                                   "by @rg.recurrence)")
    elif len(found) == 1:
        rec = next(iter(found.values()))
    elif path.stem in found:
        rec = found[path.stem]
    else:
        raise SpecError(path.stem, f"{path} defines {len(found)} recurrences {list(found)}; "
                                   "name one as path.py:name")
    if not rec.spec.doc and module.__doc__:
        rec.spec.doc = inspect.cleandoc(module.__doc__)
    _cache[key] = (digest, rec)
    return rec
