"""Watching the engine from benchmarks through its public interfaces only.

:class:`StepRecorder` is a step observer (``engine.add_observer``): per step, whether it held
prompt rows and how many rows it ran. :func:`timed_assembly` builds an engine assembly whose
scheduler, batch builder, executor and sampler are wrapped by :class:`Timed`, which adds the host
time spent in each call to a shared dict — the regions of one engine step. Nothing is patched.
"""

from __future__ import annotations

import time
from collections import defaultdict

from rlt.platform.engine.assembly import EngineAssembly
from rlt.platform.engine.interfaces import Wrapped
from rlt.platform.platforms import Platform

#: component -> (method, region label), in step order
REGIONS = {
    "scheduler": ("schedule", "schedule"),
    "batch_builder": ("build", "build batch + metadata (host->device)"),
    "executor": ("execute", "execute (total, includes sample)"),
    "sampler": ("sample", "execute: sample (+ wait for device, copy to host)"),
}
REGION_ORDER = tuple(label for _, label in REGIONS.values())


class StepRecorder:
    def __init__(self) -> None:
        self.prefill: list[bool] = []
        self.rows: list[int] = []

    def on_step(self, batch, result) -> None:
        self.prefill.append(any(r.in_prompt for r in batch.rows))
        self.rows.append(len(batch.rows))

    @property
    def last_had_prompt_rows(self) -> bool:
        return bool(self.prefill) and self.prefill[-1]


class Timed(Wrapped):
    def __init__(self, inner, method: str, label: str, acc: dict) -> None:
        super().__init__(inner)
        self._method, self._label, self._acc = method, label, acc

    def __getattr__(self, name: str):
        attr = super().__getattr__(name)
        if name != self._method:
            return attr

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return attr(*a, **k)
            finally:
                self._acc[self._label] += time.perf_counter() - t

        return timed


def timed_assembly(platform: Platform, assembly: EngineAssembly | None = None) -> tuple[EngineAssembly, dict[str, float]]:
    """``assembly`` (a bare one if None) with the step regions timed (outermost wrappers)."""
    acc: dict[str, float] = defaultdict(float)
    assembly = assembly or EngineAssembly(platform)
    for component, (method, label) in REGIONS.items():
        assembly.wrap(component, lambda ctx, inner, m=method, lb=label: Timed(inner, m, lb, acc), by="benchmark")
    return assembly, acc
