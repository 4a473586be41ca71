// Metal simulator runtime: runs the threads of each threadgroup as cooperative
// fibers that meet at barriers and simd collectives, and checks memory
// accesses (bounds, races, uninitialised reads, unwritten outputs).
//
// Built once as a shared library; kernels (compiled with msl_shim.h) call into it.
#include "msl_rt.h"

#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

using namespace msl;

namespace {

enum ErrKind {
  kOk = 0,
  kErrOOB = 1,
  kErrUnwritten = 2,
  kErrUninit = 3,
  kErrSimd = 4,
  kErrBarrier = 5,
  kErrRace = 6,
  kErrCrash = 7,
  kErrOther = 8,
};

enum TState { kRunnable = 0, kWaitColl = 1, kWaitBarrier = 2, kDone = 3, kAborted = 4 };

constexpr size_t kStackSize = 256 * 1024;
constexpr size_t kGuard = 4096;
constexpr uint32_t kMaxThreads = 1024;

#if defined(__x86_64__)
extern "C" void msl_ctx_swap(void** save_sp, void* new_sp);
asm(R"(
  .text
  .globl msl_ctx_swap
  .type msl_ctx_swap,@function
msl_ctx_swap:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size msl_ctx_swap,.-msl_ctx_swap
)");
#endif

struct Thread {
  ThreadPub pub;
  int state;
  int op;
  int line, col;
  int bflags, bscope;
  ResolveFn fn;
  CollSlot slot;
  char* stack;
#if defined(__x86_64__)
  void* sp;
#else
  ucontext_t uc;
#endif
};

struct LaunchBuf {
  Buf buf;
  std::vector<Shadow> shadow;
};

}  // namespace

extern "C" {
struct BufDesc {
  void* data;
  uint64_t nbytes;
  uint32_t esize;
  int32_t kind;
  const char* name;
  int32_t uninit_check;
  int32_t track;
};

struct LaunchDesc {
  const char* kernel_name;
  void (*entry)(void**);
  int32_t nbufs;
  BufDesc* bufs;
  uint32_t grid[3];
  uint32_t tg[3];
  int32_t check_unwritten;
  int32_t check_races;
  int32_t strict_races;
  uint64_t same_value_stores;  // out: how many same-value stores were let through
  char* warn;                  // out: the first of them, described
  int32_t warnlen;
  uint64_t threadgroup_bytes;  // the threadgroup memory a group may declare (Metal: 32 KiB)
};
}

namespace {

struct Rt {
  RtPub pub;
  const LaunchDesc* desc = nullptr;
  std::vector<LaunchBuf*> bufs;
  std::vector<void*> entry_args;
  std::vector<LaunchBuf*> tg_bufs;
  std::vector<char*> tg_mem;
  uint64_t tg_bytes = 0;
  Thread threads[kMaxThreads];
  uint32_t n = 0;
  U3 ext{1, 1, 1};      // actual extent of the current group
  U3 gpos{0, 0, 0};     // current group position
  U3 disp{1, 1, 1};     // dispatched group size
  U3 ngroups{1, 1, 1};
  uint32_t group_linear = 0;
  uint32_t G_tg = 0, G_dev = 0;
  uint32_t S_tg[kMaxThreads / 32], S_dev[kMaxThreads / 32];
  int err = kOk;
  std::string msg;
  bool check_races = true;
  Thread* cur = nullptr;
  // reads of never-written elements; reported at the next threadgroup barrier or at
  // the end of the group unless a racing write by another thread is found first.
  struct Pending {
    const Buf* b;
    uint64_t e;
    uint32_t tid;
    int mode;
    uint32_t line;
  };
  std::vector<Pending> pending;
  bool strict_races = false;
  uint64_t same_value_stores = 0;  // plain stores of an identical value that would race
  std::string same_value_msg;      // the first of them
#if defined(__x86_64__)
  void* sched_sp = nullptr;
#else
  ucontext_t sched_uc;
#endif
  sigjmp_buf crash_env;
  bool in_launch = false;
};

Rt g_rt;
char* g_stacks = nullptr;
size_t g_nstacks = 0;
uint64_t g_gen = 1;

std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

U3 group_extent(U3 gp) {
  const LaunchDesc* d = g_rt.desc;
  U3 e;
  e.x = d->grid[0] - gp.x * g_rt.disp.x < g_rt.disp.x ? d->grid[0] - gp.x * g_rt.disp.x : g_rt.disp.x;
  e.y = d->grid[1] - gp.y * g_rt.disp.y < g_rt.disp.y ? d->grid[1] - gp.y * g_rt.disp.y : g_rt.disp.y;
  e.z = d->grid[2] - gp.z * g_rt.disp.z < g_rt.disp.z ? d->grid[2] - gp.z * g_rt.disp.z : g_rt.disp.z;
  return e;
}

// "thread (x,y,z) [threadgroup (..), local (..), simdgroup s lane l]"
std::string describe(uint32_t gtid) {
  uint32_t gl = gtid >> 10, lid = gtid & 1023;
  U3 gp{gl % g_rt.ngroups.x, (gl / g_rt.ngroups.x) % g_rt.ngroups.y,
        gl / (g_rt.ngroups.x * g_rt.ngroups.y)};
  U3 e = group_extent(gp);
  U3 l{lid % e.x, (lid / e.x) % e.y, lid / (e.x * e.y)};
  return fmt("thread (%u,%u,%u) [threadgroup (%u,%u,%u), thread_position_in_threadgroup "
             "(%u,%u,%u), simdgroup %u lane %u]",
             gp.x * g_rt.disp.x + l.x, gp.y * g_rt.disp.y + l.y, gp.z * g_rt.disp.z + l.z, gp.x,
             gp.y, gp.z, l.x, l.y, l.z, lid / 32, lid % 32);
}

// " @@L<line>@@": a line of the kernel text, which the Python side turns into the
// line of the user's source and the statement there.
std::string at_line(uint32_t line) { return line ? fmt(" @@L%u@@", line) : std::string(); }

std::string kname() { return fmt("kernel `%s`", g_rt.desc ? g_rt.desc->kernel_name : "?"); }

void to_sched(Thread* t) {
#if defined(__x86_64__)
  msl_ctx_swap(&t->sp, g_rt.sched_sp);
#else
  swapcontext(&t->uc, &g_rt.sched_uc);
#endif
}

void set_error(int kind, const std::string& m) {
  if (g_rt.err == kOk) {
    g_rt.err = kind;
    g_rt.msg = m;
  }
}

[[noreturn]] void abort_thread() {
  Thread* t = g_rt.cur;
  t->state = kAborted;
  to_sched(t);
  // never resumed
  abort();
}

[[noreturn]] void fail_here(int kind, const std::string& what) {
  Thread* t = g_rt.cur;
  std::string m = kname() + ": " + (t ? describe(t->pub.gtid) : std::string("?")) + ": " + what;
  set_error(kind, m);
  abort_thread();
}

void fiber_main() {
  Thread* t = g_rt.cur;
  g_rt.desc->entry(g_rt.entry_args.data());
  t->state = kDone;
  to_sched(t);
  abort();
}

#if defined(__x86_64__)
extern "C" void msl_fiber_tramp() { fiber_main(); }
#endif

bool ensure_stacks(uint32_t n) {
  if (g_nstacks >= n) return true;
  if (g_stacks) munmap(g_stacks, g_nstacks * (kStackSize + kGuard));
  g_nstacks = 0;
  size_t total = (size_t)n * (kStackSize + kGuard);
  void* m = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (m == MAP_FAILED) return false;
  g_stacks = (char*)m;
  for (uint32_t i = 0; i < n; ++i) mprotect(g_stacks + i * (kStackSize + kGuard), kGuard, PROT_NONE);
  g_nstacks = n;
  return true;
}

void init_fiber(Thread* t, uint32_t i) {
  char* lo = g_stacks + i * (kStackSize + kGuard) + kGuard;
  t->stack = lo;
#if defined(__x86_64__)
  uintptr_t top = ((uintptr_t)(lo + kStackSize)) & ~(uintptr_t)15;
  uint64_t* sp = (uint64_t*)(top - 16);
  *sp = (uint64_t)(uintptr_t)&msl_fiber_tramp;  // return address
  for (int k = 0; k < 6; ++k) *--sp = 0;         // rbp rbx r12 r13 r14 r15
  --sp;
  uint32_t csr[2];
  asm volatile("stmxcsr %0" : "=m"(csr[0]));
  asm volatile("fnstcw %0" : "=m"(csr[1]));
  memcpy(sp, csr, 8);
  t->sp = sp;
#else
  getcontext(&t->uc);
  t->uc.uc_stack.ss_sp = lo;
  t->uc.uc_stack.ss_size = kStackSize;
  t->uc.uc_link = nullptr;
  makecontext(&t->uc, (void (*)())fiber_main, 0);
#endif
}

void run_thread(Thread* t) {
  g_rt.cur = t;
  g_rt.pub.cur = &t->pub;
#if defined(__x86_64__)
  msl_ctx_swap(&g_rt.sched_sp, t->sp);
#else
  swapcontext(&g_rt.sched_uc, &t->uc);
#endif
  g_rt.cur = nullptr;
  g_rt.pub.cur = nullptr;
}

const char* op_name(int op) {
  switch (op) {
    case 0: return "simdgroup_barrier";
    case 1: return "simd_sum";
    case 2: return "simd_product";
    case 3: return "simd_max";
    case 4: return "simd_min";
    case 5: return "simd_and";
    case 6: return "simd_or";
    case 7: return "simd_xor";
    case 8: return "simd_prefix_inclusive_sum";
    case 9: return "simd_prefix_exclusive_sum";
    case 10: return "simd_prefix_inclusive_product";
    case 11: return "simd_prefix_exclusive_product";
    case 12: return "simd_shuffle";
    case 13: return "simd_shuffle_xor";
    case 14: return "simd_shuffle_up";
    case 15: return "simd_shuffle_down";
    case 16: return "simd_broadcast";
    case 17: return "simd_broadcast_first";
    case 18: return "simd_all";
    case 19: return "simd_any";
    case 20: return "simd_ballot";
    case 21: return "simd_shuffle_and_fill_up";
    case 22: return "simd_shuffle_and_fill_down";
    case 23: return "simd_shuffle_rotate_up";
    case 24: return "simd_shuffle_rotate_down";
    case 25: return "simd_is_first";
    case 64: return "simdgroup_load";
    case 65: return "simdgroup_store";
    case 66: return "simdgroup_multiply_accumulate";
    case 67: return "simdgroup_multiply";
    default: break;
  }
  // quad_* collectives: the simd op code + 32
  static const char* const quad[] = {
      nullptr, "quad_sum", "quad_product", "quad_max", "quad_min", "quad_and", "quad_or",
      "quad_xor", "quad_prefix_inclusive_sum", "quad_prefix_exclusive_sum",
      "quad_prefix_inclusive_product", "quad_prefix_exclusive_product", "quad_shuffle",
      "quad_shuffle_xor", "quad_shuffle_up", "quad_shuffle_down", "quad_broadcast",
      "quad_broadcast_first", nullptr, nullptr, nullptr, nullptr, nullptr,
      "quad_shuffle_rotate_up", "quad_shuffle_rotate_down"};
  if (op > 32 && op - 32 < (int)(sizeof quad / sizeof quad[0]) && quad[op - 32]) return quad[op - 32];
  return "simd collective";
}

std::string where(const Thread* t) {
  switch (t->state) {
    case kDone: return "has returned";
    case kWaitBarrier:
      return fmt("waits at %s", t->bscope ? "simdgroup_barrier" : "threadgroup_barrier") +
             at_line(t->line);
    case kWaitColl: return fmt("waits at %s", op_name(t->op)) + at_line(t->line);
    default: return "is running";
  }
}

static const char* mode_name(int m) {
  switch (m) {
    case kRead: return "read";
    case kWrite: return "write";
    case kAtomicLoad: return "atomic load";
    case kAtomicStore: return "atomic store";
    default: return "atomic read-modify-write";
  }
}

static std::string buf_label(const Buf* b) {
  const char* k = b->kind == kInput ? "input" : b->kind == kOutput ? "output"
                  : b->kind == kThreadgroup ? "threadgroup array" : "argument";
  return fmt("%s `%s`", k, b->name);
}

// Report the first read of a never-written element still pending.
bool flush_pending() {
  if (g_rt.pending.empty()) return true;
  const Rt::Pending& p = g_rt.pending.front();
  const bool tgm = p.b->space == 1;
  set_error(kErrUninit,
            kname() + ": " + describe(p.tid) + ": " +
                fmt("%s of %s element %llu", mode_name(p.mode), buf_label(p.b).c_str(),
                    (unsigned long long)p.e) +
                at_line(p.line) +
                fmt(", which no thread had written (%s)",
                    tgm ? "threadgroup memory starts uninitialised: missing write or barrier?"
                        : "outputs start uninitialised without init_value"));
  g_rt.pending.clear();
  return false;
}

uint32_t tid_of(uint32_t lid) { return (g_rt.group_linear << 10) | lid; }

// Returns false on error (g_rt.err set).
bool run_group() {
  const uint32_t n = g_rt.n;
  const uint32_t nsimd = (n + 31) / 32;
  for (;;) {
    bool any_blocked = false;
    for (uint32_t i = 0; i < n; ++i) {
      Thread* t = &g_rt.threads[i];
      if (t->state == kRunnable) {
        run_thread(t);
        if (g_rt.err != kOk) return false;
      }
      if (t->state == kWaitColl || t->state == kWaitBarrier) any_blocked = true;
    }
    if (!any_blocked) return flush_pending();

    // Simdgroup-level: collectives and simdgroup barriers.
    bool progressed = false;
    for (uint32_t s = 0; s < nsimd; ++s) {
      uint32_t lo = s * 32, hi = lo + 32 < n ? lo + 32 : n;
      uint32_t ncoll = 0;
      Thread* first = nullptr;
      for (uint32_t i = lo; i < hi; ++i) {
        Thread* t = &g_rt.threads[i];
        if (t->state == kWaitColl || (t->state == kWaitBarrier && t->bscope == 1)) {
          ++ncoll;
          if (!first) first = t;
        }
      }
      if (ncoll == 0) continue;
      if (ncoll != hi - lo) {
        // find a thread that is elsewhere
        for (uint32_t i = lo; i < hi; ++i) {
          Thread* t = &g_rt.threads[i];
          bool at = t->state == kWaitColl || (t->state == kWaitBarrier && t->bscope == 1);
          if (!at) {
            const char* what = first->state == kWaitColl ? op_name(first->op) : "simdgroup_barrier";
            set_error(kErrSimd,
                      kname() + ": " +
                          what + at_line(first->line) +
                          fmt(" reached by only part of simdgroup %u (divergent control flow): ", s) +
                          describe(first->pub.gtid) + " waits there, while " +
                          describe(t->pub.gtid) + " " + where(t));
            return false;
          }
        }
      }
      for (uint32_t i = lo; i < hi; ++i) {
        Thread* t = &g_rt.threads[i];
        bool same = t->state == first->state && t->line == first->line &&
                    t->col == first->col &&
                    (t->state == kWaitColl ? (t->op == first->op && t->fn == first->fn) : true);
        if (!same) {
          set_error(kErrSimd, kname() + ": different simd collectives reached at the same time "
                                        "in simdgroup " +
                                  fmt("%u: ", s) + describe(first->pub.gtid) + " " +
                                  where(first) + ", " + describe(t->pub.gtid) + " " + where(t));
          return false;
        }
      }
      if (first->state == kWaitColl) {
        CollSlot slots[32];
        uint8_t active[32];
        memset(active, 0, sizeof active);
        memset(slots, 0, sizeof slots);
        for (uint32_t i = lo; i < hi; ++i) {
          slots[i - lo] = g_rt.threads[i].slot;
          active[i - lo] = 1;
        }
        first->fn(first->op, slots, active);
      } else {
        if (first->bflags & 2) g_rt.S_tg[s]++;
        if (first->bflags & 1) g_rt.S_dev[s]++;
      }
      for (uint32_t i = lo; i < hi; ++i) g_rt.threads[i].state = kRunnable;
      progressed = true;
    }
    if (progressed) continue;

    // Threadgroup barrier: every thread of the group must wait at the same one.
    Thread* first = nullptr;
    for (uint32_t i = 0; i < n; ++i) {
      Thread* t = &g_rt.threads[i];
      if (t->state == kWaitBarrier) {
        first = t;
        break;
      }
    }
    for (uint32_t i = 0; i < n; ++i) {
      Thread* t = &g_rt.threads[i];
      if (t->state != kWaitBarrier || t->line != first->line || t->col != first->col ||
          t->bflags != first->bflags) {
        set_error(kErrBarrier,
                  kname() + ": " +
                      "threadgroup_barrier" + at_line(first->line) +
                      fmt(" not reached by every thread of threadgroup (%u,%u,%u) (barrier in "
                          "divergent control flow): ",
                          g_rt.gpos.x, g_rt.gpos.y, g_rt.gpos.z) +
                      describe(first->pub.gtid) + " waits there, while " + describe(t->pub.gtid) +
                      " " + where(t));
        return false;
      }
    }
    if (!flush_pending()) return false;
    if (first->bflags & 2) {
      g_rt.G_tg++;
      for (uint32_t s = 0; s < nsimd; ++s) g_rt.S_tg[s]++;
    }
    if (first->bflags & 1) {
      g_rt.G_dev++;
      for (uint32_t s = 0; s < nsimd; ++s) g_rt.S_dev[s]++;
    }
    for (uint32_t i = 0; i < n; ++i) g_rt.threads[i].state = kRunnable;
  }
}

void free_group_tg() {
  for (auto* b : g_rt.tg_bufs) delete b;
  for (char* m : g_rt.tg_mem) free(m);
  g_rt.tg_bufs.clear();
  g_rt.tg_mem.clear();
  g_rt.tg_bytes = 0;
}

void cleanup_launch() {
  free_group_tg();
  for (auto* b : g_rt.bufs) delete b;
  g_rt.bufs.clear();
  g_rt.entry_args.clear();
  g_rt.desc = nullptr;
  g_rt.cur = nullptr;
  g_rt.pub.cur = nullptr;
  g_rt.in_launch = false;
}

thread_local char* g_altstack = nullptr;

void crash_handler(int sig, siginfo_t* info, void*) {
  if (!g_rt.in_launch) {
    signal(sig, SIG_DFL);
    raise(sig);
    return;
  }
  Thread* t = g_rt.cur;
  char addr[64];
  snprintf(addr, sizeof addr, "%p", info ? info->si_addr : nullptr);
  std::string who = t ? describe(t->pub.gtid) : std::string("the scheduler");
  bool stack = false;
  if (t && info) {
    char* a = (char*)info->si_addr;
    char* lo = t->stack - kGuard;
    if (a >= lo && a < t->stack + 256) stack = true;
    if (a >= g_stacks && a < g_stacks + g_nstacks * (kStackSize + kGuard)) stack = true;
  }
  set_error(kErrCrash,
            kname() + ": " + who + ": " +
                (sig == SIGSEGV || sig == SIGBUS
                     ? (stack ? std::string("stack overflow (deep recursion or huge thread-local "
                                            "arrays; fibers have 256 KiB stacks)")
                              : std::string("invalid memory access at ") + addr +
                                    " (through an unchecked pointer)")
                     : sig == SIGFPE ? std::string("arithmetic exception (integer division by zero?)")
                                     : fmt("signal %d", sig)));
  siglongjmp(g_rt.crash_env, 1);
}

}  // namespace

extern "C" {

msl::RtPub* msl_rt = &g_rt.pub;

void msl_rt_fail(int kind, const char* m) { fail_here(kind, m); }

Buf* msl_rt_find_buf(const void* p) {
  const char* c = (const char*)p;
  for (auto* b : g_rt.bufs)
    if (c >= b->buf.base && c <= b->buf.base + b->buf.nbytes) return &b->buf;
  for (auto* b : g_rt.tg_bufs)
    if (c >= b->buf.base && c <= b->buf.base + b->buf.nbytes) return &b->buf;
  return nullptr;
}

Buf* msl_rt_tg_alloc(const char* name, uint64_t nbytes, uint32_t esize) {
  const uint64_t limit = g_rt.desc->threadgroup_bytes;
  if (g_rt.tg_bytes + nbytes > limit) {
    fail_here(kErrOther, fmt("threadgroup memory `%s` (%llu bytes) exceeds the %llu bytes a "
                             "threadgroup may use (%llu bytes already declared)",
                             name, (unsigned long long)nbytes, (unsigned long long)limit,
                             (unsigned long long)g_rt.tg_bytes));
  }
  g_rt.tg_bytes += nbytes;
  char* mem = (char*)malloc(nbytes ? nbytes : 1);
  // garbage: NaN for floats, -1 for integers
  memset(mem, 0xFF, nbytes);
  g_rt.tg_mem.push_back(mem);
  auto* lb = new LaunchBuf();
  lb->buf.base = mem;
  lb->buf.nbytes = nbytes;
  lb->buf.esize = esize ? esize : 1;
  lb->buf.kind = kThreadgroup;
  lb->buf.name = name;
  lb->buf.uninit_check = 1;
  lb->buf.space = 1;
  lb->shadow.assign(nbytes / lb->buf.esize, Shadow{{kNoThread, 0, 0}, {kNoThread, 0, 0}, {kNoThread, 0, 0}, 0});
  lb->buf.shadow = lb->shadow.data();
  g_rt.tg_bufs.push_back(lb);
  return &lb->buf;
}

static inline bool concurrent(const Acc& a, uint32_t tid, uint32_t G, uint32_t S) {
  if (a.tid == kNoThread || a.tid == tid) return false;
  if ((a.tid >> 10) != (tid >> 10)) return true;  // other threadgroup: unordered
  if (((a.tid & 1023) >> 5) == ((tid & 1023) >> 5)) return a.s == S;
  return a.g == G;
}

static std::string unordered_with(uint32_t other, uint32_t tid, const char* sync) {
  return (other >> 10) != (tid >> 10)
             ? std::string(" of another threadgroup (threadgroups are unordered)")
             : std::string(" with no ") + sync + " between them";
}

void msl_rt_access(Buf* b, int64_t off, uint32_t size, int mode, int line, const void* value) {
  if (!b) return;
  const uint32_t ln = line > 0 ? (uint32_t)line : 0;
  if (off < 0 || (uint64_t)off + size > b->nbytes) {
    int64_t e = off >= 0 ? off / (int64_t)b->esize : -((-off + b->esize - 1) / (int64_t)b->esize);
    fail_here(kErrOOB, fmt("out-of-bounds %s of %s at element %lld (it has %llu elements)",
                           mode_name(mode), buf_label(b).c_str(), (long long)e,
                           (unsigned long long)(b->nbytes / b->esize)) + at_line(ln));
  }
  if (!b->shadow || !g_rt.cur) return;
  Thread* t = g_rt.cur;
  const uint32_t tid = t->pub.gtid;
  const uint32_t sg = t->pub.lid >> 5;
  const bool tgm = b->space == 1;
  const uint32_t G = tgm ? g_rt.G_tg : g_rt.G_dev;
  const uint32_t S = tgm ? g_rt.S_tg[sg] : g_rt.S_dev[sg];
  const char* sync = tgm ? "threadgroup_barrier(mem_flags::mem_threadgroup)"
                         : "threadgroup_barrier(mem_flags::mem_device)";
  const bool races = g_rt.check_races;
  uint64_t e0 = (uint64_t)off / b->esize, e1 = ((uint64_t)off + size - 1) / b->esize;
  for (uint64_t e = e0; e <= e1; ++e) {
    Shadow& sh = b->shadow[e];
    const bool atomic = mode >= kAtomicLoad;
    const bool reads = mode == kRead || mode == kAtomicLoad || mode == kAtomicRMW;
    const bool writes = mode == kWrite || mode == kAtomicStore || mode == kAtomicRMW;
    if (reads && b->uninit_check && sh.w.tid == kNoThread) {
      if (!races) {
        fail_here(kErrUninit, fmt("%s of %s element %llu, which no thread has written (%s)",
                                  mode_name(mode), buf_label(b).c_str(), (unsigned long long)e,
                                  tgm ? "threadgroup memory starts uninitialised"
                                      : "outputs start uninitialised without init_value") +
                                  at_line(ln));
      }
      if (g_rt.pending.size() < 4096) g_rt.pending.push_back(Rt::Pending{b, e, tid, mode, ln});
    }
    if (races) {
      bool w_atomic = sh.flags & 1;
      if (concurrent(sh.w, tid, G, S) && !(atomic && w_atomic)) {
        auto what = [&]() {
          return fmt("data race on %s element %llu: this %s", buf_label(b).c_str(),
                     (unsigned long long)e, mode_name(mode)) +
                 at_line(ln) + " conflicts with a " + (w_atomic ? "atomic write" : "write") +
                 at_line(sh.w.line) + " by " + describe(sh.w.tid) +
                 unordered_with(sh.w.tid, tid, sync);
        };
        // A plain store of the bytes the element already holds, over a plain store by
        // another thread: harmless on the GPU (every order leaves the same value).
        const bool same_value = mode == kWrite && !w_atomic && value &&
                                memcmp(b->base + off, value, size) == 0;
        if (same_value) {
          if (g_rt.strict_races) {
            fail_here(kErrRace, what() + "; both store the same value (an error under "
                                         "strict_races=True)");
          }
          if (g_rt.same_value_stores++ == 0) {
            g_rt.same_value_msg = kname() + ": " + describe(tid) + ": " + what();
          }
        } else {
          fail_here(kErrRace, what());
        }
      }
      if (writes) {
        const Acc* rs[2] = {&sh.r1, &sh.r2};
        for (const Acc* r : rs) {
          if (concurrent(*r, tid, G, S)) {
            fail_here(kErrRace,
                      fmt("data race on %s element %llu: this %s", buf_label(b).c_str(),
                          (unsigned long long)e, mode_name(mode)) +
                          at_line(ln) + " conflicts with a read" + at_line(r->line) + " by " +
                          describe(r->tid) + unordered_with(r->tid, tid, sync));
          }
        }
      }
    }
    if (writes) {
      // after a same-value store the latest writer is recorded, so that a different value
      // stored later by the earlier writer still races with it
      sh.w = Acc{tid, G, S, ln};
      sh.flags = atomic ? 1 : 0;
      if (!atomic) {
        // reads before this write by this thread are ordered; keep foreign ones
        if (sh.r1.tid == tid) sh.r1.tid = kNoThread;
        if (sh.r2.tid == tid) sh.r2.tid = kNoThread;
      }
    } else if (!atomic) {
      Acc me{tid, G, S, ln};
      if (sh.r1.tid == tid) sh.r1 = me;
      else if (sh.r2.tid == tid) sh.r2 = me;
      else if (!concurrent(sh.r1, tid, G, S)) sh.r1 = me;
      else if (!concurrent(sh.r2, tid, G, S)) sh.r2 = me;
    }
  }
}

void msl_rt_barrier(int simd_scope, int flags, int line, int col) {
  Thread* t = g_rt.cur;
  if (!t) return;
  t->state = kWaitBarrier;
  t->bscope = simd_scope;
  t->bflags = flags;
  t->line = line;
  t->col = col;
  t->op = -1;
  to_sched(t);
}

void msl_rt_collective(int op, int line, int col, CollSlot slot, ResolveFn fn) {
  Thread* t = g_rt.cur;
  if (!t) return;
  t->state = kWaitColl;
  t->op = op;
  t->line = line;
  t->col = col;
  t->fn = fn;
  t->slot = slot;
  t->bscope = 0;
  to_sched(t);
}

int msl_launch(const LaunchDesc* d, char* err, int errlen) {
  if (g_rt.in_launch) {
    snprintf(err, errlen, "simulator launch is not reentrant");
    return kErrOther;
  }
  g_rt.in_launch = true;
  g_rt.desc = d;
  g_rt.err = kOk;
  g_rt.msg.clear();
  g_rt.pending.clear();
  g_rt.check_races = d->check_races != 0;
  g_rt.strict_races = d->strict_races != 0;
  g_rt.same_value_stores = 0;
  g_rt.same_value_msg.clear();
  for (int i = 0; i < d->nbufs; ++i) {
    auto* lb = new LaunchBuf();
    const BufDesc& bd = d->bufs[i];
    lb->buf.base = (char*)bd.data;
    lb->buf.nbytes = bd.nbytes;
    lb->buf.esize = bd.esize ? bd.esize : 1;
    lb->buf.kind = bd.kind;
    lb->buf.name = bd.name;
    lb->buf.uninit_check = bd.uninit_check;
    lb->buf.space = 0;
    if (bd.track) {
      lb->shadow.assign(bd.nbytes / lb->buf.esize,
                        Shadow{{kNoThread, 0, 0}, {kNoThread, 0, 0}, {kNoThread, 0, 0}, 0});
      lb->buf.shadow = lb->shadow.data();
    } else {
      lb->buf.shadow = nullptr;
    }
    g_rt.bufs.push_back(lb);
    g_rt.entry_args.push_back(&lb->buf);
  }
  for (int k = 0; k < 3; ++k) {
    uint32_t gsz = d->grid[k], tsz = d->tg[k];
    uint32_t disp = tsz < gsz ? tsz : gsz;
    if (disp == 0) disp = 1;
    (&g_rt.disp.x)[k] = disp;
    (&g_rt.ngroups.x)[k] = gsz == 0 ? 0 : (gsz + disp - 1) / disp;
  }
  uint32_t disp_n = g_rt.disp.x * g_rt.disp.y * g_rt.disp.z;
  if (!ensure_stacks(disp_n)) {
    snprintf(err, errlen, "could not allocate fiber stacks");
    cleanup_launch();
    return kErrOther;
  }

  // signal handling for crashes inside the kernel
  struct sigaction sa, old_segv, old_bus, old_fpe;
  stack_t ss, old_ss;
  if (!g_altstack) g_altstack = (char*)malloc(1 << 16);
  ss.ss_sp = g_altstack;
  ss.ss_size = 1 << 16;
  ss.ss_flags = 0;
  sigaltstack(&ss, &old_ss);
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = crash_handler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  sigaction(SIGFPE, &sa, &old_fpe);

  if (sigsetjmp(g_rt.crash_env, 1) == 0) {
    const uint32_t ngx = g_rt.ngroups.x, ngy = g_rt.ngroups.y, ngz = g_rt.ngroups.z;
    for (uint32_t gz = 0; gz < ngz && g_rt.err == kOk; ++gz)
      for (uint32_t gy = 0; gy < ngy && g_rt.err == kOk; ++gy)
        for (uint32_t gx = 0; gx < ngx && g_rt.err == kOk; ++gx) {
          g_rt.gpos = U3{gx, gy, gz};
          g_rt.group_linear = gx + ngx * (gy + ngy * gz);
          g_rt.ext = group_extent(g_rt.gpos);
          const U3 e = g_rt.ext;
          const uint32_t n = e.x * e.y * e.z;
          g_rt.n = n;
          g_rt.G_tg = g_rt.G_dev = 0;
          memset(g_rt.S_tg, 0, sizeof g_rt.S_tg);
          memset(g_rt.S_dev, 0, sizeof g_rt.S_dev);
          g_rt.pub.group_gen = ++g_gen;
          const uint32_t nsimd = (n + 31) / 32;
          const uint32_t dsimd = (disp_n + 31) / 32;
          for (uint32_t lid = 0; lid < n; ++lid) {
            Thread* t = &g_rt.threads[lid];
            U3 l{lid % e.x, (lid / e.x) % e.y, lid / (e.x * e.y)};
            Attrs& a = t->pub.attrs;
            a.thread_position_in_grid =
                U3{gx * g_rt.disp.x + l.x, gy * g_rt.disp.y + l.y, gz * g_rt.disp.z + l.z};
            a.thread_position_in_threadgroup = l;
            a.threadgroup_position_in_grid = g_rt.gpos;
            a.threads_per_threadgroup = e;
            a.dispatch_threads_per_threadgroup = g_rt.disp;
            a.threads_per_grid = U3{d->grid[0], d->grid[1], d->grid[2]};
            a.threadgroups_per_grid = g_rt.ngroups;
            a.grid_origin = U3{0, 0, 0};
            a.grid_size = a.threads_per_grid;
            a.thread_index_in_threadgroup = lid;
            a.thread_index_in_simdgroup = lid % 32;
            a.simdgroup_index_in_threadgroup = lid / 32;
            a.simdgroups_per_threadgroup = nsimd;
            a.dispatch_simdgroups_per_threadgroup = dsimd;
            a.threads_per_simdgroup = 32;
            a.thread_execution_width = 32;
            a.quadgroup_index_in_threadgroup = lid / 4;
            a.thread_index_in_quadgroup = lid % 4;
            a.quadgroups_per_threadgroup = (n + 3) / 4;
            a.dispatch_quadgroups_per_threadgroup = (disp_n + 3) / 4;
            t->pub.gtid = tid_of(lid);
            t->pub.lid = lid;
            t->state = kRunnable;
            t->line = t->col = 0;
            init_fiber(t, lid);
          }
          run_group();
          free_group_tg();
        }
  }
  // crashed or finished
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  sigaction(SIGFPE, &old_fpe, nullptr);
  sigaltstack(&old_ss, nullptr);

  if (g_rt.err == kOk && d->check_unwritten) {
    for (auto* lb : g_rt.bufs) {
      if (lb->buf.kind != kOutput || !lb->buf.shadow || !lb->buf.uninit_check) continue;
      uint64_t ne = lb->buf.nbytes / lb->buf.esize, missing = 0, first = 0;
      for (uint64_t e = 0; e < ne; ++e)
        if (lb->buf.shadow[e].w.tid == kNoThread) {
          if (!missing) first = e;
          ++missing;
        }
      if (missing) {
        uint64_t gx = d->grid[0], gy = d->grid[1], gz = d->grid[2];
        std::string who;
        if (first < gx * gy * gz) {
          who = fmt("; with one element per thread, that is thread (%llu,%llu,%llu)",
                    (unsigned long long)(first % gx), (unsigned long long)((first / gx) % gy),
                    (unsigned long long)(first / (gx * gy)));
        }
        set_error(kErrUnwritten,
                  kname() + fmt(": output `%s` element %llu was never written by any thread "
                                "(%llu of %llu elements unwritten; no init_value given)",
                                lb->buf.name, (unsigned long long)first,
                                (unsigned long long)missing, (unsigned long long)ne) + who);
        break;
      }
    }
  }
  int rc = g_rt.err;
  if (rc != kOk) snprintf(err, errlen, "%s", g_rt.msg.c_str());
  LaunchDesc* out = const_cast<LaunchDesc*>(d);
  out->same_value_stores = g_rt.same_value_stores;
  if (d->warn && d->warnlen > 0) snprintf(d->warn, d->warnlen, "%s", g_rt.same_value_msg.c_str());
  cleanup_launch();
  return rc;
}

}  // extern "C"
