// A persistent one-row GEMV chain: the weight stream of one loop of an Ouro-1.4B-shaped decoder
// (per layer: q/k/v 3H x H, o_proj H x H + residual, gate/up 2I x H + SiLU*mul, down_proj H x I +
// residual) in ONE kernel launch, to measure what a persistent decode kernel could reach at C=1
// (issue 10; docs/decode.md: the eight-kernels-a-layer design streams each kernel's weights at
// ~4 TB/s but pays a few microseconds per kernel boundary). Attention is stood in for by its bytes: a
// phase after q/k/v streams KV_TILES 16 KB stages (a layer's KV at 1K context: 8 MiB = 512 stages) and
// multiplies them like weights, followed by a grid barrier as a split attention's merge would be;
// the softmax, norms and RoPE are left out (their arithmetic is small at one row).
//
// Design (the one docs/decode.md names as what the Triton designs could not express):
// - one CTA per SM (or two: MIN_BLOCKS); warp 0's lane 0 is the *producer*: it streams the CTA's weight tiles, in the
//   order the CTA will use them, into a ring of NSTAGES shared-memory stages with 1-D bulk copies
//   (cp.async.bulk, completion counted on an mbarrier per stage). Weights never depend on
//   activations, so the producer runs ahead across phase boundaries: while the consumers wait at a
//   grid barrier, the next phase's weights are already arriving.
// - warps 1..CONSUMER_WARPS are the *consumers*: per phase, after a grid-wide barrier (atomic
//   counter), they read the phase's input vector (fp32, from L2) into shared memory, then for each
//   of their tiles multiply the staged rows by it, release each stage (an mbarrier arrive), and
//   write the tile's outputs with the phase's epilogue.
// - weights are pre-packed (host side, once) so that each stage is one contiguous 16 KB block:
//   [tile][chunk][ROWS rows][CK columns] bf16; gate/up tiles hold 8 gate rows then the same 8 up rows.
// - tiles of a layer are numbered across its four phases and dealt round-robin over the CTAs, so
//   the CTAs that get a phase's leftover tiles differ from phase to phase.
// - tried and measured slower (lease 15, calls 3-5; commit 57d7373): one balanced range of stages per CTA with
//   partial sums added into fp32 accumulators and each epilogue folded into the next phase's input load —
//   1.45 ms against this design's 1.08 on one machine, its bulk-copy stream alone 1.34 ms against 0.84.
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
#define CONSUMER_WARPS 4
#define CONSUMERS (CONSUMER_WARPS * 32)
#define MAX_K 6144  // the widest input vector (Ouro-1.4B: I = 5632)

struct Shape {
  int hidden;    // H
  int inter;     // I
  int kv_tiles;  // the attention stand-in's stages per layer
};

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
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
}
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// The phases of a layer, in order: q/k/v (3H x H), the attention stand-in (KV_TILES stages of CK
// columns: the bytes a layer's attention reads, streamed and multiplied like weights; 0: no phase),
// o_proj (H x H), gate/up (2I x H), down_proj (H x I). Per phase: input width, tiles, chunks per
// tile, first stage and first tile in the layer's numbering.
#define PHASES 5
enum { QKV = 0, KV = 1, O_PROJ = 2, GATE_UP = 3, DOWN = 4 };
struct Phase {
  int k, tiles, chunks;
  long long stage0;
  int tile0;
};

__device__ __forceinline__ void phase_table(const Shape& s, Phase* ph) {
  const int H = s.hidden, I = s.inter;
  const int k[PHASES] = {H, CK, H, H, I};
  const int tiles[PHASES] = {3 * H / ROWS, s.kv_tiles, H / ROWS, 2 * I / ROWS, H / ROWS};
  long long stage = 0;
  int tile = 0;
  for (int p = 0; p < PHASES; ++p) {
    ph[p].k = k[p];
    ph[p].tiles = tiles[p];
    ph[p].chunks = k[p] / CK;
    ph[p].stage0 = stage;
    ph[p].tile0 = tile;
    stage += (long long)tiles[p] * ph[p].chunks;
    tile += tiles[p];
  }
}

__device__ __forceinline__ long long layer_stages(const Phase* ph) {
  return ph[PHASES - 1].stage0 + (long long)ph[PHASES - 1].tiles * ph[PHASES - 1].chunks;
}

// the first tile of phase ph this CTA owns (tiles numbered across the layer, dealt round-robin)
__device__ __forceinline__ int first_tile(const Phase& ph, int cta, int ctas) {
  int r = (cta - ph.tile0) % ctas;
  return r < 0 ? r + ctas : r;
}

// grid-wide barrier among the consumers of every CTA (the counter only grows; ``target`` is the
// number of arrivals that completes this barrier)
__device__ __forceinline__ void grid_sync(unsigned int* counter, unsigned int target) {
  consumers_sync();
  if (threadIdx.x == 32) {
    __threadfence();
    atomicAdd(counter, 1u);
    unsigned int v;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
#ifdef BACKOFF_NS  // fewer polls of the one counter's L2 line while the weight streams run
      if (v < target) __nanosleep(BACKOFF_NS);
#endif
    } while (v < target);
    __threadfence();
  }
  consumers_sync();
}

#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1  // CTAs per SM (2: NSTAGES <= 5, so that two CTAs' shared memory fit one SM)
#endif
extern "C" __global__ void __launch_bounds__(32 + CONSUMERS, MIN_BLOCKS)
gemv_chain(const uint16_t* __restrict__ w,  // packed weights, all layers
           float* x,                         // [H] the layer input; the chain's output at the end
           float* qkv,                       // [3H]
           float* x1,                        // [H] after o_proj + residual
           float* act,                       // [I] SiLU(gate) * up
           float* att,                       // [kv_tiles * ROWS] the attention stand-in's sums (unused)
           unsigned int* counter,            // zero at launch
           int hidden, int inter, int kv_tiles, int layers) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint16_t* ring = reinterpret_cast<uint16_t*>(smem);
  float* xin = reinterpret_cast<float*>(smem + NSTAGES * STAGE_BYTES);
  float* rowsum = xin + MAX_K;
  uint64_t* full = reinterpret_cast<uint64_t*>(rowsum + ROWS);
  uint64_t* empty = full + NSTAGES;
  volatile int* phase_go = reinterpret_cast<volatile int*>(empty + NSTAGES);  // NO_RUNAHEAD only

  const Shape s{hidden, inter, kv_tiles};
  Phase phase[PHASES];
  phase_table(s, phase);
  const int cta = blockIdx.x, ctas = gridDim.x;
  if (threadIdx.x == 0) {
    for (int i = 0; i < NSTAGES; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], CONSUMER_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    *phase_go = 0;
  }
  __syncthreads();
  const long long per_layer = layer_stages(phase);

  if (threadIdx.x < 32) {  // the producer: lane 0 streams every stage this CTA will consume, in order
    if (threadIdx.x != 0) return;
    unsigned int n = 0;
    for (int layer = 0; layer < layers; ++layer) {
      const uint16_t* lw = w + (long long)layer * per_layer * STAGE_ELEMS;
      for (int p = 0; p < PHASES; ++p) {
        const Phase ph = phase[p];
        if (ph.tiles == 0) continue;
#ifdef NO_RUNAHEAD  // the ablation: no weight of a phase is requested before the barrier that opens it
        while (*phase_go < layer * PHASES + p) {
        }
#endif
        for (int t = first_tile(ph, cta, ctas); t < ph.tiles; t += ctas) {
          const uint16_t* tw = lw + (ph.stage0 + (long long)t * ph.chunks) * STAGE_ELEMS;
          for (int c = 0; c < ph.chunks; ++c, ++n) {
            const int st = n % NSTAGES;
            mbar_wait(&empty[st], ((n / NSTAGES) & 1) ^ 1);
            mbar_expect_tx(&full[st], STAGE_BYTES);
            bulk_load(ring + st * STAGE_ELEMS, tw + (long long)c * STAGE_ELEMS, STAGE_BYTES, &full[st]);
          }
        }
      }
    }
    return;
  }

  // the consumers
  const int tid = threadIdx.x - 32, warp = tid / 32, lane = tid % 32;
  unsigned int n = 0, barriers = 0;
  for (int layer = 0; layer < layers; ++layer) {
    for (int p = 0; p < PHASES; ++p) {
      const Phase ph = phase[p];
      if (ph.tiles == 0) {  // no phase, no barrier
        if (tid == 0) *phase_go = layer * PHASES + p + 1;
        continue;
      }
      const float* in = p == QKV ? x : p == KV || p == O_PROJ ? qkv : p == GATE_UP ? x1 : act;
      for (int i = tid; i < ph.k; i += CONSUMERS) xin[i] = __ldcg(in + i);
      consumers_sync();
      for (int t = first_tile(ph, cta, ctas); t < ph.tiles; t += ctas) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int c = 0; c < ph.chunks; ++c, ++n) {
          const int st = n % NSTAGES;
          mbar_wait(&full[st], (n / NSTAGES) & 1);
#ifdef NO_COMPUTE  // timing ablation: stages are waited for and released, not multiplied (wrong output)
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[st]);
          continue;
#endif
          const uint16_t* stage = ring + st * STAGE_ELEMS;
          const float* xc = xin + c * CK;
          float xa[16];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float4 a = *reinterpret_cast<const float4*>(xc + h * 256 + lane * 8);
            const float4 b = *reinterpret_cast<const float4*>(xc + h * 256 + lane * 8 + 4);
            xa[h * 8 + 0] = a.x; xa[h * 8 + 1] = a.y; xa[h * 8 + 2] = a.z; xa[h * 8 + 3] = a.w;
            xa[h * 8 + 4] = b.x; xa[h * 8 + 5] = b.y; xa[h * 8 + 6] = b.z; xa[h * 8 + 7] = b.w;
          }
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const uint16_t* row = stage + (warp * 4 + r) * CK;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint4 v = *reinterpret_cast<const uint4*>(row + h * 256 + lane * 8);
              const float* xv = xa + h * 8;
              acc[r] += bf16_lo(v.x) * xv[0] + bf16_hi(v.x) * xv[1] + bf16_lo(v.y) * xv[2] + bf16_hi(v.y) * xv[3] +
                        bf16_lo(v.z) * xv[4] + bf16_hi(v.z) * xv[5] + bf16_lo(v.w) * xv[6] + bf16_hi(v.w) * xv[7];
            }
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[st]);
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
        }
        if (lane == 0) {
#pragma unroll
          for (int r = 0; r < 4; ++r) rowsum[warp * 4 + r] = acc[r];
        }
        consumers_sync();
        if (tid < ROWS) {  // the phase's epilogue, one output row per thread
          const int row = t * ROWS + tid;
          const float v = rowsum[tid];
          if (p == QKV) qkv[row] = v;
          else if (p == KV) att[row] = v;
          // (other CTAs wrote x and x1: read them from L2, never from a stale L1 line)
          else if (p == O_PROJ) x1[row] = v + __ldcg(x + row);
          else if (p == DOWN) x[row] = v + __ldcg(x1 + row);
          else if (tid < ROWS / 2) {  // gate rows 0..7, up rows 8..15 of the tile
            const float g = v, u = rowsum[tid + ROWS / 2];
            act[t * (ROWS / 2) + tid] = g / (1.f + __expf(-g)) * u;
          }
        }
        consumers_sync();
      }
#ifdef NO_GRID_SYNC  // timing ablation: phases not ordered across CTAs (wrong output)
      consumers_sync();
      ++barriers;
#else
      grid_sync(counter, ++barriers * (unsigned int)ctas);
#endif
      if (tid == 0) *phase_go = layer * PHASES + p + 1;
    }
  }
}
