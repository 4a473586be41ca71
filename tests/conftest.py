import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import mlx.core as mx
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Every spec of the suite is derived afresh: a program cache of this session only.
_CACHE = tempfile.mkdtemp(prefix="mlx-recgen-test-cache-")
os.environ["MLX_RECGEN_CACHE"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed():
    """Fresh, reproducible random inputs in every test."""
    mx.random.seed(1234)
    np.random.seed(1234)
    yield


@pytest.fixture
def kernel_calls(monkeypatch):
    """The shapes of the matrix kernels' cores run (``MatrixKernels.core``), so a test knows the
    kernels (not MLX ops) ran; the kernels on for every backend."""
    from mlx_recgen.backends import matrix_kernels as mk

    monkeypatch.setenv("MLX_RECGEN_MATRIX_KERNELS", "1")
    calls = []
    core = mk.MatrixKernels.core

    def counted(self, shape, *grads):
        calls.append(shape)
        return core(self, shape, *grads)

    monkeypatch.setattr(mk.MatrixKernels, "core", counted)
    return calls


def rel_err(a, b, dtype=np.float64) -> float:
    """‖a − b‖ / ‖b‖, computed in ``dtype`` (float64 by default, or float32)."""
    def as_np(x):
        if isinstance(x, mx.array):
            x = np.array(x.astype(mx.float32))
        return np.asarray(x, dtype=dtype)

    a, b = as_np(a), as_np(b)
    assert a.shape == b.shape, f"shape mismatch {a.shape} vs {b.shape}"
    den = np.linalg.norm(b.ravel())
    assert den > 0, "reference is identically zero: the comparison would prove nothing"
    return float(np.linalg.norm((a - b).ravel()) / den)


def cuda_available() -> bool:
    return hasattr(mx, "cuda") and mx.cuda.is_available()


# The kernel backends a test runs on: the emitted Metal through the simulator (marker ``sim``),
# and the same templates as CUDA on an NVIDIA GPU (marker ``gpu``; skipped without one).
KERNEL_BACKENDS = [
    pytest.param("metal-sim", marks=pytest.mark.sim),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not cuda_available(), reason="MLX has no CUDA backend on this machine")]),
]


def check_vmap_compositions(call, ref, xs, unbatched, want=None):
    """``mx.vmap`` of ``unbatched(call)`` over the leading axis of ``xs`` against ``want`` (the
    vmap of ``unbatched(ref)`` when None); then ``mx.grad`` of the vmap and per-example
    gradients (``mx.vmap`` of ``mx.grad``) against the same compositions of ``ref``."""
    y = mx.vmap(unbatched(call))(*xs)
    want = mx.vmap(unbatched(ref))(*xs) if want is None else want
    assert rel_err(y, want) < 1e-5
    w = mx.random.normal(y.shape)
    argnums = tuple(range(len(xs)))
    got = mx.grad(lambda *a: mx.sum(mx.vmap(unbatched(call))(*a) * w), argnums)(*xs)
    want_grads = mx.grad(lambda *a: mx.sum(mx.vmap(unbatched(ref))(*a) * w), argnums)(*xs)
    for g, r in zip(got, want_grads):
        assert rel_err(g, r) < 1e-4

    def per_example_grad(f):
        return mx.vmap(lambda wi, *a: mx.grad(lambda *b: mx.sum(unbatched(f)(*b) * wi),
                                              argnums)(*a))

    for g, r in zip(per_example_grad(call)(w, *xs), per_example_grad(ref)(w, *xs)):
        assert rel_err(g, r) < 1e-4


def assert_nvcc_compiles(sources, flags=("-arch=sm_90",)):
    """Compile each CUDA file of ``sources`` with nvcc (``-c``, to nothing), side by side, since
    nvcc takes seconds a kernel, and assert that every one compiled, with nvcc's errors."""
    jobs = [(src, subprocess.Popen(["nvcc", "-std=c++17", *flags, "-c", str(src), "-o",
                                    os.devnull], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)) for src in sources]
    for src, job in jobs:
        _, err = job.communicate()
        assert job.returncode == 0, f"{src.name}: {err}"
