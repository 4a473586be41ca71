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
    simd_sum: str  # (value): its sum over the whole simdgroup / warp, in every lane
    function: str  # qualifier of helper functions
    unroll: str  # a pragma that fully unrolls the loop it precedes
    private: str  # address space (with its space) of a pointer to a thread's own array
    int64: str
    uint: str
    infinity: str  # a float constant expression for +inf (-inf prints as "-" + this)
    nan: str  # a float constant expression for a quiet NaN
    # the largest threadgroup a schedule picks by itself (``threads=`` may ask for up to 1024)
    max_threads: int = 1024
    math: dict = field(default_factory=dict)
    prelude: str = ""  # target-only helpers, placed in the header


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
    simd_sum="simd_sum",  # one reduction instruction, no shuffle levels
    function="inline",
    unroll="#pragma clang loop unroll(full)",
    private="thread ",
    int64="int64_t",
    uint="uint",
    infinity="INFINITY",  # <metal_math> constants (also in MLX's utils.h)
    nan="NAN",
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
    simd_sum="recgen_warp_sum",
    function="__device__ inline",
    unroll="#pragma unroll",
    private="",
    int64="int64_t",
    uint="unsigned int",
    infinity="__int_as_float(0x7f800000)",  # NVRTC has no <math.h>: the bit patterns
    nan="__int_as_float(0x7fffffff)",
    # A block must fit the SM's 64K registers: 1024 threads leave 64 per thread, which a kernel
    # holding a large state exceeds ("too many resources requested for launch"); 256 threads
    # launch at any count up to the 255-register maximum.
    max_threads=256,
    math={**{k: v + "f" for k, v in _COMMON_MATH.items() if not v.startswith("recgen_")},
          "abs": "fabsf", "sign": "recgen_sign", "rsqrt": "rsqrtf", "max": "fmaxf",
          "log1p": "log1pf", "sigmoid": "recgen_sigmoid", "softplus": "recgen_softplus",
          "scale": "recgen_scale", "compose": "recgen_compose", "zero_hit": "recgen_zero_hit"},
    prelude="""\
// Every lane of the warp takes part (full mask): padded lanes contribute zeros.
__device__ inline float recgen_shuffle_xor(float x, int mask) {
  return __shfl_xor_sync(0xffffffffu, x, mask);
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
