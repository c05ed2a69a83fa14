// Comfy Metal MSL emulator -- runtime (coroutine scheduler, barriers, SIMD exchange).
//
// Included by shim.h *before* the MSL keyword macros are defined, so system
// headers can be used here.  Everything has internal linkage / hidden
// visibility: every compiled kernel library carries its own copy.
//
// Model:
//   * threadgroups run one after another (order: forward, reverse or shuffled);
//   * inside a threadgroup every GPU thread is a stackful coroutine with its
//     own stack (hand-written context switch, x86-64 / aarch64 SysV);
//   * a thread runs until it finishes, reaches threadgroup_barrier() or a
//     simd_* collective.  When no thread can run any more, pending SIMD
//     collectives are resolved (one call site per simdgroup at a time, the
//     lowest code address first, which approximates SIMT reconvergence),
//     then the barrier is released -- or a divergence is reported;
//   * threads that never suspend only pay for one start and one finish switch
//     and reuse a single stack.
#pragma once
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdarg.h>
#include <signal.h>
#include <setjmp.h>
#include <sys/mman.h>
#include <unistd.h>
#include <time.h>
#include <sys/syscall.h>

extern "C" void __emu_ctx_switch(void** save_sp, void* new_sp);

// The profiling build (-D__EMU_PROFILE=1) adds the profiler (profile.h); __EMU_PROF(...) is its code at
// the runtime's few hook points, and nothing in every other build.
#if defined(__EMU_PROFILE)
#define __EMU_PROF(...) __VA_ARGS__
#else
#define __EMU_PROF(...)
#endif

// The kernel code is compiled with ThreadSanitizer's instrumentation (-fsanitize=thread): every memory
// access it makes calls __tsan_readN/__tsan_writeN, which this runtime defines (the race detector below);
// tsan's own runtime is never linked.  The runtime itself is not instrumented.
#pragma clang attribute push(__attribute__((no_sanitize("thread"))), apply_to = function)

#if defined(__x86_64__)
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".globl __emu_ctx_switch\n"
    ".hidden __emu_ctx_switch\n"
    ".type __emu_ctx_switch,@function\n"
    "__emu_ctx_switch:\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".size __emu_ctx_switch, .-__emu_ctx_switch\n");
#define __EMU_FRAME_WORDS 7   /* 6 callee-saved + return address */
#define __EMU_RET_SLOT 6
#elif defined(__aarch64__)
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".globl __emu_ctx_switch\n"
    ".hidden __emu_ctx_switch\n"
    ".type __emu_ctx_switch,%function\n"
    "__emu_ctx_switch:\n"
    "  sub sp, sp, #176\n"
    "  stp x19, x20, [sp, #0]\n"
    "  stp x21, x22, [sp, #16]\n"
    "  stp x23, x24, [sp, #32]\n"
    "  stp x25, x26, [sp, #48]\n"
    "  stp x27, x28, [sp, #64]\n"
    "  stp x29, x30, [sp, #80]\n"
    "  stp d8, d9, [sp, #96]\n"
    "  stp d10, d11, [sp, #112]\n"
    "  stp d12, d13, [sp, #128]\n"
    "  stp d14, d15, [sp, #144]\n"
    "  mov x9, sp\n"
    "  str x9, [x0]\n"
    "  mov sp, x1\n"
    "  ldp x19, x20, [sp, #0]\n"
    "  ldp x21, x22, [sp, #16]\n"
    "  ldp x23, x24, [sp, #32]\n"
    "  ldp x25, x26, [sp, #48]\n"
    "  ldp x27, x28, [sp, #64]\n"
    "  ldp x29, x30, [sp, #80]\n"
    "  ldp d8, d9, [sp, #96]\n"
    "  ldp d10, d11, [sp, #112]\n"
    "  ldp d12, d13, [sp, #128]\n"
    "  ldp d14, d15, [sp, #144]\n"
    "  add sp, sp, #176\n"
    "  ret\n"
    ".size __emu_ctx_switch, .-__emu_ctx_switch\n");
#define __EMU_FRAME_WORDS 22
#define __EMU_RET_SLOT 11
#else
#error "comfy_metal emulator: only x86-64 and aarch64 (Linux/ELF) are supported"
#endif

// bfloat16 conversion helpers (clang emits calls to these; Debian's libgcc 12 lacks them)
extern "C" __attribute__((visibility("hidden"), used)) __bf16 __truncsfbf2(float f) {
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  uint16_t r;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    r = (uint16_t)((u >> 16) | 0x40u);  // quiet NaN
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    r = (uint16_t)(u >> 16);
  }
  return __builtin_bit_cast(__bf16, r);
}
extern "C" __attribute__((visibility("hidden"), used)) __bf16 __truncdfbf2(double d) { return __truncsfbf2((float)d); }

namespace __emu {

enum : uint32_t { ST_NEW = 0, ST_RUNNABLE = 1, ST_BARRIER = 2, ST_SIMD = 3, ST_DONE = 4 };
enum : int { RC_OK = 0, RC_DIVERGENCE = 1, RC_CRASH = 2, RC_ERROR = 3, RC_RACE = 4 };
enum : uint32_t { SCHED_FORWARD = 0, SCHED_REVERSE = 1, SCHED_SHUFFLE = 2 };

static constexpr uint32_t kSimdWidth = 32;
static constexpr uint32_t kMaxThreads = 1024;
static constexpr uint32_t kSlotBytes = 32;        // largest value a lane can exchange
static constexpr size_t kTgArenaBytes = 64 * 1024; // emulator limit (Metal: 32 KiB, checked)
static constexpr size_t kTgMetalLimit = 32 * 1024;
static constexpr uint32_t kMaxTgSlots = 512;

struct SimdGroup;
typedef void (*Resolver)(SimdGroup& g, uint32_t mask, uint32_t width);

struct SimdGroup {
  alignas(32) unsigned char in[kSimdWidth][kSlotBytes];
  alignas(32) unsigned char out[kSimdWidth][kSlotBytes];
  uint32_t arg[kSimdWidth];
};

struct Thread {
  void* sp;
  char* stack;  // top of stack (highest address), 16-byte aligned
  uint32_t state;
  uint32_t lin;
  uintptr_t site;
  Resolver resolver;
  uint32_t lpos[3];
  uint32_t gpos[3];
  uint32_t sepoch;  // simdgroup_barriers passed in the current threadgroup barrier interval (race detector)
};

struct Launch {
  const char* kernel_name;
  void (*entry)(void** bufs);
  void** bufs;
  uint32_t grid[3];
  uint32_t req_tpg[3];
  uint32_t ngroups[3];
  uint32_t group[3];
  uint32_t tpg[3];  // actual size of the current threadgroup
  uint32_t nthreads;
  uint32_t req_total;
  uint32_t sched;
  uint64_t seed;
  void* sched_sp;
  char* err;
  size_t errlen;
  // threadgroup memory
  unsigned char* arena;
  size_t arena_used;
  int32_t slot_off[kMaxTgSlots];
  const char* slot_name[kMaxTgSlots];
  int tg_error;
};

static thread_local Launch* g_launch = nullptr;
static thread_local Thread* g_cur = nullptr;
static thread_local Thread* g_threads = nullptr;  // [kMaxThreads]
static thread_local SimdGroup* g_simd = nullptr;  // [kMaxThreads / 32]
static thread_local unsigned char* g_arena = nullptr;
static thread_local uint32_t* g_order = nullptr;
__EMU_PROF(static void prof_group_begin(); static void prof_group_end(); static void prof_barrier(uint32_t nsg);
           static bool prof_pick_group(uint64_t gi, uint64_t* g);)

// ---------------------------------------------------------------- stacks
static size_t stack_bytes() {
  static size_t sz = 0;
  if (!sz) {
    const char* e = getenv("COMFY_METAL_EMU_STACK_KB");
    long kb = e ? atol(e) : 256;
    if (kb < 32) kb = 32;
    sz = (size_t)kb * 1024;
  }
  return sz;
}

struct StackPool {
  char* free_[kMaxThreads];
  uint32_t nfree = 0;
  uint32_t total = 0;
};
static thread_local StackPool* g_pool = nullptr;

static char* stack_get() {
  if (g_pool->nfree) return g_pool->free_[--g_pool->nfree];
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  size_t sz = stack_bytes();
  char* base = (char*)mmap(nullptr, sz + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == (char*)MAP_FAILED) return nullptr;
  mprotect(base, page, PROT_NONE);  // guard page: overflow -> SIGSEGV -> reported
  g_pool->total++;
  // cache colouring: stagger the stack tops so that the hot frames of the
  // coroutines do not all map to the same cache sets
  size_t colour = ((size_t)(g_pool->total * 7) % 61) * 64 + (size_t)(g_pool->total % 4) * 1024;
  return base + page + sz - colour;  // top
}
static inline void stack_put(char* top) { g_pool->free_[g_pool->nfree++] = top; }

// ---------------------------------------------------------------- errors
static void set_err(const char* fmt, ...) {
  Launch* L = g_launch;
  if (!L || !L->err || !L->errlen) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(L->err, L->errlen, fmt, ap);
  va_end(ap);
}

// ---------------------------------------------------------------- switching
[[noreturn]] static void trampoline() {
  Launch* L = g_launch;
  L->entry(L->bufs);
  Thread* t = g_cur;
  t->state = ST_DONE;
  __emu_ctx_switch(&t->sp, L->sched_sp);
  __builtin_unreachable();
}

static inline void yield_to_scheduler() {
  Thread* t = g_cur;
  __emu_ctx_switch(&t->sp, g_launch->sched_sp);
}

static inline void start_thread(Thread* t) {
  void** frame = (void**)(t->stack) - 8;  // 16-byte aligned, with room
  frame = (void**)((uintptr_t)frame & ~(uintptr_t)15);
  frame -= __EMU_FRAME_WORDS + (__EMU_FRAME_WORDS & 1);
  for (int i = 0; i < __EMU_FRAME_WORDS; i++) frame[i] = nullptr;
  frame[__EMU_RET_SLOT] = (void*)&trampoline;
  t->sp = frame;
  t->state = ST_RUNNABLE;
  g_cur = t;
  __emu_ctx_switch(&g_launch->sched_sp, t->sp);
}

static inline void resume_thread(Thread* t) {
  g_cur = t;
  __emu_ctx_switch(&g_launch->sched_sp, t->sp);
}

// ---------------------------------------------------------------- RNG / schedule
static inline uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static void make_order(uint32_t* order, uint32_t n, uint32_t sched, uint64_t seed) {
  if (sched == SCHED_REVERSE) {
    for (uint32_t i = 0; i < n; i++) order[i] = n - 1 - i;
    return;
  }
  for (uint32_t i = 0; i < n; i++) order[i] = i;
  if (sched == SCHED_SHUFFLE) {
    uint64_t s = seed;
    for (uint32_t i = n; i > 1; i--) {
      uint32_t j = (uint32_t)(splitmix(s) % i);
      uint32_t tmp = order[i - 1];
      order[i - 1] = order[j];
      order[j] = tmp;
    }
  }
}

// ---------------------------------------------------------------- threadgroup memory
static void* tg_alloc(uint32_t slot, size_t size, size_t align, const char* name) {
  Launch* L = g_launch;
  if (slot >= kMaxTgSlots) {
    L->tg_error = 1;
    return L->arena;
  }
  int32_t off = L->slot_off[slot];
  if (off < 0) {
    size_t o = (L->arena_used + align - 1) & ~(align - 1);
    if (o + size > kTgArenaBytes) {
      L->tg_error = 2;
      return L->arena;  // keep running; launch reports the error
    }
    L->slot_off[slot] = (int32_t)o;
    L->slot_name[slot] = name;
    L->arena_used = o + size;
    if (L->arena_used > kTgMetalLimit) L->tg_error = 2;
    off = (int32_t)o;
  }
  return L->arena + off;
}


// ---------------------------------------------------------------- checks: threadgroup fill, race detector
// Threadgroup memory (and, on the Python side, the guard regions) start as 0xFF bytes (NaN, -1) in a checked
// launch's first run and as "poison" in its two re-runs: bytes 0x7B, then 0xFB -- large finite values of
// either sign in every type (float +-1.3e36 / -2.6e36, half 61280 / -64864, fp8 e4m3 +-352), which max, min
// and abs cannot swallow the way they swallow NaN.
static uint32_t g_fill_poison = 0;  // 0: 0xFF bytes, else the poison byte
static void fill_tg(unsigned char* p, size_t n) { memset(p, g_fill_poison ? (int)g_fill_poison : 0xFF, n); }

// Shadow memory: for every byte of every bound buffer and of threadgroup memory, the last write and the last
// read (or "several readers") as (segment, thread).  A segment is one barrier interval of one threadgroup
// (numbered globally; g_seg_group maps it to its group).  Two accesses race when at least one writes and they
// come from different threads of one segment, or -- device memory only -- from different threadgroups.
struct Cell {
  uint32_t wseg, wtid, rseg, rtid;
};
static constexpr uint32_t kManyReaders = 0xFFFFFFFFu;
static constexpr uint32_t kMaxRanges = 64;
struct RaceRange {
  uintptr_t lo, hi;
  Cell* shadow;
  size_t shadow_bytes;
  int tg;
  const char* name;
};
static RaceRange g_rr[kMaxRanges];
static uint32_t g_nrr = 0;
static uintptr_t g_rlo = ~(uintptr_t)0, g_rhi = 0;
static int g_race_on = 0;
static uint32_t g_seg = 0;
static uint64_t* g_seg_group = nullptr;
static size_t g_seg_cap = 0;
static uint64_t g_nraces = 0;
static char g_race_msg[1536];

static uint64_t group_linear(const Launch* L) {
  return L->group[0] + (uint64_t)L->ngroups[0] * (L->group[1] + (uint64_t)L->ngroups[1] * L->group[2]);
}
static void new_segment() {
  if (!g_race_on) return;
  for (uint32_t i = 0; i < g_launch->nthreads; i++) g_threads[i].sepoch = 0;
  if (g_seg + 1 >= g_seg_cap) {
    size_t cap = g_seg_cap ? g_seg_cap * 2 : 4096;
    uint64_t* p = (uint64_t*)realloc(g_seg_group, cap * sizeof(uint64_t));
    if (!p) {
      g_race_on = 0;
      return;
    }
    g_seg_group = p;
    g_seg_cap = cap;
  }
  g_seg++;
  g_seg_group[g_seg] = group_linear(g_launch);
}

// thread `tid` (linear index in its group) of group `g` (linear) -> positions
static void describe_thread(char* buf, size_t len, uint64_t g, uint32_t tid) {
  const Launch* L = g_launch;
  uint32_t gp[3] = {(uint32_t)(g % L->ngroups[0]), (uint32_t)((g / L->ngroups[0]) % L->ngroups[1]),
                    (uint32_t)(g / ((uint64_t)L->ngroups[0] * L->ngroups[1]))};
  uint32_t tpg[3];
  for (int d = 0; d < 3; d++) {
    uint32_t rem = L->grid[d] - gp[d] * L->req_tpg[d];
    tpg[d] = rem < L->req_tpg[d] ? rem : L->req_tpg[d];
  }
  uint32_t lp[3] = {tid % tpg[0], (tid / tpg[0]) % tpg[1], tid / (tpg[0] * tpg[1])};
  snprintf(buf, len, "thread (%u,%u,%u) of threadgroup (%u,%u,%u)", lp[0], lp[1], lp[2], gp[0], gp[1], gp[2]);
}

static const char* tg_name(size_t off) {
  const Launch* L = g_launch;
  const char* best = "threadgroup memory";
  int32_t best_off = -1;
  for (uint32_t i = 0; i < kMaxTgSlots; i++)
    if (L->slot_off[i] >= 0 && (size_t)L->slot_off[i] <= off && L->slot_off[i] > best_off && L->slot_name[i]) {
      best_off = L->slot_off[i];
      best = L->slot_name[i];
    }
  return best;
}

__attribute__((noinline, cold)) static void report_race(const RaceRange& r, uintptr_t a, uint32_t size, bool now_write,
                                                        uint32_t pseg, uint32_t ptid, bool prev_write) {
  if (g_nraces++) return;
  const Launch* L = g_launch;
  char me[96], other[96];
  uint64_t g = group_linear(L);
  describe_thread(me, sizeof me, g, g_cur->lin);
  uint64_t pg = g_seg_group[pseg];
  if (ptid == kManyReaders) snprintf(other, sizeof other, "other threads%s", pg == g ? "" : " of other threadgroups");
  else describe_thread(other, sizeof other, pg, ptid & 1023u);
  size_t off = a - r.lo;
  char what[160];
  if (r.tg) {
    const char* nm = tg_name(off);
    int32_t base = 0;
    for (uint32_t i = 0; i < kMaxTgSlots; i++)
      if (L->slot_name[i] == nm && L->slot_off[i] >= 0) base = L->slot_off[i];
    snprintf(what, sizeof what, "threadgroup array '%s', byte offset %zu (element %zu of %u bytes)", nm,
             off - base, (off - base) / size, size);
  } else {
    snprintf(what, sizeof what, "%s, byte offset %zu (element %zu of %u bytes)", r.name, off, off / size, size);
  }
  snprintf(g_race_msg, sizeof g_race_msg,
           "kernel %s: data race on %s: %s %s it and %s %s it %s", L->kernel_name, what, other,
           prev_write ? "wrote" : "read", me, now_write ? "writes" : "reads",
           pg != g ? "in another threadgroup (nothing orders threadgroups of one dispatch: use atomics or "
                     "a separate dispatch)"
                   : "with no threadgroup_barrier between them");
}

// A cell's thread field is the thread's index in its group | (simdgroup_barrier epoch << 10): lanes of one
// simdgroup separated by a simdgroup_barrier are ordered.
static inline bool same_interval_conflict(uint32_t tid, uint32_t me) {
  const uint32_t a = tid & 1023u, b = me & 1023u;
  if (a == b) return false;
  return !(a / kSimdWidth == b / kSimdWidth && (tid >> 10) != (me >> 10));
}
static inline bool conflicts(const RaceRange& r, uint32_t seg, uint32_t tid, uint32_t me) {
  if (!seg) return false;
  if (seg == g_seg) return same_interval_conflict(tid, me);
  return !r.tg && g_seg_group[seg] != g_seg_group[g_seg];
}

static inline void race_access(uintptr_t a, uint32_t size, bool write) {
  if (!g_race_on || a + size <= g_rlo || a >= g_rhi || !g_cur) return;
  for (uint32_t i = 0; i < g_nrr; i++) {
    const RaceRange& r = g_rr[i];
    if (a + size <= r.lo || a >= r.hi) continue;
    const uint32_t me = g_cur->lin | (g_cur->sepoch << 10);
    for (uintptr_t b = a < r.lo ? r.lo : a, e = a + size > r.hi ? r.hi : a + size; b < e; b++) {
      Cell& c = r.shadow[b - r.lo];
      if (conflicts(r, c.wseg, c.wtid, me)) report_race(r, a, size, write, c.wseg, c.wtid, true);
      if (write) {
        if (c.rseg && (c.rtid == kManyReaders ? (c.rseg == g_seg || (!r.tg && g_seg_group[c.rseg] !=
                                                                              g_seg_group[g_seg]))
                                              : conflicts(r, c.rseg, c.rtid, me)))
          report_race(r, a, size, write, c.rseg, c.rtid, false);
        c.wseg = g_seg;
        c.wtid = me;
      } else if (c.rseg == g_seg && c.rtid != me && c.rtid != kManyReaders) {
        // a second reader: keep one record unless it is ordered after the first (simdgroup_barrier)
        if (same_interval_conflict(c.rtid, me)) c.rtid = kManyReaders;
        else c.rtid = me;
      } else if (c.rseg != g_seg) {
        c.rseg = g_seg;
        c.rtid = me;
      }
    }
    return;
  }
}

static void race_begin(unsigned char* arena) {
  g_seg = 0;
  g_nraces = 0;
  g_race_msg[0] = 0;
  if (!g_race_on) return;
  if (g_nrr < kMaxRanges) g_rr[g_nrr++] = RaceRange{(uintptr_t)arena, (uintptr_t)arena + kTgArenaBytes, nullptr, 0, 1,
                                                    "threadgroup memory"};
  g_rlo = ~(uintptr_t)0;
  g_rhi = 0;
  for (uint32_t i = 0; i < g_nrr; i++) {
    RaceRange& r = g_rr[i];
    r.shadow_bytes = (r.hi - r.lo) * sizeof(Cell);
    void* p = r.shadow_bytes ? mmap(nullptr, r.shadow_bytes, PROT_READ | PROT_WRITE,
                                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0) : nullptr;
    if (p == MAP_FAILED) {
      g_race_on = 0;  // no memory for the shadow: this launch runs unchecked
      p = nullptr;
    }
    r.shadow = (Cell*)p;
    if (r.lo < g_rlo) g_rlo = r.lo;
    if (r.hi > g_rhi) g_rhi = r.hi;
  }
}

static void race_end() {
  for (uint32_t i = 0; i < g_nrr; i++)
    if (g_rr[i].shadow) munmap(g_rr[i].shadow, g_rr[i].shadow_bytes);
  g_nrr = 0;
  g_race_on = 0;
}

// ---------------------------------------------------------------- barrier
static void barrier(uintptr_t site) {
  Thread* t = g_cur;
  t->site = site;
  t->state = ST_BARRIER;
  yield_to_scheduler();
}

// ---------------------------------------------------------------- SIMD exchange
template <class T>
static inline T simd_exchange(T v, uint32_t arg, uintptr_t site, Resolver r) {
  static_assert(sizeof(T) <= kSlotBytes, "simd value too large");
  Thread* t = g_cur;
  uint32_t lane = t->lin % kSimdWidth;
  SimdGroup& g = g_simd[t->lin / kSimdWidth];
  memcpy(g.in[lane], &v, sizeof(T));
  g.arg[lane] = arg;
  t->site = site;
  t->resolver = r;
  t->state = ST_SIMD;
  yield_to_scheduler();
  T out;
  memcpy(&out, g.out[lane], sizeof(T));
  return out;
}

// ---------------------------------------------------------------- group execution
static const char* state_name(uint32_t s) {
  switch (s) {
    case ST_DONE: return "returned";
    case ST_BARRIER: return "waiting at threadgroup_barrier";
    case ST_SIMD: return "waiting at a simd collective";
    default: return "running";
  }
}

static void describe_threads(char* buf, size_t len, uint32_t state, uintptr_t site, bool match_site) {
  Launch* L = g_launch;
  size_t pos = 0;
  uint32_t shown = 0, count = 0;
  buf[0] = 0;
  for (uint32_t i = 0; i < L->nthreads; i++) {
    Thread& t = g_threads[i];
    if (t.state != state) continue;
    if (match_site && t.site != site) continue;
    count++;
    if (shown < 6 && pos < len) {
      int n = snprintf(buf + pos, len - pos, "%s%u(%u,%u,%u)", shown ? ", " : "", t.lin, t.lpos[0], t.lpos[1], t.lpos[2]);
      if (n > 0) pos += (size_t)n;
      shown++;
    }
  }
  if (count > shown && pos < len) snprintf(buf + pos, len - pos, ", ... (%u threads)", count);
}

static int run_group() {
  Launch* L = g_launch;
  const uint32_t n = L->nthreads;
  const uint32_t tx = L->tpg[0], ty = L->tpg[1];
  for (uint32_t i = 0; i < n; i++) {
    Thread& t = g_threads[i];
    t.state = ST_NEW;
    t.lin = i;
    t.stack = nullptr;
    t.lpos[0] = i % tx;
    t.lpos[1] = (i / tx) % ty;
    t.lpos[2] = i / (tx * ty);
    for (int d = 0; d < 3; d++) t.gpos[d] = L->group[d] * L->req_tpg[d] + t.lpos[d];
  }
  if (L->arena_used) fill_tg(L->arena, L->arena_used);
  new_segment();
  __EMU_PROF(prof_group_begin();)
  uint64_t gseed = L->seed ^ (0x51ED27ull * (1 + L->group[0] + 65537ull * L->group[1] + 4294967311ull * L->group[2]));
  uint32_t phase = 0;
  make_order(g_order, n, L->sched, gseed);
  const uint32_t nsg = (n + kSimdWidth - 1) / kSimdWidth;
  for (;;) {
    for (uint32_t k = 0; k < n; k++) {
      Thread* t = &g_threads[g_order[k]];
      if (t->state == ST_NEW) {
        t->stack = stack_get();
        if (!t->stack) {
          set_err("kernel %s: could not allocate a coroutine stack", L->kernel_name);
          return RC_ERROR;
        }
        start_thread(t);
      } else if (t->state == ST_RUNNABLE) {
        resume_thread(t);
      } else {
        continue;
      }
      if (t->state == ST_DONE) {
        stack_put(t->stack);
        t->stack = nullptr;
      }
    }
    // Resolve SIMD collectives: per simdgroup, the waiting call site with the
    // lowest address goes first; lanes elsewhere are inactive for it.
    bool any = false;
    for (uint32_t s = 0; s < nsg; s++) {
      uint32_t lo = s * kSimdWidth, hi = lo + kSimdWidth;
      if (hi > n) hi = n;
      uintptr_t best = 0;
      bool found = false;
      for (uint32_t i = lo; i < hi; i++) {
        Thread& t = g_threads[i];
        if (t.state == ST_SIMD && (!found || t.site < best)) {
          best = t.site;
          found = true;
        }
      }
      if (!found) continue;
      uint32_t mask = 0;
      Resolver r = nullptr;
      for (uint32_t i = lo; i < hi; i++) {
        Thread& t = g_threads[i];
        if (t.state == ST_SIMD && t.site == best) {
          mask |= 1u << (i - lo);
          r = t.resolver;
        }
      }
      r(g_simd[s], mask, hi - lo);
      for (uint32_t i = lo; i < hi; i++)
        if (mask & (1u << (i - lo))) g_threads[i].state = ST_RUNNABLE;
      any = true;
    }
    if (any) continue;
    uint32_t waiting = 0, done = 0;
    uintptr_t site0 = 0;
    bool multi = false;
    for (uint32_t i = 0; i < n; i++) {
      Thread& t = g_threads[i];
      if (t.state == ST_BARRIER) {
        if (!waiting) site0 = t.site;
        else if (t.site != site0) multi = true;
        waiting++;
      } else if (t.state == ST_DONE) {
        done++;
      }
    }
    if (!waiting) break;
    if (done || multi) {
      char a[256], b[256];
      if (done) {
        describe_threads(a, sizeof a, ST_DONE, 0, false);
        describe_threads(b, sizeof b, ST_BARRIER, 0, false);
        set_err("barrier in divergent control flow / deadlock: kernel %s, threadgroup (%u,%u,%u): "
                "threads [%s] returned while threads [%s] wait at threadgroup_barrier",
                L->kernel_name, L->group[0], L->group[1], L->group[2], a, b);
      } else {
        uintptr_t other = 0;
        for (uint32_t i = 0; i < n; i++)
          if (g_threads[i].state == ST_BARRIER && g_threads[i].site != site0) { other = g_threads[i].site; break; }
        describe_threads(a, sizeof a, ST_BARRIER, site0, true);
        describe_threads(b, sizeof b, ST_BARRIER, other, true);
        set_err("barrier in divergent control flow / deadlock: kernel %s, threadgroup (%u,%u,%u): "
                "threads wait at different threadgroup_barrier call sites: [%s] at one, [%s] at another",
                L->kernel_name, L->group[0], L->group[1], L->group[2], a, b);
      }
      // free the stacks of the abandoned coroutines
      for (uint32_t i = 0; i < n; i++)
        if (g_threads[i].stack) { stack_put(g_threads[i].stack); g_threads[i].stack = nullptr; }
      return RC_DIVERGENCE;
    }
    for (uint32_t i = 0; i < n; i++)
      if (g_threads[i].state == ST_BARRIER) g_threads[i].state = ST_RUNNABLE;
    __EMU_PROF(prof_barrier(nsg);)
    phase++;
    new_segment();
    make_order(g_order, n, L->sched, gseed + 0x1234567ull * phase);
  }
  __EMU_PROF(prof_group_end();)
  return RC_OK;
}

// ---------------------------------------------------------------- crash handling
static thread_local sigjmp_buf* g_jmp = nullptr;
static thread_local volatile int g_sig = 0;

static void on_signal(int sig, siginfo_t*, void*) {
  if (g_jmp) {
    g_sig = sig;
    siglongjmp(*g_jmp, sig);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

static int launch(const char* name, void (*entry)(void**), void** bufs, const uint32_t* dims, uint32_t sched,
                  uint64_t seed, char* err, size_t errlen) {
  static thread_local Launch L;
  if (!g_threads) {
    g_threads = (Thread*)calloc(kMaxThreads, sizeof(Thread));
    g_simd = (SimdGroup*)aligned_alloc(64, sizeof(SimdGroup) * (kMaxThreads / kSimdWidth));
    g_arena = (unsigned char*)aligned_alloc(64, kTgArenaBytes);
    g_order = (uint32_t*)calloc(kMaxThreads, sizeof(uint32_t));
    g_pool = (StackPool*)calloc(1, sizeof(StackPool));
    if (!g_threads || !g_simd || !g_arena || !g_order || !g_pool) {
      snprintf(err, errlen, "emulator: out of memory");
      return RC_ERROR;
    }
  }
  memset(&L, 0, sizeof L);
  L.kernel_name = name;
  L.entry = entry;
  L.bufs = bufs;
  L.sched = sched;
  L.seed = seed;
  L.err = err;
  L.errlen = errlen;
  L.arena = g_arena;
  L.arena_used = 0;
  for (uint32_t i = 0; i < kMaxTgSlots; i++) L.slot_off[i] = -1;
  fill_tg(g_arena, kTgArenaBytes);
  uint64_t total_groups = 1;
  L.req_total = 1;
  for (int d = 0; d < 3; d++) {
    L.grid[d] = dims[d];
    L.req_tpg[d] = dims[3 + d];
    if (!L.grid[d]) return RC_OK;
    if (!L.req_tpg[d]) {
      snprintf(err, errlen, "group_size must be positive");
      return RC_ERROR;
    }
    L.ngroups[d] = (L.grid[d] + L.req_tpg[d] - 1) / L.req_tpg[d];
    total_groups *= L.ngroups[d];
    L.req_total *= L.req_tpg[d];
  }
  if (L.req_total > kMaxThreads) {
    snprintf(err, errlen, "Threadgroup size exceeds %u limit", kMaxThreads);
    return RC_ERROR;
  }
  g_launch = &L;
  race_begin(g_arena);

  // install crash handlers (restored afterwards)
  // SIGRTMIN+7: watchdog (CPU time of this thread, $COMFY_METAL_EMU_TIMEOUT seconds, default 600)
  const int kWatchdogSig = SIGRTMIN + 7;
  struct sigaction sa, old[5];
  const int sigs[5] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, kWatchdogSig};
  static thread_local char* altstack_mem = nullptr;
  stack_t ss, old_ss;
  if (!altstack_mem) altstack_mem = (char*)malloc(1 << 16);
  ss.ss_sp = altstack_mem;
  ss.ss_size = 1 << 16;
  ss.ss_flags = 0;
  sigaltstack(&ss, &old_ss);
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < 5; i++) sigaction(sigs[i], &sa, &old[i]);
  timer_t watchdog;
  bool have_watchdog = false;
  {
    const char* e = getenv("COMFY_METAL_EMU_TIMEOUT");
    double secs = e ? atof(e) : 600.0;
    if (secs > 0) {
      struct sigevent sev;
      memset(&sev, 0, sizeof sev);
      sev.sigev_notify = SIGEV_THREAD_ID;
      sev.sigev_signo = kWatchdogSig;
      sev._sigev_un._tid = (pid_t)syscall(SYS_gettid);
      if (timer_create(CLOCK_THREAD_CPUTIME_ID, &sev, &watchdog) == 0) {
        struct itimerspec its;
        memset(&its, 0, sizeof its);
        its.it_value.tv_sec = (time_t)secs;
        its.it_value.tv_nsec = (long)((secs - (double)(time_t)secs) * 1e9);
        timer_settime(watchdog, 0, &its, nullptr);
        have_watchdog = true;
      }
    }
  }

  int rc = RC_OK;
  sigjmp_buf jb;
  uint64_t gi = 0;
  if (sigsetjmp(jb, 1) == 0) {
    g_jmp = &jb;
    // group order
    for (; gi < total_groups; gi++) {
      uint64_t g = gi;
      if (sched == SCHED_REVERSE) {
        g = total_groups - 1 - gi;
      } else if (sched == SCHED_SHUFFLE && total_groups > 1) {
        // bijective affine permutation of [0, total_groups)
        uint64_t s = seed ^ 0xC0FFEEull;
        uint64_t a = (splitmix(s) % total_groups) | 1;
        while (true) {  // make a coprime with total_groups
          uint64_t x = a, y = total_groups;
          while (y) { uint64_t tmp = x % y; x = y; y = tmp; }
          if (x == 1) break;
          a += 2;
          if (a >= total_groups) a = 1;
        }
        uint64_t b = splitmix(s) % total_groups;
        g = (uint64_t)(((unsigned __int128)a * gi + b) % total_groups);
      }
      __EMU_PROF(if (!prof_pick_group(gi, &g)) break;)  // a sampled profile runs only its sample
      L.group[0] = (uint32_t)(g % L.ngroups[0]);
      L.group[1] = (uint32_t)((g / L.ngroups[0]) % L.ngroups[1]);
      L.group[2] = (uint32_t)(g / ((uint64_t)L.ngroups[0] * L.ngroups[1]));
      L.nthreads = 1;
      for (int d = 0; d < 3; d++) {
        uint32_t rem = L.grid[d] - L.group[d] * L.req_tpg[d];
        L.tpg[d] = rem < L.req_tpg[d] ? rem : L.req_tpg[d];
        L.nthreads *= L.tpg[d];
      }
      rc = run_group();
      if (rc != RC_OK) break;
      if (L.tg_error) {
        if (L.tg_error == 1)
          set_err("kernel %s: too many threadgroup variables", name);
        else
          set_err("kernel %s: threadgroup memory exceeds the 32 KiB limit (needs at least %zu bytes)", name,
                  L.arena_used);
        rc = RC_ERROR;
        break;
      }
    }
  } else {
    const char* what = g_sig == kWatchdogSig ? "a timeout (the kernel ran longer than $COMFY_METAL_EMU_TIMEOUT "
                                               "CPU seconds, default 600: an endless loop or spin-wait?)"
                       : g_sig == SIGFPE ? "SIGFPE (integer division by zero?)"
                       : g_sig == SIGSEGV ? "SIGSEGV (invalid or misaligned memory access, or coroutine stack overflow)"
                       : g_sig == SIGBUS ? "SIGBUS (misaligned/invalid memory access)"
                                         : "SIGILL (trap)";
    Thread* t = g_cur;
    snprintf(err, errlen, "kernel %s crashed with %s in threadgroup (%u,%u,%u), thread (%u,%u,%u)", name, what,
             L.group[0], L.group[1], L.group[2], t ? t->lpos[0] : 0, t ? t->lpos[1] : 0, t ? t->lpos[2] : 0);
    rc = RC_CRASH;
    // coroutine stacks are abandoned; drop the whole pool's bookkeeping of busy stacks
    for (uint32_t i = 0; i < kMaxThreads; i++) {
      if (g_threads[i].stack) { stack_put(g_threads[i].stack); g_threads[i].stack = nullptr; }
    }
  }
  g_jmp = nullptr;
  if (have_watchdog) timer_delete(watchdog);
  for (int i = 0; i < 5; i++) sigaction(sigs[i], &old[i], nullptr);
  sigaltstack(&old_ss, nullptr);
  if (rc == RC_OK && g_nraces) {
    snprintf(err, errlen, "%s (%llu racing accesses in all)", g_race_msg, (unsigned long long)g_nraces);
    rc = RC_RACE;
  }
  race_end();
  g_fill_poison = 0;
  g_launch = nullptr;
  g_cur = nullptr;
  return rc;
}

static inline Thread& cur() { return *g_cur; }
static inline Launch& launch_info() { return *g_launch; }

}  // namespace __emu
#include "profile.h"
#pragma clang attribute pop

// ---------------------------------------------------------------- instrumentation hooks and configuration
#define __EMU_TSAN_HOOKS(N)                                                                                    \
  extern "C" __attribute__((visibility("hidden"), no_sanitize("thread"))) void __tsan_read##N(void* p) {       \
    __emu::race_access((uintptr_t)p, N, false);                                                                \
    __EMU_PROF(__emu::prof_access((uintptr_t)p, N, false, 0, (uintptr_t)__builtin_return_address(0));)        \
  }                                                                                                            \
  extern "C" __attribute__((visibility("hidden"), no_sanitize("thread"))) void __tsan_write##N(void* p) {      \
    __emu::race_access((uintptr_t)p, N, true);                                                                 \
    __EMU_PROF(__emu::prof_access((uintptr_t)p, N, true, 0, (uintptr_t)__builtin_return_address(0));)         \
  }                                                                                                            \
  extern "C" __attribute__((visibility("hidden"), no_sanitize("thread"))) void __tsan_unaligned_read##N(void* p) { \
    __emu::race_access((uintptr_t)p, N, false);                                                                \
    __EMU_PROF(__emu::prof_access((uintptr_t)p, N, false, 0, (uintptr_t)__builtin_return_address(0));)        \
  }                                                                                                            \
  extern "C" __attribute__((visibility("hidden"), no_sanitize("thread"))) void __tsan_unaligned_write##N(void* p) { \
    __emu::race_access((uintptr_t)p, N, true);                                                                 \
    __EMU_PROF(__emu::prof_access((uintptr_t)p, N, true, 0, (uintptr_t)__builtin_return_address(0));)         \
  }
__EMU_TSAN_HOOKS(1)
__EMU_TSAN_HOOKS(2)
__EMU_TSAN_HOOKS(4)
__EMU_TSAN_HOOKS(8)
__EMU_TSAN_HOOKS(16)
#undef __EMU_TSAN_HOOKS
extern "C" __attribute__((visibility("hidden"), no_sanitize("thread"))) void __tsan_read_range(void* p, size_t n) {
  if (n) __emu::race_access((uintptr_t)p, (uint32_t)n, false);
}
extern "C" __attribute__((visibility("hidden"), no_sanitize("thread"))) void __tsan_write_range(void* p, size_t n) {
  if (n) __emu::race_access((uintptr_t)p, (uint32_t)n, true);
}
extern "C" __attribute__((visibility("hidden"), no_sanitize("thread"))) void __tsan_init() {}
extern "C" __attribute__((visibility("hidden"), no_sanitize("thread"))) void __tsan_func_entry(void*) {}
extern "C" __attribute__((visibility("hidden"), no_sanitize("thread"))) void __tsan_func_exit() {}
extern "C" __attribute__((visibility("hidden"), no_sanitize("thread"))) void __tsan_vptr_update(void**, void*) {}
extern "C" __attribute__((visibility("hidden"), no_sanitize("thread"))) void __tsan_vptr_read(void**) {}

// Checks for the next launch: race detection over the given [lo, hi) buffer ranges (names for messages),
// and the threadgroup fill (0: 0xFF bytes, 1: poison).
extern "C" __attribute__((visibility("default"), no_sanitize("thread"))) void __emu_configure(
    uint32_t race, uint32_t poison, uint32_t n, const uint64_t* lohi, const char* const* names) {
  __emu::g_fill_poison = poison;
  __emu::g_race_on = race ? 1 : 0;
  __emu::g_nrr = 0;
  if (!race) return;
  for (uint32_t i = 0; i < n && __emu::g_nrr + 1 < __emu::kMaxRanges; i++)
    if (lohi[2 * i + 1] > lohi[2 * i])
      __emu::g_rr[__emu::g_nrr++] = __emu::RaceRange{(uintptr_t)lohi[2 * i], (uintptr_t)lohi[2 * i + 1], nullptr, 0,
                                                     0, names[i]};
}
