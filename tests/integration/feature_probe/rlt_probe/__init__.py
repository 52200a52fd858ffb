"""rlt-probe: a minimal feature package, written only against rlt's public extension interfaces.

It is the example of ``docs/features.md`` and the subject of ``test_feature_package.py``, which
builds and installs it as a real distribution. Installed, it

- wraps the **scheduler policy**: forces prompt chunks of at most ``chunk`` tokens and vetoes
  requests whose ``top_k`` equals ``veto_top_k`` (a 400 in serve, an error in generate / LLM);
- wraps the **KV manager**, the **executor** and the **sampler**: counts allocations, steps and
  sampled rows;
- observes every step, appending ``<steps> <rows> <allocations> <sampled>`` to the file named by
  ``log`` (when given).
"""

from __future__ import annotations

import attrs

from rlt.platform.engine.interfaces import Wrapped
from rlt.platform.errors import InvalidRequestError
from rlt.platform.features import Feature


@attrs.frozen
class ProbeOptions:
    chunk: int = attrs.field(default=0, metadata={"help": "cap prompt chunks at this many tokens (0: off)"})
    veto_top_k: int = attrs.field(default=-2, metadata={"help": "reject requests with this top_k"})
    log: str = attrs.field(default="", metadata={"help": "append per-step counters to this file"})


@attrs.define
class Counters:
    steps: int = 0
    allocations: int = 0
    sampled: int = 0


class VetoingScheduler(Wrapped):
    def __init__(self, inner, options: ProbeOptions) -> None:
        super().__init__(inner)
        self.veto = options.veto_top_k
        if options.chunk > 0:
            inner.chunk_limit = options.chunk  # a documented attribute of the base policy

    def add(self, request) -> None:
        if request.params.top_k == self.veto:
            raise InvalidRequestError(f"top_k {self.veto} is vetoed by rlt-probe", "top_k")
        self.inner.add(request)


class CountingKV(Wrapped):
    def __init__(self, inner, counters: Counters) -> None:
        super().__init__(inner)
        self.counters = counters

    def allocate(self, slot, request) -> bool:
        ok = self.inner.allocate(slot, request)
        self.counters.allocations += ok
        return ok


class CountingExecutor(Wrapped):
    def __init__(self, inner, counters: Counters) -> None:
        super().__init__(inner)
        self.counters = counters

    def execute(self, batch):
        self.counters.steps += 1
        return self.inner.execute(batch)


class CountingSampler(Wrapped):
    def __init__(self, inner, counters: Counters) -> None:
        super().__init__(inner)
        self.counters = counters

    def sample(self, logits, slots):
        self.counters.sampled += len(slots)
        return self.inner.sample(logits, slots)


class StepLog:
    def __init__(self, path: str, counters: Counters) -> None:
        self.path, self.counters = path, counters

    def on_step(self, batch, result) -> None:
        c = self.counters
        with open(self.path, "a") as f:
            f.write(f"{c.steps} {len(batch.rows)} {c.allocations} {c.sampled} "
                    f"{max(r.length for r in batch.rows)}\n")


def install(builder, options: ProbeOptions) -> None:
    counters = Counters()
    builder.wrap("scheduler", lambda ctx, inner: VetoingScheduler(inner, options))
    builder.wrap("kv_manager", lambda ctx, inner: CountingKV(inner, counters))
    builder.wrap("executor", lambda ctx, inner: CountingExecutor(inner, counters))
    builder.wrap("sampler", lambda ctx, inner: CountingSampler(inner, counters))
    if options.log:
        builder.observe(StepLog(options.log, counters))
    builder.notes.append("probe: counting steps (test feature)")


def _replace_executor(builder, options) -> None:
    builder.replace("executor", lambda ctx: None)  # never built: composition refuses the pair first


FEATURES = [
    Feature(name="probe", package="rlt-probe", description="test feature: wraps four components",
            options=ProbeOptions, install=install, enabled_by_default=False),
    Feature(name="probe_rival_a", package="rlt-probe", description="replaces the executor",
            install=_replace_executor, enabled_by_default=False),
    Feature(name="probe_rival_b", package="rlt-probe", description="replaces the executor too",
            install=_replace_executor, enabled_by_default=False),
]
