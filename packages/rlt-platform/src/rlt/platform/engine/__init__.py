"""The loop-level engine: requests, scheduler, executor, sampler, exit policy, LLMEngine, LLM."""
