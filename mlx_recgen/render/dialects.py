"""Per-target spellings for the kernel templates.

The templates are written once; everything that differs between Metal and CUDA is a token in
this table (thread ids, the simdgroup/warp shuffle, threadgroup memory, barriers, math names) or a
helper in ``prelude``. Nothing target-specific lives in the templates themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Dialect:
    name: str
    thread_in_group: str  # linear thread index inside the threadgroup / block
    group_id: str  # linear threadgroup / block index (grid x)
    simd_lane: str  # index inside the simdgroup / warp
    simd_group: str  # simdgroup / warp index inside the group
    shared: str  # qualifier of group-shared arrays
    barrier: str  # group-wide barrier on shared memory
    simd_shuffle_xor: str  # (value, lane mask): the value of lane ``simd_lane ^ mask``
    simd_shuffle: str  # (value, lane): the value of lane ``lane`` of the simdgroup / warp
    simd_sum: str  # (value): its sum over the whole simdgroup / warp, in every lane
    function: str  # qualifier of helper functions
    unroll: str  # a pragma that fully unrolls the loop it precedes
    unroll_by: str  # a pragma that unrolls the loop it precedes ``{}`` times
    private: str  # address space (with its space) of a pointer to a thread's own array
    int64: str
    uint: str
    infinity: str  # a float constant expression for +inf (-inf prints as "-" + this)
    nan: str  # a float constant expression for a quiet NaN
    # the largest threadgroup a schedule picks by itself (``threads=`` may ask for up to 1024)
    max_threads: int = 1024
    math: dict = field(default_factory=dict)
    prelude: str = ""  # target-only helpers, placed in the header
    # the matrix schedule's kernels (``render/matrix.py``): the qualifier of a pointer to group
    # memory, the most group memory a kernel may declare, and ``recgen_mm``, the product of two
    # tiles in group memory on the target's matrix units
    shared_pointer: str = ""
    shared_bytes: int = 32768
    matrix_prelude: str = ""
    # recgen_copy_to_group(dst, src, ok): a float of device memory into group memory (0 where
    # not ok), complete in this thread after recgen_group_copies_done(); then a barrier.
    # recgen_copy4_to_group(dst, src, n): four floats (or halves, widened, or into a tile of
    # halves as they are), the first n of src (0 <= n <= 4) and zeros after, where
    # recgen_aligned4(src) holds (four elements at once) and dst is 16-byte aligned;
    # recgen_fetch4(dst, src, n) and recgen_put4(dst, fetched): the same in two parts, src
    # floats or halves (widened on the way), every fetch of a pass before its puts;
    # recgen_group_copies_commit() and recgen_group_copies_done_but<N>(): the copies issued
    # since the last commit as a group, and a wait for all but the N groups committed last;
    # recgen_load4(p) and recgen_store4(p, x): four floats of group or device memory at p,
    # 16-byte aligned (a store to device memory of halves rounds them, 8-byte aligned);
    # recgen_store1(p, x): one float to device memory of floats or halves
    group_copy_prelude: str = ""
    # the qualifier that aligns a declared group array to 16 bytes (the four-float copies' rows)
    shared_align: str = ""
    # group memory sized at launch, where the target has it beyond ``shared_bytes`` of
    # declared arrays: the declaration of that buffer (``{}``: its name) and the most a kernel
    # takes (0: none; every array is declared)
    dynamic_shared: str = ""
    dynamic_shared_bytes: int = 0
    # floats added to the rows of the products' operands in group memory, against bank
    # conflicts: (an operand read along its rows, one read down its columns)
    matrix_pads: tuple = (0, 0)
    # the tile types, by dtype tag ("bf16", "f16"), in which the walks multiply half-precision
    # factors as they are (``recgen_mm`` on tiles of halves; the scaled rows rounded to the
    # factors' precision) where both are halves of one kind; elsewhere their tiles hold floats
    half_tiles: dict = field(default_factory=dict)
    # header lines that bound a kernel's registers to what ``{threads}`` threads a group and
    # ``{groups}`` groups a core leave (the kernel's signature is the host's, MLX's); "" where
    # the target has no such bound
    launch_bounds: str = ""
    # the scan's look-back (``Schedule.lookback``): groups that wait on floats other groups
    # publish, through device memory. recgen_words(zeros): the call's zero array as 64-bit
    # words; recgen_take_ticket(counter): this group's number in the
    # order groups start; recgen_publish(word, v): v with a ready tag; recgen_peek(word): the
    # word as it is now, recgen_ready / recgen_value of it; recgen_pause(): a short wait
    # between polls. "" where the target promises no progress to a group that waits on
    # another (Metal: then one group walks all of a lane block's stretches)
    lookback: str = ""


_COMMON_MATH = {
    "exp": "exp", "log": "log", "tanh": "tanh", "sin": "sin", "cos": "cos", "tan": "tan",
    "cosh": "cosh", "sinh": "sinh", "sqrt": "sqrt", "rsqrt": "rsqrt", "pow": "pow",
    "abs": "abs", "sign": "sign", "log1p": "recgen_log1p", "sigmoid": "recgen_sigmoid",
    "softplus": "recgen_softplus", "max": "max", "scale": "recgen_scale",
    "compose": "recgen_compose", "zero_hit": "recgen_zero_hit",
}

METAL = Dialect(
    name="metal",
    thread_in_group="thread_position_in_threadgroup.x",
    group_id="threadgroup_position_in_grid.x",
    simd_lane="thread_index_in_simdgroup",
    simd_group="simdgroup_index_in_threadgroup",
    shared="threadgroup",
    barrier="threadgroup_barrier(mem_flags::mem_threadgroup)",
    simd_shuffle_xor="simd_shuffle_xor",
    simd_shuffle="simd_shuffle",
    simd_sum="simd_sum",  # one reduction instruction, no shuffle levels
    function="inline",
    unroll="#pragma clang loop unroll(full)",
    unroll_by="#pragma clang loop unroll_count({})",
    private="thread ",
    int64="int64_t",
    uint="uint",
    infinity="INFINITY",  # <metal_math> constants (also in MLX's utils.h)
    nan="NAN",
    shared_pointer="threadgroup ",
    shared_bytes=32768,
    matrix_prelude="""\
// D (M x N) = [D +] op(A) (M x K) op(B) (K x N), every array in threadgroup memory (row-major,
// leading dimensions lda, ldb, ldd; op transposes where TA / TB), called by all ``threads`` of
// the threadgroup (``tid``: this one): 8 x 8 tiles of D dealt to the simdgroups in turn, each a chain of simdgroup_multiply_accumulate over K (fp32 throughout).
template <int M, int N, int K, bool TA, bool TB, bool ACC, int WARPS = 8>  // (CUDA's strips)
inline void recgen_mm(threadgroup float* D, int ldd, const threadgroup float* A, int lda,
                      const threadgroup float* B, int ldb, uint tid, uint threads) {
  for (uint tile = tid / 32; tile < uint((M / 8) * (N / 8)); tile += threads / 32) {
    const uint i = (tile / (N / 8)) * 8, j = (tile % (N / 8)) * 8;
    simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    if (ACC) {
      simdgroup_load(acc, D, ldd, ulong2(j, i));
    }
    for (uint k = 0; k < uint(K); k += 8) {
      simdgroup_float8x8 a, b;
      simdgroup_load(a, A, lda, ulong2(k, i), TA);  // the origin is (column, row) of op(A)
      simdgroup_load(b, B, ldb, ulong2(j, k), TB);
      simdgroup_multiply_accumulate(acc, a, b, acc);
    }
    simdgroup_store(acc, D, ldd, ulong2(j, i));
  }
}
""",
    group_copy_prelude="""\
// a device or a constant pointer, as MLX passes the input, to floats or halves (widened)
template <typename Source>
inline void recgen_copy_to_group(threadgroup float* dst, Source src, bool ok) {
  *dst = ok ? float(*src) : 0.0f;
}
template <typename Source>
inline void recgen_copy4_to_group(threadgroup float* dst, Source src, int n) {
  for (int i = 0; i < 4; ++i) {
    dst[i] = i < n ? float(src[i]) : 0.0f;
  }
}
template <typename Source>  // plain loads: any element's address will do
inline bool recgen_aligned4(Source) {
  return true;
}
// a copy of four elements in two parts (recgen_fetch4, then recgen_put4 after every fetch of
// the pass): plain loads, then plain stores
template <typename Source>
inline float4 recgen_fetch4(threadgroup float*, Source src, int n) {
  return float4(n > 0 ? float(src[0]) : 0.0f, n > 1 ? float(src[1]) : 0.0f,
                n > 2 ? float(src[2]) : 0.0f, n > 3 ? float(src[3]) : 0.0f);
}
inline void recgen_put4(threadgroup float* dst, float4 x) {
  dst[0] = x.x;
  dst[1] = x.y;
  dst[2] = x.z;
  dst[3] = x.w;
}
inline void recgen_group_copies_done() {}
// the copies in groups (cp.async's commit and wait on CUDA): copies here are done when issued
inline void recgen_group_copies_commit() {}
template <int PENDING>
inline void recgen_group_copies_done_but() {}
// four floats of a tile's row, read or written as one (plain accesses: any float's address will do)
template <typename P>
inline float4 recgen_load4(P p) {
  return float4(p[0], p[1], p[2], p[3]);
}
template <typename P>  // floats or halves (rounded to nearest)
inline void recgen_store4(P p, float4 x) {
  p[0] = x.x;
  p[1] = x.y;
  p[2] = x.z;
  p[3] = x.w;
}
template <typename P>  // one float to device memory of floats or halves
inline void recgen_store1(P p, float x) {
  *p = x;
}
inline float4 recgen_zeros4() {
  return float4(0.0f);
}
""",
    math={k: ("metal::" + v if not v.startswith("recgen_") else v) for k, v in _COMMON_MATH.items()},
    prelude="""\
// MSL has no log1p: log(1 + x) with the rounding error of 1 + x cancelled.
inline float recgen_log1p(float x) {
  float u = 1.0f + x;
  return u == 1.0f ? x : metal::log(u) * (x / (u - 1.0f));
}
""",
)

CUDA = Dialect(
    name="cuda",
    thread_in_group="threadIdx.x",
    group_id="blockIdx.x",
    simd_lane="(threadIdx.x & 31u)",
    simd_group="(threadIdx.x >> 5)",
    shared="__shared__",
    barrier="__syncthreads()",
    simd_shuffle_xor="recgen_shuffle_xor",
    simd_shuffle="recgen_shuffle",
    simd_sum="recgen_warp_sum",
    function="__device__ inline",
    unroll="#pragma unroll",
    unroll_by="#pragma unroll {}",
    private="",
    int64="int64_t",
    uint="unsigned int",
    infinity="__int_as_float(0x7f800000)",  # NVRTC has no <math.h>: the bit patterns
    nan="__int_as_float(0x7fffffff)",
    # A block must fit the SM's 64K registers: 1024 threads leave 64 per thread, which a kernel
    # holding a large state exceeds ("too many resources requested for launch"); 256 threads
    # launch at any count up to the 255-register maximum.
    max_threads=256,
    shared_pointer="",
    shared_bytes=49152,  # static __shared__ arrays of one block
    # beyond 48 KB a block's shared memory is dynamic, sized at launch (MLX's ``shared_memory``
    # sets the kernel's attribute); 96 KB runs on every GPU with TF32 tensor cores (sm_80 and
    # later) and leaves two blocks an SM on an H100
    dynamic_shared="extern __shared__ float {}[];",
    dynamic_shared_bytes=98304,
    # a warp's fragment loads touch 8 rows x 4 columns (or 4 x 8): rows 4 (8) floats apart
    # fall in 32 distinct banks
    matrix_pads=(4, 8),
    # bf16 only: fp16's range would overflow where a growing multiplier scales a row past 65504
    half_tiles={"bf16": "__nv_bfloat16"},
    # MLX writes the kernel's signature, so its launch bounds come through the qualifier it
    # writes first; only this kernel follows the header
    launch_bounds="""\
#undef __global__
#define __global__ __location__(global) __launch_bounds__({threads}, {groups})""",
    lookback="""\
// MLX passes every input as const: the words are a zero array of one call, written only here.
// It comes as 32-bit zeros (MLX fills those faster than 64-bit ones), read as 64-bit words.
__device__ inline const uint64_t* recgen_words(const uint32_t* zeros) {
  return reinterpret_cast<const uint64_t*>(zeros);
}
__device__ inline unsigned long long recgen_take_ticket(const uint64_t* counter) {
  return atomicAdd(reinterpret_cast<unsigned long long*>(const_cast<uint64_t*>(counter)), 1ull);
}
// a float beside its ready tag in one aligned 64-bit word, written and read whole (single-copy
// atomic): a reader that sees the tag sees the value, with no fence between them
__device__ inline void recgen_publish(const uint64_t* word, float v) {
  atomicExch(reinterpret_cast<unsigned long long*>(const_cast<uint64_t*>(word)),
             (1ull << 32) | __float_as_uint(v));
}
__device__ inline unsigned long long recgen_peek(const uint64_t* word) {
  return *reinterpret_cast<volatile const unsigned long long*>(word);  // from L2, not L1
}
__device__ inline bool recgen_ready(unsigned long long word) {
  return (word >> 32) != 0ull;
}
__device__ inline float recgen_value(unsigned long long word) {
  return __uint_as_float(static_cast<unsigned>(word));
}
__device__ inline void recgen_pause() {
  __nanosleep(32);
}
""",
    matrix_prelude="""\
// fp32 -> TF32 (round to nearest, ties away), the operand format of the fp32 tensor-core MMA,
// which reads the top 19 bits of a 32-bit operand: half a TF32 unit added to the magnitude
// bits rounds it, a carry into the exponent included. One integer add, where cvt.rna.tf32.f32
// is two instructions on sm_90 (a test for infinity and NaN, then the add): the same TF32 for
// every finite value and for infinities; a NaN whose payload lies only in the 13 bits TF32
// drops reads as infinity (arithmetic makes none: its NaNs carry the top mantissa bit)
__device__ inline unsigned recgen_tf32(float x) {
  return __float_as_uint(x) + 0x1000u;
}
// the offset of element (r, c) of op(X) from X: X row-major with leading dimension ld,
// transposed where tr
__device__ inline int recgen_at(int ld, bool tr, int r, int c) {
  return tr ? c * ld + r : r * ld + c;
}
// a strip's accumulators, NB tiles of 16 x 8 side by side: lane (g, t) holds D's rows g, g + 8,
// columns 2t, 2t + 1 of each (d: D at (g, 2t) of the first); zeros unless ACC adds to D
template <int NB, bool ACC>
__device__ inline void recgen_accumulators(float (&c)[NB][4], const float* d, int ldd) {
#pragma unroll
  for (int n = 0; n < NB; ++n) {
    c[n][0] = ACC ? d[8 * n] : 0.0f;
    c[n][1] = ACC ? d[8 * n + 1] : 0.0f;
    c[n][2] = ACC ? d[8 * ldd + 8 * n] : 0.0f;
    c[n][3] = ACC ? d[8 * ldd + 8 * n + 1] : 0.0f;
  }
}
template <int NB>
__device__ inline void recgen_store_accumulators(float* d, int ldd, const float (&c)[NB][4]) {
#pragma unroll
  for (int n = 0; n < NB; ++n) {
    d[8 * n] = c[n][0];
    d[8 * n + 1] = c[n][1];
    d[8 * ldd + 8 * n] = c[n][2];
    d[8 * ldd + 8 * n + 1] = c[n][3];
  }
}
// D (M x N) = [D +] op(A) (M x K) op(B) (K x N), every array in shared memory (row-major,
// leading dimensions lda, ldb, ldd; op transposes where TA / TB), called by all ``threads`` of
// the block (``tid``: this one): strips of 16 x 8 tiles of D dealt to the warps in turn, each a chain of mma.sync m16n8k8 over K on the tensor cores, operands in TF32
// and accumulation in fp32 (sm_80 and later). Lane (g, t) = (lane / 4, lane % 4) holds A at
// rows g, g + 8 and columns t, t + 4, B at rows t, t + 4 and column g, D at rows g, g + 8 and
// columns 2t, 2t + 1 (PTX ISA, "Matrix Fragments for mma.m16n8k8").
template <int M, int N, int K, bool TA, bool TB, bool ACC, int WARPS = 8>
__device__ inline void recgen_mm(float* D, int ldd, const float* A, int lda, const float* B,
                                 int ldb, unsigned tid, unsigned threads) {
  // a warp takes a strip of NB tiles side by side: A's fragment is loaded once for all of them;
  // four where that still makes a strip for each of the group's WARPS warps, else two (a
  // [64, 32] product in strips of four left half of 8 warps idle)
  constexpr int NB = (N / 8) % 4 == 0 && (M / 16) * (N / 32) >= WARPS ? 4
                     : ((N / 8) % 2 == 0 ? 2 : 1);
  constexpr int STRIPS = N / (8 * NB);
  const int lane = int(tid & 31u), g = lane >> 2, t = lane & 3;
  for (unsigned strip = tid >> 5; strip < unsigned((M / 16) * STRIPS); strip += threads >> 5) {
    const int i = int(strip / STRIPS) * 16, j0 = int(strip % STRIPS) * 8 * NB;
    // this lane's first element of each operand, op(A)(i + g, t), op(B)(t, j0 + g) and
    // D(i + g, j0 + 2t): every other one it reads lies a constant offset from these (lda, ldb,
    // ldd are the callers' constants), so a load is one instruction with its offset folded in
    const float* a = A + recgen_at(lda, TA, i + g, t);
    const float* b = B + recgen_at(ldb, TB, t, j0 + g);
    float* d = D + (i + g) * ldd + j0 + 2 * t;
    float c[NB][4];
    recgen_accumulators<NB, ACC>(c, d, ldd);
#pragma unroll
    for (int k = 0; k < K; k += 8) {
      const unsigned a0 = recgen_tf32(a[recgen_at(lda, TA, 0, k)]);
      const unsigned a1 = recgen_tf32(a[recgen_at(lda, TA, 8, k)]);
      const unsigned a2 = recgen_tf32(a[recgen_at(lda, TA, 0, k + 4)]);
      const unsigned a3 = recgen_tf32(a[recgen_at(lda, TA, 8, k + 4)]);
#pragma unroll
      for (int n = 0; n < NB; ++n) {
        const unsigned b0 = recgen_tf32(b[recgen_at(ldb, TB, k, 8 * n)]);
        const unsigned b1 = recgen_tf32(b[recgen_at(ldb, TB, k + 4, 8 * n)]);
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"
            : "+f"(c[n][0]), "+f"(c[n][1]), "+f"(c[n][2]), "+f"(c[n][3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      }
    }
    recgen_store_accumulators<NB>(d, ldd, c);
  }
}
// The same product on half-precision operands (bf16 or fp16 in shared memory, fp32 D): a
// chain of mma.sync m16n8k16 whose fragments come by ldmatrix, eight halves of a row at a time
// (every row address 16-byte aligned: lda, ldb and the tiles' origins multiples of 8 halves).
// ldmatrix gives lane (g, t) elements (g, 2t), (g, 2t + 1) of each 8 x 8 matrix it loads, or
// with .trans those of the matrix transposed; A's four matrices are op(A)'s blocks at rows
// +0/+8 and columns +0/+8 (fragments a0..a3), B's two op(B)'s at rows +0/+8 of one 8-column
// block (b0, b1), read from op(B)ᵀ's rows (PTX ISA, "Matrix Fragments for mma.m16n8k16").
template <bool TRANS>
__device__ inline void recgen_ldmatrix4(unsigned (&r)[4], const void* p) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(p));
  if (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
  }
}
template <bool TRANS>
__device__ inline void recgen_ldmatrix2(unsigned (&r)[2], const void* p) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(p));
  if (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(at));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(at));
  }
}
__device__ inline void recgen_mma16(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                    const __nv_bfloat16*) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ inline void recgen_mma16(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                    const __half*) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <int M, int N, int K, bool TA, bool TB, bool ACC, int WARPS = 8, typename Half>
__device__ inline void recgen_mm(float* D, int ldd, const Half* A, int lda, const Half* B,
                                 int ldb, unsigned tid, unsigned threads) {
  static_assert(M % 16 == 0 && N % 8 == 0 && K % 16 == 0, "whole m16n8k16 tiles");
  constexpr int NB = (N / 8) % 4 == 0 && (M / 16) * (N / 32) >= WARPS ? 4
                     : ((N / 8) % 2 == 0 ? 2 : 1);
  constexpr int STRIPS = N / (8 * NB);
  const int lane = int(tid & 31u), g = lane >> 2, t = lane & 3;
  const int mat = lane >> 3, row = lane & 7;  // the matrix and row whose address this lane gives
  for (unsigned strip = tid >> 5; strip < unsigned((M / 16) * STRIPS); strip += threads >> 5) {
    const int i = int(strip / STRIPS) * 16, j0 = int(strip % STRIPS) * 8 * NB;
    float* d = D + (i + g) * ldd + j0 + 2 * t;
    float c[NB][4];
    recgen_accumulators<NB, ACC>(c, d, ldd);
    // this lane's row of op(A)'s block (rows +8 (mat & 1), columns +8 (mat >> 1)) at k = 0, as
    // stored: a row of A, or of Aᵀ where op transposes (then loaded transposed)
    const Half* a = TA ? A + (8 * (mat >> 1) + row) * lda + i + 8 * (mat & 1)
                       : A + (i + 8 * (mat & 1) + row) * lda + 8 * (mat >> 1);
    // and of op(B)'s block (rows +8 (mat & 1)) at k = 0, column j0: a row of B (transposed), or
    // of Bᵀ, op(B)ᵀ's row
    const Half* b = TB ? B + (j0 + row) * ldb + 8 * (mat & 1)
                       : B + (8 * (mat & 1) + row) * ldb + j0;
#pragma unroll
    for (int k = 0; k < K; k += 16) {
      unsigned af[4];
      recgen_ldmatrix4<TA>(af, TA ? a + k * lda : a + k);
#pragma unroll
      for (int n = 0; n < NB; ++n) {
        unsigned bf[2];
        recgen_ldmatrix2<!TB>(bf, TB ? b + 8 * n * ldb + k : b + k * ldb + 8 * n);
        recgen_mma16(c[n], af, bf, A);
      }
    }
    recgen_store_accumulators<NB>(d, ldd, c);
  }
}
""",
    # copies that bypass the registers (cp.async, sm_80 and later): a thread issues all of a
    # tile's at once, where loads through registers held 8 or 16 in flight
    group_copy_prelude="""\
__device__ inline void recgen_copy_to_group(float* dst, const float* src, bool ok) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  // src-size 0 reads nothing and fills the destination with zeros
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\\n" ::"r"(to), "l"(src),
               "r"(ok ? 4 : 0));
}
// four floats in one 16-byte copy, the last 4 - n filled with zeros (src-size 4 n)
__device__ inline void recgen_copy4_to_group(float* dst, const float* src, int n) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" ::"r"(to), "l"(src),
               "r"(4 * n));
}
__device__ inline bool recgen_aligned4(const float* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}
// a copy of four elements of a factor's row in two parts, so that a thread's copies of a
// pass are in flight together: recgen_fetch4 starts it (n elements, zeros after), recgen_put4,
// after every fetch of the pass, ends it. Floats: cp.async, which lands the bytes by itself.
struct recgen_copy_in_flight {};
__device__ inline recgen_copy_in_flight recgen_fetch4(float* dst, const float* src, int n) {
  recgen_copy4_to_group(dst, src, n);
  return {};
}
__device__ inline void recgen_put4(float*, recgen_copy_in_flight) {}
// Halves (bf16, fp16) widen to floats on their way, which cp.async (a copy of bytes) cannot:
// an 8-byte load into registers (src aligned to 8 bytes), widened when put
template <typename Half>
struct recgen_halves4 {
  uint2 bits;
};
__device__ inline float2 recgen_widen2(unsigned w, recgen_halves4<__nv_bfloat16>) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
__device__ inline float2 recgen_widen2(unsigned w, recgen_halves4<__half>) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
template <typename Half>
__device__ inline recgen_halves4<Half> recgen_fetch4(float*, const Half* src, int n) {
  if (n == 4) {
    return {__ldg(reinterpret_cast<const uint2*>(src))};
  }
  const unsigned short* bits = reinterpret_cast<const unsigned short*>(src);
  unsigned e[4];
  for (int i = 0; i < 4; ++i) {
    e[i] = i < n ? bits[i] : 0u;  // zero bits: 0.0 in either format
  }
  return {make_uint2(e[0] | e[1] << 16, e[2] | e[3] << 16)};
}
template <typename Half>
__device__ inline void recgen_put4(float* dst, recgen_halves4<Half> x) {
  const float2 lo = recgen_widen2(x.bits.x, x), hi = recgen_widen2(x.bits.y, x);
  *reinterpret_cast<float4*>(dst) = make_float4(lo.x, lo.y, hi.x, hi.y);
}
template <typename Half>
__device__ inline void recgen_copy_to_group(float* dst, const Half* src, bool ok) {
  *dst = ok ? float(*src) : 0.0f;
}
// four halves of a state's row into a tile of floats, widened (src 8-byte aligned)
template <typename Half>
__device__ inline void recgen_copy4_to_group(float* dst, const Half* src, int n) {
  recgen_put4(dst, recgen_fetch4(dst, src, n));
}
// Halves into a tile of halves (the walks' operands where both factors are halves of one
// kind, ``Dialect.half_tiles``): bytes, so cp.async lands them by itself; 8 bytes for four
// (src-size 2 n: zeros after n), one by a plain load and store
template <typename Half>
__device__ inline recgen_copy_in_flight recgen_fetch4(Half* dst, const Half* src, int n) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\\n" ::"r"(to), "l"(src),
               "r"(2 * n));
  return {};
}
template <typename Half>
__device__ inline void recgen_put4(Half*, recgen_copy_in_flight) {}
template <typename Half>  // four halves of a state's row into a tile of halves (src 8-byte aligned)
__device__ inline void recgen_copy4_to_group(Half* dst, const Half* src, int n) {
  recgen_fetch4(dst, src, n);
}
template <typename Half>
__device__ inline void recgen_copy_to_group(Half* dst, const Half* src, bool ok) {
  *dst = ok ? *src : Half(0.0f);
}
// four halves of a tile's row as floats (p 8-byte aligned); recgen_store4 rounds them back
template <typename Half>
__device__ inline float4 recgen_load4(const Half* p) {
  const uint2 bits = *reinterpret_cast<const uint2*>(p);
  const recgen_halves4<Half> x{bits};
  const float2 lo = recgen_widen2(bits.x, x), hi = recgen_widen2(bits.y, x);
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
template <typename Half>
__device__ inline bool recgen_aligned4(const Half* p) {
  return (reinterpret_cast<unsigned long long>(p) & 7ull) == 0;
}
__device__ inline void recgen_group_copies_done() {
  asm volatile("cp.async.wait_all;\\n" ::);
}
// the copies issued since the last commit form a group; done_but<N> waits for every group but
// the N committed last (a group may be empty)
__device__ inline void recgen_group_copies_commit() {
  asm volatile("cp.async.commit_group;\\n" ::);
}
template <int PENDING>
__device__ inline void recgen_group_copies_done_but() {
  asm volatile("cp.async.wait_group %0;\\n" ::"n"(PENDING));
}
// four floats of a tile's row, read or written as one 16-byte access (p 16-byte aligned)
__device__ inline float4 recgen_load4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ inline void recgen_store4(float* p, float4 x) {
  *reinterpret_cast<float4*>(p) = x;
}
// to device memory of halves, rounded to nearest: four in one 8-byte store (p 8-byte aligned)
__device__ inline unsigned recgen_narrow2(float a, float b, const __nv_bfloat16*) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}
__device__ inline unsigned recgen_narrow2(float a, float b, const __half*) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}
template <typename Half>
__device__ inline void recgen_store4(Half* p, float4 x) {
  *reinterpret_cast<uint2*>(p) = make_uint2(recgen_narrow2(x.x, x.y, p), recgen_narrow2(x.z, x.w, p));
}
// one float to device memory of floats or halves
__device__ inline void recgen_store1(float* p, float x) {
  *p = x;
}
__device__ inline void recgen_store1(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16_rn(x);
}
__device__ inline void recgen_store1(__half* p, float x) {
  *p = __float2half_rn(x);
}
__device__ inline float4 recgen_zeros4() {
  return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}
""",
    shared_align="__align__(16) ",
    math={**{k: v + "f" for k, v in _COMMON_MATH.items() if not v.startswith("recgen_")},
          "abs": "fabsf", "sign": "recgen_sign", "rsqrt": "rsqrtf", "max": "fmaxf",
          "log1p": "log1pf", "sigmoid": "recgen_sigmoid", "softplus": "recgen_softplus",
          "scale": "recgen_scale", "compose": "recgen_compose", "zero_hit": "recgen_zero_hit"},
    prelude="""\
// Every lane of the warp takes part (full mask): padded lanes contribute zeros.
__device__ inline float recgen_shuffle_xor(float x, int mask) {
  return __shfl_xor_sync(0xffffffffu, x, mask);
}
__device__ inline float recgen_shuffle(float x, int lane) {
  return __shfl_sync(0xffffffffu, x, lane);
}
// CUDA has no warp sum of a float: a butterfly of shuffles, the sum left in every lane.
__device__ inline float recgen_warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}
__device__ inline float recgen_sign(float x) {
  return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
}
""",
)

DIALECTS = {"metal": METAL, "metal-sim": METAL, "cuda": CUDA}
