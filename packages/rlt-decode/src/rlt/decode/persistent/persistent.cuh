// What the persistent decode kernels of benchmarks/megakernel share: the packed weight stage
// (ROWS weight rows x CK columns of bf16, 16 KB), the shared-memory ring's mbarriers and bulk copies,
// the consumer warps' named barrier, the grid-wide barrier, and one stage's GEMV by the consumers.
// gemv_chain.cu (the weight stream alone) and loop_kernel.cu (a whole Ouro loop at one row) include it.
#pragma once
#ifdef __CUDACC_RTC__  // NVRTC has no C library headers
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

#ifndef NSTAGES
#define NSTAGES 12
#endif
#define ROWS 16
#define CK 512
#define STAGE_ELEMS (ROWS * CK)
#define STAGE_BYTES (STAGE_ELEMS * 2)
#ifndef CONSUMER_WARPS
#define CONSUMER_WARPS 8  // 4 or 8: each takes ROWS_PER_WARP rows of a stage (plan.CONSUMER_WARPS)
#endif
#define CONSUMERS (CONSUMER_WARPS * 32)
#define ROWS_PER_WARP (ROWS / CONSUMER_WARPS)
#ifndef MAX_K  // (cuda.CudaLoop passes plan.MAX_K)
#define MAX_K 6144  // the widest input vector (Ouro-1.4B: I = 5632)
#endif
#ifndef RLT_CPU_SIM
#define DYNAMIC_SHARED(name) extern __shared__ __align__(128) unsigned char name[]
#endif

struct Shape {
  int hidden;    // H
  int inter;     // I
  int kv_tiles;  // the attention stand-in's stages per layer
};

// The hardware primitives: mbarriers, bulk copies, the consumers' named barrier, the global timer, an
// acquire load. RLT_CPU_SIM swaps in a CPU stand-in for each (tests/rlt-decode/cuda_sim: every thread an OS
// thread), so the kernels' own source runs on a CPU in the tests.
#ifdef RLT_CPU_SIM
#include "cuda_cpu_sim.h"
#else
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
// the bytes at src (global) into L2, no completion tracked (the producer's lookahead beyond its ring)
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
}
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint32_t load_acquire_u32(const unsigned int* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
#endif  // RLT_CPU_SIM

// the two bf16 values of a 32-bit word, as fp32
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// A watchdog on every wait: a wait longer than WATCHDOG_NS (default 20 s; 0: none) traps, so that a kernel that
// cannot make progress (its CTAs not all resident, a lost arrival) fails the launch with an error instead of
// hanging the device. Normal waits last microseconds; the timer (%globaltimer, ns) is read only while waiting.
#ifndef WATCHDOG_NS
#define WATCHDOG_NS 20000000000ull
#endif
__device__ __forceinline__ void watchdog(uint64_t& since) {
#if WATCHDOG_NS
  const uint64_t now = globaltimer_ns();
  if (since == 0) since = now;
  else if (now - since > WATCHDOG_NS) __trap();
#endif
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint64_t since = 0;
  while (!mbar_try_wait(bar, parity)) watchdog(since);
}
// grid-wide barrier among the consumers of every CTA (the counter only grows; ``target`` is the
// number of arrivals that completes this barrier)
__device__ __forceinline__ void grid_sync(unsigned int* counter, unsigned int target) {
  consumers_sync();
  if (threadIdx.x == 32) {
    __threadfence();
    atomicAdd(counter, 1u);
    unsigned int v;
    uint64_t since = 0;
    for (;;) {
      v = load_acquire_u32(counter);
      if (v >= target) break;
      watchdog(since);
#ifdef BACKOFF_NS  // fewer polls of the one counter's L2 line while the weight streams run
      __nanosleep(BACKOFF_NS);
#endif
    }
    __threadfence();
  }
  consumers_sync();
}

// The consumers' share of one stage: warp w multiplies rows w*ROWS_PER_WARP.. of the staged [ROWS x CK] tile
// by the CK-wide slice ``xc`` of the phase input (fp32, shared memory), each lane 16 columns, into acc.
__device__ __forceinline__ void stage_dot(const uint16_t* stage, const float* xc, float acc[ROWS_PER_WARP], int warp,
                                          int lane) {
  float xa[16];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float4 a = *reinterpret_cast<const float4*>(xc + h * 256 + lane * 8);
    const float4 b = *reinterpret_cast<const float4*>(xc + h * 256 + lane * 8 + 4);
    xa[h * 8 + 0] = a.x; xa[h * 8 + 1] = a.y; xa[h * 8 + 2] = a.z; xa[h * 8 + 3] = a.w;
    xa[h * 8 + 4] = b.x; xa[h * 8 + 5] = b.y; xa[h * 8 + 6] = b.z; xa[h * 8 + 7] = b.w;
  }
#pragma unroll
  for (int r = 0; r < ROWS_PER_WARP; ++r) {
    const uint16_t* row = stage + (warp * ROWS_PER_WARP + r) * CK;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 v = *reinterpret_cast<const uint4*>(row + h * 256 + lane * 8);
      const float* xv = xa + h * 8;
      acc[r] += bf16_lo(v.x) * xv[0] + bf16_hi(v.x) * xv[1] + bf16_lo(v.y) * xv[2] + bf16_hi(v.y) * xv[3] +
                bf16_lo(v.z) * xv[4] + bf16_hi(v.z) * xv[5] + bf16_lo(v.w) * xv[6] + bf16_hi(v.w) * xv[7];
    }
  }
}

// The ROWS_PER_WARP row sums of each consumer warp (acc after its stages) reduced over the lanes into rowsum[ROWS].
__device__ __forceinline__ void tile_rowsums(float acc[ROWS_PER_WARP], float* rowsum, int warp, int lane) {
#pragma unroll
  for (int r = 0; r < ROWS_PER_WARP; ++r) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) rowsum[warp * ROWS_PER_WARP + r] = acc[r];
  }
}

// The ring's mbarriers, by one thread before the CTA's first __syncthreads: ``full`` completes on the
// producer's arrival plus the stage's bytes, ``empty`` on one arrival per consumer warp.
__device__ __forceinline__ void ring_init(uint64_t* full, uint64_t* empty) {
  for (int i = 0; i < NSTAGES; ++i) {
    mbar_init(&full[i], 1);
    mbar_init(&empty[i], CONSUMER_WARPS);
  }
  fence_mbarrier_init();
}

// A phase of a layer: input width k, tiles of ROWS output rows, CK-wide chunks per tile, first stage and first
// tile in the layer's numbering (tiles are numbered across a layer's phases and dealt round-robin over the
// CTAs, so the CTAs that get a phase's leftover tiles differ from phase to phase).
struct Phase {
  int k, tiles, chunks;
  long long stage0;
  int tile0;
};

// ph[0..count) from each phase's input width and tile count; returns the stages of a layer
__device__ __forceinline__ long long fill_phases(const int* k, const int* tiles, int count, Phase* ph) {
  long long stage = 0;
  int tile = 0;
  for (int p = 0; p < count; ++p) {
    ph[p].k = k[p];
    ph[p].tiles = tiles[p];
    ph[p].chunks = k[p] / CK;
    ph[p].stage0 = stage;
    ph[p].tile0 = tile;
    stage += (long long)tiles[p] * ph[p].chunks;
    tile += tiles[p];
  }
  return stage;
}

// the first tile of phase ph this CTA owns
__device__ __forceinline__ int first_tile(const Phase& ph, int cta, int ctas) {
  int r = (cta - ph.tile0) % ctas;
  return r < 0 ? r + ctas : r;
}

// The producer's n-th stage (src: its 16 KB in global memory) into its ring slot, once the consumers released it
__device__ __forceinline__ void ring_load(const uint16_t* src, unsigned int n, uint16_t* ring, uint64_t* full,
                                          uint64_t* empty) {
  const int st = n % NSTAGES;
  mbar_wait(&empty[st], ((n / NSTAGES) & 1) ^ 1);
  mbar_expect_tx(&full[st], STAGE_BYTES);
  bulk_load(ring + st * STAGE_ELEMS, src, STAGE_BYTES, &full[st]);
}

// The producer lane's share of one phase of a layer (lw: the layer's packed stages): every stage of the CTA's
// tiles, in the order the consumers take them, into the ring (n: the producer's running stage count).
__device__ __forceinline__ void produce_phase(const uint16_t* lw, const Phase& ph, int cta, int ctas, unsigned int& n,
                                              uint16_t* ring, uint64_t* full, uint64_t* empty) {
  for (int t = first_tile(ph, cta, ctas); t < ph.tiles; t += ctas) {
    const uint16_t* tw = lw + (ph.stage0 + (long long)t * ph.chunks) * STAGE_ELEMS;
    for (int c = 0; c < ph.chunks; ++c, ++n) ring_load(tw + (long long)c * STAGE_ELEMS, n, ring, full, empty);
  }
}

// The first ``most`` stages of the CTA's tiles of phase ph (lw: that layer's packed stages) into L2 (no completion
// tracked: the ring's copies find them there). Not inlined: the producer's code adds no registers to the kernel's
// allocation, which the consumers fill.
__device__ __noinline__ void prefetch_phase(const uint16_t* lw, const Phase& ph, int cta, int ctas, int most) {
  for (int t = first_tile(ph, cta, ctas); t < ph.tiles && most > 0; t += ctas) {
    const uint16_t* tw = lw + (ph.stage0 + (long long)t * ph.chunks) * STAGE_ELEMS;
    for (int c = 0; c < ph.chunks && most > 0; ++c, --most)
      bulk_prefetch_l2(tw + (long long)c * STAGE_ELEMS, STAGE_BYTES);
  }
}

// The consumers' GEMV of one tile: its ``chunks`` stages from the ring times the phase input xin (shared
// memory), each stage released as soon as it is used; the tile's ROWS sums land in rowsum (n: the consumers'
// running stage count). COMPUTE false: stages waited for and released only (a timing ablation).
template <bool COMPUTE = true>
__device__ __forceinline__ void consume_tile(int chunks, const float* xin, unsigned int& n, const uint16_t* ring,
                                             uint64_t* full, uint64_t* empty, float* rowsum, int warp, int lane) {
  float acc[ROWS_PER_WARP] = {};
  for (int c = 0; c < chunks; ++c, ++n) {
    const int st = n % NSTAGES;
    mbar_wait(&full[st], (n / NSTAGES) & 1);
    if (COMPUTE) stage_dot(ring + st * STAGE_ELEMS, xin + c * CK, acc, warp, lane);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[st]);
  }
  tile_rowsums(acc, rowsum, warp, lane);
}
