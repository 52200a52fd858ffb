// Runs loop_kernel.cu's ouro_loop on the CPU (cuda_cpu_sim.h): one OS thread per CUDA thread, ``ctas`` CTAs of
// 32 + CONSUMERS threads. Built by tests/rlt-decode/test_persistent_loop.py with -DRLT_CPU_SIM.
#include "loop_kernel.cu"

// Returns 0; 1 when a CTA's L2 prefetches (L2_AHEAD > 0) named a stage its copies did not load, or none at all
// where a later phase had stages for it.
extern "C" int sim_ouro_loop(const LoopArgs* args, int ctas, unsigned long smem_bytes) {
  const int threads = 32 + CONSUMERS;
  Phase ph[GEMV_PHASES];
  const long long per_layer = phase_table(*args, ph);
  sim::src_lo = reinterpret_cast<const unsigned char*>(args->w);
  sim::src_hi = sim::src_lo + per_layer * args->layers * STAGE_BYTES;
  sim::grid_dim = {(unsigned int)ctas, 1, 1};
  std::vector<std::unique_ptr<sim::Cta>> blocks;
  for (int c = 0; c < ctas; ++c) blocks.emplace_back(std::make_unique<sim::Cta>(smem_bytes, threads, CONSUMERS));
  std::vector<std::thread> pool;
  pool.reserve((size_t)ctas * threads);
  for (int c = 0; c < ctas; ++c) {
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&blocks, args, c, t] {
        sim::block_idx = {(unsigned int)c, 0, 0};
        sim::thread_idx = {(unsigned int)t, 0, 0};
        sim::cta = blocks[c].get();
        ouro_loop(*args);
      });
    }
  }
  for (auto& th : pool) th.join();
  for (auto& b : blocks) {
    if (!L2_AHEAD) continue;
    std::sort(b->loads.begin(), b->loads.end());
    for (const void* p : b->prefetches)
      if (!std::binary_search(b->loads.begin(), b->loads.end(), p)) return 1;
    if (b->prefetches.empty() && b->loads.size() > 0 && args->layers > 1) return 1;
  }
  return 0;
}
