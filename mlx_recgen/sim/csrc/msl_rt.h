// Interface between simulated kernels (msl_shim.h) and the simulator runtime
// (msl_runtime.cpp).  Plain C layout: both sides are compiled separately.
#pragma once
#include <stddef.h>
#include <stdint.h>

namespace msl {

enum : uint32_t { kNoThread = 0xFFFFFFFFu };

// Access modes for msl_rt_access.
enum AccessMode : int {
  kRead = 0,
  kWrite = 1,
  kAtomicLoad = 2,
  kAtomicStore = 3,
  kAtomicRMW = 4,
};

// Buffer kinds.
enum BufKind : int {
  kInput = 0,
  kOutput = 1,
  kThreadgroup = 2,
  kMeta = 3,  // <name>_shape / _strides / _ndim
};

// One recorded access of one element: which thread, and the barrier counters
// (threadgroup-wide and simdgroup-local) that were current for it.
struct Acc {
  uint32_t tid;  // global thread id (group_linear << 10 | local index), kNoThread if none
  uint32_t g;
  uint32_t s;
  uint32_t line;  // line of the access in the kernel text (0: unknown)
};

struct Shadow {
  Acc w;
  Acc r1;
  Acc r2;
  uint32_t flags;  // bit 0: last write was atomic
};

struct Buf {
  char* base;
  uint64_t nbytes;
  uint32_t esize;
  int32_t kind;
  const char* name;
  Shadow* shadow;     // nullptr: bounds checks only
  int32_t uninit_check;  // reading an element never written is an error
  int32_t space;      // 0 device/constant, 1 threadgroup
};

struct U3 {
  uint32_t x, y, z;
};

// Values of the Metal thread attributes for one thread.
struct Attrs {
  U3 thread_position_in_grid;
  U3 thread_position_in_threadgroup;
  U3 threadgroup_position_in_grid;
  U3 threads_per_threadgroup;
  U3 dispatch_threads_per_threadgroup;
  U3 threads_per_grid;
  U3 threadgroups_per_grid;
  U3 grid_origin;
  U3 grid_size;
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t threads_per_simdgroup;
  uint32_t thread_execution_width;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
};

// One lane's part in a simd collective.
struct CollSlot {
  const void* in;
  const void* in2;
  void* out;
  int64_t arg;
};

// Computes every active lane's result of a collective.  active[l] != 0 for the
// lanes that exist; nlanes = 32.
typedef void (*ResolveFn)(int op, CollSlot* slots, const uint8_t* active);

struct ThreadPub {
  Attrs attrs;
  uint32_t gtid;
  uint32_t lid;
};

// The runtime's state as visible to kernels.
struct RtPub {
  ThreadPub* cur;
  uint64_t group_gen;  // changes for every threadgroup executed
};

}  // namespace msl

extern "C" {
extern msl::RtPub* msl_rt;
// `line`: line of the access in the kernel text (0: unknown); `value`: for plain
// writes, the bytes about to be stored (nullptr: unknown).
void msl_rt_access(msl::Buf* b, int64_t byte_off, uint32_t size, int mode, int line,
                   const void* value);
msl::Buf* msl_rt_find_buf(const void* p);
msl::Buf* msl_rt_tg_alloc(const char* name, uint64_t nbytes, uint32_t esize);
void msl_rt_barrier(int simd_scope, int flags, int line, int col);
void msl_rt_collective(int op, int line, int col, msl::CollSlot slot, msl::ResolveFn fn);
[[noreturn]] void msl_rt_fail(int kind, const char* msg);
}
