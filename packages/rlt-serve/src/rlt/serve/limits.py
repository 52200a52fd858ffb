"""Request-body limits (pure ASGI middleware): size and read time.

A body whose ``Content-Length`` exceeds the limit is answered 413 before it is read; a body sent
without a length (chunked) is counted as it arrives and refused with 413 once it passes the limit.
A body must also arrive in full within ``read_timeout`` seconds of the request's headers (408
otherwise, and the connection is closed), so a client that sends a length and then stops, or
trickles its body, cannot hold a connection and a handler for ever. Only the body is limited here;
prompt length in tokens is checked before tokenising (400).
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException

from rlt.serve.errors import ErrorResponse, error_body


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the server's limit of {limit} bytes (--max-body-bytes)")


class BodyTimeout(HTTPException):
    def __init__(self, timeout: float) -> None:
        super().__init__(408, f"the request body did not arrive in full within {timeout:g} s (--body-read-timeout)",
                         headers={"Connection": "close"})


class BodySizeLimit:
    def __init__(self, app, max_bytes: int, on_reject=None, read_timeout: float = 0.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject
        self.read_timeout = read_timeout

    async def _refuse(self, send, status: int, message: str) -> None:
        if self.on_reject is not None:
            self.on_reject("too_large" if status == 413 else "bad_request")
        body = ErrorResponse(error_body(status, message)).body  # the same bytes as every other error
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await self._refuse(send, 400, "Content-Length header is not an integer")
                    return
                if length > self.max_bytes:
                    await self._refuse(send, 413, BodyTooLarge(self.max_bytes).detail)
                    return
        received = 0
        limit = self.max_bytes
        on_reject = self.on_reject
        timeout = self.read_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout > 0 else None
        body_done = False

        async def limited_receive():
            nonlocal received, body_done
            if body_done or deadline is None:
                message = await receive()  # after the body: waiting for a disconnect is not timed
            else:
                left = deadline - loop.time()
                try:
                    if left <= 0:
                        raise asyncio.TimeoutError
                    message = await asyncio.wait_for(receive(), left)
                except asyncio.TimeoutError:
                    raise BodyTimeout(timeout) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if not message.get("more_body", False):
                    body_done = True
                if received > limit:
                    if on_reject is not None:
                        on_reject("too_large")
                    raise BodyTooLarge(limit)
            else:
                body_done = True
            return message

        await self.app(scope, limited_receive, send)
