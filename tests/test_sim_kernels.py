"""Metal simulator: semantics of hand-written kernels against numpy/MLX references."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_recgen import sim

pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(not sim.is_available(), reason="no C++ compiler for the Metal simulator"),
    pytest.mark.filterwarnings("ignore:clang\\+\\+ not found"),
]

rng = np.random.default_rng(1234)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_threadgroup_tree_reduction_256():
    src = """
        uint tid = thread_index_in_threadgroup;
        uint gid = threadgroup_position_in_grid.x;
        threadgroup float buf[256];
        buf[tid] = x[thread_position_in_grid.x];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint s = 128; s > 0; s >>= 1) {
            if (tid < s) {
                buf[tid] = buf[tid] + buf[tid + s];
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        if (tid == 0) {
            out[gid] = buf[0];
        }
    """
    k = sim.metal_kernel("tg_sum", ["x"], ["out"], src)
    x = randn(4 * 256)
    (out,) = k(inputs=[mx.array(x)], grid=(1024, 1, 1), threadgroup=(256, 1, 1),
               output_shapes=[(4,)], output_dtypes=[mx.float32])
    ref = x.reshape(4, 256).sum(axis=1)
    np.testing.assert_allclose(np.array(out), ref, rtol=1e-5, atol=1e-5)


def test_simd_collectives_semantics():
    src = """
        uint i = thread_position_in_grid.x;
        uint lane = thread_index_in_simdgroup;
        float v = x[i];
        int k = ix[i];
        out[i * 12 + 0] = simd_sum(v);
        out[i * 12 + 1] = simd_shuffle(v, (lane + 5) % 32);
        out[i * 12 + 2] = simd_shuffle_xor(v, 3);
        out[i * 12 + 3] = float(simd_prefix_exclusive_sum(k));
        out[i * 12 + 4] = float(simd_prefix_inclusive_sum(k));
        out[i * 12 + 5] = simd_max(v);
        out[i * 12 + 6] = simd_min(v);
        out[i * 12 + 7] = simd_shuffle_down(v, 4);
        out[i * 12 + 8] = simd_shuffle_up(v, 4);
        out[i * 12 + 9] = simd_broadcast(v, 7);
        out[i * 12 + 10] = simd_all(v > -100.0f) ? 1.0f : 0.0f;
        out[i * 12 + 11] = simd_any(v > 1.5f) ? 1.0f : 0.0f;
        isum[i] = simd_sum(k);
    """
    k = sim.metal_kernel("simd_ops", ["x", "ix"], ["out", "isum"], src)
    n = 64
    x = randn(n)
    ix = rng.integers(-50, 50, n).astype(np.int32)
    out, isum = k(inputs=[mx.array(x), mx.array(ix)], grid=(n, 1, 1), threadgroup=(64, 1, 1),
                  output_shapes=[(n * 12,), (n,)], output_dtypes=[mx.float32, mx.int32])
    out = np.array(out).reshape(n, 12)
    xs = x.reshape(2, 32)
    ks = ix.reshape(2, 32)
    lane = np.arange(32)
    exp = np.zeros((2, 32, 12), np.float32)
    for s in range(2):
        v, kk = xs[s], ks[s]
        exp[s, :, 0] = v.sum(dtype=np.float32)
        exp[s, :, 1] = v[(lane + 5) % 32]
        exp[s, :, 2] = v[lane ^ 3]
        exp[s, :, 3] = np.concatenate([[0], np.cumsum(kk)[:-1]])
        exp[s, :, 4] = np.cumsum(kk)
        exp[s, :, 5] = v.max()
        exp[s, :, 6] = v.min()
        exp[s, :, 7] = np.where(lane + 4 < 32, v[np.minimum(lane + 4, 31)], v)
        exp[s, :, 8] = np.where(lane - 4 >= 0, v[np.maximum(lane - 4, 0)], v)
        exp[s, :, 9] = v[7]
        exp[s, :, 10] = 1.0
        exp[s, :, 11] = float((v > 1.5).any())
    exp = exp.reshape(n, 12)
    np.testing.assert_allclose(out[:, 0], exp[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[:, 1:], exp[:, 1:])
    np.testing.assert_array_equal(np.array(isum), np.repeat(ks.sum(axis=1), 32))


def test_simd_sum_partial_simdgroup():
    # 40 threads: simdgroup 1 has only 8 active threads; collectives use the active ones
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = simd_sum(x[i]);
        cnt[i] = simd_sum(1u);
    """
    k = sim.metal_kernel("simd_partial", ["x"], ["out", "cnt"], src)
    x = randn(40)
    out, cnt = k(inputs=[mx.array(x)], grid=(40, 1, 1), threadgroup=(64, 1, 1),
                 output_shapes=[(40,), (40,)], output_dtypes=[mx.float32, mx.uint32])
    ref = np.concatenate([np.full(32, x[:32].sum()), np.full(8, x[32:].sum())])
    np.testing.assert_allclose(np.array(out), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.array(cnt), [32] * 32 + [8] * 8)


@pytest.mark.parametrize("in_dtype", ["bfloat16", "float16"])
def test_low_precision_conversions_bit_exact(in_dtype):
    src = """
        uint i = thread_position_in_grid.x;
        float v = static_cast<float>(x[i]);
        of[i] = v * 1.5f;
        oh[i] = static_cast<half>(v * 1.5f);
        ob[i] = static_cast<bfloat16_t>(v * 1.5f);
        ob2[i] = static_cast<bfloat16_t>(f[i]);
        oh2[i] = static_cast<float16_t>(f[i]);
        ox[i] = x[i] * x[i] + x[i];
    """
    dt = getattr(mx, in_dtype)
    k = sim.metal_kernel("lowp", ["x", "f"], ["of", "oh", "ob", "ob2", "oh2", "ox"], src)
    n = 300
    f = randn(n) * 3
    f[:4] = [0.0, -0.0, 1e-30, 70000.0]  # signed zero, subnormal/flush, overflow for half
    x = mx.array(randn(n) * 4).astype(dt)
    fm = mx.array(f)
    outs = k(inputs=[x, fm], grid=(n, 1, 1), threadgroup=(128, 1, 1),
             output_shapes=[(n,)] * 6,
             output_dtypes=[mx.float32, mx.float16, mx.bfloat16, mx.bfloat16, mx.float16, dt])
    of, oh, ob, ob2, oh2, ox = outs
    v = x.astype(mx.float32) * 1.5
    def bits(a):
        return np.array(a.view(mx.uint16))

    np.testing.assert_array_equal(np.array(of), np.array(v))
    np.testing.assert_array_equal(np.array(oh.view(mx.uint16)), np.array(v.astype(mx.float16).view(mx.uint16)))
    np.testing.assert_array_equal(bits(ob), bits(v.astype(mx.bfloat16)))
    np.testing.assert_array_equal(bits(ob2), bits(fm.astype(mx.bfloat16)))
    np.testing.assert_array_equal(bits(oh2), bits(fm.astype(mx.float16)))
    # x*x + x in the low-precision type: each op rounds to that type (as MLX does)
    np.testing.assert_array_equal(bits(ox), bits(x * x + x))


def test_3d_grid_with_partial_threadgroups():
    src = """
        uint3 p = thread_position_in_grid;
        uint idx = (p.z * threads_per_grid.y + p.y) * threads_per_grid.x + p.x;
        uint3 g = threadgroup_position_in_grid;
        uint3 l = thread_position_in_threadgroup;
        uint3 t = threads_per_threadgroup;
        uint3 d = dispatch_threads_per_threadgroup;
        uint3 n = threadgroups_per_grid;
        out[idx * 16 + 0] = p.x; out[idx * 16 + 1] = p.y; out[idx * 16 + 2] = p.z;
        out[idx * 16 + 3] = g.x; out[idx * 16 + 4] = g.y; out[idx * 16 + 5] = g.z;
        out[idx * 16 + 6] = l.x; out[idx * 16 + 7] = l.y; out[idx * 16 + 8] = l.z;
        out[idx * 16 + 9] = t.x * 10000 + t.y * 100 + t.z;
        out[idx * 16 + 10] = d.x * 10000 + d.y * 100 + d.z;
        out[idx * 16 + 11] = n.x * 10000 + n.y * 100 + n.z;
        out[idx * 16 + 12] = thread_index_in_threadgroup;
        out[idx * 16 + 13] = simdgroup_index_in_threadgroup * 100 + thread_index_in_simdgroup;
        out[idx * 16 + 14] = simdgroups_per_threadgroup;
        out[idx * 16 + 15] = uint(x[idx] * 1000.0f);
    """
    k = sim.metal_kernel("grid3d", ["x"], ["out"], src)
    G = (13, 7, 5)
    T = (4, 4, 2)
    n = G[0] * G[1] * G[2]
    x = np.abs(randn(n))
    (out,) = k(inputs=[mx.array(x)], grid=G, threadgroup=T, output_shapes=[(n, 16)],
               output_dtypes=[mx.uint32])
    out = np.array(out)
    z, y, xx = np.meshgrid(np.arange(G[2]), np.arange(G[1]), np.arange(G[0]), indexing="ij")
    z, y, xx = z.ravel(), y.ravel(), xx.ravel()
    np.testing.assert_array_equal(out[:, 0], xx)
    np.testing.assert_array_equal(out[:, 1], y)
    np.testing.assert_array_equal(out[:, 2], z)
    gx, gy, gz = xx // T[0], y // T[1], z // T[2]
    np.testing.assert_array_equal(out[:, 3:6], np.stack([gx, gy, gz], 1))
    lx, ly, lz = xx % T[0], y % T[1], z % T[2]
    np.testing.assert_array_equal(out[:, 6:9], np.stack([lx, ly, lz], 1))
    # actual extent of partial groups
    ex = np.minimum(T[0], G[0] - gx * T[0])
    ey = np.minimum(T[1], G[1] - gy * T[1])
    ez = np.minimum(T[2], G[2] - gz * T[2])
    np.testing.assert_array_equal(out[:, 9], ex * 10000 + ey * 100 + ez)
    assert (out[:, 10] == T[0] * 10000 + T[1] * 100 + T[2]).all()
    ng = [-(-G[i] // T[i]) for i in range(3)]
    assert (out[:, 11] == ng[0] * 10000 + ng[1] * 100 + ng[2]).all()
    lin = lx + ly * ex + lz * ex * ey
    np.testing.assert_array_equal(out[:, 12], lin)
    np.testing.assert_array_equal(out[:, 13], (lin // 32) * 100 + lin % 32)
    np.testing.assert_array_equal(out[:, 14], -(-(ex * ey * ez) // 32))
    np.testing.assert_array_equal(out[:, 15], (x * 1000).astype(np.uint32))


def test_group_size_clamped_to_grid():
    # MLX passes min(threadgroup, grid) per dimension
    src = """
        out[thread_position_in_grid.x] = threads_per_threadgroup.x * 100 + threadgroups_per_grid.x
            + 0 * x[0];
    """
    k = sim.metal_kernel("clamp_tg", ["x"], ["out"], src)
    (out,) = k(inputs=[mx.array(randn(3))], grid=(20, 1, 1), threadgroup=(256, 1, 1),
               output_shapes=[(20,)], output_dtypes=[mx.uint32])
    assert (np.array(out) == 2001).all()


@pytest.mark.parametrize("T,N,F", [(mx.float32, 3, True), (mx.float16, 5, False),
                                   (mx.bfloat16, 2, True)])
def test_template_parameters(T, N, F):
    src = """
        uint i = thread_position_in_grid.x;
        T acc = T(0);
        for (int k = 0; k < N; ++k) {
            acc += static_cast<T>(x[i]);
        }
        if (F) {
            acc = acc + T(1);
        }
        out[i] = acc;
    """
    k = sim.metal_kernel("tmpl", ["x"], ["out"], src)
    x = mx.array(randn(50)).astype(T)
    (out,) = k(inputs=[x], template=[("T", T), ("N", N), ("F", F)], grid=(50, 1, 1),
               threadgroup=(32, 1, 1), output_shapes=[(50,)], output_dtypes=[T])
    acc = mx.zeros((50,), dtype=T)
    for _ in range(N):
        acc = acc + x
    if F:
        acc = acc + mx.array(1, dtype=T)
    np.testing.assert_array_equal(np.array(out.astype(mx.float32)),
                                  np.array(acc.astype(mx.float32)))


def test_shape_strides_ndim():
    src = """
        uint i = thread_position_in_grid.x;
        int64_t loc = elem_to_loc(i, x_shape, x_strides, x_ndim);
        out[i] = x[loc] + float(x_shape[x_ndim - 1]) + float(x_strides[0]);
    """
    k = sim.metal_kernel("shapes", ["x"], ["out"], src, ensure_row_contiguous=False)
    x = randn(3, 4, 5)
    (out,) = k(inputs=[mx.array(x)], grid=(60, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(3, 4, 5)], output_dtypes=[mx.float32])
    np.testing.assert_allclose(np.array(out), x + 5 + 20, rtol=1e-6)
    assert out.shape == (3, 4, 5)


def test_scalar_and_small_constant_inputs():
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = x[i] * s + c[i % 3] + float(n);
    """
    k = sim.metal_kernel("scalars", ["x", "s", "c", "n"], ["out"], src)
    x = randn(10)
    c = randn(3)
    (out,) = k(inputs=[mx.array(x), 2.5, mx.array(c), 4], grid=(10, 1, 1),
               threadgroup=(16, 1, 1), output_shapes=[(10,)], output_dtypes=[mx.float32])
    np.testing.assert_allclose(np.array(out), x * 2.5 + c[np.arange(10) % 3] + 4, rtol=1e-6)


def test_init_value_keeps_unwritten_elements():
    src = """
        uint i = thread_position_in_grid.x;
        if (i % 2 == 0) out[i] = x[i];
    """
    k = sim.metal_kernel("init_val", ["x"], ["out"], src)
    x = randn(33)
    (out,) = k(inputs=[mx.array(x)], grid=(33, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(33,)], output_dtypes=[mx.float32], init_value=7.0)
    ref = np.where(np.arange(33) % 2 == 0, x, 7.0)
    np.testing.assert_array_equal(np.array(out), ref.astype(np.float32))


def test_atomic_outputs_histogram_and_float_sum():
    src = """
        uint i = thread_position_in_grid.x;
        atomic_fetch_add_explicit(&hist[bins[i]], 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&total[0], x[i], memory_order_relaxed);
    """
    k = sim.metal_kernel("atomics", ["bins", "x"], ["hist", "total"], src, atomic_outputs=True)
    n = 200
    bins = rng.integers(0, 10, n).astype(np.int32)
    x = randn(n)
    hist, total = k(inputs=[mx.array(bins), mx.array(x)], grid=(n, 1, 1),
                    threadgroup=(64, 1, 1), output_shapes=[(10,), (1,)],
                    output_dtypes=[mx.int32, mx.float32], init_value=0)
    np.testing.assert_array_equal(np.array(hist), np.bincount(bins, minlength=10))
    np.testing.assert_allclose(np.array(total)[0], x.sum(), rtol=1e-4, atol=1e-4)


def test_dtypes_roundtrip():
    src = """
        uint i = thread_position_in_grid.x;
        o64[i] = a[i] * 3;
        o32[i] = b[i] + 1u;
        ob[i] = !c[i];
    """
    k = sim.metal_kernel("dtypes", ["a", "b", "c"], ["o64", "o32", "ob"], src)
    a = rng.integers(-2**40, 2**40, 20).astype(np.int64)
    b = rng.integers(0, 2**31, 20).astype(np.uint32)
    c = rng.integers(0, 2, 20).astype(bool)
    o64, o32, ob = k(inputs=[mx.array(a), mx.array(b), mx.array(c)], grid=(20, 1, 1),
                     threadgroup=(32, 1, 1), output_shapes=[(20,)] * 3,
                     output_dtypes=[mx.int64, mx.uint32, mx.bool_])
    np.testing.assert_array_equal(np.array(o64), a * 3)
    np.testing.assert_array_equal(np.array(o32), b + 1)
    np.testing.assert_array_equal(np.array(ob), ~c)


def test_header_functions_math_and_vectors():
    header = """
    #include <metal_stdlib>
    using namespace metal;
    template <typename T>
    inline T softplus(T x) { return x > 20.0f ? x : metal::log(1.0f + metal::exp(x)); }
    """
    src = """
        uint i = thread_position_in_grid.x;
        float v = x[i];
        float2 p = float2(v, 2.0f * v);
        float4 q = float4(p, 1.0, 0.5);
        q = q * 2.0f + float4(1.0f);
        out[i * 8 + 0] = softplus(v);
        out[i * 8 + 1] = metal::fast::exp(v) + metal::precise::tanh(v);
        out[i * 8 + 2] = metal::rsqrt(metal::abs(v) + 1.0f);
        out[i * 8 + 3] = metal::clamp(v, -0.5f, 0.5f);
        out[i * 8 + 4] = metal::select(1.0f, 2.0f, v > 0.0f);
        out[i * 8 + 5] = dot(q, q);
        out[i * 8 + 6] = metal::pow(metal::abs(v), 1.5f) + metal::fma(v, v, 1.0f);
        out[i * 8 + 7] = metal::isnan(v) ? 0.0f : metal::max(v, 0.0f) + metal::log2(2.0f);
    """
    k = sim.metal_kernel("mathk", ["x"], ["out"], src, header=header)
    x = randn(40)
    (out,) = k(inputs=[mx.array(x)], grid=(40, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(40, 8)], output_dtypes=[mx.float32])
    out = np.array(out)
    q = np.stack([x, 2 * x, np.ones_like(x), 0.5 * np.ones_like(x)], 1) * 2 + 1
    ref = np.stack([
        np.where(x > 20, x, np.log1p(np.exp(x))),
        np.exp(x) + np.tanh(x),
        1 / np.sqrt(np.abs(x) + 1),
        np.clip(x, -0.5, 0.5),
        np.where(x > 0, 2.0, 1.0),
        (q * q).sum(1),
        np.abs(x) ** 1.5 + x * x + 1,
        np.maximum(x, 0) + 1,
    ], 1)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_threadgroup_memory_is_per_group_and_2d():
    src = """
        uint tid = thread_index_in_threadgroup;
        threadgroup float tile[2][32];
        threadgroup int counter;
        if (tid == 0) counter = int(threadgroup_position_in_grid.x);
        tile[tid / 32][tid % 32] = x[thread_position_in_grid.x];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_position_in_grid.x] = tile[1 - tid / 32][31 - tid % 32] + float(counter);
    """
    k = sim.metal_kernel("tile2d", ["x"], ["out"], src)
    x = randn(256)
    (out,) = k(inputs=[mx.array(x)], grid=(256, 1, 1), threadgroup=(64, 1, 1),
               output_shapes=[(256,)], output_dtypes=[mx.float32])
    ref = x.reshape(4, 64)[:, ::-1] + np.arange(4)[:, None]
    np.testing.assert_allclose(np.array(out), ref.ravel(), rtol=1e-6)


def test_verbose_prints_mlx_text(capsys):
    k = sim.metal_kernel("verb", ["x"], ["out"], "out[thread_position_in_grid.x] = x[0];")
    k(inputs=[mx.array(randn(8))], grid=(1, 1, 1), threadgroup=(1, 1, 1),
      output_shapes=[(1,)], output_dtypes=[mx.float32], verbose=True)
    text = capsys.readouterr().out
    assert "[[kernel]] void custom_kernel_verb_float_float(" in text
    assert "uint3 thread_position_in_grid [[thread_position_in_grid]]" in text


def test_performance_budget():
    import time
    src = """
        uint i = thread_position_in_grid.x;
        uint b = thread_position_in_grid.y;
        float acc = 0.0f;
        for (int t = 0; t < 32; ++t) {
            acc = acc * 0.9f + x[(b * 32 + t) * 64 + i];
        }
        out[b * 64 + i] = acc;
    """
    k = sim.metal_kernel("perf", ["x"], ["out"], src)
    x = mx.array(randn(4 * 32 * 64))
    kw = dict(inputs=[x], grid=(64, 4, 1), threadgroup=(64, 1, 1), output_shapes=[(256,)],
              output_dtypes=[mx.float32])
    k(**kw)  # compile
    t0 = time.perf_counter()
    (out,) = k(**kw)
    assert time.perf_counter() - t0 < 0.5
    xn = np.array(x).reshape(4, 32, 64)
    acc = np.zeros((4, 64), np.float32)
    for t in range(32):
        acc = acc * np.float32(0.9) + xn[:, t]
    np.testing.assert_allclose(np.array(out), acc.ravel(), rtol=1e-6)


def test_common_msl_idioms():
    header = """
    inline float tg_sum(threadgroup float* buf, uint tid, uint n) {
        float s = 0.0f;
        for (uint k = 0; k < n; ++k) s += buf[k];
        return s + 0.0f * tid;
    }
    inline float first4(const device float4* v) { return v[0].x + v[0].w; }
    """
    src = """
        uint tid = thread_index_in_threadgroup;
        uint i = thread_position_in_grid.x;
        threadgroup float buf[32];
        float v = x[i];
        // shuffle-down tree reduction
        float r = v;
        for (ushort off = 16; off > 0; off >>= 1) {
            r += simd_shuffle_down(r, off);
        }
        buf[tid] = v;
        simdgroup_barrier(mem_flags::mem_threadgroup);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float s = tg_sum(buf, tid, 32);
        const device float4* x4 = reinterpret_cast<const device float4*>(x);
        float4 q = x4[1];
        float m = -metal::numeric_limits<float>::infinity();
        m = metal::max(m, Limits<float>::min);
        uint bits = as_type<uint>(v);
        out[i * 6 + 0] = tid == 0 ? r : 0.0f;
        out[i * 6 + 1] = s;
        out[i * 6 + 2] = q.y + first4(x4);
        out[i * 6 + 3] = m;
        out[i * 6 + 4] = as_type<float>(bits);
        out[i * 6 + 5] = static_cast<float>(static_cast<bfloat16_t>(v) * 2);
    """
    k = sim.metal_kernel("idioms", ["x"], ["out"], src, header=header)
    x = randn(32)
    (out,) = k(inputs=[mx.array(x)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(32, 6)], output_dtypes=[mx.float32])
    out = np.array(out)
    assert abs(out[0, 0] - x.sum()) < 1e-4
    np.testing.assert_allclose(out[:, 1], x.sum(), rtol=1e-5)
    np.testing.assert_array_equal(out[:, 2], x[5] + x[0] + x[3])
    assert (out[:, 3] == -np.inf).all()
    np.testing.assert_array_equal(out[:, 4], x)
    bf = np.array((mx.array(x).astype(mx.bfloat16) * 2).astype(mx.float32))
    np.testing.assert_array_equal(out[:, 5], bf)


def test_inputs_as_they_lie_where_not_made_contiguous():
    """With ``ensure_row_contiguous=False`` an input comes as MLX passes it: its memory as it lies
    and its own strides, which the kernel sees. Transposed, sliced and broadcast views read
    through their strides give their elements; a read past a view's last element is reported (on a GPU it may still land
    in the array's buffer, but never in the view); with the default, the same views come as
    row-contiguous copies."""
    src = """
        uint i = thread_position_in_grid.x;
        uint r = i / inp_shape[1], c = i % inp_shape[1];
        out[i] = inp[r * inp_strides[0] + c * inp_strides[1]];
    """
    base = mx.arange(24.0).reshape(4, 6)
    views = [mx.transpose(base)[1:4], mx.broadcast_to(mx.arange(3.0)[None], (5, 3)),
             base[:, ::2]]
    strides_src = "strides[0] = inp_strides[0]; strides[1] = inp_strides[1];"
    for contiguous in (False, True):
        k = sim.metal_kernel("strided_read", ["inp"], ["out"], src,
                             ensure_row_contiguous=contiguous)
        seen = sim.metal_kernel("seen_strides", ["inp"], ["strides"], strides_src,
                                ensure_row_contiguous=contiguous)
        for x, own in zip(views, ([1, 6], [0, 1], [6, 2])):
            y = k(inputs=[x], grid=(x.size, 1, 1), threadgroup=(x.size, 1, 1),
                  output_shapes=[(x.size,)], output_dtypes=[mx.float32])[0]
            assert mx.array_equal(y, x.reshape(-1)).item()
            st = seen(inputs=[x], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(2,)],
                      output_dtypes=[mx.int32])[0]
            assert st.tolist() == ([x.shape[1], 1] if contiguous else own)
    past = sim.metal_kernel("read_past", ["inp"], ["out"],
                            "out[0] = inp[inp_strides[0] * inp_shape[0]];",
                            ensure_row_contiguous=False)
    with pytest.raises(sim.OutOfBoundsError):
        past(inputs=[base[:, ::2][1:3]], grid=(1, 1, 1), threadgroup=(1, 1, 1),
             output_shapes=[(1,)], output_dtypes=[mx.float32])
