"""Metal simulator: every checker fires on a kernel planted with its bug."""

import re

import mlx.core as mx
import numpy as np
import pytest

from mlx_recgen import sim

pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(not sim.is_available(), reason="no C++ compiler for the Metal simulator"),
    pytest.mark.filterwarnings("ignore:clang\\+\\+ not found"),
]

rng = np.random.default_rng(7)
THREAD = re.compile(r"thread \(\d+,\d+,\d+\)")


def run(name, src, n=64, tg=64, header="", out_n=None, init_value=None, inputs=None, **kw):
    k = sim.metal_kernel(name, ["x"], ["out"], src, header=header, **kw)
    x = mx.array(rng.standard_normal(n).astype(np.float32)) if inputs is None else inputs
    return k(inputs=[x], grid=(n, 1, 1), threadgroup=(tg, 1, 1),
             output_shapes=[(out_n or n,)], output_dtypes=[mx.float32], init_value=init_value)


def names_kernel_and_thread(msg, name):
    assert f"custom_kernel_{name}" in msg, msg
    assert THREAD.search(msg), msg


def test_out_of_bounds_write():
    src = """
        uint i = thread_position_in_grid.x;
        out[i + 1] = x[i];
    """
    with pytest.raises(sim.OutOfBoundsError) as e:
        run("oob_write", src)
    msg = str(e.value)
    names_kernel_and_thread(msg, "oob_write")
    assert "write" in msg and "`out`" in msg and "element 64" in msg
    assert "thread (63,0,0)" in msg


def test_out_of_bounds_read():
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = x[i] + x[i + 10];
    """
    with pytest.raises(sim.OutOfBoundsError) as e:
        run("oob_read", src)
    msg = str(e.value)
    names_kernel_and_thread(msg, "oob_read")
    assert "read" in msg and "input `x`" in msg and "thread (54,0,0)" in msg


def test_out_of_bounds_threadgroup_array():
    src = """
        threadgroup float buf[32];
        uint t = thread_index_in_threadgroup;
        buf[t] = x[t];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[t] = buf[t];
    """
    with pytest.raises(sim.OutOfBoundsError) as e:
        run("oob_tg", src)
    msg = str(e.value)
    names_kernel_and_thread(msg, "oob_tg")
    assert "threadgroup array `buf`" in msg and "thread (32,0,0)" in msg


def test_unwritten_output_element():
    src = """
        uint i = thread_position_in_grid.x;
        if (i != 5) out[i] = x[i];
    """
    with pytest.raises(sim.UnwrittenOutputError) as e:
        run("unwritten", src)
    msg = str(e.value)
    assert "custom_kernel_unwritten" in msg and "`out` element 5" in msg
    assert "thread (5,0,0)" in msg
    # with init_value the same kernel is fine
    (out,) = run("unwritten", src, init_value=0.0)
    assert np.array(out)[5] == 0.0


def test_simd_sum_in_divergent_code():
    src = """
        uint i = thread_position_in_grid.x;
        float v = x[i];
        if (thread_index_in_simdgroup < 16) {
            v = simd_sum(v);
        }
        out[i] = v;
    """
    with pytest.raises(sim.SimdDivergenceError) as e:
        run("simd_div", src)
    msg = str(e.value)
    names_kernel_and_thread(msg, "simd_div")
    assert "simd_sum" in msg and "only part of simdgroup" in msg and "line" in msg


def test_simd_collective_after_early_return():
    src = """
        uint i = thread_position_in_grid.x;
        if (i >= 40) return;
        out[i] = simd_sum(x[i]);
    """
    with pytest.raises(sim.SimdDivergenceError) as e:
        run("simd_ret", src, init_value=0.0)
    assert "has returned" in str(e.value)
    names_kernel_and_thread(str(e.value), "simd_ret")


def test_different_collectives_at_once():
    src = """
        uint i = thread_position_in_grid.x;
        float v = x[i];
        if (thread_index_in_simdgroup % 2 == 0) {
            v = simd_sum(v);
        } else {
            v = simd_max(v);
        }
        out[i] = v;
    """
    with pytest.raises(sim.SimdDivergenceError) as e:
        run("simd_diff", src)
    msg = str(e.value)
    names_kernel_and_thread(msg, "simd_diff")
    assert "simd_sum" in msg and "simd_max" in msg


def test_barrier_in_divergent_code():
    src = """
        uint t = thread_index_in_threadgroup;
        threadgroup float buf[64];
        buf[t] = x[t];
        if (t < 32) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        out[t] = buf[t];
    """
    with pytest.raises(sim.BarrierDivergenceError) as e:
        run("bar_div", src)
    msg = str(e.value)
    names_kernel_and_thread(msg, "bar_div")
    assert "threadgroup_barrier" in msg and "has returned" in msg


def test_missing_barrier_race_on_threadgroup_memory():
    src = """
        uint t = thread_index_in_threadgroup;
        threadgroup float buf[64];
        buf[t] = x[thread_position_in_grid.x];
        // missing threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_position_in_grid.x] = buf[(t + 1) % 64];
    """
    with pytest.raises(sim.DataRaceError) as e:
        run("race_tg", src, n=128)
    msg = str(e.value)
    names_kernel_and_thread(msg, "race_tg")
    assert "threadgroup array `buf`" in msg and "mem_threadgroup" in msg
    # the fixed kernel runs
    fixed = src.replace("// missing ", "")
    x = rng.standard_normal(128).astype(np.float32)
    (out,) = run("race_tg_fixed", fixed, n=128, inputs=mx.array(x))
    expected = np.roll(x.reshape(2, 64), -1, axis=1).ravel()  # each group reads its next thread
    np.testing.assert_array_equal(np.array(out), expected)


def test_write_write_race_on_threadgroup_memory():
    src = """
        threadgroup float acc;
        acc = x[thread_position_in_grid.x];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_position_in_grid.x] = acc;
    """
    with pytest.raises(sim.DataRaceError) as e:
        run("race_ww", src)
    names_kernel_and_thread(str(e.value), "race_ww")
    assert "write" in str(e.value)


def test_device_race_across_threadgroups():
    src = """
        uint i = thread_position_in_grid.x;
        out[i % 32] = x[i];
    """
    with pytest.raises(sim.DataRaceError) as e:
        run("race_dev", src, n=64, tg=32, out_n=32)
    msg = str(e.value)
    names_kernel_and_thread(msg, "race_dev")
    assert "another threadgroup" in msg and "output `out`" in msg


def test_uninitialised_threadgroup_read():
    src = """
        uint t = thread_index_in_threadgroup;
        threadgroup float buf[64];
        if (t > 0) buf[t] = x[t];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[t] = buf[0];
    """
    with pytest.raises(sim.UninitializedReadError) as e:
        run("uninit_tg", src)
    names_kernel_and_thread(str(e.value), "uninit_tg")


def test_double_is_rejected():
    src = """
        uint i = thread_position_in_grid.x;
        double v = x[i];
        out[i] = float(v);
    """
    with pytest.raises(sim.MetalCompileError) as e:
        run("dbl", src)
    msg = str(e.value)
    assert "custom_kernel_dbl" in msg and "double" in msg
    assert ".metal:" in msg  # file:line of the MSL text


def test_recursion_is_rejected():
    header = """
    inline float fact(int n) { return n <= 1 ? 1.0f : float(n) * fact(n - 1); }
    """
    src = "out[thread_position_in_grid.x] = fact(3) * x[thread_position_in_grid.x];"
    with pytest.raises(sim.MetalCompileError) as e:
        run("recur", src, header=header)
    assert "recursi" in str(e.value) and "fact" in str(e.value)


def test_cxx_compile_error_reports_msl_line():
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = x[i] + undefined_name;
    """
    with pytest.raises(sim.MetalCompileError) as e:
        run("cerr", src)
    msg = str(e.value)
    assert "undefined_name" in msg
    # body line 3 of the source; signature lines come first in the MLX text
    assert re.search(r"custom_kernel_cerr_float_float\.metal:\d+:\d+: error", msg), msg


def test_cstdlib_math_is_not_msl():
    src = "out[thread_position_in_grid.x] = expf(x[thread_position_in_grid.x]);"
    with pytest.raises(sim.MetalCompileError):
        run("expf", src)


@pytest.mark.skipif(sim.find_clang() is None, reason="clang++ not installed")
def test_address_space_mismatch():
    src = """
        threadgroup float buf[64];
        uint t = thread_index_in_threadgroup;
        threadgroup float* p = out;   // device pointer into a threadgroup pointer
        buf[t] = x[t];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[t] = buf[t] + p[0] * 0.0f;
    """
    with pytest.raises(sim.MetalCompileError) as e:
        run("aspace", src)
    assert "address-space" in str(e.value) and "device float *" in str(e.value)
    names = str(e.value)
    assert "custom_kernel_aspace" in names


def test_threadgroup_memory_beyond_metals_32_kib(monkeypatch):
    """A group declaring more than Metal's 32 KiB of threadgroup memory fails, unless the
    simulator is told to allow more (``sim.kernel.THREADGROUP_BYTES``: tests of kernels tiled
    for CUDA's larger group memory)."""
    from mlx_recgen.sim import kernel as sim_kernel

    src = """
        threadgroup float big[9000];  // 36000 bytes
        uint t = thread_index_in_threadgroup;
        big[t] = x[t];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[t] = big[63 - t];
    """
    with pytest.raises(sim.KernelRuntimeError) as e:
        run("tg_bytes", src)
    assert "exceeds the 32768 bytes a threadgroup may use" in str(e.value)
    monkeypatch.setattr(sim_kernel, "THREADGROUP_BYTES", 40000)
    x = mx.array(rng.standard_normal(64).astype(np.float32))
    out = run("tg_bytes", src, inputs=x)[0]
    assert np.array_equal(np.array(out), np.array(x)[::-1])
