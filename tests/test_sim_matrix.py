"""Metal simulator: simdgroup matrices (8x8, float/half/bfloat) and quad collectives.

References are numpy products of the inputs rounded to the element type; the lane
layout is checked against the coordinates MLX's steel GEMM kernels assume
(``get_coord`` in ``steel/gemm/mma.h``), written out independently here.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_recgen import sim

pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(not sim.is_available(), reason="no C++ compiler for the Metal simulator"),
    pytest.mark.filterwarnings("ignore:clang\\+\\+ not found"),
]

rng = np.random.default_rng(88)
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
TOL = {mx.float32: 1e-5, mx.float16: 1e-2, mx.bfloat16: 6e-2}


def rounded(a, dt):
    """`a` rounded to `dt`, as an mx input and as the float64 numpy value the kernel sees."""
    x = mx.array(a).astype(dt)
    return x, np.array(x.astype(mx.float32)).astype(np.float64)


def lane_coords(lane):
    """The two (row, col) elements a lane holds: the layout of MLX's BaseMMAFrag."""
    q = lane // 4
    row = (q & 4) + (lane // 2) % 4
    col = (q & 2) * 2 + (lane % 2) * 2
    return (row, col), (row, col + 1)


def matmul_kernel(name, body, inputs=("a", "b")):
    return sim.metal_kernel(name, list(inputs), ["out"], body)


def run(k, inputs, dt, shape=(8, 8), tg=32, grid=32):
    (out,) = k(inputs=inputs, template=[("T", dt)], grid=(grid, 1, 1), threadgroup=(tg, 1, 1),
               output_shapes=[shape], output_dtypes=[dt])
    return np.array(out.astype(mx.float32)).astype(np.float64)


MMA = """
    simdgroup_matrix<T, 8, 8> A, B, C;
    simdgroup_load(A, a, 8);
    simdgroup_load(B, b, 8);
    simdgroup_load(C, c, 8);
    simdgroup_multiply_accumulate(C, A, B, C);
    simdgroup_store(C, out, 8);
"""


@pytest.mark.parametrize("dt", DTYPES, ids=["float", "half", "bfloat"])
def test_multiply_accumulate_matches_numpy(dt):
    (a, an), (b, bn), (c, cn) = (rounded(rng.standard_normal((8, 8)), dt) for _ in range(3))
    out = run(matmul_kernel("sgm_mma", MMA, ("a", "b", "c")), [a, b, c], dt)
    np.testing.assert_allclose(out, an @ bn + cn, rtol=TOL[dt], atol=TOL[dt])


def test_typedef_names_and_multiply_and_diagonal():
    src = """
        simdgroup_float8x8 A, B;
        simdgroup_half8x8 H = make_filled_simdgroup_matrix<half, 8, 8>(1.5h);
        simdgroup_bfloat8x8 Z = simdgroup_bfloat8x8(0);
        simdgroup_load(A, a, 8);
        simdgroup_float8x8 two(2.0f);                  // 2 on the diagonal
        simdgroup_multiply(B, A, two);
        simdgroup_float8x8 h;
        h.thread_elements() = float2(H.thread_elements()) + float2(Z.thread_elements());
        simdgroup_multiply_accumulate(B, B, two, h);   // 4 A + 1.5
        simdgroup_store(B, out, 8);
    """
    a, an = rounded(rng.standard_normal((8, 8)), mx.float32)
    out = run(matmul_kernel("sgm_diag", src, ("a",)), [a], mx.float32)
    np.testing.assert_allclose(out, 4 * an + 1.5, rtol=1e-6)


def test_load_store_with_stride_origin_and_transpose():
    # a 16 x 24 buffer; load the block at rows 8.., cols 16.. (origin (x=16, y=8)),
    # and the transpose of the block at rows 0..7, cols 4..11; store the product
    # transposed into a 12-wide output at column offset 3.
    src = """
        simdgroup_matrix<T, 8, 8> A, B, C;
        simdgroup_load(A, a, 24, ulong2(16, 8));
        simdgroup_load(B, a, 24, ulong2(0, 4), true);
        simdgroup_multiply(C, A, B);
        simdgroup_store(C, out, 12, ulong2(0, 3), true);
    """
    x, xn = rounded(rng.standard_normal((16, 24)), mx.float32)
    k = sim.metal_kernel("sgm_stride", ["a"], ["out"], src)
    (out,) = k(inputs=[x], template=[("T", mx.float32)], grid=(32, 1, 1),
               threadgroup=(32, 1, 1), output_shapes=[(8, 12)], output_dtypes=[mx.float32],
               init_value=0.0)
    want = np.zeros((8, 12))
    prod = xn[8:16, 16:24] @ xn[0:8, 4:12].T
    want[:, 3:11] = prod.T
    np.testing.assert_allclose(np.array(out), want, rtol=1e-5, atol=1e-5)


def test_thread_elements_follow_the_mma_layout():
    # each lane reports the two elements it holds after a simdgroup_load of 0..63
    src = """
        uint lane = thread_index_in_simdgroup;
        simdgroup_float8x8 A;
        simdgroup_load(A, a, 8);
        out[2 * lane] = A.thread_elements()[0];
        out[2 * lane + 1] = A.thread_elements()[1];
    """
    a = mx.arange(64, dtype=mx.float32)
    k = sim.metal_kernel("sgm_layout", ["a"], ["out"], src)
    (out,) = k(inputs=[a], grid=(32, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(64,)], output_dtypes=[mx.float32])
    want = [r * 8 + c for lane in range(32) for r, c in lane_coords(lane)]
    assert np.array(out).astype(int).tolist() == want


def test_fragments_written_by_coordinates_multiply_like_steel():
    # MLX's steel loop: every lane fills thread_elements from its own coordinates
    # (no simdgroup_load), multiplies, and writes its fragment of the result back.
    src = """
        uint lane = thread_index_in_simdgroup;
        short qid = lane / 4;
        short sm = (qid & 4) + (lane / 2) % 4;
        short sn = (qid & 2) * 2 + (lane % 2) * 2;
        simdgroup_matrix<float, 8, 8> A, B, C = simdgroup_matrix<float, 8, 8>(0);
        A.thread_elements()[0] = a[sm * 8 + sn];
        A.thread_elements()[1] = a[sm * 8 + sn + 1];
        B.thread_elements()[0] = b[sm * 8 + sn];
        B.thread_elements()[1] = b[sm * 8 + sn + 1];
        simdgroup_multiply_accumulate(C, A, B, C);
        thread const auto& acc = C.thread_elements();
        out[sm * 8 + sn] = acc[0];
        out[sm * 8 + sn + 1] = acc[1];
    """
    (a, an), (b, bn) = (rounded(rng.standard_normal((8, 8)), mx.float32) for _ in range(2))
    k = sim.metal_kernel("sgm_frag", ["a", "b"], ["out"], src)
    (out,) = k(inputs=[a, b], grid=(32, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(8, 8)], output_dtypes=[mx.float32])
    np.testing.assert_allclose(np.array(out), an @ bn, rtol=1e-5, atol=1e-5)


FRAGMENT_HEADER = """
#include <metal_simdgroup_matrix>
// fragments kept as vec<T, 2> and moved in and out of simdgroup matrices by reference,
// the way MLX's steel MMA helpers do
template <typename T>
struct Frag {
  typedef metal::simdgroup_matrix<T, 8, 8> mat_type;
  typedef metal::vec<T, 2> frag_type;
  static short2 coord(ushort lane) {
    short q = lane / 4;
    return short2((q & 2) * 2 + (lane % 2) * 2, (q & 4) + (lane / 2) % 4);
  }
  static void mma(thread frag_type& D, thread frag_type& A, thread frag_type& B,
                  thread frag_type& C) {
    mat_type Dm, Am, Bm, Cm;
    reinterpret_cast<thread frag_type&>(Am.thread_elements()) = A;
    reinterpret_cast<thread frag_type&>(Bm.thread_elements()) = B;
    reinterpret_cast<thread frag_type&>(Cm.thread_elements()) = C;
    simdgroup_multiply_accumulate(Dm, Am, Bm, Cm);
    D = reinterpret_cast<thread frag_type&>(Dm.thread_elements());
  }
};
"""


@pytest.mark.parametrize("dt", [mx.float16, mx.bfloat16], ids=["half", "bfloat"])
def test_steel_style_fragments(dt):
    src = """
        short2 c = Frag<T>::coord(thread_index_in_simdgroup);
        typename Frag<T>::frag_type A, B, C, D;
        for (short k = 0; k < 2; k++) {
            A[k] = a[c.y * 8 + c.x + k];
            B[k] = b[c.y * 8 + c.x + k];
            C[k] = T(0);
        }
        Frag<T>::mma(D, A, B, C);
        out[c.y * 8 + c.x] = D[0];
        out[c.y * 8 + c.x + 1] = D[1];
    """
    (a, an), (b, bn) = (rounded(rng.standard_normal((8, 8)), dt) for _ in range(2))
    k = sim.metal_kernel("sgm_steel", ["a", "b"], ["out"], src, header=FRAGMENT_HEADER)
    out = run(k, [a, b], dt)
    np.testing.assert_allclose(out, an @ bn, rtol=TOL[dt], atol=TOL[dt])


TILED = """
    // C[16 x 16] = A[16 x K] B[K x 16]: 4 simdgroups, one 8x8 tile each, K staged
    // through threadgroup memory 8 columns at a time.
    threadgroup float As[16 * 8];
    threadgroup float Bs[8 * 16];
    uint t = thread_index_in_threadgroup;
    uint sg = simdgroup_index_in_threadgroup;
    uint tm = 8 * (sg / 2), tn = 8 * (sg % 2);
    simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint k0 = 0; k0 < K; k0 += 8) {
        As[t] = a[(t / 8) * K + k0 + t % 8];
        Bs[t] = b[(k0 + t / 16) * 16 + t % 16];
        BARRIER_1
        simdgroup_float8x8 A, B;
        simdgroup_load(A, As, 8, ulong2(0, tm));
        simdgroup_load(B, Bs, 16, ulong2(tn, 0));
        simdgroup_multiply_accumulate(acc, A, B, acc);
        BARRIER_2
    }
    simdgroup_store(acc, out, 16, ulong2(tn, tm));
"""
BAR = "threadgroup_barrier(mem_flags::mem_threadgroup);"


def tiled(name, src, k=24):
    (a, an), (b, bn) = (rounded(rng.standard_normal(s), mx.float32) for s in ((16, k), (k, 16)))
    kern = sim.metal_kernel(name, ["a", "b"], ["out"], src)
    (out,) = kern(inputs=[a, b], template=[("K", k)], grid=(128, 1, 1), threadgroup=(128, 1, 1),
                  output_shapes=[(16, 16)], output_dtypes=[mx.float32])
    return np.array(out), an @ bn


def test_tiled_gemm_through_threadgroup_memory():
    out, want = tiled("sgm_tiled", TILED.replace("BARRIER_1", BAR).replace("BARRIER_2", BAR))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_planted_missing_barrier_before_simdgroup_load_is_a_race():
    src = TILED.replace("BARRIER_1", "").replace("BARRIER_2", BAR)
    with pytest.raises(sim.DataRaceError, match="threadgroup array `As`"):
        tiled("sgm_race", src)


def test_planted_wrong_stride_gives_a_wrong_product():
    # elements_per_row 16 instead of 8 for the A tile: reads the wrong rows of As
    src = (TILED.replace("BARRIER_1", BAR).replace("BARRIER_2", BAR)
           .replace("simdgroup_load(A, As, 8, ulong2(0, tm));",
                    "simdgroup_load(A, As, 7, ulong2(0, tm));"))
    out, want = tiled("sgm_stride_bug", src)
    assert np.abs(out - want).max() > 0.1


def test_planted_stride_past_the_buffer_is_out_of_bounds():
    src = MMA.replace("simdgroup_load(B, b, 8);", "simdgroup_load(B, b, 9);")
    (a, _), (b, _), (c, _) = (rounded(rng.standard_normal((8, 8)), mx.float32) for _ in range(3))
    with pytest.raises(sim.OutOfBoundsError,
                       match=r"input `b`.*source line 4 .*`simdgroup_load\(B, b, 9\);`"):
        run(matmul_kernel("sgm_oob", src, ("a", "b", "c")), [a, b, c], mx.float32)


def test_planted_partial_lane_participation_is_divergence():
    src = """
        simdgroup_float8x8 A, C = simdgroup_float8x8(0);
        simdgroup_load(A, a, 8);
        if (thread_index_in_simdgroup < 16) {
            simdgroup_multiply_accumulate(C, A, A, C);
        }
        simdgroup_store(C, out, 8);
    """
    a, _ = rounded(rng.standard_normal((8, 8)), mx.float32)
    with pytest.raises(sim.SimdDivergenceError, match="simdgroup_multiply_accumulate"):
        run(matmul_kernel("sgm_div", src, ("a",)), [a], mx.float32)


def test_planted_partial_simdgroup_is_rejected():
    src = """
        simdgroup_float8x8 A;
        simdgroup_load(A, a, 8);
        simdgroup_store(A, out, 8);
    """
    a, _ = rounded(rng.standard_normal((8, 8)), mx.float32)
    with pytest.raises(sim.SimdDivergenceError, match="simdgroup of 16 threads"):
        run(matmul_kernel("sgm_partial", src, ("a",)), [a], mx.float32, tg=16, grid=16)


def test_quad_collectives():
    src = """
        uint i = thread_position_in_grid.x;
        float v = x[i];
        out[6 * i + 0] = quad_sum(v);
        out[6 * i + 1] = quad_max(v);
        out[6 * i + 2] = quad_shuffle_xor(v, 1u);
        out[6 * i + 3] = quad_broadcast(v, 2u);
        out[6 * i + 4] = quad_shuffle_down(v, 1u);
        out[6 * i + 5] = quad_prefix_exclusive_sum(v);
    """
    x = rng.standard_normal(64).astype(np.float32)
    k = sim.metal_kernel("quads", ["x"], ["out"], src)
    (out,) = k(inputs=[mx.array(x)], grid=(64, 1, 1), threadgroup=(64, 1, 1),
               output_shapes=[(64 * 6,)], output_dtypes=[mx.float32])
    out = np.array(out).reshape(64, 6)
    q = x.reshape(16, 4)
    want = np.stack([
        np.repeat(q.sum(1), 4),
        np.repeat(q.max(1), 4),
        q[:, [1, 0, 3, 2]].reshape(-1),
        np.repeat(q[:, 2], 4),
        np.concatenate([q[:, 1:], q[:, 3:]], axis=1).reshape(-1),
        np.concatenate([np.zeros((16, 1)), np.cumsum(q, 1)[:, :3]], axis=1).reshape(-1),
    ], axis=1)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
