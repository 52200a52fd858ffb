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
#include "persistent.cuh"

// The phases of a layer, in order: q/k/v (3H x H), the attention stand-in (KV_TILES stages of CK
// columns: the bytes a layer's attention reads, streamed and multiplied like weights; 0: no phase),
// o_proj (H x H), gate/up (2I x H), down_proj (H x I).
#define PHASES 5
enum { QKV = 0, KV = 1, O_PROJ = 2, GATE_UP = 3, DOWN = 4 };

__device__ __forceinline__ long long phase_table(const Shape& s, Phase* ph) {
  const int H = s.hidden, I = s.inter;
  const int k[PHASES] = {H, CK, H, H, I};
  const int tiles[PHASES] = {3 * H / ROWS, s.kv_tiles, H / ROWS, 2 * I / ROWS, H / ROWS};
  return fill_phases(k, tiles, PHASES, ph);
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
  DYNAMIC_SHARED(smem);
  uint16_t* ring = reinterpret_cast<uint16_t*>(smem);
  float* xin = reinterpret_cast<float*>(smem + NSTAGES * STAGE_BYTES);
  float* rowsum = xin + MAX_K;
  uint64_t* full = reinterpret_cast<uint64_t*>(rowsum + ROWS);
  uint64_t* empty = full + NSTAGES;
  volatile int* phase_go = reinterpret_cast<volatile int*>(empty + NSTAGES);  // NO_RUNAHEAD only

  const Shape s{hidden, inter, kv_tiles};
  Phase phase[PHASES];
  const long long per_layer = phase_table(s, phase);
  const int cta = blockIdx.x, ctas = gridDim.x;
  if (threadIdx.x == 0) {
    ring_init(full, empty);
    *phase_go = 0;
  }
  __syncthreads();

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
        produce_phase(lw, ph, cta, ctas, n, ring, full, empty);
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
#ifdef NO_COMPUTE  // timing ablation: stages are waited for and released, not multiplied (wrong output)
        consume_tile<false>(ph.chunks, xin, n, ring, full, empty, rowsum, warp, lane);
#else
        consume_tile(ph.chunks, xin, n, ring, full, empty, rowsum, warp, lane);
#endif
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
