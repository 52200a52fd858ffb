// One whole Ouro loop at one row in ONE persistent launch (issue 10's C=1 gap; docs/decode.md): the
// 24 sandwich-norm layers of a loop step — q/k/v, RoPE, the paged per-depth KV store and attention,
// o_proj, the residual adds and norms, gate/up + SiLU * up, down_proj — and the end-of-loop norm,
// with every bf16 rounding point of the kernel-per-op path (OuroModel.recurrent at one row: F.linear
// rounds once, rms_norm as layers.rms_norm, RoPE as fused_ops._rope_kernel, attention in fp32 with
// the exp2 online softmax of paged_decode). benchmarks/megakernel/gemv_chain.cu measured this design's weight
// stream; this kernel adds what that probe stood in for, so the probe's timing becomes a loop step's.
//
// Layout of the work (one CTA per SM, 1 producer lane + CONSUMER_WARPS consumer warps, persistent.cuh):
// - the producer streams the CTA's GEMV weight stages (q/k/v, o_proj, gate/up, down_proj of every layer,
//   packed as in gemv_chain) into the shared-memory ring, running ahead across the grid barriers; with
//   L2_AHEAD > 0 it first prefetches up to that many of the next phase's stages into L2 as it starts a phase, so
//   that a stall of the consumers (attention, a barrier) with the ring full still has the HBM stream busy;
// - the consumers run, per layer, five phases separated by grid barriers:
//     QKV   prologue: the layer input a = RMS_in(h) (layer 0: h = the loop input; else h += RMS_post2(down)
//           first); CTA 0 keeps h. GEMV tiles -> qkv (bf16 values)
//     ATTN  no weights: item = (q head, split of the cached context); RoPE of q and of its kv head's new k,
//           the split's keys read through the depth-resolved slots (the new token's from shared memory,
//           since its store by another CTA may not have landed), an online softmax per warp, the CTA's
//           (m, l, acc) written as one partial; the first split of a kv head's first q head stores the
//           rotated k and v at the token's slot
//           the last CTA to write a head's partial (a per-head count) merges the head -> o (bf16 values)
//     O     prologue: o; GEMV -> o_out
//     GU    prologue: h += RMS_in2(o_out), m = RMS_post(h) (CTA 0 keeps h); GEMV tiles of 8 gate + 8 up
//           rows -> act = SiLU(g) * u
//     DOWN  GEMV -> down
//   and after the last layer CTA 0 writes out = RMS_final(h + RMS_post2(down)).
// Every CTA computes a prologue's whole vector itself (one row: a few KB from L2; each thread's elements in
// registers, every load issued at once, the norm weights loaded before the barrier), so a phase needs no
// extra barrier; the residual h is kept in two global buffers used alternately (GU writes hres[1]
// from hres[0], QKV writes hres[0] from hres[1]) so no CTA overwrites what another still reads.
#include "persistent.cuh"

#define HEAD_DIM 128
#ifndef MAX_H                         // (cuda.CudaLoop passes plan.MAX_H, plan.STAMPS)
#define MAX_H 2048                    // the widest hidden size (Ouro-1.4B / 2.6B: 2048)
#endif
#define PER_H (MAX_H / CONSUMERS)     // a consumer thread's elements of a hidden-sized vector
#define PER_K (MAX_K / CONSUMERS)     // ... of the widest phase input
#ifndef STAMPS
#define STAMPS 16                     // phase-boundary stamps a layer (times)
#endif
#ifndef L2_AHEAD
#define L2_AHEAD 0                    // the producer's L2 prefetch of its next phase, in stages (module comment)
#endif

struct LoopArgs {
  const uint16_t* w;           // packed GEMV stages, all layers (phase_table() stages each)
  const uint16_t* norms;       // [layers][4][H]: input_layernorm, input_layernorm_2, post_attention_layernorm,
                               // post_attention_layernorm_2
  const uint16_t* final_norm;  // [H] the end-of-loop norm
  const uint16_t* hidden_in;   // [H] the loop input
  uint16_t* out;               // [H] the loop output (normalised by final_norm)
  const uint16_t* cos;         // [HEAD_DIM] the row's position (split-half layout)
  const uint16_t* sin;
  uint16_t* k_cache;           // [layers][slots][nkv][HEAD_DIM]
  uint16_t* v_cache;
  long long layer_stride;      // elements between two layers of k_cache / v_cache
  const int* slots;            // [>= seq_len] the row's depth-resolved key slots (flat)
  const long long* write_slot; // [1] the new token's slot (< 0: no store)
  const int* seq_len;          // [1] context length including the new token
  float* qkv;                  // [(nq + 2 nkv) HEAD_DIM]
  float* part;                 // [nq * splits][HEAD_DIM + 2]: acc, m, l
  float* o;                    // [nq * HEAD_DIM] the merged attention (bf16 values)
  float* o_out;                // [H]
  float* hres;                 // [2][H]
  float* act;                  // [I]
  float* down;                 // [H]
  unsigned int* counter;       // [1 + nq] zero at launch: the grid barrier's arrivals, then per q head its
                               // attention partials written (the last writer of a layer merges the head)
  long long* times;            // null, or [ctas][layers][STAMPS] clock64 stamps + [ctas][4]: start ns / clock,
                               // end ns / clock (benchmarks/megakernel/loop.py's phase breakdown)
  int hidden, inter, layers, nq, nkv, splits;
  float eps, scale_log2;       // RMS epsilon; softmax scale * log2(e)
};

enum { P_QKV = 0, P_O = 1, P_GU = 2, P_DOWN = 3, GEMV_PHASES = 4 };

// the GEMV phases of a layer (q/k/v, o_proj, gate/up, down_proj); returns the stages of a layer
__device__ __forceinline__ long long phase_table(const LoopArgs& a, Phase* ph) {
  const int H = a.hidden, I = a.inter;
  const int k[GEMV_PHASES] = {H, H, H, I};
  const int tiles[GEMV_PHASES] = {(a.nq + 2 * a.nkv) * HEAD_DIM / ROWS, H / ROWS, 2 * I / ROWS, H / ROWS};
  return fill_phases(k, tiles, GEMV_PHASES, ph);
}

// bf16 round to nearest even (the value kept as fp32), and loads / stores of bf16 bits
__device__ __forceinline__ float bf16r(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return f;  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return __uint_as_float(u & 0xffff0000u);
}
__device__ __forceinline__ float ldbf(const uint16_t* p) { return __uint_as_float((uint32_t)*p << 16); }
__device__ __forceinline__ uint16_t bf16_bits(float rounded) { return (uint16_t)(__float_as_uint(rounded) >> 16); }

// the sum of v over the consumer threads (every consumer gets it); red: CONSUMER_WARPS floats of shared memory
__device__ __forceinline__ float consumers_sum(float v, float* red, int warp, int lane) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) red[warp] = v;
  consumers_sync();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < CONSUMER_WARPS; ++i) s += red[i];
  consumers_sync();  // red is reused by the next call
  return s;
}

// A vector in registers: v[k] is element tid + k * CONSUMERS (0 beyond n); every load issued before any is used,
// so a prologue pays one memory latency, not one per element or per step.
template <int PER>
__device__ __forceinline__ void load_regs(const float* src, float (&v)[PER], int n, int tid) {
#pragma unroll
  for (int k = 0; k < PER; ++k) v[k] = tid + k * CONSUMERS < n ? __ldcg(src + tid + k * CONSUMERS) : 0.f;
}
template <int PER>
__device__ __forceinline__ void load_regs(const uint16_t* src, float (&v)[PER], int n, int tid) {
#pragma unroll
  for (int k = 0; k < PER; ++k) v[k] = tid + k * CONSUMERS < n ? ldbf(src + tid + k * CONSUMERS) : 0.f;
}
template <int PER>
__device__ __forceinline__ void store_regs(const float (&v)[PER], float* dst, int n, int tid) {
#pragma unroll
  for (int k = 0; k < PER; ++k)
    if (tid + k * CONSUMERS < n) dst[tid + k * CONSUMERS] = v[k];
}

// rms_norm(v, w) as layers.rms_norm in bf16: w * (v * rsqrt(mean(v^2) + eps)).to(bf16), one rounding each
// (v, w: bf16 values in registers, as load_regs holds them; the zeros beyond n add nothing to the sum).
__device__ __forceinline__ void rms_regs(float (&v)[PER_H], const float (&w)[PER_H], int n, float eps, float* red,
                                         int warp, int lane) {
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < PER_H; ++k) ss += v[k] * v[k];
  const float r = rsqrtf(consumers_sum(ss, red, warp, lane) / n + eps);
#pragma unroll
  for (int k = 0; k < PER_H; ++k) v[k] = bf16r(w[k] * bf16r(v[k] * r));
}

// fused_ops.add_norm_norm at one row: h_new = h + RMS_w1(x); xin = RMS_w2(h_new). x, h: global (written by
// other CTAs before the last barrier: read through L2); w1, w2: the norms' weights, loaded before that barrier;
// h_keep: where CTA 0 keeps h_new (keep false: nowhere).
__device__ void add_norm_norm(const float* x, const float* h, const float (&w1)[PER_H], const float (&w2)[PER_H],
                              float* h_keep, float* xin, int n, float eps, float* red, bool keep, int tid, int warp,
                              int lane) {
  float xv[PER_H], hv[PER_H];
  load_regs(x, xv, n, tid);
  load_regs(h, hv, n, tid);
  rms_regs(xv, w1, n, eps, red, warp, lane);
#pragma unroll
  for (int k = 0; k < PER_H; ++k) xv[k] = bf16r(hv[k] + xv[k]);
  if (keep) store_regs(xv, h_keep, n, tid);
  rms_regs(xv, w2, n, eps, red, warp, lane);
  store_regs(xv, xin, n, tid);
}

// fused_ops._rope_kernel's order for one head at ``src`` (bf16 values): x * cos + rotate_half(x) * sin,
// each product rounded, then the sum; into dst[HEAD_DIM] (shared memory), times ``mul`` (not rounded).
__device__ __forceinline__ void rope_head(const float* src, const uint16_t* cosp, const uint16_t* sinp, float* dst,
                                          float mul, int i) {
  const int half = HEAD_DIM / 2;
  if (i < half) {
    const float x1 = __ldcg(src + i), x2 = __ldcg(src + i + half);
    const float c1 = ldbf(cosp + i), c2 = ldbf(cosp + i + half), s1 = ldbf(sinp + i), s2 = ldbf(sinp + i + half);
    dst[i] = bf16r(bf16r(x1 * c1) + bf16r(-x2 * s1)) * mul;
    dst[i + half] = bf16r(bf16r(x2 * c2) + bf16r(x1 * s2)) * mul;
  }
}

// V rows of a key block loaded with its K rows (0..32; 0: all after the softmax, 16 at a time)
#ifndef V_EARLY
#define V_EARLY 0
#endif

// o[head] (bf16 values) from the head's split partials (acc, m, l), merged in split order
__device__ __forceinline__ void merge_head(const LoopArgs& a, int head, int tid) {
  const int S = a.splits, D = HEAD_DIM;
  const float* base = a.part + (long long)head * S * (D + 2);
  float m = -1.0e30f;
  for (int s = 0; s < S; ++s) m = fmaxf(m, __ldcg(base + s * (D + 2) + D));
  float accd = 0.f, l = 0.f;
  for (int s = 0; s < S; ++s) {
    const float sc = exp2f(__ldcg(base + s * (D + 2) + D) - m);
    accd += sc * __ldcg(base + s * (D + 2) + tid);
    l += sc * __ldcg(base + s * (D + 2) + D + 1);
  }
  a.o[head * D + tid] = bf16r(accd / (l > 0.f ? l : 1.f));
}

// The attention phase of one layer (module comment). sm: 3 * HEAD_DIM + CONSUMER_WARPS * (HEAD_DIM + 2) + 1 floats.
__device__ void attention(const LoopArgs& a, int layer, float* sm, int cta, int ctas, int tid, int warp, int lane) {
  float* q = sm;                    // rotated q * scale_log2
  float* knew = q + HEAD_DIM;       // the new token's rotated k (bf16 values)
  float* vnew = knew + HEAD_DIM;
  float* wpart = vnew + HEAD_DIM;   // per warp: acc[HEAD_DIM], m, l
  int* merges = reinterpret_cast<int*>(wpart + CONSUMER_WARPS * (HEAD_DIM + 2));  // this CTA merges the head
  const int S = a.splits, group = a.nq / a.nkv, D = HEAD_DIM, STEP = CONSUMER_WARPS * 32;
  const int seq = *a.seq_len, ctx = seq - 1;  // cached positions 0..ctx-1; the new token is position ctx
  const long long slot_new = *a.write_slot;
  const long long row_stride = (long long)a.nkv * D;
  for (int item = cta; item < a.nq * S; item += ctas) {
    const int head = item / S, split = item % S, kvh = head / group;
    // this split's positions: [p0, p1) of the cache, and the new token in the last split
    const int per = (ctx + S - 1) / S;
    const int p0 = min(ctx, split * per), p1 = min(ctx, p0 + per) + (split == S - 1 ? 1 : 0);
    // a lane's key at pos: its cache row's offset (0: none, or the new token's, which is read from shared memory)
    auto key_offset = [&](int pos) -> long long {
      return pos < p1 && pos != ctx ? (long long)__ldg(a.slots + pos) * row_stride : 0;
    };
    long long off = key_offset(p0 + warp * 32 + lane);  // the first block's, in flight under RoPE's loads
    rope_head(a.qkv + head * D, a.cos, a.sin, q, a.scale_log2, tid);
    rope_head(a.qkv + (a.nq + kvh) * D, a.cos, a.sin, knew, 1.f, tid);
    if (tid < D) vnew[tid] = __ldcg(a.qkv + (a.nq + a.nkv + kvh) * D + tid);
    consumers_sync();
    if (split == 0 && head % group == 0 && slot_new >= 0 && tid < D) {
      const long long st = layer * a.layer_stride + slot_new * row_stride + (long long)kvh * D + tid;
      a.k_cache[st] = bf16_bits(knew[tid]);
      a.v_cache[st] = bf16_bits(vnew[tid]);
    }
    const uint16_t* kbase = a.k_cache + layer * a.layer_stride + (long long)kvh * D;
    const uint16_t* vbase = a.v_cache + layer * a.layer_stride + (long long)kvh * D;
    float m_i = -1.0e30f, l_i = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};  // acc: dims 4 * lane .. 4 * lane + 3
    for (int b = p0 + warp * 32; b < p1; b += STEP) {
      const int pos = b + lane;
      const bool valid = pos < p1;
      const bool fresh = pos == ctx;
      // the block's cached keys (the new token, always the row's last position, is the last of its block)
      const int n = min(32, p1 - b);
      const int cached = (ctx >= b && ctx < b + n) ? ctx - b : n;
#if V_EARLY
      uint2 vearly[V_EARLY];  // the first V_EARLY keys' V rows, issued with the K loads (not after the softmax)
#pragma unroll
      for (int j = 0; j < V_EARLY; ++j) {
        const long long oj = __shfl_sync(0xffffffffu, off, j);
        const uint2 zero = {0u, 0u};
        vearly[j] = j < cached ? __ldg(reinterpret_cast<const uint2*>(vbase + oj) + lane) : zero;
      }
#endif
      float s = -1.0e30f;
      if (valid) {  // lane-per-key: q . k over HEAD_DIM
        float d = 0.f;
        if (fresh) {
          for (int i = 0; i < D; ++i) d += q[i] * knew[i];
        } else {
          const uint4* kp = reinterpret_cast<const uint4*>(kbase + off);
#pragma unroll  // all 16 loads of the key in flight
          for (int c = 0; c < D / 8; ++c) {
            const uint4 kv = __ldg(kp + c);
            const float* qq = q + c * 8;
            d += bf16_lo(kv.x) * qq[0] + bf16_hi(kv.x) * qq[1] + bf16_lo(kv.y) * qq[2] + bf16_hi(kv.y) * qq[3] +
                 bf16_lo(kv.z) * qq[4] + bf16_hi(kv.z) * qq[5] + bf16_lo(kv.w) * qq[6] + bf16_hi(kv.w) * qq[7];
          }
        }
        s = d;
      }
      const long long next_off = key_offset(b + STEP + lane);  // the next block's, in flight under this one
      float mb = s;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, o));
      const float m_new = fmaxf(m_i, mb);
      const float alpha = exp2f(m_i - m_new);
      const float p = valid ? exp2f(s - m_new) : 0.f;
      float ps = p;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
      l_i = l_i * alpha + ps;
      m_i = m_new;
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[r] *= alpha;
      // acc += p_j * v_j, each lane its 4 dims: the block's cached keys, then the new token
#if V_EARLY
#pragma unroll
      for (int j = 0; j < V_EARLY; ++j) {
        if (j < cached) {  // (cached: the same in every lane)
          const float pj = __shfl_sync(0xffffffffu, p, j);
          acc[0] += pj * bf16_lo(vearly[j].x);
          acc[1] += pj * bf16_hi(vearly[j].x);
          acc[2] += pj * bf16_lo(vearly[j].y);
          acc[3] += pj * bf16_hi(vearly[j].y);
        }
      }
#endif
#pragma unroll 16
      for (int j = V_EARLY; j < cached; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
        const long long oj = __shfl_sync(0xffffffffu, off, j);
        const uint2 vv = __ldg(reinterpret_cast<const uint2*>(vbase + oj) + lane);
        acc[0] += pj * bf16_lo(vv.x);
        acc[1] += pj * bf16_hi(vv.x);
        acc[2] += pj * bf16_lo(vv.y);
        acc[3] += pj * bf16_hi(vv.y);
      }
      if (cached < n) {
        const float pj = __shfl_sync(0xffffffffu, p, cached);
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[r] += pj * vnew[lane * 4 + r];
      }
      off = next_off;
    }
    // the CTA's warps into one partial
    float* mine = wpart + warp * (D + 2);
#pragma unroll
    for (int r = 0; r < 4; ++r) mine[lane * 4 + r] = acc[r];
    if (lane == 0) {
      mine[D] = m_i;
      mine[D + 1] = l_i;
    }
    consumers_sync();
    if (tid < D) {
      float m = -1.0e30f;
      for (int w = 0; w < CONSUMER_WARPS; ++w) m = fmaxf(m, wpart[w * (D + 2) + D]);
      float accd = 0.f, l = 0.f;
      for (int w = 0; w < CONSUMER_WARPS; ++w) {
        const float sc = exp2f(wpart[w * (D + 2) + D] - m);
        accd += sc * wpart[w * (D + 2) + tid];
        l += sc * wpart[w * (D + 2) + D + 1];
      }
      float* out = a.part + (long long)item * (D + 2);
      out[tid] = accd;
      if (tid == 0) {
        out[D] = m;
        out[D + 1] = l;
      }
      __threadfence();  // the partial visible before its count (the threadFenceReduction pattern)
    }
    consumers_sync();
    // the head's last partial of this layer merges the head, so o_proj's prologue reads o as one vector
    if (tid == 0) *merges = atomicAdd(a.counter + 1 + head, 1u) == (unsigned int)((layer + 1) * S - 1);
    consumers_sync();
    if (*merges) {
      __threadfence();
      if (tid < D) merge_head(a, head, tid);
    }
    consumers_sync();  // (q, knew, vnew, wpart and merges are the next item's)
  }
}

#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
extern "C" __global__ void __launch_bounds__(32 + CONSUMERS, MIN_BLOCKS) ouro_loop(const LoopArgs a) {
  DYNAMIC_SHARED(smem);
  uint16_t* ring = reinterpret_cast<uint16_t*>(smem);
  float* xin = reinterpret_cast<float*>(smem + NSTAGES * STAGE_BYTES);  // MAX_K: a phase's input (attention: scratch)
  float* rowsum = xin + MAX_K;
  float* red = rowsum + ROWS;
  uint64_t* full = reinterpret_cast<uint64_t*>(red + CONSUMER_WARPS);
  uint64_t* empty = full + NSTAGES;

  Phase phase[GEMV_PHASES];
  const long long per_layer = phase_table(a, phase);
  const int cta = blockIdx.x, ctas = gridDim.x;
  if (threadIdx.x == 0) ring_init(full, empty);
  __syncthreads();

  if (threadIdx.x < 32) {  // the producer: every stage this CTA will consume, in order (and L2_AHEAD: module comment)
    if (threadIdx.x != 0) return;
    unsigned int n = 0;
    for (int layer = 0; layer < a.layers; ++layer) {
      const uint16_t* lw = a.w + (long long)layer * per_layer * STAGE_ELEMS;
      for (int p = 0; p < GEMV_PHASES; ++p) {
        if (L2_AHEAD && (p + 1 < GEMV_PHASES || layer + 1 < a.layers))  // the next phase's first stages into L2
          prefetch_phase(p + 1 < GEMV_PHASES ? lw : lw + per_layer * STAGE_ELEMS, phase[(p + 1) % GEMV_PHASES], cta,
                         ctas, L2_AHEAD);
        produce_phase(lw, phase[p], cta, ctas, n, ring, full, empty);
      }
    }
    return;
  }

  const int tid = threadIdx.x - 32, warp = tid / 32, lane = tid % 32;
  const int H = a.hidden;
  const bool keeper = cta == 0;
  // phase-boundary stamps (a.times; benchmarks/megakernel/loop.py): layer start, then after each prologue, each
  // phase's GEMV tiles, the attention and each grid barrier
  long long* stamps = a.times ? a.times + (long long)cta * a.layers * STAMPS : nullptr;
  int stamp_k = 0;
  auto stamp = [&](int layer) {
    if (stamps && tid == 0) stamps[layer * STAMPS + stamp_k] = clock64();
    ++stamp_k;
  };
  long long* ends = a.times ? a.times + (long long)ctas * a.layers * STAMPS + cta * 4 : nullptr;
  if (ends && tid == 0) {
    ends[0] = (long long)globaltimer_ns();
    ends[1] = clock64();
  }
  // the norm weights of the next prologue, loaded before the grid barrier that precedes it (w1: the norm of the
  // branch output, w2: the one of the new residual; layer 0's QKV: w2 alone)
  float w1[PER_H], w2[PER_H];
  load_regs(a.norms, w2, H, tid);
  unsigned int n = 0, barriers = 0;
  for (int layer = 0; layer < a.layers; ++layer) {
    const uint16_t* nw = a.norms + (long long)layer * 4 * H;  // in, in2, post, post2
    stamp_k = 0;
    stamp(layer);
    for (int p = 0; p < GEMV_PHASES; ++p) {
      const Phase ph = phase[p];
      // the phase's input vector, every CTA its own copy
      if (p == P_QKV) {
        if (layer == 0) {
          float xv[PER_H];
          load_regs(a.hidden_in, xv, H, tid);
          if (keeper) store_regs(xv, a.hres, H, tid);
          rms_regs(xv, w2, H, a.eps, red, warp, lane);
          store_regs(xv, xin, H, tid);
        } else {
          add_norm_norm(a.down, a.hres + H, w1, w2, a.hres, xin, H, a.eps, red, keeper, tid, warp, lane);
        }
      } else if (p == P_O) {
        float ov[PER_H];
        load_regs(a.o, ov, H, tid);
        store_regs(ov, xin, H, tid);
      } else if (p == P_GU) {
        add_norm_norm(a.o_out, a.hres, w1, w2, a.hres + H, xin, H, a.eps, red, keeper, tid, warp, lane);
      } else {
        float av[PER_K];
        load_regs(a.act, av, ph.k, tid);
        store_regs(av, xin, ph.k, tid);
      }
      consumers_sync();
      stamp(layer);
      for (int t = first_tile(ph, cta, ctas); t < ph.tiles; t += ctas) {
        consume_tile(ph.chunks, xin, n, ring, full, empty, rowsum, warp, lane);
        consumers_sync();
        if (tid < ROWS) {  // the epilogue: F.linear's one rounding, then the phase's elementwise op
          const int row = t * ROWS + tid;
          const float v = bf16r(rowsum[tid]);
          if (p == P_QKV) a.qkv[row] = v;
          else if (p == P_O) a.o_out[row] = v;
          else if (p == P_DOWN) a.down[row] = v;
          else if (tid < ROWS / 2) {  // gate rows 0..7, up rows 8..15 of the tile
            const float g = v, u = bf16r(rowsum[tid + ROWS / 2]);
            const float act = bf16r(g / (1.f + expf(-g)));
            a.act[t * (ROWS / 2) + tid] = bf16r(act * u);
          }
        }
        consumers_sync();
      }
      stamp(layer);
      if (p == P_O) {  // GU's prologue: h += RMS_in2(o_out), m = RMS_post(h)
        load_regs(nw + H, w1, H, tid);
        load_regs(nw + 2 * H, w2, H, tid);
      } else if (p == P_DOWN) {  // the next QKV prologue (or the end): h += RMS_post2(down), then RMS_in / final
        load_regs(nw + 3 * H, w1, H, tid);
        load_regs(layer + 1 < a.layers ? nw + 4 * H : a.final_norm, w2, H, tid);
      }
      grid_sync(a.counter, ++barriers * (unsigned int)ctas);
      stamp(layer);
      if (p == P_QKV) {
        attention(a, layer, xin, cta, ctas, tid, warp, lane);
        stamp(layer);
        grid_sync(a.counter, ++barriers * (unsigned int)ctas);
        stamp(layer);
      }
    }
  }
  if (keeper) {  // out = RMS_final(h + RMS_post2(down))
    add_norm_norm(a.down, a.hres + H, w1, w2, nullptr, xin, H, a.eps, red, false, tid, warp, lane);
    for (int i = tid; i < H; i += CONSUMERS) a.out[i] = bf16_bits(xin[i]);
  }
  if (ends && tid == 0) {
    ends[2] = (long long)globaltimer_ns();
    ends[3] = clock64();
  }
}
