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
// - each CTA takes one balanced range of a phase's stages (``segment``; DEAL_TILES: whole tiles dealt
//   round-robin, lease 15's first design), adds its rows' partial sums into fp32 accumulators, and
//   each phase's epilogue (residual, SiLU*mul) is folded into the next phase's input load (``Work``).
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

// This CTA's k-th segment of phase ph: positions [lo, hi) in the phase's (tile, chunk) order, i.e. its
// stages stage0 + lo .. stage0 + hi - 1, contiguous in memory. DEAL_TILES: whole tiles dealt round-robin
// (tiles numbered across the layer: the CTAs with a phase's leftover tiles differ from phase to phase);
// default: one balanced range of positions per CTA (tiles may be split between two CTAs, whose partial
// sums meet in the accumulator), so no CTA streams more than one stage above the phase's average.
__device__ __forceinline__ bool segment(const Phase& ph, int cta, int ctas, int k, int* lo, int* hi) {
#ifdef DEAL_TILES
  int t = (cta - ph.tile0) % ctas;
  t = (t < 0 ? t + ctas : t) + k * ctas;
  *lo = t * ph.chunks;
  *hi = *lo + ph.chunks;
  return t < ph.tiles;
#else
  const long long total = (long long)ph.tiles * ph.chunks;
  *lo = (int)(total * cta / ctas);
  *hi = (int)(total * (cta + 1) / ctas);
  return k == 0;
#endif
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

// The fp32 workspace (zeroed by the host before a launch, except acc_down = the chain's input):
// every phase ADDS its rows' (partial) sums into its accumulator, and each epilogue is folded into the
// next phase's input load — x = acc_down + x1 (q/k/v's input), x1 = acc_o + x (gate/up's), act =
// SiLU(gate) * up (down_proj's); the chain's output is acc_down + x1 after the last layer. CTA 0 keeps
// the vectors two phases need (x, x1) and zeroes each accumulator between its last read and its next
// write (both a barrier away).
struct Work {
  float *x, *x1, *acc_qkv, *acc_o, *acc_gu, *acc_down, *att;
};

__device__ __forceinline__ Work workspace(float* ws, int H, int I) {
  Work w;
  w.x = ws;
  w.x1 = w.x + H;
  w.acc_qkv = w.x1 + H;
  w.acc_o = w.acc_qkv + 3 * H;
  w.acc_gu = w.acc_o + H;        // gate rows [0, I), up rows [I, 2I)
  w.acc_down = w.acc_gu + 2 * I;
  w.att = w.acc_down + H;        // the attention stand-in's sums (never read)
  return w;
}

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + __expf(-g)) * u; }

// the phase's input vector into shared memory (the previous phase's epilogue folded in), after its barrier.
// The loads come first and alone: a global store in the same loop (CTA 0's copies) would keep the compiler
// from overlapping one iteration's L2 loads with the next's (lease 15, call 3: that made every phase start
// ~10 us late); CTA 0 then copies from shared memory and zeroes.
__device__ __forceinline__ void load_input(int p, const Work& w, float* xin, int H, int I, int cta, int tid) {
  if (p == QKV) {
    for (int i = tid; i < H; i += CONSUMERS) xin[i] = __ldcg(w.acc_down + i) + __ldcg(w.x1 + i);
  } else if (p == KV || p == O_PROJ) {
    for (int i = tid; i < (p == KV ? CK : H); i += CONSUMERS) xin[i] = __ldcg(w.acc_qkv + i);
  } else if (p == GATE_UP) {
    for (int i = tid; i < H; i += CONSUMERS) xin[i] = __ldcg(w.acc_o + i) + __ldcg(w.x + i);
  } else {
    for (int i = tid; i < I; i += CONSUMERS) xin[i] = silu_mul(__ldcg(w.acc_gu + i), __ldcg(w.acc_gu + I + i));
  }
  if (cta != 0 || p == KV) return;
  // CTA 0: keep x (q/k/v's input) and x1 (gate/up's) for later phases; zero the accumulator whose last
  // read was the previous phase's load
  float* keep = p == QKV ? w.x : p == GATE_UP ? w.x1 : nullptr;
  if (keep)
    for (int i = tid; i < H; i += CONSUMERS) keep[i] = xin[i];
  float* zero = p == QKV ? w.acc_gu : p == O_PROJ ? w.acc_down : p == GATE_UP ? w.acc_qkv : w.acc_o;
  const int n = p == QKV ? 2 * I : p == GATE_UP ? 3 * H : H;
  for (int i = tid; i < n; i += CONSUMERS) zero[i] = 0.f;
}

// where row r of tile t of phase p adds its sum
__device__ __forceinline__ float* out_row(int p, const Work& w, int I, int t, int r) {
  if (p == QKV) return w.acc_qkv + t * ROWS + r;
  if (p == KV) return w.att + t * ROWS + r;
  if (p == O_PROJ) return w.acc_o + t * ROWS + r;
  if (p == GATE_UP) return r < ROWS / 2 ? w.acc_gu + t * (ROWS / 2) + r : w.acc_gu + I + t * (ROWS / 2) + r - ROWS / 2;
  return w.acc_down + t * ROWS + r;
}

#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1  // CTAs per SM (2: NSTAGES <= 5, so that two CTAs' shared memory fit one SM)
#endif
extern "C" __global__ void __launch_bounds__(32 + CONSUMERS, MIN_BLOCKS)
gemv_chain(const uint16_t* __restrict__ w,  // packed weights, all layers
           float* ws,                        // the fp32 workspace (struct Work)
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
        int lo, hi;
        for (int k = 0; segment(ph, cta, ctas, k, &lo, &hi); ++k) {
          for (int pos = lo; pos < hi; ++pos, ++n) {
            const int st = n % NSTAGES;
            mbar_wait(&empty[st], ((n / NSTAGES) & 1) ^ 1);
            mbar_expect_tx(&full[st], STAGE_BYTES);
            bulk_load(ring + st * STAGE_ELEMS, lw + (ph.stage0 + pos) * STAGE_ELEMS, STAGE_BYTES, &full[st]);
          }
        }
      }
    }
    return;
  }

  // the consumers
  const int tid = threadIdx.x - 32, warp = tid / 32, lane = tid % 32;
  const Work wk = workspace(ws, hidden, inter);
  unsigned int n = 0, barriers = 0;
  for (int layer = 0; layer < layers; ++layer) {
    for (int p = 0; p < PHASES; ++p) {
      const Phase ph = phase[p];
      if (ph.tiles == 0) {  // no phase, no barrier
        if (tid == 0) *phase_go = layer * PHASES + p + 1;
        continue;
      }
      load_input(p, wk, xin, hidden, inter, cta, tid);
      consumers_sync();
      int lo, hi;
      for (int k = 0; segment(ph, cta, ctas, k, &lo, &hi); ++k) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int pos = lo; pos < hi; ++pos, ++n) {
          const int t = pos / ph.chunks, c = pos - t * ph.chunks;
          const int st = n % NSTAGES;
          mbar_wait(&full[st], (n / NSTAGES) & 1);
#ifndef NO_COMPUTE  // (the ablation: stages waited for and released, not multiplied: wrong output)
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
#endif
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[st]);
          if (c == ph.chunks - 1 || pos == hi - 1) {  // the tile's (part of the) sums: add them
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
            if (tid < ROWS) atomicAdd(out_row(p, wk, inter, t, tid), rowsum[tid]);
            consumers_sync();
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[r] = 0.f;
          }
        }
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
