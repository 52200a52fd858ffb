"""rlt.platform — what every rlt deployment has.

Hardware platforms and their declared capabilities, engine configuration, requests and sampling
parameters, model definitions and the checkpoint loader, the depth-aware paged KV pool, the
loop-level scheduler, the base executor, the sampler, the engine, the offline ``LLM`` API and the
feature contract. Features (rlt-prefill, rlt-decode, ...) are found through entry points only.
"""

from rlt.platform.config import EngineConfig
from rlt.platform.engine.engine import LLMEngine
from rlt.platform.engine.llm import LLM
from rlt.platform.errors import CheckpointError, ConfigError, InvalidRequestError, RltError
from rlt.platform.outputs import RequestOutput
from rlt.platform.platforms import Capability, Platform, detect_platform
from rlt.platform.sampling_params import SamplingParams

__all__ = [
    "Capability", "CheckpointError", "ConfigError", "EngineConfig", "InvalidRequestError", "LLM", "LLMEngine",
    "Platform", "RequestOutput", "RltError", "SamplingParams", "detect_platform",
]
