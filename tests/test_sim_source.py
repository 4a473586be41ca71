"""mlx_source: the kernel text we build is the text MLX builds.

MLX cannot run Metal here, but while a function is being exported
(``mx.export_function``) ``mx.fast.metal_kernel`` builds the kernel without running it,
and ``verbose=True`` prints the full source: compare against that when this MLX does it,
else against hand-written expected text.
"""

import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest

from mlx_recgen.backends.mlx_source import (
    cuda_source,
    metal_kernel_name,
    metal_source,
)

pytestmark = pytest.mark.sim

CASES = {
    "template_shapes_scalar": dict(
        name="a", input_names=["x", "s"], output_names=["out"],
        source="uint i = thread_position_in_grid.x; out[i] = x[i] * x_shape[0] + s + "
               "x_strides[0] + x_ndim;",
        header="", inputs=[("float32", (3, 4)), ("float32", ())], output_dtypes=["float32"],
        template=[("T", "bfloat16"), ("N", 3), ("F", False)], atomic=False),
    "two_outputs_no_attributes": dict(
        name="b", input_names=["x", "y"], output_names=["o1", "o2"],
        source="o1[0] = x[0] + y_shape[0];", header="#define Q 1\n",
        inputs=[("float16", (16,)), ("int32", (2,))], output_dtypes=["float32", "int32"],
        template=None, atomic=False),
    "atomic_many_attributes": dict(
        name="c", input_names=["x"], output_names=["o"],
        source="atomic_fetch_add_explicit(&o[simdgroup_index_in_threadgroup], "
               "x[thread_index_in_simdgroup], memory_order_relaxed); // threads_per_threadgroup "
               "threadgroup_position_in_grid dispatch_threads_per_threadgroup",
        header="", inputs=[("float32", (16,))], output_dtypes=["float32"],
        template=[("B", True)], atomic=True),
}

_PROBE = textwrap.dedent("""
    import json, sys, tempfile, os
    import mlx.core as mx
    case = json.loads(sys.argv[1])
    dt = lambda n: getattr(mx, n)
    k = mx.fast.metal_kernel(name=case["name"], input_names=case["input_names"],
                             output_names=case["output_names"], source=case["source"],
                             header=case["header"], atomic_outputs=case["atomic"])
    xs = [mx.zeros(tuple(s), dtype=dt(d)) for d, s in case["inputs"]]
    tmpl = [(n, dt(v) if isinstance(v, str) else v) for n, v in (case["template"] or [])]
    def f(*a):
        return k(inputs=list(a), template=tmpl or None, grid=(4, 1, 1), threadgroup=(4, 1, 1),
                 output_shapes=[(4,)] * len(case["output_names"]),
                 output_dtypes=[dt(d) for d in case["output_dtypes"]], verbose=True)
    path = os.path.join(tempfile.mkdtemp(), "k.mlxfn")
    try:
        mx.export_function(path, f, *xs)
    except Exception:
        pass
""")


class _Arr:
    def __init__(self, dtype, shape):
        self.dtype = dtype
        self.ndim = len(shape)
        n = 1
        for d in shape:
            n *= d
        self.size = n


def _ours(case):
    return metal_source(case["name"], case["input_names"], case["output_names"], case["source"],
                        case["header"], [_Arr(d, s) for d, s in case["inputs"]],
                        case["output_dtypes"], case["template"], case["atomic"])


def _mlx_printed(case):
    import json
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(case)], capture_output=True,
                          text=True, timeout=120, env={**os.environ})
    out = proc.stdout
    if "Generated source code for" not in out:
        return None
    start = out.index("```\n") + 4
    end = out.rindex("\n```")
    return out[start:end]


@pytest.mark.parametrize("case", list(CASES))
def test_metal_source_matches_mlx(case):
    c = CASES[case]
    kname, text = _ours(c)
    printed = _mlx_printed(c)
    if printed is None:
        pytest.skip("this MLX does not print the kernel source without Metal")
    assert text == printed
    assert f"void {kname}(" in printed


def test_metal_source_hand_written_expected():
    c = CASES["template_shapes_scalar"]
    kname, text = _ours(c)
    assert kname == "custom_kernel_a__bfloat16_t_3_0_float_floats_float"
    expected = (
        "template <typename T, int N, bool F>\n"
        "[[kernel]] void custom_kernel_a__bfloat16_t_3_0_float_floats_float(\n"
        "  const device float* x [[buffer(0)]],\n"
        "  const constant int* x_shape [[buffer(1)]],\n"
        "  const constant int64_t* x_strides [[buffer(2)]],\n"
        "  const constant int& x_ndim [[buffer(3)]],\n"
        "  const constant float& s [[buffer(4)]],\n"
        "  device float* out [[buffer(5)]],\n"
        "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n"
        + c["source"] +
        "\n}\n\n"
        'template [[host_name("custom_kernel_a__bfloat16_t_3_0_float_floats_float")]] '
        "[[kernel]] decltype(custom_kernel_a__bfloat16_t_3_0_float_floats_float"
        "<bfloat16_t, 3, 0>) custom_kernel_a__bfloat16_t_3_0_float_floats_float"
        "<bfloat16_t, 3, 0>;\n"
    )
    assert text == expected


def test_metal_kernel_name_constant_suffix_and_mx_arrays():
    x = mx.zeros((5,), dtype=mx.float16)
    y = mx.zeros((2, 8), dtype=mx.int32)
    assert metal_kernel_name("k", [x, y], [mx.bfloat16]) == "custom_kernel_k_float16_tc_int32_t_bfloat16_t"


def test_cuda_source_layout():
    c = CASES["template_shapes_scalar"]
    kname, text = cuda_source(c["name"], c["input_names"], c["output_names"], c["source"],
                              "// hdr\n", [_Arr(d, s) for d, s in c["inputs"]],
                              c["output_dtypes"], [("T", "bfloat16"), ("N", 3), ("F", False)])
    assert kname == "custom_kernel_a_bfloat16_t_3_f"
    expected = (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        "// hdr\n"
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_a_bfloat16_t_3_f(\n"
        "    const float* x,\n"
        "    const __grid_constant__ Shape x_shape,\n"
        "    const __grid_constant__ Strides x_strides,\n"
        "    const __grid_constant__ int x_ndim,\n"
        "    const float* s,\n"
        "    float* out) {\n"
        "  using T = __nv_bfloat16;\n"
        "  constexpr int N = 3;\n"
        "  constexpr bool F = false;\n"
        "\n"
        + c["source"] +
        "\n}\n\n} // namespace mlx::core::cu\n"
    )
    assert text == expected
