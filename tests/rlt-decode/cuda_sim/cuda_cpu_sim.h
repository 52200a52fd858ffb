// A CPU stand-in for the CUDA features the persistent kernels use (rlt.decode.persistent), so that their own
// source runs in the CPU test suite: every CUDA thread is an OS thread; a CTA's __syncthreads, named barrier and
// warps are std::barriers; warp shuffles exchange through a per-warp buffer between two barrier phases;
// mbarriers keep PTX's arrival count, transaction bytes and phase parity; a bulk copy is a memcpy that then
// completes its bytes; the grid barrier's counter is an atomic. Waiting threads yield (thousands of threads
// share two cores). It checks the kernels' logic, indexing and synchronisation pattern — a missing barrier
// arrival deadlocks here as it would on the GPU (the kernels' watchdog then aborts) — not the GPU memory
// model, timing or the hardware's copy engines. Included by persistent.cuh when RLT_CPU_SIM is defined
// (launch.cpp builds a kernel with it).
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __restrict__

struct float4 { float x, y, z, w; };
struct uint4 { unsigned int x, y, z, w; };
struct uint2 { unsigned int x, y; };
struct Dim3 { unsigned int x, y, z; };

namespace sim {

struct MBar {  // PTX mbarrier: expected arrivals, pending transaction bytes, phase parity
  unsigned int count = 0, pending = 0, phase = 0;
  long long tx = 0;
};

struct Warp {
  explicit Warp() : bar(32) {}
  std::barrier<> bar;
  uint64_t buf[32];
};

struct Cta {
  Cta(size_t smem_bytes, int threads, int consumers)
      : all(threads), consumers(consumers), smem(new (std::align_val_t(128)) unsigned char[smem_bytes]()) {
    for (int i = 0; i < (threads + 31) / 32; ++i) warps.emplace_back(std::make_unique<Warp>());
  }
  ~Cta() { operator delete[](smem, std::align_val_t(128)); }
  std::barrier<> all, consumers;
  std::vector<std::unique_ptr<Warp>> warps;
  unsigned char* smem;
  std::mutex mutex;  // guards mbars
  std::vector<MBar> mbars;
  // the source addresses of the producer's bulk copies and L2 prefetches (the launcher checks that every prefetch
  // named a stage the copies loaded)
  std::vector<const void*> loads, prefetches;
};

// the global bytes the bulk copies and prefetches may read (set by the launcher; a copy outside aborts)
inline const unsigned char* src_lo = nullptr;
inline const unsigned char* src_hi = nullptr;
inline void check_source(const void* src, uint32_t bytes) {
  const auto* p = static_cast<const unsigned char*>(src);
  if (src_lo && (p < src_lo || p + bytes > src_hi)) {
    std::fprintf(stderr, "bulk copy / prefetch outside the weights: %p + %u\n", src, bytes);
    std::abort();
  }
}

inline thread_local Dim3 thread_idx, block_idx;
inline Dim3 grid_dim;
inline thread_local Cta* cta;

inline Warp& warp() { return *cta->warps[thread_idx.x / 32]; }

template <class T>
T shuffle(T v, int src) {
  Warp& w = warp();
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  w.buf[thread_idx.x % 32] = bits;
  w.bar.arrive_and_wait();
  T out;
  const uint64_t got = w.buf[src & 31];
  std::memcpy(&out, &got, sizeof(T));
  w.bar.arrive_and_wait();  // the buffer is reused by the next shuffle
  return out;
}

inline MBar& mbar(uint64_t* bar) { return cta->mbars[*bar]; }
inline void mbar_complete_if_done(MBar& m) {
  if (m.pending == 0 && m.tx == 0) {
    m.phase ^= 1u;
    m.pending = m.count;
  }
}

}  // namespace sim

#define threadIdx sim::thread_idx
#define blockIdx sim::block_idx
#define gridDim sim::grid_dim
#define DYNAMIC_SHARED(name) unsigned char* name = sim::cta->smem

inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int mask) {
  return sim::shuffle(v, (int)(sim::thread_idx.x % 32) ^ mask);
}
template <class T> inline T __shfl_sync(unsigned, T v, int src) { return sim::shuffle(v, src); }
inline void __syncwarp() { sim::warp().bar.arrive_and_wait(); }
inline void __syncthreads() { sim::cta->all.arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
[[noreturn]] inline void __trap() {
  std::fprintf(stderr, "cuda_cpu_sim: __trap (the kernel's watchdog: a wait that never ended)\n");
  std::abort();
}

// persistent.cuh's hardware primitives
inline void mbar_init(uint64_t* bar, uint32_t count) {
  std::lock_guard<std::mutex> g(sim::cta->mutex);
  *bar = sim::cta->mbars.size();
  sim::cta->mbars.push_back(sim::MBar{count, count, 0, 0});
}
inline void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  std::lock_guard<std::mutex> g(sim::cta->mutex);
  sim::MBar& m = sim::mbar(bar);
  m.tx += bytes;
  --m.pending;
  sim::mbar_complete_if_done(m);
}
inline void mbar_arrive(uint64_t* bar) {
  std::lock_guard<std::mutex> g(sim::cta->mutex);
  sim::MBar& m = sim::mbar(bar);
  --m.pending;
  sim::mbar_complete_if_done(m);
}
inline bool mbar_try_wait(uint64_t* bar, uint32_t parity) {  // the phase of this parity has completed
  bool done;
  {
    std::lock_guard<std::mutex> g(sim::cta->mutex);
    done = sim::mbar(bar).phase != parity;
  }
  if (!done) std::this_thread::yield();
  return done;
}
inline void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  sim::check_source(src, bytes);
  sim::cta->loads.push_back(src);
  std::memcpy(dst, src, bytes);
  std::lock_guard<std::mutex> g(sim::cta->mutex);
  sim::MBar& m = sim::mbar(bar);
  m.tx -= bytes;
  sim::mbar_complete_if_done(m);
}
inline void bulk_prefetch_l2(const void* src, uint32_t bytes) {  // (the producer lane alone calls it)
  sim::check_source(src, bytes);
  sim::cta->prefetches.push_back(src);
}
inline void consumers_sync() { sim::cta->consumers.arrive_and_wait(); }
inline uint64_t globaltimer_ns() {
  return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}
inline long long clock64() { return (long long)globaltimer_ns(); }  // (an SM's cycle counter on a GPU)
inline uint32_t load_acquire_u32(const unsigned int* p) {
  const uint32_t v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
  std::this_thread::yield();
  return v;
}
inline void fence_mbarrier_init() {}
