"""API-key authentication (pure ASGI middleware), as vLLM's ``--api-key``.

With a key set (``--api-key`` or the ``RLT_API_KEY`` environment variable), every request must
carry ``Authorization: Bearer <key>``; anything else is answered 401 ``AuthenticationError``
with ``WWW-Authenticate: Bearer`` before the body is read or a route runs. ``/health`` and
``/metrics`` stay open unless ``--no-public-health-metrics``. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from typing import Callable, Iterable

from rlt.serve.errors import ErrorResponse, error_body


class ApiKeyAuth:
    def __init__(self, app, api_key: str, open_paths: Iterable[str] = (),
                 on_reject: Callable[[str], None] | None = None) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self.open_paths = frozenset(open_paths)
        self.on_reject = on_reject

    def _authorized(self, scope) -> bool:
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(b"Bearer " + token.strip(), self._expected)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if self.on_reject is not None:
            self.on_reject("unauthorized")
        has_header = any(name == b"authorization" for name, _ in scope.get("headers", ()))
        message = ("invalid API key" if has_header else
                   "missing API key: send the header 'Authorization: Bearer <key>'")
        response = ErrorResponse(error_body(401, message), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
