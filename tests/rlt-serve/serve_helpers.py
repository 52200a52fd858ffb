"""Helpers shared by the rlt-serve tests (plain functions, no fixtures)."""

from __future__ import annotations

from rlt.platform.engine.interfaces import Wrapped

POISON_TOP_K = 317


class PoisonedExecutor(Wrapped):
    """Wraps the executor through the public assembly: a step running a request with
    ``top_k == POISON_TOP_K`` fails, as an engine fault would."""

    def execute(self, batch):
        if any(r.request.params.top_k == POISON_TOP_K for r in batch.rows):
            raise RuntimeError("injected fault")
        return self.inner.execute(batch)


def poisoned_engine(config):
    from rlt.platform.engine.assembly import EngineAssembly
    from rlt.platform.platforms import detect_platform

    assembly = EngineAssembly(detect_platform(config.device))
    assembly.wrap("executor", lambda ctx, inner: PoisonedExecutor(inner), by="test")
    return assembly.build_engine(config)
