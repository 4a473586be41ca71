"""Compile simulator kernels with the host C++ compiler, with a two-level cache.

* in-process: ``{hash of the C++ text: loaded library}``;
* on disk: ``$MLX_RECGEN_SIM_CACHE`` or ``$XDG_CACHE_HOME/mlx-recgen/sim`` or
  ``~/.cache/mlx-recgen/sim``; files are written to a temporary name and renamed,
  so concurrent test processes can share the directory.

The disk cache holds shared libraries that are loaded into the process, so a directory is used
only if the current user owns it and no other user can write it (``mlx_recgen.cachedirs``);
missing directories are created with mode 0700. When the configured directory cannot be used,
``$TMPDIR/mlx-recgen-sim-<uid>`` is (created likewise), and when that one exists but fails the
check, a fresh ``tempfile.mkdtemp()`` directory for this process; a directory refused because
another user controls it is reported once with a ``RuntimeWarning``.

Beside each library ``<name>.so`` lies ``<name>.so.sha256`` with its size and digest, written
after the library; a library whose file does not match (zero bytes, truncated, garbage, or no
record) is deleted and built again before it is loaded, as is one that fails to load.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Sequence

from .. import cachedirs
from .errors import MetalCompileError, SimulatorSetupError

CSRC = Path(__file__).resolve().parent / "csrc"
_VERSION = "1"

_lock = threading.RLock()
_libs: dict[str, ctypes.CDLL] = {}
_runtime: ctypes.CDLL | None = None
_compiler: str | None = None
_clang: str | None | bool = False  # False: not looked up yet
_private: Path | None = None  # this process's own fallback directory, made when first needed


def cache_dir() -> Path:
    """The disk cache: the configured directory when only this user can write it, else a
    private fallback (see the module docstring)."""
    d = os.environ.get("MLX_RECGEN_SIM_CACHE")
    if d:
        p = Path(d)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        p = Path(base) / "mlx-recgen" / "sim"
    why, unsafe = cachedirs.prepare(p)
    if why is None:
        return p
    fallback = _fallback_dir()
    if unsafe:
        cachedirs.warn_once("simulator cache", p, why, f"using {fallback} instead")
    return fallback


def _fallback_dir() -> Path:
    """``$TMPDIR/mlx-recgen-sim-<uid>`` if it is (or can be made) private, else a directory of
    this process's own: a predictable name in a shared directory may have been made by anyone."""
    global _private
    shared = Path(tempfile.gettempdir()) / f"mlx-recgen-sim-{os.getuid()}"
    why, _ = cachedirs.prepare(shared)
    if why is None:
        return shared
    with _lock:
        if _private is None or not _private.is_dir():
            _private = Path(tempfile.mkdtemp(prefix="mlx-recgen-sim-"))
            atexit.register(shutil.rmtree, _private, ignore_errors=True)
        private = _private
    cachedirs.warn_once("simulator cache", shared, why, f"using {private} for this process")
    return private


def find_compiler() -> str:
    """The C++ compiler: $MLX_RECGEN_SIM_CXX, else g++, else clang++, else c++."""
    global _compiler
    if _compiler:
        return _compiler
    env = os.environ.get("MLX_RECGEN_SIM_CXX")
    cands = [env] if env else ["g++", "clang++", "c++"]
    for c in cands:
        path = shutil.which(c) if c else None
        if path:
            _compiler = path
            return path
    raise SimulatorSetupError(
        "the Metal simulator needs a C++17 compiler (clang++ or g++); none found on PATH"
    )


def find_clang() -> str | None:
    """clang++ for the address-space pass (None if absent)."""
    global _clang
    if _clang is False:
        _clang = shutil.which("clang++") or None
        if _clang is None:
            for v in range(20, 13, -1):
                p = shutil.which(f"clang++-{v}")
                if p:
                    _clang = p
                    break
    return _clang  # type: ignore[return-value]


def _compiler_id(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except Exception:  # pragma: no cover
        out = cxx
    return out.splitlines()[0] if out else cxx


def _sources_hash() -> str:
    h = hashlib.sha256(_VERSION.encode())
    for name in ("msl_rt.h", "msl_shim.h", "msl_runtime.cpp", "msl_addrspace.h"):
        p = CSRC / name
        if p.exists():
            h.update(p.read_bytes())
    return h.hexdigest()


_SRC_HASH = None


def sources_hash() -> str:
    global _SRC_HASH
    if _SRC_HASH is None:
        _SRC_HASH = _sources_hash()
    return _SRC_HASH


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _fingerprint(data: bytes) -> str:
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}\n"


def _intact(path: Path) -> bool:
    """The library at ``path`` is the file that was built: its size and digest match the
    record written beside it."""
    try:
        return _digest_path(path).read_text() == _fingerprint(path.read_bytes())
    except (OSError, UnicodeDecodeError):
        return False


def _remove(path: Path) -> None:
    for p in (path, _digest_path(path)):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _atomic_compile(cmd_tail: list[str], src_text: str, out_path: Path, suffix: str,
                    cxx: str) -> subprocess.CompletedProcess:
    d = out_path.parent
    fd, tmp_src = tempfile.mkstemp(suffix=suffix, dir=d)
    with os.fdopen(fd, "w") as f:
        f.write(src_text)
    tmp_out = str(out_path) + f".tmp{os.getpid()}.{threading.get_ident()}"
    tmp_digest = tmp_out + ".sha256"
    try:
        proc = subprocess.run([cxx, tmp_src, "-o", tmp_out] + cmd_tail,
                              capture_output=True, text=True)
        if proc.returncode == 0:
            # on disk before it is named: a crash leaves no empty library under the final name
            with open(tmp_out, "rb") as f:
                data = f.read()
                os.fsync(f.fileno())
            with open(tmp_digest, "w") as f:
                f.write(_fingerprint(data))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_out, out_path)
            os.replace(tmp_digest, _digest_path(out_path))
        proc.tmp_src = tmp_src  # type: ignore[attr-defined]
        return proc
    finally:
        for p in (tmp_src, tmp_out, tmp_digest):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def _load(path: Path, build, mode: int = ctypes.DEFAULT_MODE) -> ctypes.CDLL:
    """Load the library at ``path``, built by ``build()`` first when it is missing or not
    intact; a library that fails to load is deleted and built once more."""
    for attempt in range(2):
        if attempt or not _intact(path):
            _remove(path)
            build()
        try:
            return ctypes.CDLL(str(path), mode=mode)
        except OSError as e:
            if attempt:
                raise SimulatorSetupError(f"loading the simulator library {path} failed: {e}") from e
    raise AssertionError("unreachable")


def _runtime_path(cxx: str) -> Path:
    key = hashlib.sha256((sources_hash() + _compiler_id(cxx)).encode()).hexdigest()[:24]
    return cache_dir() / f"libmslsim_rt-{key}.so"


def runtime() -> ctypes.CDLL:
    """Build (once) and load the simulator runtime library (RTLD_GLOBAL)."""
    global _runtime
    with _lock:
        if _runtime is not None:
            return _runtime
        cxx = find_compiler()
        path = _runtime_path(cxx)

        def build():
            src = (CSRC / "msl_runtime.cpp").read_text()
            proc = _atomic_compile(
                ["-std=c++17", "-O2", "-fPIC", "-shared", f"-I{CSRC}", "-x", "c++"],
                src, path, ".cpp", cxx)
            if proc.returncode != 0:
                raise SimulatorSetupError("building the simulator runtime failed:\n" + proc.stderr)

        lib = _load(path, build, mode=ctypes.RTLD_GLOBAL)
        lib.msl_launch.restype = ctypes.c_int
        lib.msl_launch.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        _runtime = lib
        return lib


KERNEL_FLAGS = ["-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-fno-exceptions",
                "-fwrapv", "-fno-strict-aliasing", "-fstack-clash-protection", "-w"]


def _format_diagnostics(stderr: str, msl_name: str, msl_text: str, tmp_src: str) -> str:
    lines = msl_text.splitlines()
    out = []
    for ln in stderr.splitlines():
        ln = ln.replace(tmp_src, "<sim-tu>")
        ln = re.sub(r"\S*/csrc/", "", ln)
        out.append(ln)
        m = re.match(re.escape(msl_name) + r":(\d+):(\d+): (?:fatal )?error", ln)
        if m:
            k = int(m.group(1))
            if 1 <= k <= len(lines):
                out.append(f"  {k} | {lines[k - 1]}")
    text = "\n".join(out)
    if len(out) > 80:
        text = "\n".join(out[:80]) + f"\n... ({len(out) - 80} more lines)"
    return text


def compile_kernel(kernel_name: str, msl_name: str, msl_text: str, tu: str,
                   flags: Sequence[str] = ()) -> ctypes.CDLL:
    """Compile the C++ translation unit ``tu`` (built from ``msl_text``) and load it.

    ``flags``: compiler flags after ``KERNEL_FLAGS`` (the math mode's)."""
    runtime()
    cxx = find_compiler()
    all_flags = KERNEL_FLAGS + list(flags)
    key = hashlib.sha256(
        (tu + "\0" + sources_hash() + "\0" + " ".join(all_flags) + "\0" + cxx).encode()
    ).hexdigest()[:32]
    with _lock:
        lib = _libs.get(key)
        if lib is not None:
            return lib
        path = cache_dir() / f"k-{key}.so"

        def build():
            proc = _atomic_compile(all_flags + [f"-I{CSRC}", f"-I{CSRC / 'include'}", "-lm"],
                                   tu, path, ".cpp", cxx)
            if proc.returncode != 0:
                msg = _format_diagnostics(proc.stderr, msl_name, msl_text,
                                          getattr(proc, "tmp_src", ""))
                raise MetalCompileError(
                    f"kernel `{kernel_name}` failed to compile:\n{msg}", kernel=kernel_name)

        lib = _load(path, build)
        _libs[key] = lib
        return lib


def addrspace_check(kernel_name: str, msl_name: str, msl_text: str, tu: str) -> None:
    """Syntax-only clang pass with address-space attributes; reports only
    address-space diagnostics (everything else is the main pass's business)."""
    clang = find_clang()
    if clang is None:
        return
    key = hashlib.sha256((tu + sources_hash() + clang).encode()).hexdigest()[:32]
    ok_marker = cache_dir() / f"as-{key}.ok"
    if ok_marker.exists():
        return
    fd, tmp = tempfile.mkstemp(suffix=".cpp", dir=cache_dir())
    with os.fdopen(fd, "w") as f:
        f.write(tu)
    try:
        proc = subprocess.run(
            [clang, "-std=c++17", "-fsyntax-only", "-ferror-limit=0", f"-I{CSRC}",
             f"-I{CSRC / 'include'}", "-Wno-everything", tmp],
            capture_output=True, text=True)
    finally:
        os.unlink(tmp)
    errs = []
    lines = msl_text.splitlines()
    for ln in proc.stderr.splitlines():
        if not ln.startswith(msl_name) or not _is_addrspace_diag(ln):
            continue
        errs.append(ln)
        m = re.match(re.escape(msl_name) + r":(\d+):", ln)
        if m and 1 <= int(m.group(1)) <= len(lines):
            errs.append(f"  {m.group(1)} | {lines[int(m.group(1)) - 1]}")
    if errs:
        raise MetalCompileError(
            f"kernel `{kernel_name}`: address-space error (Metal rejects mixing "
            f"device/constant/threadgroup/thread pointers):\n" + "\n".join(errs),
            kernel=kernel_name)
    try:
        ok_marker.touch()
    except OSError:  # pragma: no cover
        pass


_QUOTED_PTR = re.compile(r"'((?:const |volatile )*)(device |constant |threadgroup )?[^']*\*[^']*'")


def _is_addrspace_diag(line: str) -> bool:
    """Does a clang diagnostic line report mixing address spaces?"""
    if "error:" not in line and "note:" not in line:
        return False
    if "automatic variable qualified with an address space" in line:
        return False
    if "address space" in line:
        return True
    spaces = {(m.group(2) or "thread").strip() for m in _QUOTED_PTR.finditer(line)}
    return len(spaces) >= 2


def clear_memory_cache() -> None:
    """Forget loaded kernels (the disk cache stays)."""
    with _lock:
        _libs.clear()


def warn_no_clang_once() -> None:
    if find_clang() is None and not getattr(warn_no_clang_once, "done", False):
        warn_no_clang_once.done = True  # type: ignore[attr-defined]
        warnings.warn(
            "clang++ not found: the Metal simulator skips its address-space check "
            "(install clang to enable it)", RuntimeWarning, stacklevel=3)
