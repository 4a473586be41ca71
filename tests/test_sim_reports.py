"""Metal simulator: same-value stores (a warning, or an error under strict_races) and the
source line that race, bounds, uninitialised-read and divergence reports name."""

import warnings

import mlx.core as mx
import numpy as np
import pytest

from mlx_recgen import sim
from mlx_recgen.sim import compiler
from mlx_recgen.sim import kernel as sim_kernel

pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(not sim.is_available(), reason="no C++ compiler for the Metal simulator"),
    pytest.mark.filterwarnings("ignore:clang\\+\\+ not found"),
]

rng = np.random.default_rng(5)


def run(name, src, n=64, tg=64, header="", inputs=None, template=None, **kw):
    k = sim.metal_kernel(name, ["x"], ["out"], src, header=header, **kw)
    x = mx.array(rng.standard_normal(n).astype(np.float32)) if inputs is None else inputs
    (out,) = k(inputs=[x], grid=(n, 1, 1), threadgroup=(tg, 1, 1), template=template,
               output_shapes=[(n,)], output_dtypes=[mx.float32])
    return np.array(out)


# -- same-value stores ---------------------------------------------------------------
MASKED = """
    // every lane of the simdgroup zeroes the row's element 0, as mlx-lm's masked
    // gated-delta kernels do, then writes its own element
    uint i = thread_position_in_grid.x;
    out[(i / 32) * 32] = 0.0f;
    if (i % 32 != 0) out[i] = x[i];
"""


def test_identical_stores_from_a_simdgroup_are_a_warning():
    x = rng.standard_normal(64).astype(np.float32)
    with pytest.warns(sim.SameValueStoreWarning, match=r"62 store\(s\).*source line 5"):
        out = run("same_value", MASKED, inputs=mx.array(x))
    want = x.copy()
    want[[0, 32]] = 0
    np.testing.assert_array_equal(out, want)


def test_two_threads_storing_an_attribute_is_a_warning():
    # both threads of the group store threads_per_threadgroup.x to one element
    k = sim.metal_kernel("attr_store", ["a"], ["out"], "out[0] = threads_per_threadgroup.x;")
    with pytest.warns(sim.SameValueStoreWarning, match=r"1 store\(s\)"):
        (out,) = k(inputs=[mx.zeros((1, 1))], grid=(2, 1, 1), threadgroup=(2, 1, 1),
                   output_shapes=[(1, 1)], output_dtypes=[mx.uint32])
    assert out.item() == 2


def test_identical_stores_are_an_error_under_strict_races():
    with pytest.raises(sim.DataRaceError, match="same value .*strict_races=True"):
        run("same_value_strict", MASKED, strict_races=True)


def test_identical_stores_across_threadgroups_are_a_warning():
    src = """
        uint i = thread_position_in_grid.x;
        if (i != 0) out[i] = x[i];
        if (i % 32 == 5) out[0] = 1.5f;  // one lane per group, groups are unordered
    """
    with pytest.warns(sim.SameValueStoreWarning, match="another threadgroup"):
        run("same_value_groups", src, tg=32)


def test_conflicting_stores_stay_a_race():
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = x[i];
        out[0] = float(i);
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error", sim.SameValueStoreWarning)
        with pytest.raises(sim.DataRaceError, match="output `out` element 0"):
            run("different_values", src)


def test_a_different_value_after_an_agreed_one_is_a_race():
    # threads 0 and 1 agree on 7, then thread 0 stores 8 with nothing ordering
    # thread 1's store of 7 before it
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = 0.0f;
        threadgroup_barrier(mem_flags::mem_device);
        if (i < 2) out[40] = 7.0f;
        if (i == 0) out[40] = 8.0f;
    """
    with pytest.raises(sim.DataRaceError, match="element 40"):
        run("agreed_then_not", src)


def test_same_value_store_against_a_read_stays_a_race():
    src = """
        uint i = thread_position_in_grid.x;
        threadgroup float buf[1];
        if (i == 0) buf[0] = 1.0f;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float v = buf[0];
        if (i == 3) buf[0] = 1.0f;
        out[i] = v;
    """
    with pytest.raises(sim.DataRaceError, match="conflicts with a read"):
        run("same_value_read", src)


# -- source lines ---------------------------------------------------------------------
def test_out_of_bounds_names_the_source_line_and_statement():
    src = """
        uint i = thread_position_in_grid.x;
        float v = x[i];
        out[i + 1] = v;
    """
    with pytest.raises(sim.OutOfBoundsError) as e:
        run("oob_line", src)
    msg = str(e.value)
    assert "at source line 4 (" in msg and "`out[i + 1] = v;`" in msg, msg
    assert e.value.line is not None and ".metal:%d:" % e.value.line in msg


TWO_RACES = """
    uint i = thread_position_in_grid.x;
    threadgroup float a[64];
    threadgroup float b[64];
    a[i] = x[i];
    b[i] = x[i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float u = WHICH == 0 ? a[63 - i] : 0.0f;
    a[i] = 1.0f;
    float w = WHICH == 1 ? b[(i + 1) % 64] : 0.0f;
    b[i] = 2.0f;
    out[i] = u + w;
"""


def test_two_races_in_one_kernel_read_differently():
    msgs = []
    for which in (0, 1):
        with pytest.raises(sim.DataRaceError) as e:
            run("two_races", TWO_RACES, template=[("WHICH", which)])
        msgs.append(str(e.value))
    assert "source line 9" in msgs[0] and "`a[i] = 1.0f;`" in msgs[0], msgs[0]
    assert "source line 8" in msgs[0] and "a[63 - i]" in msgs[0], msgs[0]
    assert "source line 11" in msgs[1] and "`b[i] = 2.0f;`" in msgs[1], msgs[1]
    assert "source line 10" in msgs[1] and "b[(i + 1) % 64]" in msgs[1], msgs[1]


def test_access_in_a_header_function_names_the_header_line():
    header = """
inline float second(const device float* p, uint i) {
    return p[i + 1];
}
"""
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = second(x, i);
    """
    with pytest.raises(sim.OutOfBoundsError, match=r"header line 3 \(.*`return p\[i \+ 1\];`"):
        run("header_line", src, header=header)


def test_uninitialised_read_and_divergence_name_their_lines():
    src = """
        uint i = thread_position_in_grid.x;
        threadgroup float buf[64];
        out[i] = buf[i];
    """
    with pytest.raises(sim.UninitializedReadError, match=r"source line 4 .*`out\[i\] = buf\[i\];`"):
        run("uninit_line", src)
    src = """
        uint i = thread_position_in_grid.x;
        float v = x[i];
        if (i % 2 == 0) v = simd_sum(v);
        out[i] = v;
    """
    with pytest.raises(sim.SimdDivergenceError, match=r"simd_sum at source line 4"):
        run("div_line", src)


def test_declarations_next_to_accesses_still_compile():
    # array declarations must not be taken for element accesses
    src = """
        uint i = thread_position_in_grid.x;
        float acc[2] = {x[i], 0.0f}, tmp[3];
        vec<float, 2> pair[2];
        pair[0] = float2(acc[0], 1.0f);
        tmp[0] = pair[0].x > acc[1] ? acc[0] : 0.0f;
        constexpr int one[2] = {1, 0};
        static_assert(one[0] == 1, "constant subscripts stay constant");
        out[i] = tmp[one[1]];
    """
    x = rng.standard_normal(64).astype(np.float32)
    out = run("decls", src, inputs=mx.array(x))
    np.testing.assert_array_equal(out, np.where(x > 0, x, 0))
    # ... and compiled with the line marks, not through the fallback without them
    k = sim.metal_kernel("decls", ["x"], ["out"], src)
    kname, text, params, _ = k.build([mx.array(x)], [mx.float32])
    tu, _ = sim_kernel.build_translation_unit(kname, text, None, params, lines=True)
    assert "::msl::at_line(acc, __LINE__)[0]" in tu
    compiler.compile_kernel(kname, kname + ".metal", text, tu)
