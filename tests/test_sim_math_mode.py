"""Metal simulator: ``compile_options={"math_mode": ...}`` as ``mx.fast.metal_kernel`` takes it."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_recgen import sim

pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(not sim.is_available(), reason="no C++ compiler for the Metal simulator"),
    pytest.mark.filterwarnings("ignore:clang\\+\\+ not found"),
]


def run(src, mode, x):
    k = sim.metal_kernel("math_mode", ["inp"], ["out"], src,
                         compile_options=None if mode is None else {"math_mode": mode})
    (out,) = k(inputs=[x], grid=(x.size, 1, 1), threadgroup=(x.size, 1, 1),
               output_shapes=[x.shape], output_dtypes=[mx.float32])
    return np.array(out)


def test_fast_math_defines_the_macro_and_the_others_do_not():
    # the same kernel name in every mode: a cached build of another mode must not be reused
    src = """
        uint elem = thread_position_in_grid.x;
        #if defined(__FAST_MATH__) && __FAST_MATH__
        out[elem] = 1.0f;
        #else
        out[elem] = 0.0f;
        #endif
    """
    x = mx.zeros((4,))
    got = {mode: run(src, mode, x)[0] for mode in (None, "safe", "relaxed", "fast", "safe")}
    assert got == {None: 0.0, "safe": 0.0, "relaxed": 0.0, "fast": 1.0}


def test_safe_and_relaxed_keep_inf_and_nan():
    src = """
        uint i = thread_position_in_grid.x;
        float v = inp[i];
        out[i] = isnan(v) ? 1.0f : (isinf(v) ? 2.0f : metal::exp(v));
    """
    x = mx.array([np.nan, -np.inf, np.inf, 0.0])
    for mode in ("safe", "relaxed"):
        np.testing.assert_array_equal(run(src, mode, x), [1.0, 2.0, 2.0, 1.0])


@pytest.mark.parametrize("options", [{"math_mode": "precise"}, {"unknown": "value"}, "fast"])
def test_invalid_compile_options_are_rejected(options):
    with pytest.raises(ValueError, match=r"\[metal_kernel\]"):
        sim.metal_kernel("bad", ["inp"], ["out"], "out[0] = inp[0];", compile_options=options)
