"""EngineAssembly: how features change the engine before it is built.

A feature's ``install(builder, options)`` receives a :class:`FeatureInstaller` (this assembly,
seen through the feature's name) and may:

- ``wrap(component, fn)`` — ``fn(ctx, inner) -> component``: decorate what is there. Wrappers
  apply in composition order (features sorted by name; a feature's own wraps in call order), so
  the outermost wrapper is the last one installed.
- ``replace(component, factory)`` — ``factory(ctx) -> component``: provide the base component.
  Two features replacing one component is a :class:`CompositionError` naming both.
- ``observe(observer)`` — receive ``on_step(batch, result)`` after every step.
- add HTTP routers (``http_routers``) and startup notes (``notes``).

Components are built in the order of :data:`COMPONENTS`; each factory or wrapper sees the ones
built before it in ``ctx.parts``. Each built component is checked against its protocol, and the
executor's exit latency against what the scheduler policy supports. Nothing here patches
anything: what a feature cannot express through this interface it cannot do.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from rlt.platform.engine.batch import RowBatchBuilder
from rlt.platform.engine.boundary import BoundaryExecutor
from rlt.platform.engine.core import SyncStepLoop
from rlt.platform.engine.executor import EagerExecutor
from rlt.platform.engine.interfaces import (
    COMPONENTS,
    BatchBuilder,
    EngineContext,
    Executor,
    KVManager,
    Sampler,
    SchedulerPolicy,
    StepLoop,
    StepObserver,
    Uploader,
)
from rlt.platform.engine.sampler import TokenSampler
from rlt.platform.engine.scheduler import LoopScheduler
from rlt.platform.engine.slots import SlotTable
from rlt.platform.engine.staging import CopyUploader
from rlt.platform.errors import ConfigError
from rlt.platform.kv import PagedKVManager
from rlt.platform.platforms import Platform


class CompositionError(ConfigError):
    """Features that cannot be composed together; the message names them."""


Factory = Callable[[EngineContext], Any]
Wrapper = Callable[[EngineContext, Any], Any]

DEFAULT_FACTORIES: dict[str, Factory] = {
    "uploader": lambda ctx: CopyUploader(ctx.device),
    "kv_manager": PagedKVManager.from_context,
    "scheduler": LoopScheduler.from_context,
    "sampler": TokenSampler.from_context,
    "batch_builder": RowBatchBuilder.from_context,
    "executor": lambda ctx: (BoundaryExecutor if ctx.model.boundary_attention else EagerExecutor).from_context(ctx),
    "step_loop": lambda ctx: SyncStepLoop(),
}
PROTOCOLS = {"uploader": Uploader, "kv_manager": KVManager, "scheduler": SchedulerPolicy, "sampler": Sampler,
             "batch_builder": BatchBuilder, "executor": Executor, "step_loop": StepLoop}


def protocol_members(protocol: type) -> frozenset[str]:
    """The attributes and methods a component must have to implement ``protocol``."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items()
              if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return frozenset(names)


def missing_members(component: Any, protocol: type) -> list[str]:
    """What ``component`` lacks of ``protocol``, looked up with ``hasattr`` — so delegating
    wrappers (:class:`Wrapped`, whose members come from ``__getattr__``) count, on every Python
    (``isinstance`` on runtime protocols ignores ``__getattr__`` from Python 3.12 on)."""
    return sorted(n for n in protocol_members(protocol) if not hasattr(component, n))


def _check_component(name: str) -> None:
    if name not in COMPONENTS:
        raise CompositionError(f"unknown engine component {name!r}; components are {', '.join(COMPONENTS)}")


@attrs.define(eq=False)
class EngineAssembly:
    platform: Platform
    #: options of the enabled features by name (also handed to components as ctx.feature_options)
    feature_options: dict[str, Any] = attrs.field(factory=dict)
    http_routers: list[Any] = attrs.field(factory=list)
    notes: list[str] = attrs.field(factory=list)
    observers: list[StepObserver] = attrs.field(factory=list)
    #: features verified with models that run attention outside the loop (``Feature.boundary_attention``)
    boundary_attention_ok: set[str] = attrs.field(factory=set)
    _replaced: dict[str, tuple[str, Factory]] = attrs.field(factory=dict)
    _wrappers: dict[str, list[tuple[str, Wrapper]]] = attrs.field(factory=dict)

    def for_feature(self, name: str) -> "FeatureInstaller":
        return FeatureInstaller(self, name)

    def replace(self, component: str, factory: Factory, *, by: str) -> None:
        _check_component(component)
        if component in self._replaced:
            other = self._replaced[component][0]
            raise CompositionError(f"features {other!r} and {by!r} both replace the engine's {component}; "
                                   f"disable one of them (--no-{other.replace('_', '-')} or "
                                   f"--no-{by.replace('_', '-')})")
        self._replaced[component] = (by, factory)

    def wrap(self, component: str, fn: Wrapper, *, by: str) -> None:
        _check_component(component)
        self._wrappers.setdefault(component, []).append((by, fn))

    def describe(self) -> dict[str, list[str]]:
        """Per component: who provides it, then who wraps it (for logs and /v1/engine)."""
        return {c: [self._replaced.get(c, ("base", None))[0], *(by for by, _ in self._wrappers.get(c, ()))]
                for c in COMPONENTS}

    def _check_model(self, ctx: EngineContext) -> None:
        """Refuse features whose components were not verified with the model's kind of stages."""
        if not ctx.model.boundary_attention:
            return
        users = {by for by, _ in self._replaced.values()} | {by for ws in self._wrappers.values() for by, _ in ws}
        refused = sorted(users - self.boundary_attention_ok)
        if refused:
            raise CompositionError(
                f"{ctx.model_type} runs attention in its prelude and coda (boundary KV, per-row injection), which "
                f"feature(s) {', '.join(refused)} do not support; disable them ("
                + " ".join(f"--no-{n.replace('_', '-')}" for n in refused) + ")")

    def build_parts(self, ctx: EngineContext) -> None:
        self._check_model(ctx)
        parts = ctx.parts
        parts.slots = SlotTable(ctx.max_num_seqs)
        for name in COMPONENTS:
            by, factory = self._replaced.get(name, ("base", DEFAULT_FACTORIES[name]))
            component = factory(ctx)
            for wrapper_by, fn in self._wrappers.get(name, ()):
                component, by = fn(ctx, component), wrapper_by
                if component is None:
                    raise CompositionError(f"feature {wrapper_by!r}'s wrapper of the {name} returned None")
            missing = missing_members(component, PROTOCOLS[name])
            if missing:
                raise CompositionError(f"the {name} from {by!r} ({type(component).__name__}) does not implement "
                                       f"the {PROTOCOLS[name].__name__} protocol (rlt.platform.engine.interfaces): "
                                       f"it lacks {', '.join(missing)}")
            setattr(parts, name, component)
        if parts.executor.exit_latency > parts.scheduler.supported_exit_latency:
            raise CompositionError(
                f"the executor decides exits {parts.executor.exit_latency} step(s) late but the scheduler policy "
                f"supports at most {parts.scheduler.supported_exit_latency}")

    def build_engine(self, config, **engine_kwargs):
        from rlt.platform.engine.engine import LLMEngine

        return LLMEngine(config, platform=self.platform, assembly=self, **engine_kwargs)


@attrs.frozen(eq=False)
class FeatureInstaller:
    """The assembly as one feature sees it: everything it registers is recorded under its name."""

    assembly: EngineAssembly
    feature: str

    @property
    def platform(self) -> Platform:
        return self.assembly.platform

    @property
    def http_routers(self) -> list[Any]:
        return self.assembly.http_routers

    @property
    def notes(self) -> list[str]:
        return self.assembly.notes

    @property
    def feature_options(self) -> dict[str, Any]:
        return self.assembly.feature_options

    def replace(self, component: str, factory: Factory) -> None:
        self.assembly.replace(component, factory, by=self.feature)

    def wrap(self, component: str, fn: Wrapper) -> None:
        self.assembly.wrap(component, fn, by=self.feature)

    def observe(self, observer: StepObserver) -> None:
        self.assembly.observers.append(observer)
