"""The simulator's disk cache loads only libraries from a directory no other user can write, and
rebuilds a library whose file is damaged instead of failing (or crashing) on it."""

import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_recgen import cachedirs, sim
from mlx_recgen.sim import compiler

pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(not sim.is_available(), reason="no C++ compiler for the Metal simulator"),
    pytest.mark.filterwarnings("ignore:clang\\+\\+ not found"),
]

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "uint i = thread_position_in_grid.x; out[i] = 2.0f * x[i] - 1.0f;"
RUN = f"""
import mlx.core as mx
import numpy as np
from mlx_recgen import sim

x = mx.array(np.random.default_rng(3).standard_normal(32).astype(np.float32))
k = sim.metal_kernel("cache_probe", ["x"], ["out"], {SOURCE!r})
(out,) = k(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
           output_dtypes=[mx.float32])
assert mx.allclose(out, 2 * x - 1).item(), "wrong result"
print("ok")
"""


def _run_kernel():
    x = mx.array(np.random.default_rng(3).standard_normal(32).astype(np.float32))
    k = sim.metal_kernel("cache_probe", ["x"], ["out"], SOURCE)
    (out,) = k(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
               output_dtypes=[mx.float32])
    assert mx.allclose(out, 2 * x - 1).item()


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A cache directory of this test, a temporary directory of its own for the fallback, no
    kernel loaded from an earlier test and no warning given yet (the runtime stays loaded)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(compiler, "_libs", {})
    monkeypatch.setattr(compiler, "_private", None, raising=False)
    monkeypatch.setattr(cachedirs, "_warned", set())
    directory = tmp_path / "sim"
    monkeypatch.setenv("MLX_RECGEN_SIM_CACHE", str(directory))
    return directory


def _kernel_name(tmp_path, monkeypatch) -> str:
    """The file name of the probe kernel's library (built once in a directory of its own)."""
    monkeypatch.setenv("MLX_RECGEN_SIM_CACHE", str(tmp_path / "first"))
    _run_kernel()
    (lib,) = (tmp_path / "first").glob("k-*.so")
    return lib.name


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_damaged_kernel_library_is_rebuilt(fresh, tmp_path, monkeypatch, damage):
    name = _kernel_name(tmp_path, monkeypatch)
    good = (tmp_path / "first" / name).read_bytes()
    monkeypatch.setenv("MLX_RECGEN_SIM_CACHE", str(fresh))
    monkeypatch.setattr(compiler, "_libs", {})
    fresh.mkdir(mode=0o700)
    planted = {"empty": b"", "truncated": good[: len(good) // 3],
               "garbage": b"\x7fELF" + bytes(range(256)) * 8}[damage]
    (fresh / name).write_bytes(planted)
    if damage == "truncated":  # even with the record of the good file beside it
        (tmp_path / "first" / (name + ".sha256")).replace(fresh / (name + ".sha256"))
    _run_kernel()
    rebuilt = (fresh / name).read_bytes()
    assert rebuilt != planted and len(rebuilt) > len(good) // 2, "the library must be rebuilt"
    assert compiler._intact(fresh / name)


def test_library_failing_to_load_is_rebuilt_once(fresh, monkeypatch):
    """A library that passes the size and digest check yet does not load (say, built by another
    compiler for this key) is deleted and built once more."""
    real = compiler.ctypes.CDLL
    failures = []

    def flaky(path, *a, **kw):
        if "/k-" in str(path) and not failures:
            failures.append(path)
            raise OSError(f"{path}: file too short")
        return real(path, *a, **kw)

    monkeypatch.setattr(compiler.ctypes, "CDLL", flaky)
    _run_kernel()
    assert len(failures) == 1


def test_damaged_runtime_is_rebuilt(tmp_path):
    """A zero-byte runtime library (another process's, as the runtime loads once per process)."""
    directory = tmp_path / "sim"
    directory.mkdir(mode=0o700)
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""
        from mlx_recgen.sim import compiler
        compiler._runtime_path(compiler.find_compiler()).write_bytes(b"")
    """) + RUN)
    env = dict(os.environ, MLX_RECGEN_SIM_CACHE=str(directory), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    (runtime,) = directory.glob("libmslsim_rt-*.so")
    assert runtime.stat().st_size > 0 and compiler._intact(runtime)


def _refused(fresh, monkeypatch, match):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = compiler.cache_dir()
        _run_kernel()
        assert compiler.cache_dir() == first
    ours = [str(w.message) for w in caught if "simulator cache" in str(w.message)]
    assert len(ours) == 1 and str(fresh) in ours[0] and match in ours[0], ours
    assert first != fresh and not list(fresh.glob("k-*")), "the refused directory must not be used"
    st = first.stat()
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert list(first.glob("k-*.so"))
    return first


def test_directory_writable_by_others_is_refused(fresh, monkeypatch):
    fresh.mkdir()
    os.chmod(fresh, 0o777)
    used = _refused(fresh, monkeypatch, "other users can write")
    assert used == Path(tempfile.gettempdir()) / f"mlx-recgen-sim-{os.getuid()}"


def test_directory_of_another_user_is_refused(fresh, tmp_path, monkeypatch):
    fresh.mkdir(mode=0o700)
    uid = os.getuid()
    fallback = Path(tempfile.gettempdir()) / f"mlx-recgen-sim-{uid}"
    monkeypatch.setattr(cachedirs, "_uid", lambda: uid + 1)  # every directory now looks foreign
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        used = compiler.cache_dir()
        assert compiler.cache_dir() == used
    messages = [str(w.message) for w in caught if "simulator cache" in str(w.message)]
    assert len(messages) == 2, messages  # the configured directory and the shared fallback
    assert any(f"cache {fresh} is not used: it is owned by uid {uid}" in m for m in messages)
    assert any(f"cache {fallback} is not used" in m for m in messages)
    assert used not in (fresh, fallback) and used.parent == Path(tempfile.gettempdir())
    assert stat.S_IMODE(used.stat().st_mode) == 0o700


def test_planted_fallback_directory_is_not_used(fresh, monkeypatch):
    """The configured directory cannot be made, and the predictable fallback in the shared
    temporary directory exists, writable by anyone: this process makes its own directory."""
    blocker = fresh.parent / "file"
    blocker.write_text("")
    monkeypatch.setenv("MLX_RECGEN_SIM_CACHE", str(blocker / "sim"))
    planted = Path(tempfile.gettempdir()) / f"mlx-recgen-sim-{os.getuid()}"
    planted.mkdir()
    os.chmod(planted, 0o777)
    used = _refused(planted, monkeypatch, "other users can write")
    assert used.parent == planted.parent and used != planted


def test_new_cache_directory_is_private(fresh):
    old = os.umask(0o022)
    try:
        assert compiler.cache_dir() == fresh
    finally:
        os.umask(old)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
