"""Test harness: ``rlt-server serve`` plus a test-only feature, composed through the same
Feature contract as real ones.

The ``test_gate`` feature wraps the executor: every step first waits on a gate (closed with
``POST /_test/gate/close``, opened with ``/_test/gate/open``; it reopens by itself after 60 s so
a failed test cannot hang the server), and a step that runs a request with ``top_k == 317``
raises, as an engine fault would. Tests use it to hold requests in flight deterministically.
Admitting a request with ``top_k == 318`` raises right after its KV blocks were allocated —
after the scheduler has taken a slot and reserved its KV — as the int64 overflow of issue 15 did: admission must give both back and answer the request with an error.
"""

from __future__ import annotations

import sys
import threading

from fastapi import APIRouter

from rlt.platform.engine.interfaces import Wrapped
from rlt.platform.features import Feature
from rlt_server import serve
from rlt_server.cli import build_parser
from rlt_server.common import run_guarded

POISON_TOP_K = 317
POISON_ADMIT_TOP_K = 318
GATE = threading.Event()
GATE.set()
router = APIRouter()


@router.post("/_test/gate/{action}")
async def gate(action: str):
    (GATE.clear if action == "close" else GATE.set)()
    return {"open": GATE.is_set()}


class GatedExecutor(Wrapped):
    """Wraps the engine's executor (through the public assembly): waits on the gate, and fails a
    step that runs a request with the poison top_k."""

    def execute(self, batch):
        if not GATE.wait(60):
            GATE.set()
        if any(r.request.params.top_k == POISON_TOP_K for r in batch.rows):
            raise RuntimeError("injected fault (test harness)")
        return self.inner.execute(batch)


class PoisonedAdmission(Wrapped):
    """Wraps the KV manager: allocating for a request with the admission-poison top_k takes the
    blocks, then fails — a fault after the scheduler took a slot and KV."""

    def allocate(self, slot, request) -> bool:
        ok = self.inner.allocate(slot, request)
        if request.params.top_k == POISON_ADMIT_TOP_K:
            raise RuntimeError("injected admission fault (test harness)")
        return ok


def _install(builder, options) -> None:
    builder.wrap("executor", lambda ctx, inner: GatedExecutor(inner))
    builder.wrap("kv_manager", lambda ctx, inner: PoisonedAdmission(inner))
    builder.http_routers.append(router)


TEST_GATE = Feature(name="test_gate", package="tests", description="test-only step gate and fault injection",
                    install=_install)

if __name__ == "__main__":
    args = build_parser().parse_args(sys.argv[1:])
    sys.exit(run_guarded(lambda: serve.run(args, extra_features=[TEST_GATE])))
