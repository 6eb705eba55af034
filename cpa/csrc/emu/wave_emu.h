// The kernels' GPU code paths on the host CPU (CPA_EMU), run by a lock-step wave emulator so
// that lane mappings and control flow are executed and checked against the reference
// (tests/test_emu.py) without a GPU:
//  * the HIP side (default): wave64, ds_bpermute shuffles, the v_mfma_f32_16x16x16 / 4x4x4 (16
//    blocks) matrix instructions with the operand layouts AMD documents, LDS and barriers --
//    the only execution the AMD tilings get here;
//  * the CUDA side (-DCPA_EMU_CUDA): warp32, __shfl_*_sync, mma.sync.m16n8k16 / m16n8k8 and
//    movmatrix.m8n8.trans with the fragment layouts the PTX ISA documents, __syncthreads and
//    __syncwarp, and the sm_89+ hardware fp8 decode (cvt.rn.f16x2.e4m3x2) with __byte_perm --
//    so that an index change in the NVIDIA tilings fails on the CPU before a GPU sees it;
//    thread-block clusters (barrier.cluster, ld.shared::cluster: run_grid's cluster launches);
//    and programmatic dependent launch (griddepcontrol: run_pdl_chain).
//    Not emulated: cache hints, cp.async / TMA (staged loops).
// It checks lane mappings and control flow, not timing or ISA (of the memory model, only the
// release and acquire of the partials: below): every lane is a
// fiber, and a fiber runs until it reaches a wave-wide operation (a matrix instruction, a
// shuffle, a wave barrier) or a workgroup barrier; when every live lane of a wave is waiting
// at the same wave-wide operation it is computed for the whole wave, and a barrier opens when
// every live thread of the workgroup waits at one.
// Lanes of one wave waiting at different operations are a divergent collective: an error.
// Not caught: lanes of one wave at the same kind of operation from two different branches
// (an if/else with a permute or an MFMA in each) are computed as one, where hardware runs each
// branch with the other's lanes off and a permute reads 0 from them -- every call site in the
// kernels is wave-uniform (audited 2026-12-06), so keep it that way. __builtin_amdgcn_exp2f and
// ex2.approx are libm's exp2f here; the hardware is within 1-2 ULP and flushes denormal results
// (far below the tolerances). The MFMA modifiers (cbsz, abid, blgp) are ignored: the kernels
// pass 0.
// Workgroups run one after another by default; with set_schedule(workers > 1, seed) a launch's
// workgroups are dispatched in a seeded random order to `workers` host threads that take turns
// (one runs at a time): after every scheduling round of
// the running workgroup (a wave-wide operation or a barrier computed) a seeded random pick among
// the live workgroups runs next (or, turns "until_blocked", the running one goes on until it
// waits at a cluster barrier or ends: a workgroup that runs ahead of its cluster). That
// interleaves the workgroups that share counters (the shared steps' tickets, the fused reduce's
// last-arriver count) at wave-operation granularity; interleaving alone is not a memory-model
// test (no reordering, no stale reads: the held stores below are). Every access to the
// schedule's shared state (the next workgroup, the first error) is made by the thread holding
// the turn, after the baton's mutex handed it on.
// What another workgroup of the same launch may read -- the fused combine's partials, stored
// through platform.h's store_partial -- is held back by default (set_schedule's weak_stores):
// such a store becomes visible to other workgroups only at a release by its workgroup (an
// acquire-release or release RMW, a device-scope fence) or when its grid has ended (for a PDL
// dependent: at its griddepcontrol.wait); its own workgroup reads it at once. A relaxed atomic
// releases nothing. So a count made relaxed, or a partial stored after the count, makes the
// last workgroup combine poisoned partials even in grid order (tests/test_emu.py, by mutation).
// The acquire side (set_schedule's acquire_loads, on by default with weak_stores): a thread's
// load of a partial another workgroup released during the launch returns the value from before
// that release unless the thread has acquired since it -- an acquire or acquire-release RMW, an
// acquiring device-scope fence or griddepcontrol.wait by itself, or by another thread of its
// workgroup before a barrier they both passed (a wave barrier: of its wave). Each thread starts
// a launch having acquired nothing of it. So a count made release-only, or the barrier after
// the count removed (the other threads combine without having acquired), reads the poison too.
// Not modelled: loads reordered within a thread, a cluster barrier's release or acquire across
// the cluster (the cluster combine reads distributed shared memory, not partials).
// `__shared__` is a function-local static, thread_local: one emulated workgroup at a time per
// host thread.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

namespace cpa_emu {

constexpr int kLanes = CPA_WAVE;  // 64 (HIP) or 32 (CUDA)
enum Op : int {
  kRun = 0, kDone, kBarrier, kWaveBarrier, kPermute, kMfma16, kMfma4, kMma16816, kMma1688, kMovmatrix, kClusterBarrier,
  kGridWait
};

struct Lane {
  ucontext_t ctx;
  int op = kRun;
  int addr = 0;
  uint32_t val = 0, res = 0;  // shuffles: addr is the source lane
  float a[4] = {}, b[4] = {}, c[4] = {}, d[4] = {};
  uint32_t ra[4] = {}, rb[2] = {};  // mma.sync: the packed 16-bit operand registers
  bool bf16 = false;
  long long acquired = 0;  // acquire_loads: the launch's releases this thread has acquired (ReleaseLog)
};

struct Baton;
struct Cluster;
struct Pdl;
// Partial stores held back from the other workgroups (weak_stores): where, and the value.
using HeldStores = std::vector<std::pair<float*, float>>;
// acquire_loads: the partial stores a launch's workgroups released, numbered by release (the
// header's note), each with the value it overwrote and its workgroup, so that a load by a
// thread that has not acquired a release returns what was there before it.
struct ReleaseLog {
  struct Entry {
    long long release;
    float before;
    long long workgroup;  // Group::serial of the writer
  };
  long long releases = 0;
  std::unordered_map<const float*, std::vector<Entry>> at;
};

struct Group {
  Baton* baton = nullptr;  // concurrent workgroups: the turn to hand on after each round
  int worker = 0;
  Cluster* cluster = nullptr;  // a cluster launch: this workgroup's cluster and its rank in it
  int cluster_rank = 0;
  // a chain of programmatic dependent launches (run_pdl_chain): the link to the grid this one
  // depends on (its griddepcontrol.wait) and to the grid that depends on it (its trigger)
  Pdl* pdl_prior = nullptr;
  Pdl* pdl_next = nullptr;
  bool triggered = false;
  int threads = 0, cur = 0;
  int block[3] = {0, 0, 0};
  std::vector<Lane> lanes;
  // the lanes' fiber stacks, left uninitialized: pages a lane never touches are never committed
  // (a concurrent launch holds one set per host thread)
  std::vector<std::unique_ptr<char[]>> stacks;
  int stack_bytes = 0;
  ucontext_t sched;
  std::function<void()> body;
  std::string error;
  long long wave_ops = 0, barriers = 0;
  // weak_stores: this workgroup's partial stores since its last release (its own loads see
  // them), and the launch's list of those its ended workgroups never released (null: every
  // store is visible at once)
  HeldStores unreleased;
  HeldStores* ended = nullptr;
  ReleaseLog* log = nullptr;  // acquire_loads: the launch's releases (null: loads see memory)
  long long serial = 0;       // this workgroup, among every workgroup the emulator has run
};

// (per host thread: two Python threads may run the emulator at once; a workgroup's fibers all
// run on the thread that started it)
inline Group& group() {
  static thread_local Group g;
  return g;
}
inline std::string& last_error() {
  static thread_local std::string e;
  return e;
}

// The turn among the host threads of a concurrent launch (set_schedule): one runs at a time.
struct Baton {
  std::mutex m;
  std::condition_variable cv;
  std::vector<char> live, blocked;  // blocked: waiting at a cluster barrier
  std::mt19937_64 rng;
  int turn = 0;
  bool abort = false, deadlock = false;
  bool keep = false;  // turns "until_blocked": the running workgroup keeps the turn until it waits
  long long switches = 0;  // turns handed to another workgroup's thread
  Baton(int workers, uint64_t seed, bool keep) : live(workers, 1), blocked(workers, 0), rng(seed), keep(keep) {}
  void wait(std::unique_lock<std::mutex>& lk, int me) { cv.wait(lk, [&] { return turn == me; }); }
  void pick(int me) {  // (under m) a random live worker, or -1 when none is left
    int n = 0, waiting = 0;
    for (size_t w = 0; w < live.size(); ++w) {
      n += live[w];
      waiting += live[w] && blocked[w];
    }
    if (!n) { turn = -1; return; }
    if (waiting == n) abort = deadlock = true;  // every live workgroup waits for one that never comes
    int k = (int)(rng() % (uint64_t)n);
    for (int w = 0; w < (int)live.size(); ++w)
      if (live[w] && k-- == 0) { switches += w != me; turn = w; break; }
    cv.notify_all();
  }
  void start(int me) { std::unique_lock<std::mutex> lk(m); wait(lk, me); }
  // hand the turn on and wait for it back; false when another thread failed (stop)
  bool pass(int me) {
    std::unique_lock<std::mutex> lk(m);
    if (keep && !blocked[me]) return !abort;
    pick(me);
    wait(lk, me);
    return !abort;
  }
  void leave(int me, bool failed) {
    std::unique_lock<std::mutex> lk(m);
    live[me] = 0;
    abort = abort || failed;
    pick(me);
  }
};

struct Schedule {
  int workers = 1;
  uint64_t seed = 0;
  bool until_blocked = false;  // the turns: a random pick after every round, or kept until a wait
  bool weak_stores = true;     // partial stores held back until a release (the header's note)
  bool acquire_loads = true;   // and seen by another workgroup's thread only after its acquire
  long long switches = 0;  // of the concurrent launches since set_schedule
};
// (per calling thread, as the emulator's other state)
inline Schedule& schedule() {
  static thread_local Schedule s;
  return s;
}

// weak_stores (the header's note). Every call is made by the host thread holding the turn.
// Held stores made visible: at a grid's end to everything after it (no log), or at a release
// by workgroup `serial`, logged as release number `release` of the launch.
inline void apply(HeldStores& stores, ReleaseLog* log = nullptr, long long release = 0, long long serial = 0) {
  for (const auto& st : stores) {
    if (log) log->at[st.first].push_back({release, *st.first, serial});
    *st.first = st.second;
  }
  stores.clear();
}
// platform.h's store_partial: held back until a release, or at once without weak_stores
inline void store_partial(float* p, float v) {
  Group& g = group();
  if (g.ended) {
    g.unreleased.push_back({p, v});
  } else {
    *p = v;
  }
}
// platform.h's loads of partials (load_f32_l2): this workgroup's own held stores, else memory
// as this thread has acquired it (acquire_loads: the value before the first release of `p` by
// another workgroup that the thread has not acquired)
inline float load_partial(const float* p) {
  const Group& g = group();
  for (auto it = g.unreleased.rbegin(); it != g.unreleased.rend(); ++it)
    if (it->first == p) return it->second;
  if (g.log) {
    const auto at = g.log->at.find(p);
    if (at != g.log->at.end())
      for (const ReleaseLog::Entry& e : at->second)
        if (e.release > g.lanes[g.cur].acquired && e.workgroup != g.serial) return e.before;
  }
  return *p;
}
// A release by this workgroup: its held stores become visible to every workgroup (that acquires
// it, with acquire_loads).
inline void release() {
  Group& g = group();
  apply(g.unreleased, g.log, g.log ? ++g.log->releases : 0, g.serial);
}
// An acquire by thread `t` (the running one by default): every release of the launch so far is
// visible to it.
inline void acquire(Group& g, int t) {
  if (g.log) g.lanes[t].acquired = g.log->releases;
}
inline void acquire() { acquire(group(), group().cur); }
// __ATOMIC_* orders (the HIP builtins' and the CUDA side's)
inline bool releases(int order) { return order == __ATOMIC_RELEASE || order == __ATOMIC_ACQ_REL || order == __ATOMIC_SEQ_CST; }
inline bool acquires(int order) { return order == __ATOMIC_ACQUIRE || order == __ATOMIC_CONSUME || order == __ATOMIC_ACQ_REL || order == __ATOMIC_SEQ_CST; }
// What one thread has acquired passes to the threads [t0, t1) at a barrier they all pass.
inline void pass_acquired(Group& g, int t0, int t1) {
  long long a = 0;
  for (int t = t0; t < t1; ++t) a = std::max(a, g.lanes[t].acquired);
  for (int t = t0; t < t1; ++t) g.lanes[t].acquired = a;
}
// A launch's (or a PDL chain's) memory-model state, as the schedule asks for it: the stores its
// ended workgroups never released and the log of its releases. attach() hands them to a host
// thread's Group for the workgroups it runs, detach() takes them back; grid_ended() makes the
// held stores visible (to the next launch, or past the dependent grid's wait).
struct LaunchMemory {
  HeldStores ended;
  ReleaseLog log;
  bool weak_stores, acquire_loads;
  explicit LaunchMemory(const Schedule& sch)
      : weak_stores(sch.weak_stores), acquire_loads(sch.weak_stores && sch.acquire_loads) {}
  void attach(Group& g) {
    g.ended = weak_stores ? &ended : nullptr;
    g.log = acquire_loads ? &log : nullptr;
  }
  static void detach(Group& g) {
    g.ended = nullptr;
    g.log = nullptr;
  }
  void grid_ended() { apply(ended); }
};
// The workgroup ended: what it never released stays held until its grid ends.
inline void end_of_workgroup(Group& g) {
  if (g.ended) g.ended->insert(g.ended->end(), g.unreleased.begin(), g.unreleased.end());
  g.unreleased.clear();
}
// A device-scope fence (__threadfence, the agent-scope fence of HIP) releases and acquires as
// its order says; narrower scopes order within the workgroup only.
inline void fence(int order, const char* scope) {
  if (strcmp(scope, "agent") != 0) return;
  if (releases(order)) release();
  if (acquires(order)) acquire();
}

// A thread-block cluster of the emulated launch (the CUDA side's cluster combine): its arrivals
// at the current cluster barrier, the barrier's generation, and each rank's host thread (where its
// `__shared__` variables live) and worker.
struct Cluster {
  int n = 0, arrived = 0, gen = 0;
  std::vector<const char*> tls;
  std::vector<int> workers;
  explicit Cluster(int n) : n(n), tls(n, nullptr), workers(n, 0) {}
};
// One link of a chain of programmatic dependent launches (sm_90's PDL, the CUDA side): the
// dependent grid is dispatched once every workgroup of the grid before it (its primary) has run
// griddepcontrol.launch_dependents or ended (open), and a dependent thread at
// griddepcontrol.wait waits until every primary workgroup has ended (ready; run_pdl_chain).
// The waiters: host threads blocked on either, unblocked by the primary workgroup that opens it
// (so the baton never sees them all blocked while a primary still runs).
struct Pdl {
  int primaries = 0, triggered = 0, done = 0;
  std::vector<int> gate_waiters, grid_waiters;  // host threads blocked on open() / ready()
  bool open() const { return triggered == primaries; }
  bool ready() const { return done == primaries; }
};

// An address in this host thread's thread-local storage. The `__shared__` variables are
// thread_local statics of one module, whose TLS block each thread holds whole, so the same
// variable of another thread is at the same offset from that thread's anchor.
inline const char* tls_anchor() {
  static thread_local char a;
  return &a;
}
// `p` (this workgroup's shared memory) in workgroup `rank` of its cluster (ld.shared::cluster).
template <class T>
inline const T* cluster_ptr(const T* p, int rank) {
  Group& g = group();
  if (!g.cluster || rank < 0 || rank >= g.cluster->n || !g.cluster->tls[rank]) {
    if (g.error.empty())
      g.error = "a distributed shared memory load of rank " + std::to_string(rank) + " outside the cluster";
    return p;
  }
  return reinterpret_cast<const T*>(reinterpret_cast<const char*>(p) + (g.cluster->tls[rank] - tls_anchor()));
}

inline void arrive(int op) {
  Group& g = group();
  Lane& l = g.lanes[g.cur];
  l.op = op;
  swapcontext(&l.ctx, &g.sched);
}

inline void lane_main() {
  Group& g = group();
  g.body();
  g.lanes[g.cur].op = kDone;  // (uc_link returns to the scheduler)
}

// The low (h = 0) or high 16-bit value of a packed register, fp16 or bf16, as a float.
inline float half_of(uint32_t r, int h, bool bf16) {
  const uint16_t b = (uint16_t)(r >> (16 * h));
  if (bf16) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
  }
  _Float16 x;
  memcpy(&x, &b, 2);
  return (float)x;
}

// One wave-wide operation for lanes [w, w + kLanes) (all live: checked by the caller).
inline void wave_op(Group& g, int w, int op) {
  Lane* L = g.lanes.data() + w;
  if (op == kPermute) {
    for (int l = 0; l < kLanes; ++l) L[l].res = L[L[l].addr & (kLanes - 1)].val;
  } else if (op == kMfma16) {
    // v_mfma_f32_16x16x16{f16,bf16}: lane x + 16 y holds A[x][4y + v], B[4y + v][x] and
    // D[4y + v][x] (v = 0..3)
    for (int l = 0; l < kLanes; ++l) {
      const int x = l % 16, y = l / 16;
      for (int v = 0; v < 4; ++v) {
        const int i = 4 * y + v;
        float acc = L[l].c[v];
        for (int k = 0; k < 16; ++k) acc += L[i + 16 * (k / 4)].a[k % 4] * L[x + 16 * (k / 4)].b[k % 4];
        L[l].d[v] = acc;
      }
    }
  } else if (op == kMfma4) {
    // v_mfma_f32_4x4x4_16b{f16,bf16}: block y = lane / 4; lane x + 4 y holds A_y[x][v],
    // B_y[v][x] and D_y[v][x]
    for (int l = 0; l < kLanes; ++l) {
      const int x = l % 4, base = l - x;
      for (int v = 0; v < 4; ++v) {
        float acc = L[l].c[v];
        for (int k = 0; k < 4; ++k) acc += L[base + v].a[k] * L[base + x].b[k];
        L[l].d[v] = acc;
      }
    }
  } else if (op == kMma16816 || op == kMma1688) {
    // mma.sync.aligned.m16n8k{16,8}.row.col.f32.{f16,bf16}: lane 4 g + t holds A[g][2t, 2t+1]
    // (ra[0]), A[g+8][2t, 2t+1] (ra[1]), for k16 A[g][2t+8, 2t+9] (ra[2]) and A[g+8][2t+8, 2t+9]
    // (ra[3]); B[2t, 2t+1][g] (rb[0]), for k16 B[2t+8, 2t+9][g] (rb[1]); C and D [g][2t, 2t+1],
    // [g+8][2t, 2t+1] (PTX ISA, "Matrix Fragments for mma.m16n8k16 / mma.m16n8k8", f16 / bf16)
    const int K = op == kMma16816 ? 16 : 8;
    float A[16][16], B[16][8];
    for (int l = 0; l < kLanes; ++l) {
      const int g = l >> 2, t = l & 3;
      const bool bf = L[l].bf16;
      for (int h = 0; h < 2; ++h) {
        A[g][2 * t + h] = half_of(L[l].ra[0], h, bf);
        A[g + 8][2 * t + h] = half_of(L[l].ra[1], h, bf);
        B[2 * t + h][g] = half_of(L[l].rb[0], h, bf);
        if (K == 16) {
          A[g][2 * t + 8 + h] = half_of(L[l].ra[2], h, bf);
          A[g + 8][2 * t + 8 + h] = half_of(L[l].ra[3], h, bf);
          B[2 * t + 8 + h][g] = half_of(L[l].rb[1], h, bf);
        }
      }
    }
    for (int l = 0; l < kLanes; ++l) {
      const int g = l >> 2, t = l & 3;
      for (int v = 0; v < 4; ++v) {
        const int row = g + 8 * (v >> 1), col = 2 * t + (v & 1);
        float acc = L[l].c[v];
        for (int k = 0; k < K; ++k) acc += A[row][k] * B[k][col];
        L[l].d[v] = acc;
      }
    }
  } else if (op == kMovmatrix) {
    // movmatrix.sync.aligned.m8n8.trans.b16: lane 4 g + t holds row g, columns 2t, 2t+1 of
    // an 8x8 matrix of 16-bit values, afterwards those of its transpose: M[2t][g], M[2t+1][g]
    for (int l = 0; l < kLanes; ++l) {
      const int g = l >> 2, t = l & 3;
      const uint32_t lo = (L[(2 * t) * 4 + g / 2].val >> (16 * (g & 1))) & 0xffffu;
      const uint32_t hi = (L[(2 * t + 1) * 4 + g / 2].val >> (16 * (g & 1))) & 0xffffu;
      L[l].res = lo | (hi << 16);
    }
  }
  ++g.wave_ops;
}

inline const char* op_name(int op) {
  static const char* names[] = {"running", "done", "barrier", "wave barrier", kLanes == 64 ? "ds_bpermute" : "shfl.sync",
                                "mfma 16x16x16", "mfma 4x4x4", "mma.m16n8k16", "mma.m16n8k8", "movmatrix",
                                "cluster barrier", "griddepcontrol.wait"};
  return names[op];
}

// Every thread of this workgroup is at a cluster barrier: count the workgroup in, and hand the
// turn on until every workgroup of the cluster has (false: a deadlock or another failure).
inline bool cluster_wait(Group& g) {
  Cluster* c = g.cluster;
  if (!c || !g.baton) {
    last_error() = "a cluster barrier outside a cluster launch";
    return false;
  }
  c->tls[g.cluster_rank] = tls_anchor();
  c->workers[g.cluster_rank] = g.worker;
  const int gen = c->gen;
  if (++c->arrived == c->n) {
    c->arrived = 0;
    ++c->gen;
    for (int w : c->workers) g.baton->blocked[w] = 0;
    return true;
  }
  g.baton->blocked[g.worker] = 1;
  while (c->gen == gen)
    if (!g.baton->pass(g.worker)) {
      last_error() = g.baton->deadlock ? "deadlock: workgroups wait at cluster barriers no other member reaches"
                                       : "stopped: another workgroup failed";
      return false;
    }
  return true;
}

// PDL (struct Pdl): every access below is made by the host thread holding the turn.
inline void unblock(Baton& b, std::vector<int>& waiters) {
  for (int w : waiters) b.blocked[w] = 0;
  waiters.clear();
}
// A primary workgroup counted as having launched its dependents (it ran
// griddepcontrol.launch_dependents, or ended without).
inline void count_trigger(Group& g) {
  g.triggered = true;
  if (++g.pdl_next->triggered == g.pdl_next->primaries) unblock(*g.baton, g.pdl_next->gate_waiters);
}
// platform.h's allow_dependent_launch: the first thread of a workgroup with a dependent counts it.
inline void launch_dependents() {
  Group& g = group();
  if (g.pdl_next && !g.triggered) count_trigger(g);
}
// platform.h's wait_prior_grid: in a dependent grid a thread waits (kGridWait) until every
// workgroup of the grid before it has ended; elsewhere (the chain's first grid, no chain) it
// returns at once.
inline void grid_dependency_wait() {
  if (group().pdl_prior) arrive(kGridWait);
}
inline bool grid_wait_over(const Group& g) { return !g.pdl_prior || g.pdl_prior->ready(); }
// Every thread of the workgroup that is not done waits at griddepcontrol.wait or behind one:
// hand the turn on until the primary grid has ended (false: a deadlock or another failure).
inline bool grid_block(Group& g) {
  if (!g.pdl_prior || !g.baton) {
    last_error() = "griddepcontrol.wait blocked outside a programmatic dependent launch";
    return false;
  }
  g.pdl_prior->grid_waiters.push_back(g.worker);
  g.baton->blocked[g.worker] = 1;
  while (!g.pdl_prior->ready())
    if (!g.baton->pass(g.worker)) {
      last_error() = g.baton->deadlock ? "deadlock: a dependent grid waits for a primary grid that never ends"
                                       : "stopped: another workgroup failed";
      return false;
    }
  return true;
}

// Run one workgroup of `threads` (a multiple of kLanes) to completion; false with last_error() set
// on a divergent collective or a deadlock.
inline bool run_group(int threads, int bx, int by, int bz, std::function<void()> body, int stack_bytes = 1 << 17) {
  Group& g = group();
  g.error.clear();
  g.unreleased.clear();
  static std::atomic<long long> workgroups{0};
  g.serial = ++workgroups;
  g.threads = threads;
  g.block[0] = bx; g.block[1] = by; g.block[2] = bz;
  g.body = std::move(body);
  if ((int)g.lanes.size() < threads) g.lanes.resize(threads);
  if (g.stack_bytes != stack_bytes) {
    g.stacks.clear();
    g.stack_bytes = stack_bytes;
  }
  while ((int)g.stacks.size() < threads) g.stacks.emplace_back(new char[stack_bytes]);
  for (int t = 0; t < threads; ++t) {
    Lane& l = g.lanes[t];
    l.op = kRun;
    l.acquired = 0;  // (nothing of the launch: its first release is number 1)
    getcontext(&l.ctx);
    l.ctx.uc_stack.ss_sp = g.stacks[t].get();
    l.ctx.uc_stack.ss_size = stack_bytes;
    l.ctx.uc_link = &g.sched;
    makecontext(&l.ctx, lane_main, 0);
  }
  const int waves = threads / kLanes;
  for (;;) {
    for (int t = 0; t < threads; ++t) {
      if (g.lanes[t].op != kRun) continue;
      g.cur = t;
      swapcontext(&g.sched, &g.lanes[t].ctx);
    }
    bool any_live = false, progressed = false, all_at_barrier = true;
    // griddepcontrol.wait is per thread: a thread there goes on once its wait is over; until then
    // its wave's collectives wait for it (no error), and the workgroup blocks on the prior grid.
    // (Only a dependent grid's threads ever wait there: grid_dependency_wait.)
    const bool dependent = g.pdl_prior != nullptr;
    bool grid_waiting = false;
    for (int t = 0; dependent && t < threads; ++t)
      if (g.lanes[t].op == kGridWait) {
        if (grid_wait_over(g)) {
          g.lanes[t].op = kRun;
          acquire(g, t);  // (griddepcontrol.wait acquires)
          progressed = true;
        } else {
          grid_waiting = true;
        }
      }
    if (progressed) continue;  // (those threads run on to their next operation first)
    int barrier_op = -1;  // kBarrier or kClusterBarrier: every thread of the workgroup must wait at one kind
    for (int w = 0; w < waves; ++w) {
      Lane* L = g.lanes.data() + w * kLanes;
      int op = -1, live = 0;
      bool at_grid_wait = false;
      for (int l = 0; dependent && l < kLanes; ++l) at_grid_wait = at_grid_wait || L[l].op == kGridWait;
      if (at_grid_wait) {
        any_live = true;
        all_at_barrier = false;
        continue;
      }
      for (int l = 0; l < kLanes; ++l) {
        if (L[l].op == kDone) continue;
        ++live;
        if (op < 0) {
          op = L[l].op;
        } else if (L[l].op != op) {
          last_error() = "divergent collective in workgroup (" + std::to_string(bx) + ", " + std::to_string(by) + ", " +
                         std::to_string(bz) + ") wave " + std::to_string(w) + ": lanes wait at " + op_name(op) +
                         " and at " + op_name(L[l].op);
          return false;
        }
      }
      if (!live) continue;
      any_live = true;
      if (op == kBarrier || op == kClusterBarrier) {
        if (barrier_op >= 0 && barrier_op != op) {
          last_error() = "threads of workgroup (" + std::to_string(bx) + ", " + std::to_string(by) + ", " +
                         std::to_string(bz) + ") wait at a barrier and at a cluster barrier";
          return false;
        }
        barrier_op = op;
        continue;
      }
      all_at_barrier = false;
      if (live != kLanes && op != kWaveBarrier) {
        last_error() = std::string(op_name(op)) + " with " + std::to_string(kLanes - live) +
                       " exited lanes in wave " + std::to_string(w);
        return false;
      }
      wave_op(g, w * kLanes, op);
      if (op == kWaveBarrier) pass_acquired(g, w * kLanes, (w + 1) * kLanes);
      for (int l = 0; l < kLanes; ++l)
        if (L[l].op != kDone) L[l].op = kRun;
      progressed = true;
    }
    if (!any_live) {
      end_of_workgroup(g);
      return true;
    }
    if (!g.error.empty()) {
      last_error() = g.error;
      return false;
    }
    if (all_at_barrier) {
      if (barrier_op == kClusterBarrier && !cluster_wait(g)) return false;
      pass_acquired(g, 0, threads);
      for (int t = 0; t < threads; ++t)
        if (g.lanes[t].op == kBarrier || g.lanes[t].op == kClusterBarrier) g.lanes[t].op = kRun;
      ++g.barriers;
      progressed = true;
    }
    if (!progressed && grid_waiting) {
      if (!grid_block(g)) return false;
      progressed = true;
    }
    if (!progressed) {
      last_error() = "deadlock";
      return false;
    }
    if (g.baton && !g.baton->pass(g.worker)) {
      last_error() = "stopped: another workgroup failed";
      return false;
    }
  }
}

// `workers` host threads taking turns on one baton (the concurrent launches below), each
// running work(g, w, error) with its Group's baton and worker set; work returns false on a
// failure and sets `error` if it is the first. The threads' wave operations and turns handed
// on are added to the caller's; false with last_error() set when any failed.
template <class Work>
inline bool run_workers(int workers, uint64_t seed, bool keep, Work work) {
  Baton baton(workers, seed, keep);
  std::string error;
  long long ops = 0;
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      baton.start(w);
      Group& g = group();
      g.baton = &baton;
      g.worker = w;
      const bool ok = work(g, w, error);
      ops += g.wave_ops;
      g.baton = nullptr;
      baton.leave(w, !ok);
    });
  for (std::thread& t : pool) t.join();
  group().wave_ops += ops;
  schedule().switches += baton.switches;
  if (!error.empty()) last_error() = error;
  return error.empty();
}

// The dispatch units of a gx x gy x gz launch with clusters of n (> 1: = gy) workgroups: each
// workgroup, or each cluster (x, 0, z) of n ranks y; false with last_error() set when a cluster
// does not span y.
inline bool dispatch_units(int gx, int gy, int gz, int n, std::vector<std::array<int, 3>>& units) {
  if (n > 1 && n != gy) {
    last_error() = "a cluster must span the grid's y dimension (the partitions)";
    return false;
  }
  units.clear();
  for (int z = 0; z < gz; ++z)
    for (int y = 0; y < (n > 1 ? 1 : gy); ++y)
      for (int x = 0; x < gx; ++x) units.push_back({x, y, z});
  return true;
}

// Every workgroup of a gx x gy x gz grid through run_group: one after another in grid order, or
// (schedule().workers > 1) in a seeded random order on that many host threads taking turns.
// cluster > 1 (= gy): each (x, z) is one thread-block cluster of gy workgroups, rank y; a
// cluster's workgroups run at once, as the hardware guarantees (whole clusters are dispatched
// in a seeded random order, workers rounded up to whole clusters).
template <class Body>
inline bool run_grid(int gx, int gy, int gz, int threads, Body body, int cluster = 0) {
  const Schedule sch = schedule();
  const int n = cluster > 1 ? cluster : 1;
  std::vector<std::array<int, 3>> order;  // single workgroups in grid order, or clusters (x, z)
  if (!dispatch_units(gx, gy, gz, n, order)) return false;
  LaunchMemory memory(sch);
  if (sch.workers <= 1 && n == 1) {
    memory.attach(group());
    bool ok = true;
    for (size_t i = 0; ok && i < order.size(); ++i) ok = run_group(threads, order[i][0], order[i][1], order[i][2], body);
    LaunchMemory::detach(group());
    memory.grid_ended();
    return ok;
  }
  std::mt19937_64 rng(sch.seed);
  std::shuffle(order.begin(), order.end(), rng);
  const int slots = std::max(1, std::min<int>((sch.workers + n - 1) / n, (int)order.size()));
  const int workers = slots * n;
  std::vector<Cluster> clusters(n > 1 ? order.size() : 0, Cluster(n));
  size_t next = 0;  // (read and advanced by the thread holding the turn only)
  const bool ok = run_workers(workers, rng(), sch.until_blocked, [&](Group& g, int w, std::string& error) {
    memory.attach(g);
    bool ok = true;
    if (n == 1) {
      while (ok && !g.baton->abort && next < order.size()) {
        const std::array<int, 3> b = order[next++];
        ok = run_group(threads, b[0], b[1], b[2], body);
        if (!ok && error.empty()) error = last_error();
      }
    } else {  // slot w / n runs rank w % n of every slots-th cluster
      for (size_t u = w / n; ok && !g.baton->abort && u < order.size(); u += slots) {
        g.cluster = &clusters[u];
        g.cluster_rank = w % n;
        ok = run_group(threads, order[u][0], w % n, order[u][2], body);
        if (!ok && error.empty()) error = last_error();
      }
      g.cluster = nullptr;
    }
    LaunchMemory::detach(g);
    return ok;
  });
  memory.grid_ended();  // its stores are visible to the next launch
  return ok;
}

// Grids launched one after another, each a programmatic dependent of the one before (CUDA's
// PDL: the attention kernel then its reduce kernel, launch.h; or a kernel writing the inputs
// first): each grid's workgroups in a seeded random order on schedule().workers host threads
// taking turns, every workgroup of a grid dispatched before any of the next one's; a workgroup
// of grid k + 1 starts once every workgroup of grid k has run griddepcontrol.launch_dependents
// or ended, and its threads pass griddepcontrol.wait once every workgroup of grid k has ended
// (struct Pdl). So what a dependent grid does before its wait runs beside the grid before it: a
// read there of what that grid writes gets the value of the moment (NaN-poisoned, half
// written), as on the GPU. A grid with cluster > 1 (= gy, as run_grid) is a cluster launch: its
// clusters are shuffled whole and their ranks dispatched one after another, so a cluster's
// workgroups are taken up together (workers are rounded up to whole clusters, and a worker
// blocked at a cluster barrier leaves the turn to those that take up the rest of its cluster).
struct GridSpec {
  int gx, gy, gz, threads;
  std::function<void()> body;
  int cluster = 0;
};
inline bool run_pdl_chain(const std::vector<GridSpec>& grids) {
  const Schedule sch = schedule();
  std::mt19937_64 rng(sch.seed);
  std::vector<std::array<int, 5>> order;  // (x, y, z, grid, cluster or -1), grid by grid
  std::vector<Cluster> clusters;
  std::vector<std::array<int, 3>> units;
  int widest = 1;  // the largest cluster
  for (int k = 0; k < (int)grids.size(); ++k) {
    const GridSpec& s = grids[k];
    const int n = s.cluster > 1 ? s.cluster : 1;
    if (!dispatch_units(s.gx, s.gy, s.gz, n, units)) return false;
    widest = std::max(widest, n);
    std::shuffle(units.begin(), units.end(), rng);
    for (const auto& u : units) {
      if (n == 1) {
        order.push_back({u[0], u[1], u[2], k, -1});
        continue;
      }
      clusters.emplace_back(n);
      for (int r = 0; r < n; ++r) order.push_back({u[0], r, u[2], k, (int)clusters.size() - 1});
    }
  }
  std::vector<Pdl> links(grids.empty() ? 0 : grids.size() - 1);  // link k: grid k, then grid k + 1
  for (size_t k = 0; k < links.size(); ++k) links[k].primaries = grids[k].gx * grids[k].gy * grids[k].gz;
  // (ranks are taken in order, so the workers blocked on a cluster's barrier are all of that
  // cluster: with at least `widest` workers its last rank is always taken up)
  const int workers = std::max(widest, std::min<int>((sch.workers + widest - 1) / widest * widest,
                                                     (int)order.size()));
  size_t next = 0;  // (read and advanced by the thread holding the turn only)
  LaunchMemory memory(sch);  // one for the chain (a thread past its wait has acquired it all)
  const bool ok = run_workers(workers, rng(), sch.until_blocked, [&](Group& g, int w, std::string& error) {
    Baton& baton = *g.baton;
    memory.attach(g);
    bool ok = true;
    while (ok && !baton.abort && next < order.size()) {
      const std::array<int, 5> b = order[next++];
      const int k = b[3];
      g.pdl_prior = k > 0 ? &links[k - 1] : nullptr;
      g.pdl_next = k + 1 < (int)grids.size() ? &links[k] : nullptr;
      g.triggered = false;
      g.cluster = b[4] >= 0 ? &clusters[b[4]] : nullptr;
      g.cluster_rank = b[4] >= 0 ? b[1] : 0;
      if (g.pdl_prior && !g.pdl_prior->open()) {  // this grid is not launched yet
        g.pdl_prior->gate_waiters.push_back(w);
        baton.blocked[w] = 1;
        while (ok && !g.pdl_prior->open()) ok = baton.pass(w);
        if (!ok) {
          if (error.empty())
            error = baton.deadlock ? "deadlock: a dependent grid is never launched" : "stopped: another workgroup failed";
          break;
        }
      }
      ok = run_group(grids[k].threads, b[0], b[1], b[2], grids[k].body);
      if (!ok && error.empty()) error = last_error();
      if (ok && g.pdl_next) {
        if (!g.triggered) count_trigger(g);
        if (++g.pdl_next->done == g.pdl_next->primaries) {
          memory.grid_ended();  // its stores are visible past the dependent's wait
          unblock(baton, g.pdl_next->grid_waiters);
        }
      }
    }
    g.pdl_prior = g.pdl_next = nullptr;
    g.cluster = nullptr;
    LaunchMemory::detach(g);
    return ok;
  });
  memory.grid_ended();
  return ok;
}

template <class V>
inline float lane_value(V v, int i, bool bf16) {
  return bf16 ? half_of((uint16_t)v[i], 0, true) : (float)v[i];
}

template <int OP, bool BF16, class AV, class CV>
inline CV mfma(AV a, AV b, CV c) {
  Group& g = group();
  Lane& l = g.lanes[g.cur];
  for (int i = 0; i < 4; ++i) {
    l.a[i] = lane_value(a, i, BF16);
    l.b[i] = lane_value(b, i, BF16);
    l.c[i] = c[i];
  }
  arrive(OP);
  Lane& r = group().lanes[group().cur];
  CV d = {r.d[0], r.d[1], r.d[2], r.d[3]};
  return d;
}

// The value lane `src` offers (every live lane of the wave offers one and reads one).
inline uint32_t shuffle(int src, uint32_t v) {
  Group& g = group();
  Lane& l = g.lanes[g.cur];
  l.addr = src;
  l.val = v;
  arrive(kPermute);
  return group().lanes[group().cur].res;
}
// ds_bpermute addresses lanes in bytes
inline int bpermute(int addr, int v) { return (int)shuffle(addr >> 2, (uint32_t)v); }

inline int lane_now() { return group().cur % kLanes; }

template <int OP>
inline void mma(float (&c)[4], const uint32_t* a, const uint32_t* b, bool bf16) {
  Group& g = group();
  Lane& l = g.lanes[g.cur];
  for (int i = 0; i < 4; ++i) {
    l.ra[i] = i < (OP == kMma16816 ? 4 : 2) ? a[i] : 0u;
    l.c[i] = c[i];
  }
  l.rb[0] = b[0];
  l.rb[1] = OP == kMma16816 ? b[1] : 0u;
  l.bf16 = bf16;
  arrive(OP);
  Lane& r = group().lanes[group().cur];
  for (int i = 0; i < 4; ++i) c[i] = r.d[i];
}

inline uint32_t movmatrix_trans(uint32_t x) {
  Group& g = group();
  Lane& l = g.lanes[g.cur];
  l.val = x;
  arrive(kMovmatrix);
  return group().lanes[group().cur].res;
}

// An atomic add of the __ATOMIC_* `order`: a releasing one publishes the workgroup's held
// stores first, an acquiring one then acquires (a relaxed one does neither).
inline int fetch_add(int* p, int v, int order) {
  if (releases(order)) release();
  const int old = *p;
  *p = old + v;
  if (acquires(order)) acquire();
  return old;
}

}  // namespace cpa_emu

#if CPA_HIP

// The builtins platform.h's HIP branches call.
#define __builtin_amdgcn_workitem_id_x() (::cpa_emu::group().cur)
#define __builtin_amdgcn_workgroup_id_x() (::cpa_emu::group().block[0])
#define __builtin_amdgcn_workgroup_id_y() (::cpa_emu::group().block[1])
#define __builtin_amdgcn_workgroup_id_z() (::cpa_emu::group().block[2])
#define __builtin_amdgcn_s_barrier() ::cpa_emu::arrive(::cpa_emu::kBarrier)
#define __builtin_amdgcn_wave_barrier() ::cpa_emu::arrive(::cpa_emu::kWaveBarrier)
#define __builtin_amdgcn_fence(order, scope) ::cpa_emu::fence((order), (scope))
#define __builtin_amdgcn_ds_bpermute(addr, v) ::cpa_emu::bpermute((addr), (v))
#define __builtin_amdgcn_exp2f(x) ::exp2f(x)
#define __builtin_amdgcn_mfma_f32_16x16x16f16(a, b, c, cbsz, abid, blgp) \
  ::cpa_emu::mfma<::cpa_emu::kMfma16, false>((a), (b), (c))
#define __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, c, cbsz, abid, blgp) \
  ::cpa_emu::mfma<::cpa_emu::kMfma16, true>((a), (b), (c))
#define __builtin_amdgcn_mfma_f32_4x4x4f16(a, b, c, cbsz, abid, blgp) \
  ::cpa_emu::mfma<::cpa_emu::kMfma4, false>((a), (b), (c))
#define __builtin_amdgcn_mfma_f32_4x4x4bf16_1k(a, b, c, cbsz, abid, blgp) \
  ::cpa_emu::mfma<::cpa_emu::kMfma4, true>((a), (b), (c))
#define __HIP_MEMORY_SCOPE_AGENT 0
#define __hip_atomic_fetch_add(p, v, order, scope) ::cpa_emu::fetch_add((p), (v), (order))
#define __hip_atomic_store(p, v, order, scope) ((void)(*(p) = (v)))
#else  // CPA_CUDA: the CUDA built-ins platform.h's CUDA branches call (its PTX asm has CPA_EMU branches)
namespace cpa_emu {
struct Index3 { unsigned x, y, z; };
inline Index3 thread_index() { return {(unsigned)group().cur, 0u, 0u}; }
inline Index3 block_index() { return {(unsigned)group().block[0], (unsigned)group().block[1], (unsigned)group().block[2]}; }
template <class V>
inline V shfl(V v, int src) {
  static_assert(sizeof(V) == 4, "32-bit shuffles");
  uint32_t u;
  memcpy(&u, &v, 4);
  u = shuffle(src & (kLanes - 1), u);
  memcpy(&v, &u, 4);
  return v;
}
}  // namespace cpa_emu
#define threadIdx (::cpa_emu::thread_index())
#define blockIdx (::cpa_emu::block_index())
#define __syncthreads() ::cpa_emu::arrive(::cpa_emu::kBarrier)
#define __syncwarp() ::cpa_emu::arrive(::cpa_emu::kWaveBarrier)
#define __threadfence() ::cpa_emu::fence(__ATOMIC_SEQ_CST, "agent")  // (fence.sc.gpu)
// (the kernels shuffle with the full mask only: every lane of the warp takes part)
#define __shfl_xor_sync(mask, v, m) ::cpa_emu::shfl((v), ::cpa_emu::lane_now() ^ (m))
#define __shfl_sync(mask, v, src) ::cpa_emu::shfl((v), (src))
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
template <class P> inline P __ldg(const P* p) { return *p; }
template <class P> inline P __ldcg(const P* p) { return *p; }
inline int atomicAdd(int* p, int v) { return ::cpa_emu::fetch_add(p, v, __ATOMIC_RELAXED); }
inline int atomicExch(int* p, int v) { const int old = *p; *p = v; return old; }
// __byte_perm(x, y, s): byte n of the result is byte (s >> 4n) & 7 of the 8 bytes {y, x}
// (x bytes 0-3, y bytes 4-7)
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = ((uint64_t)y << 32) | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xffu) << (8 * n);
  return r;
}
namespace cpa_emu {
// platform.h's hardware fp8 decode (CPA_FP8_HW): cvt.rn.f16x2.e4m3x2 of the two bytes of `w`
// (the low byte to the low half, as the reverse conversion packs them), then mul.rn.f16x2 by
// 2^-8: each e4m3fn value / 256, exact in fp16 (NaN bytes to NaN)
inline uint32_t cvt_f16x2_e4m3x2_div256(uint32_t w) {
  uint32_t r = 0;
  for (int h = 0; h < 2; ++h) {
    const uint32_t b = (w >> (8 * h)) & 0xffu;
    const int e = (b >> 3) & 15, m = b & 7;
    float v = e == 15 && m == 7 ? NAN : e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf((float)m, -9);
    _Float16 x = (_Float16)((b & 0x80u) ? -v : v);
    x = x * (_Float16)0.00390625f;
    uint16_t bits;
    memcpy(&bits, &x, 2);
    r |= (uint32_t)bits << (16 * h);
  }
  return r;
}
}  // namespace cpa_emu
// (named by the staged loops' cp.async / TMA helpers, which the emulator does not run: they
// stay PTX asm and are never emitted unless a CPA_KV_ASYNC build calls them, which fails)
inline unsigned __cvta_generic_to_shared(const void* p) { return (unsigned)(uintptr_t)p; }
#endif

inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; memcpy(&x, &f, 4); return x; }
inline float __uint_as_float(unsigned x) { float f; memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; memcpy(&x, &f, 4); return x; }
// (HIP's integer max / min device functions)
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
