// Comfy Metal MSL emulator -- the profiler's runtime (built into the profiling variant only:
// -D__EMU_PROFILE=1; normal builds contain none of it).  Included by runtime.h after its namespace.
//
// What it counts, per launch (see profiler.py for the Python side and ir_mix.py for the IR numbering):
//   * per-lane executions of every numbered basic block (__emu_prof_block), folded per simdgroup at the
//     end of each threadgroup: a block executed by any lane costs the simdgroup max(lane count) times;
//   * memory accesses (__emu_prof_readN/writeN from the rewritten IR, __tsan_* and simdgroup_load/store by
//     return address): the k-th execution of a site by the lanes of one simdgroup is one SIMT instruction;
//     per instruction the bytes requested, the distinct bytes, 32-byte sectors and 128-byte lines (device
//     memory: by the address the GPU sees, the offset into the buffer's storage, which starts a line as an
//     MTLBuffer does, never the host address the CPU allocator chose, which aligns to 64 bytes only) or,
//     for threadgroup memory, the most-hit of 32 four-byte banks (distinct words; one word read by several
//     lanes is a broadcast);
//   * unique bytes read / written per bound buffer (one bit per byte; sectors by the same GPU address),
//     the DRAM floor;
//   * SIMD collectives (per simdgroup instruction, from the resolvers), simdgroup_barrier, threadgroup
//     barriers, simdgroup_matrix multiply-accumulates (per simdgroup: max over lanes of the lane's calls).
// Sampled launches run only the listed threadgroups; every count is multiplied by the group's weight.
#pragma once
#if defined(__EMU_PROFILE)
#include <algorithm>

namespace __emu {

// a growable array of trivially copyable values (the emulator links no C++ runtime library)
template <class T>
struct PVec {
  T* p = nullptr;
  size_t n = 0, cap = 0;
  size_t size() const { return n; }
  T* begin() { return p; }
  T* end() { return p + n; }
  T& operator[](size_t i) { return p[i]; }
  const T& operator[](size_t i) const { return p[i]; }
  void reserve(size_t c) {
    if (c <= cap) return;
    size_t nc = cap ? cap : 16;
    while (nc < c) nc *= 2;
    T* q = (T*)realloc(p, nc * sizeof(T));
    if (!q) abort();
    p = q;
    cap = nc;
  }
  void push_back(const T& v) {
    reserve(n + 1);
    p[n++] = v;
  }
  void resize(size_t m, const T& v = T()) {
    reserve(m);
    for (size_t i = n; i < m; i++) p[i] = v;
    n = m;
  }
  void clear() { n = 0; }
  void release() {
    free(p);
    p = nullptr;
    n = cap = 0;
  }
};

static constexpr int kWhereTg = 255;
static constexpr uint32_t kDynSite = 0x80000000u;  // site ids of accesses found by return address
enum : int { PK_DEVICE = 0, PK_CONSTANT = 1, PK_THREADGROUP = 2 };
enum : int {
  EV_SIMD_SHUFFLE, EV_SIMD_REDUCE, EV_QUAD_SHUFFLE, EV_QUAD_REDUCE, EV_SIMDGROUP_BARRIER, EV_TG_BARRIER,
  EV_MMA, EV_GROUPS, EV_TG_BYTES, EV_COLLECTIVE_LANES, EV_MMA16, EV_COUNT
};
enum : int {
  SF_INSTR, SF_LANES, SF_BYTES, SF_DISTINCT, SF_SECTORS, SF_LINES, SF_BANK_CYCLES, SF_BANK_IDEAL, SF_COUNT
};

struct ProfRegion {
  uintptr_t lo, hi;
  uintptr_t base;          // host address of the GPU line the tensor starts in: lo - (lo - storage start) % 128
  uint32_t constant;
  uint32_t* bits;          // one bit per byte from base (a word is one 32-byte sector): read, written
  size_t words;            // (the launch), then read, written by the current threadgroup
  PVec<size_t> touched[2]; // words of the current group's bitmaps that are set
  double group_sum[4];     // sum over groups of weight x (bytes read, written, sectors read, written)
};
struct MemRec {
  uint64_t key;  // simdgroup << 56 | local site << 36 | k
  uintptr_t addr;
  uint32_t size;
  uint8_t where;
};
struct Prof {  // allocated zeroed
  PVec<ProfRegion> regions;
  uintptr_t tg_lo, tg_hi;
  uint64_t nsample;
  const uint64_t* sample;
  const double* weights;
  double weight;
  // blocks: global id -> local index; per local: lane counters [1024], simdgroup slots, lane executions
  PVec<int32_t> block_local;
  PVec<uint32_t> block_global, bcnt, btouched_list;
  PVec<uint8_t> btouched;
  PVec<double> bslots, blanes;
  // sites
  PVec<int32_t> site_local;
  PVec<uintptr_t> dyn_ra;  // sites found by return address, and their local indices
  PVec<int32_t> dyn_local;
  PVec<uint32_t> site_global, kcnt, site_info;  // site_info: kind, write, size per local
  PVec<double> sacc;
  PVec<MemRec> recs;
  PVec<uint64_t> scratch;
  uint32_t mma[kMaxThreads], mma16[kMaxThreads];  // per lane: all, and those with 16-bit operands
  double ev[EV_COUNT];
};
static Prof* g_prof = nullptr;

static inline int32_t prof_local_block(uint32_t id) {
  Prof& P = *g_prof;
  if (id >= P.block_local.size()) P.block_local.resize((size_t)id + 1, -1);
  int32_t l = P.block_local[id];
  if (l < 0) {
    l = (int32_t)P.block_global.size();
    P.block_local[id] = l;
    P.block_global.push_back(id);
    P.bcnt.resize(P.bcnt.size() + kMaxThreads, 0);
    P.btouched.push_back(0);
    P.bslots.push_back(0);
    P.blanes.push_back(0);
  }
  return l;
}

static inline void prof_block(uint32_t id) {
  if (!g_prof || !g_cur) return;
  Prof& P = *g_prof;
  int32_t l = id < P.block_local.size() ? P.block_local[id] : -1;
  if (l < 0) l = prof_local_block(id);
  P.bcnt[(size_t)l * kMaxThreads + g_cur->lin]++;
  if (!P.btouched[l]) {
    P.btouched[l] = 1;
    P.btouched_list.push_back((uint32_t)l);
  }
}

static inline int prof_where(uintptr_t a, uint32_t size) {
  Prof& P = *g_prof;
  if (a >= P.tg_lo && a < P.tg_hi) return kWhereTg;
  for (size_t i = 0; i < P.regions.size(); i++)
    if (a + size > P.regions[i].lo && a < P.regions[i].hi) return (int)i;
  return -1;  // thread (private) memory, stack: registers on the GPU
}

static uint32_t prof_new_site(uint32_t global, uint32_t kind, bool write, uint32_t size) {
  Prof& P = *g_prof;
  uint32_t l = (uint32_t)P.site_global.size();
  P.site_global.push_back(global);
  P.site_info.push_back(kind);
  P.site_info.push_back(write ? 1u : 0u);
  P.site_info.push_back(size);
  P.kcnt.resize(P.kcnt.size() + kMaxThreads, 0);
  P.sacc.resize(P.sacc.size() + SF_COUNT, 0.0);
  return l;
}

static void prof_access(uintptr_t a, uint32_t size, bool write, uint32_t site, uintptr_t ra) {
  if (!g_prof || !g_cur || !size) return;
  Prof& P = *g_prof;
  const int where = prof_where(a, size);
  if (where < 0) return;
  const uint32_t kind = where == kWhereTg ? PK_THREADGROUP : P.regions[where].constant ? PK_CONSTANT : PK_DEVICE;
  uint32_t local;
  if (!ra) {
    if (site >= P.site_local.size()) P.site_local.resize((size_t)site + 1, -1);
    int32_t l = P.site_local[site];
    if (l < 0) P.site_local[site] = l = (int32_t)prof_new_site(site, kind, write, size);
    local = (uint32_t)l;
  } else {
    size_t d = 0;
    while (d < P.dyn_ra.size() && P.dyn_ra[d] != ra) d++;
    if (d == P.dyn_ra.size()) {
      P.dyn_ra.push_back(ra);
      P.dyn_local.push_back((int32_t)prof_new_site(kDynSite | (uint32_t)d, kind, write, size));
    }
    local = (uint32_t)P.dyn_local[d];
  }
  const uint32_t lin = g_cur->lin;
  const uint64_t k = P.kcnt[(size_t)local * kMaxThreads + lin]++;
  P.recs.push_back(MemRec{(uint64_t)(lin / kSimdWidth) << 56 | (uint64_t)local << 36 | k, a, size, (uint8_t)where});
  if (where != kWhereTg) {
    ProfRegion& r = P.regions[where];
    if (r.bits) {
      uint32_t* all = r.bits + (write ? r.words : 0);
      uint32_t* grp = r.bits + (write ? 3 : 2) * r.words;
      uintptr_t b0 = a < r.lo ? r.lo : a, b1 = a + size > r.hi ? r.hi : a + size;
      for (uintptr_t b = b0 - r.base; b < b1 - r.base; b++) {
        all[b >> 5] |= 1u << (b & 31);
        if (!grp[b >> 5]) r.touched[write].push_back(b >> 5);
        grp[b >> 5] |= 1u << (b & 31);
      }
    }
  }
}

static inline size_t prof_unique(PVec<uint64_t>& v) {
  std::sort(v.begin(), v.end());
  return (size_t)(std::unique(v.begin(), v.end()) - v.begin());
}

// one SIMT memory instruction: records [i, j) share (simdgroup, site, k)
static void prof_instruction(size_t i, size_t j) {
  Prof& P = *g_prof;
  const uint32_t local = (uint32_t)((P.recs[i].key >> 36) & 0xFFFFFu);
  double* acc = &P.sacc[(size_t)local * SF_COUNT];
  const double w = P.weight;
  double bytes = 0;
  for (size_t r = i; r < j; r++) bytes += P.recs[r].size;
  acc[SF_INSTR] += w;
  acc[SF_LANES] += w * (double)(j - i);
  acc[SF_BYTES] += w * bytes;
  PVec<uint64_t>& s = P.scratch;
  s.clear();
  if (P.recs[i].where == kWhereTg) {
    for (size_t r = i; r < j; r++)
      for (uintptr_t wd = P.recs[r].addr >> 2; wd <= (P.recs[r].addr + P.recs[r].size - 1) >> 2; wd++) s.push_back(wd);
    const size_t nw = prof_unique(s);
    uint32_t bank[32] = {0};
    uint32_t worst = 0;
    for (size_t q = 0; q < nw; q++) worst = std::max(worst, ++bank[s[q] & 31]);
    acc[SF_DISTINCT] += w * 4.0 * (double)nw;
    acc[SF_BANK_CYCLES] += w * worst;
    acc[SF_BANK_IDEAL] += w * (double)((nw + 31) / 32);
    return;
  }
  // distinct bytes: union of the lanes' byte ranges
  for (size_t r = i; r < j; r++) s.push_back((uint64_t)P.recs[r].addr << 8 | std::min<uint32_t>(P.recs[r].size, 255));
  std::sort(s.begin(), s.end());
  uint64_t distinct = 0, cur_lo = 0, cur_hi = 0;
  bool open = false;
  for (uint64_t v : s) {
    uint64_t lo = v >> 8, hi = lo + (v & 255);
    if (open && lo <= cur_hi) {
      cur_hi = std::max(cur_hi, hi);
    } else {
      if (open) distinct += cur_hi - cur_lo;
      cur_lo = lo, cur_hi = hi, open = true;
    }
  }
  if (open) distinct += cur_hi - cur_lo;
  // sectors and lines by the GPU's address: the region, and the offset from its storage's (line-aligned)
  // start (biased: an access may begin a little before its region)
  s.clear();
  for (size_t r = i; r < j; r++) {
    const uint64_t reg = (uint64_t)P.recs[r].where << 48;
    const uint64_t off = (uint64_t)(P.recs[r].addr - P.regions[P.recs[r].where].base) + (1ull << 40);
    for (uint64_t x = off >> 5; x <= (off + P.recs[r].size - 1) >> 5; x++) s.push_back(reg | x);
  }
  const size_t sectors = prof_unique(s);
  for (size_t q = 0; q < sectors; q++) s[q] >>= 2;
  s.resize(sectors);
  const size_t lines = prof_unique(s);
  acc[SF_DISTINCT] += w * (double)distinct;
  acc[SF_SECTORS] += w * (double)sectors;
  acc[SF_LINES] += w * (double)lines;
}

static void prof_flush_memory() {
  Prof& P = *g_prof;
  std::sort(P.recs.begin(), P.recs.end(), [](const MemRec& a, const MemRec& b) { return a.key < b.key; });
  for (size_t i = 0; i < P.recs.size();) {
    size_t j = i + 1;
    while (j < P.recs.size() && P.recs[j].key == P.recs[i].key) j++;
    prof_instruction(i, j);
    i = j;
  }
  P.recs.clear();
}

static void prof_group_begin() {
  if (!g_prof) return;
  memset(g_prof->mma, 0, sizeof g_prof->mma);
  memset(g_prof->mma16, 0, sizeof g_prof->mma16);
  g_prof->tg_lo = (uintptr_t)g_arena;
  g_prof->tg_hi = g_prof->tg_lo + kTgArenaBytes;
}

static void prof_group_end() {
  if (!g_prof) return;
  Prof& P = *g_prof;
  const Launch* L = g_launch;
  const uint32_t n = L->nthreads, nsg = (n + kSimdWidth - 1) / kSimdWidth;
  const double w = P.weight;
  for (uint32_t l : P.btouched_list) {
    uint32_t* row = &P.bcnt[(size_t)l * kMaxThreads];
    for (uint32_t s = 0; s < nsg; s++) {
      uint32_t mx = 0;
      uint64_t sum = 0;
      for (uint32_t i = s * kSimdWidth; i < n && i < (s + 1) * kSimdWidth; i++) {
        mx = std::max(mx, row[i]);
        sum += row[i];
        row[i] = 0;
      }
      P.bslots[l] += w * mx;
      P.blanes[l] += w * (double)sum;
    }
    P.btouched[l] = 0;
  }
  P.btouched_list.clear();
  for (uint32_t s = 0; s < nsg; s++) {
    uint32_t mx = 0, mx16 = 0;
    for (uint32_t i = s * kSimdWidth; i < n && i < (s + 1) * kSimdWidth; i++) {
      mx = std::max(mx, P.mma[i]);
      mx16 = std::max(mx16, P.mma16[i]);
    }
    P.ev[EV_MMA] += w * mx;
    P.ev[EV_MMA16] += w * mx16;
  }
  prof_flush_memory();
  memset(P.kcnt.begin(), 0, P.kcnt.size() * sizeof(uint32_t));
  for (size_t i = 0; i < P.regions.size(); i++) {
    ProfRegion& r = P.regions[i];
    for (int wr = 0; wr < 2; wr++) {
      uint32_t* grp = r.bits + (2 + wr) * r.words;
      double bytes = 0;
      for (size_t q : r.touched[wr]) {
        bytes += __builtin_popcount(grp[q]);
        grp[q] = 0;
      }
      r.group_sum[wr] += w * bytes;
      r.group_sum[2 + wr] += w * (double)r.touched[wr].size();
      r.touched[wr].clear();
    }
  }
  P.ev[EV_GROUPS] += w;
  P.ev[EV_TG_BYTES] = std::max(P.ev[EV_TG_BYTES], (double)L->arena_used);
}

static void prof_barrier(uint32_t nsg) {
  if (!g_prof) return;
  g_prof->ev[EV_TG_BARRIER] += g_prof->weight * nsg;
  // every lane has reached this barrier: the instructions before it are complete; fold them early when
  // they take memory (k keeps counting, so a later instruction never meets an earlier one's records)
  if (g_prof->recs.size() > (1u << 22)) prof_flush_memory();
}

// the threadgroup to run at position gi of a sampled launch (false: the sample is done)
static bool prof_pick_group(uint64_t gi, uint64_t* g) {
  if (!g_prof || !g_prof->nsample) return true;
  if (gi >= g_prof->nsample) return false;
  *g = g_prof->sample[gi];
  g_prof->weight = g_prof->weights[gi];
  return true;
}

// called by a SIMD resolver, once per simdgroup instruction; category 0: shuffle/broadcast/vote,
// 1: reduction or prefix scan, 2: simdgroup_barrier; width 32 (simd_*) or 4 (quad_*)
static inline void prof_collective(int category, uint32_t width, uint32_t mask) {
  if (!g_prof) return;
  Prof& P = *g_prof;
  const int ev = category == 2 ? EV_SIMDGROUP_BARRIER
                 : width == 4 ? (category ? EV_QUAD_REDUCE : EV_QUAD_SHUFFLE)
                              : (category ? EV_SIMD_REDUCE : EV_SIMD_SHUFFLE);
  P.ev[ev] += P.weight;
  P.ev[EV_COLLECTIVE_LANES] += P.weight * __builtin_popcount(mask);
}

static inline void prof_mma(bool sixteen_bit) {
  if (!g_prof || !g_cur) return;
  g_prof->mma[g_cur->lin]++;
  if (sixteen_bit) g_prof->mma16[g_cur->lin]++;
}

// simdgroup_load / simdgroup_store of an 8x8 matrix: lane l moves its two elements (row r, columns c and
// c+1 of the fixed layout, from sg_coord): one access of two elements, or two accesses (two sites) when the
// matrix is transposed
template <class U>
static inline void prof_matrix(const U* base, unsigned long per_row, unsigned long ox, unsigned long oy, int r, int c,
                               bool transpose, bool write, uintptr_t ra) {
  if (!g_prof || !g_cur) return;
  if (!transpose) {  // two neighbours of one row: one access
    prof_access((uintptr_t)&base[(oy + r) * per_row + ox + c], 2 * sizeof(U), write, 0, ra);
    return;
  }
  prof_access((uintptr_t)&base[(oy + c) * per_row + ox + r], sizeof(U), write, 0, ra);
  prof_access((uintptr_t)&base[(oy + c + 1) * per_row + ox + r], sizeof(U), write, 0, ra + 1);
}

}  // namespace __emu

#define __EMU_PROF_HOOKS(N)                                                                                   \
  extern "C" __attribute__((visibility("hidden"), used, no_sanitize("thread"))) void __emu_prof_read##N(void* p, \
                                                                                                 uint32_t site) { \
    __emu::race_access((uintptr_t)p, N, false);                                                               \
    __emu::prof_access((uintptr_t)p, N, false, site, 0);                                                      \
  }                                                                                                           \
  extern "C" __attribute__((visibility("hidden"), used, no_sanitize("thread"))) void __emu_prof_write##N(       \
      void* p, uint32_t site) {                                                                               \
    __emu::race_access((uintptr_t)p, N, true);                                                                \
    __emu::prof_access((uintptr_t)p, N, true, site, 0);                                                       \
  }
__EMU_PROF_HOOKS(1)
__EMU_PROF_HOOKS(2)
__EMU_PROF_HOOKS(4)
__EMU_PROF_HOOKS(8)
__EMU_PROF_HOOKS(16)
#undef __EMU_PROF_HOOKS

namespace __emu {
// an access of n bytes that is not one load or store (an odd size, a struct copy): accesses of the widest
// naturally aligned size up to 16 bytes, as a GPU compiler emits them; they count as one site's k-th,
// (k+1)-th, ... executions, so the lanes of a simdgroup pair up chunk by chunk
static void prof_range(uintptr_t a, uint64_t n, bool write, uint32_t site) {
  if (n) race_access(a, (uint32_t)n, write);
  while (n) {
    uint32_t w = 16;
    while (w > 1 && ((a & (w - 1)) || w > n)) w >>= 1;
    prof_access(a, w, write, site, 0);
    a += w, n -= w;
  }
}
}  // namespace __emu
#define __EMU_PROF_EXPORT extern "C" __attribute__((visibility("hidden"), used, no_sanitize("thread")))
__EMU_PROF_EXPORT void __emu_prof_read_range(void* p, uint64_t n, uint32_t site) {
  __emu::prof_range((uintptr_t)p, n, false, site);
}
__EMU_PROF_EXPORT void __emu_prof_write_range(void* p, uint64_t n, uint32_t site) {
  __emu::prof_range((uintptr_t)p, n, true, site);
}
// struct copies: the read site, then the write site (site + 1)
__EMU_PROF_EXPORT void* __emu_prof_memcpy(void* d, const void* s, uint64_t n, uint32_t site) {
  __emu::prof_range((uintptr_t)s, n, false, site);
  __emu::prof_range((uintptr_t)d, n, true, site + 1);
  return memcpy(d, s, n);
}
__EMU_PROF_EXPORT void* __emu_prof_memmove(void* d, const void* s, uint64_t n, uint32_t site) {
  __emu::prof_range((uintptr_t)s, n, false, site);
  __emu::prof_range((uintptr_t)d, n, true, site + 1);
  return memmove(d, s, n);
}
__EMU_PROF_EXPORT void* __emu_prof_memset(void* d, int c, uint64_t n, uint32_t site) {
  __emu::prof_range((uintptr_t)d, n, true, site);
  return memset(d, c, n);
}
// the same calls in emulator code (not rewritten: not counted)
__EMU_PROF_EXPORT void* __tsan_memcpy(void* d, const void* s, uint64_t n) { return memcpy(d, s, n); }
__EMU_PROF_EXPORT void* __tsan_memmove(void* d, const void* s, uint64_t n) { return memmove(d, s, n); }
__EMU_PROF_EXPORT void* __tsan_memset(void* d, int c, uint64_t n) { return memset(d, c, n); }
#undef __EMU_PROF_EXPORT
extern "C" __attribute__((visibility("hidden"), used, no_sanitize("thread"))) void __emu_prof_block(uint32_t id) {
  __emu::prof_block(id);
}
// SanitizerCoverage's module constructor registers the guards (unused: the IR pass numbers the blocks)
extern "C" __attribute__((visibility("hidden"), used, no_sanitize("thread"))) void __sanitizer_cov_trace_pc_guard_init(
    uint32_t*, uint32_t*) {}
extern "C" __attribute__((visibility("hidden"), used, no_sanitize("thread"))) void __sanitizer_cov_trace_pc_guard(
    uint32_t*) {}

// ---- the Python side's interface (profiler.py)
extern "C" __attribute__((visibility("default"), no_sanitize("thread"))) void __emu_prof_end();
extern "C" __attribute__((visibility("default"), no_sanitize("thread"))) int __emu_prof_begin(
    uint32_t nregions, const uint64_t* lohi, const uint64_t* origin, const uint32_t* constant, uint64_t nsample,
    const uint64_t* groups, const double* weights) {
  using namespace __emu;
  __emu_prof_end();
  g_prof = (Prof*)calloc(1, sizeof(Prof));  // every member is zero when empty
  if (!g_prof) return 1;
  Prof& P = *g_prof;
  P.weight = 1.0;
  P.nsample = nsample;
  P.sample = groups;
  P.weights = weights;
  for (uint32_t i = 0; i < nregions; i++) {
    ProfRegion r;
    memset(&r, 0, sizeof r);
    r.lo = (uintptr_t)lohi[2 * i], r.hi = (uintptr_t)lohi[2 * i + 1], r.constant = constant[i];
    r.base = r.lo - (r.lo - (uintptr_t)origin[i]) % 128;
    if (r.hi > r.lo && !r.constant) {
      r.words = (r.hi - r.base + 31) / 32;
      void* a = mmap(nullptr, 4 * r.words * 4, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (a == MAP_FAILED) return 1;
      r.bits = (uint32_t*)a;
    }
    P.regions.push_back(r);
  }
  return 0;
}

extern "C" __attribute__((visibility("default"), no_sanitize("thread"))) void __emu_prof_sizes(uint32_t* out) {
  out[0] = __emu::g_prof ? (uint32_t)__emu::g_prof->block_global.size() : 0;
  out[1] = __emu::g_prof ? (uint32_t)__emu::g_prof->site_global.size() : 0;
  out[2] = (uint32_t)__emu::SF_COUNT;
  out[3] = (uint32_t)__emu::EV_COUNT;
}

// blocks: ids[n], data[2n] (simdgroup executions, lane executions); sites: ids[m], info[3m] (kind, write,
// size), data[SF_COUNT m]; regions: data[8 r] (unique bytes read, written, sectors read, written over the
// launch; the same summed over threadgroups, weighted); events
extern "C" __attribute__((visibility("default"), no_sanitize("thread"))) void __emu_prof_read(
    uint32_t* block_ids, double* block_data, uint32_t* site_ids, uint32_t* site_info, double* site_data,
    double* region_data, double* events) {
  using namespace __emu;
  Prof& P = *g_prof;
  for (size_t l = 0; l < P.block_global.size(); l++) {
    block_ids[l] = P.block_global[l];
    block_data[2 * l] = P.bslots[l];
    block_data[2 * l + 1] = P.blanes[l];
  }
  for (size_t l = 0; l < P.site_global.size(); l++) {
    site_ids[l] = P.site_global[l];
    for (int f = 0; f < 3; f++) site_info[3 * l + f] = P.site_info[3 * l + f];
    for (int f = 0; f < SF_COUNT; f++) site_data[SF_COUNT * l + f] = P.sacc[SF_COUNT * l + f];
  }
  for (size_t i = 0; i < P.regions.size(); i++) {
    const ProfRegion& r = P.regions[i];
    double rb = 0, wb = 0, rs = 0, ws = 0;
    for (size_t q = 0; r.bits && q < r.words; q++) {
      rb += __builtin_popcount(r.bits[q]);
      wb += __builtin_popcount(r.bits[r.words + q]);
      rs += r.bits[q] != 0;
      ws += r.bits[r.words + q] != 0;
    }
    double* out = region_data + 8 * i;
    out[0] = rb, out[1] = wb, out[2] = rs, out[3] = ws;
    for (int f = 0; f < 4; f++) out[4 + f] = r.group_sum[f];
  }
  for (int e = 0; e < EV_COUNT; e++) events[e] = P.ev[e];
}

extern "C" __attribute__((visibility("default"), no_sanitize("thread"))) void __emu_prof_end() {
  using namespace __emu;
  if (!g_prof) return;
  Prof& P = *g_prof;
  for (size_t i = 0; i < P.regions.size(); i++) {
    if (P.regions[i].bits) munmap(P.regions[i].bits, 4 * P.regions[i].words * 4);
    P.regions[i].touched[0].release(), P.regions[i].touched[1].release();
  }
  P.regions.release(), P.block_local.release(), P.block_global.release(), P.bcnt.release();
  P.btouched_list.release(), P.btouched.release(), P.bslots.release(), P.blanes.release();
  P.site_local.release(), P.dyn_ra.release(), P.dyn_local.release(), P.site_global.release();
  P.kcnt.release(), P.site_info.release(), P.sacc.release(), P.recs.release(), P.scratch.release();
  free(g_prof);
  g_prof = nullptr;
}

#endif
