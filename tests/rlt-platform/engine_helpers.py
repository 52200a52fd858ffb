"""Helpers shared by the rlt-platform engine tests (not fixtures: plain functions)."""

from rlt.platform.engine.interfaces import Wrapped


def drain(engine) -> dict:
    """Step ``engine`` until idle; the finished outputs by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


class FaultyExecutor(Wrapped):
    """An executor wrapper (installed through the public assembly) that fails while armed."""

    def __init__(self, inner, message: str = "injected device fault") -> None:
        super().__init__(inner)
        self.message, self.armed = message, False

    def execute(self, batch):
        if self.armed:
            raise RuntimeError(self.message)
        return self.inner.execute(batch)


def engine_with_faults(config):
    """``(engine, faults)``: the base engine whose executor is wrapped by a :class:`FaultyExecutor`."""
    from rlt.platform.engine.assembly import EngineAssembly
    from rlt.platform.platforms import detect_platform

    assembly = EngineAssembly(detect_platform(config.device))
    wrapped = {}
    assembly.wrap("executor", lambda ctx, inner: wrapped.setdefault("x", FaultyExecutor(inner)), by="test")
    return assembly.build_engine(config), wrapped["x"]
