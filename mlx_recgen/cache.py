"""An on-disk cache of derived step programs, keyed by the content of a spec.

Deriving the adjoint runs sympy; a spec that has not changed need not pay that again in every
process. The cache stores the forward program and the adjoint of a spec under a key made of

* a stable text of the spec: its axes and roles, every declared tensor, the traced symbols and
  the traced expressions (``sympy.srepr``), the names of its reductions;
* the library version, a digest of the compiler modules' source (a changed compiler misses)
  and the sympy and Python versions.

Location: ``$MLX_RECGEN_CACHE`` if set (``0``, ``off`` or ``none`` disable the cache), else
``$XDG_CACHE_HOME/mlx-recgen/programs``, else ``~/.cache/mlx-recgen/programs``.

A file is written under a temporary name and renamed into place (``os.replace``), so processes
can share the directory. A file is used only if it unpickles, names the same full key text, its
payload matches its digest, and the programs it holds are consistent with the spec (their stores
and free symbols); anything else is a miss, and the programs are derived again.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import sys
import tempfile
from pathlib import Path

import sympy

FORMAT = "mlx-recgen-programs-1"
_DISABLED = {"0", "off", "none", "false", "no"}
# The modules whose code decides the derived programs.
_COMPILER_MODULES = ("spec.py", "functions.py", "ir.py", "adjoint.py", "simplify.py", "cache.py")
_compiler_digest_value = None


def cache_dir() -> Path | None:
    """The directory of the program cache, or ``None`` when it is disabled."""
    env = os.environ.get("MLX_RECGEN_CACHE")
    if env is not None and env.strip().lower() in _DISABLED | {""}:
        return None
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx-recgen" / "programs"


def _compiler_digest() -> str:
    global _compiler_digest_value
    if _compiler_digest_value is None:
        h = hashlib.sha256()
        here = Path(__file__).resolve().parent
        for name in _COMPILER_MODULES:
            h.update(name.encode())
            h.update((here / name).read_bytes())
        _compiler_digest_value = h.hexdigest()
    return _compiler_digest_value


def spec_key(spec) -> str:
    """A stable text of everything in the spec that the derived programs depend on."""
    from . import __version__

    def tensor(t):  # every field: roles, group axes, whether it is differentiated
        return repr(t)

    lines = [FORMAT, f"mlx-recgen {__version__} {_compiler_digest()}",
             f"sympy {sympy.__version__}", f"python {sys.version_info[0]}.{sys.version_info[1]}",
             f"spec {spec.name}", f"time {spec.time}", f"lane {spec.lane}",
             f"batch {spec.batch_axes!r}", f"state_axis {spec.state_axis!r}",
             f"index {spec.index_name!r}", f"groups {sorted(spec.groups.items())!r}"]
    lines += [tensor(t) for group in (spec.states, spec.inputs, spec.outputs) for t in group.values()]
    lines += [f"symbol {slot.tensor} {slot.component} {sympy.srepr(sym)}"
              for slot, sym in spec.symbols.items()]
    lines += [f"vector {name}" for name in sorted(str(s) for s in spec.vector_symbols)]
    lines += [f"update {slot.tensor} {slot.component} {sympy.srepr(e)}"
              for slot, e in spec.state_updates.items()]
    lines += [f"output {slot.tensor} {slot.component} {sympy.srepr(e)}"
              for slot, e in spec.output_exprs.items()]
    lines += [f"reduce {name} {sympy.srepr(e)}" for e, name in spec.reduce_names.items()]
    return "\n".join(lines)


def _path(directory: Path, spec, key: str) -> Path:
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    safe = "".join(c if c.isalnum() or c in "_-" else "_" for c in spec.name)[:40]
    return directory / f"{safe}-{digest}.pkl"


class _EnvelopeUnpickler(pickle.Unpickler):
    """The outer record holds only builtins; refuse anything else."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a cache record")


def load(spec):
    """``(forward_program, adjoint)`` from the cache, or ``None`` (a miss, an unreadable or
    corrupt file, a disabled cache)."""
    directory = cache_dir()
    if directory is None:
        return None
    try:
        key = spec_key(spec)
        data = _path(directory, spec, key).read_bytes()
        record = _EnvelopeUnpickler(io.BytesIO(data)).load()
        if not (isinstance(record, dict) and record.get("format") == FORMAT
                and record.get("key") == key and isinstance(record.get("payload"), bytes)):
            return None
        payload = record["payload"]
        if hashlib.sha256(payload).hexdigest() != record.get("digest"):
            return None
        forward, adjoint = pickle.loads(payload)
        if not _consistent(spec, forward, adjoint):
            return None
        return forward, adjoint
    except Exception:  # any failure to read is a miss: derive again
        return None


def store(spec, forward, adjoint) -> bool:
    """Write the programs of ``spec``; ``False`` when the cache is disabled or not writable."""
    directory = cache_dir()
    if directory is None:
        return False
    tmp = None
    try:
        key = spec_key(spec)
        payload = pickle.dumps((forward, adjoint), protocol=pickle.HIGHEST_PROTOCOL)
        record = {"format": FORMAT, "key": key, "payload": payload,
                  "digest": hashlib.sha256(payload).hexdigest()}
        directory.mkdir(parents=True, exist_ok=True)
        path = _path(directory, spec, key)
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "wb") as f:
            f.write(pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(tmp, path)
        return True
    except Exception:  # a cache that cannot be written is no cache
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False


def _consistent(spec, forward, adjoint) -> bool:
    """The loaded programs fit the spec: the stores it needs, and no symbol it does not know."""
    from .adjoint import Adjoint
    from .ir import Assign, Accumulate, Loop, Program, Store

    if not (isinstance(forward, Program) and isinstance(adjoint, Adjoint)
            and isinstance(adjoint.program, Program)):
        return False
    ybar, lam = adjoint.output_cotangents, adjoint.state_cotangents
    if set(ybar) != set(spec.output_slots()) or set(lam) != set(spec.state_slots()):
        return False
    known = set(spec.symbols.values())
    expected = {
        id(forward): (known, {("state", s) for s in spec.state_slots()}
                      | {("output", s) for s in spec.output_slots()}),
        id(adjoint.program): (known | set(ybar.values()) | set(lam.values()),
                              {("lambda", s) for s in spec.state_slots()}
                              | {("grad", s) for s in spec.input_slots()}),
    }
    for program in (forward, adjoint.program):
        readable, stores = expected[id(program)]
        readable = set(readable)
        seen = set()
        for st in program.statements:
            body = st.body if isinstance(st, Loop) else [st]
            if not isinstance(st, (Loop, Assign, Accumulate, Store)):
                return False
            # every statement is one of the vocabulary and reads only what is defined
            targets = {b.target for b in body if isinstance(b, (Assign, Accumulate))}
            readable |= targets  # a loop body reads its own temporaries and accumulators
            for b in body:
                if not isinstance(b, (Assign, Accumulate, Store)):
                    return False
                if not isinstance(b.expr, sympy.Basic) or not b.expr.free_symbols <= readable:
                    return False
                if isinstance(b, Store):
                    seen.add((b.kind, b.slot))
        if seen != stores:
            return False
    return True


__all__ = ["cache_dir", "load", "store", "spec_key"]
