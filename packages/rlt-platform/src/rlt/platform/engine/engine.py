"""LLMEngine: the public engine API over an assembled :class:`EngineCore`.

``add_request`` validates and queues (input processing; a rejected request raises
:class:`InvalidRequestError` and changes nothing); ``step`` runs the step loop once and returns
the outputs of requests that produced tokens or finished; ``abort_request`` ends a request and
frees its KV. An exception inside a step aborts the requests of that step with the error
recorded, and the engine stays usable. ``add_observer`` registers a step observer; ``stats`` and
``running_request_ids`` are what front ends read — nothing outside the engine reaches into its
components.

``LLMEngine(config)`` builds the base engine (no features). To get the installed features,
composed for the platform, use :func:`rlt.platform.composition.build_engine` (the ``LLM`` API,
``rlt-server generate`` and ``rlt-server serve`` do).
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from rlt.attention.fold import fold_status
from rlt.attention.pdl import pdl_status, weight_prefetch_status
from rlt.platform.config import EngineConfig
from rlt.platform.engine.assembly import EngineAssembly
from rlt.platform.engine.context import build_context
from rlt.platform.engine.core import EngineCore
from rlt.platform.engine.input_processor import InputProcessor
from rlt.platform.engine.interfaces import COMPONENTS
from rlt.platform.engine.output_processor import OutputProcessor
from rlt.platform.engine.warmup import warm_up
from rlt.platform.errors import InvalidRequestError
from rlt.platform.outputs import RequestOutput
from rlt.platform.platforms import Platform, detect_platform
from rlt.platform.sampling_params import SamplingParams


@attrs.frozen
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    #: the blocks requests can hold (the pool less what a feature reserved: KVManager.reserve)
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_steps: int
    num_faults: int
    #: why the head of the waiting queue waits (None when nothing waits for a resource)
    blocked_reason: str | None = None
    #: what components report through ``feature_metrics()`` (see interfaces.FeatureMetric)
    feature_metrics: tuple = ()


class LLMEngine:
    def __init__(self, config: EngineConfig, *, platform: Platform | None = None,
                 assembly: EngineAssembly | None = None, load_checkpoint=None) -> None:
        """``load_checkpoint``: the checkpoint loader to use (default
        :func:`rlt.platform.checkpoint.loader.load_checkpoint`; benchmarks pass a caching one)."""
        platform = platform or detect_platform(config.device)
        assembly = assembly or EngineAssembly(platform)
        self.config = config
        self.platform = platform
        self.assembly = assembly
        self.ctx = build_context(config, platform, assembly.feature_options, load_checkpoint=load_checkpoint)
        assembly.build_parts(self.ctx)
        parts = self.ctx.parts
        self.core = EngineCore(self.ctx, OutputProcessor(self.ctx.eos_token_ids))
        self.core.observers.extend(assembly.observers)
        self.inputs = InputProcessor(self.ctx, kv_manager=parts.kv_manager, scheduler=parts.scheduler)
        self._loop = parts.step_loop
        #: the feature table this engine was composed with (set by the composition)
        self.features: tuple = ()

    # -- what front ends read ------------------------------------------------------------------------
    @property
    def device(self):
        return self.ctx.device

    @property
    def dtype(self):
        return self.ctx.dtype

    @property
    def model(self):
        return self.ctx.model

    @property
    def model_dir(self) -> str:
        return self.ctx.model_dir

    @property
    def tokenizer(self):
        return self.ctx.tokenizer

    @property
    def selection(self):
        return self.ctx.selection

    @property
    def num_loops(self) -> int:
        return self.ctx.num_loops

    @property
    def max_model_len(self) -> int:
        return self.ctx.max_model_len

    @property
    def max_num_batched_tokens(self) -> int:
        return self.ctx.max_num_batched_tokens

    @property
    def default_threshold(self) -> float:
        return self.ctx.default_threshold

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation unless a request sets ``ignore_eos`` (default: the model family's)."""
        return self.inputs.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.inputs.eos_token_ids = self.core.out.eos_token_ids = frozenset(ids)

    def describe(self) -> dict[str, Any]:
        """Components and who provides them, the KV pool, UVA, programmatic dependent launch of the
        decode kernels (``rlt.attention.pdl``) and their last-arriver folds (``rlt.attention.fold``), the
        memory of the penalties' token history: for logs and ``/v1/engine``."""
        kv = self.ctx.kv
        executor = self.ctx.parts.executor
        describe_executor = getattr(executor, "describe", None)
        penalties = getattr(self.ctx.parts.sampler, "penalties", None)  # the token history (engine/penalties.py)
        return {
            "components": self.assembly.describe(),
            "executor": describe_executor() if callable(describe_executor) else {"type": type(executor).__name__},
            "kv": {"layout": kv.layout.value, "block_size": kv.block_size, "num_blocks": kv.num_blocks,
                   "num_planes": kv.num_planes},
            "uva": {"enabled": self.ctx.uva.enabled, "reason": self.ctx.uva.reason},
            "pdl": dict(zip(("enabled", "reason"), pdl_status(self.ctx.device))),
            "weight_prefetch": dict(zip(("enabled", "reason"), weight_prefetch_status(self.ctx.device))),
            "fold": dict(zip(("enabled", "reason"), fold_status(self.ctx.device))),
            "sampler": {"penalty_history_mib": None if penalties is None else round(penalties.nbytes / 2**20, 2)},
        }

    # -- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.inputs.tokenize(prompt)

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", "request_id")
        if request_id in self.core.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", "request_id")
        self.core.add(self.inputs.process(request_id, prompt, params))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        s = self.ctx.parts.scheduler
        return bool(s.num_running or s.num_waiting)

    def running_request_ids(self) -> list[str]:
        return [r.request_id for r in self.ctx.parts.scheduler.running_requests()]

    def add_observer(self, observer) -> None:
        self.core.observers.append(observer)

    def remove_observer(self, observer) -> None:
        self.core.observers.remove(observer)

    def stats(self) -> EngineStats:
        s, kv = self.ctx.parts.scheduler, self.ctx.parts.kv_manager
        total = getattr(kv, "usable_blocks", kv.num_blocks)  # blocks a feature reserved are not requests' pool
        return EngineStats(s.num_running, s.num_waiting, 0.0 if total == 0 else 1.0 - kv.num_free / total,
                           total, kv.num_free, self.core.num_steps, self.core.num_faults, s.blocked_reason,
                           self._feature_metrics())

    def _feature_metrics(self) -> tuple:
        seen: dict[str, Any] = {}
        for name in COMPONENTS:
            report = getattr(getattr(self.ctx.parts, name), "feature_metrics", None)
            for m in (report() if callable(report) else ()):
                seen.setdefault(m.name, m)
        return tuple(seen.values())

    # -- stepping --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        return self._loop.step(self.core)

    def warm_up(self, **kwargs):
        """Run a short synthetic workload so kernels compile before real traffic
        (:func:`rlt.platform.engine.warmup.warm_up`; returns its report)."""
        return warm_up(self, **kwargs)
