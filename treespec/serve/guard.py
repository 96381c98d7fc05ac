"""What every HTTP request passes before the app sees it: the API key, the body's size and time.

`Guard` is plain ASGI middleware, so it answers before FastAPI parses (or even reads) a body:
- with API keys set, every `/v1` route (and the schema, `/openapi.json`, and docs pages) wants
  `Authorization: Bearer <key>` (401 otherwise, as OpenAI answers a wrong key; the keys are
  compared in constant time); `/health` and `/metrics` stay open, for load balancers and
  scrapers;
- a body over `max_body_bytes` is answered 413: at once when its Content-Length says so, and
  while it arrives when it is sent chunked (nothing beyond the limit is kept);
- a body that has not arrived `read_timeout` seconds after its headers is answered 408.

Below ASGI, `timed_h11(read_timeout)` is uvicorn's h11 protocol closing a connection (with a
408) whose request headers have not arrived `read_timeout` seconds after it opened or after
its previous response: a client that connects and stalls holds nothing for long.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
from pathlib import Path

from .protocol import error_body

API_KEY_ENV = "TREESPEC_API_KEY"
# what wants a key when the server has keys: the API, and the schema and docs pages describing it
KEYED = ("/v1", "/openapi.json", "/docs", "/redoc")


def read_api_keys(keys: list[str] | None, key_file: str | None) -> tuple[str, ...]:
    """The keys a server accepts: `keys` (--api-key), $TREESPEC_API_KEY and one per line of
    `key_file` (blank lines and # comments skipped). ValueError for an unreadable or empty file
    or an empty key."""
    found = list(keys or [])
    if os.environ.get(API_KEY_ENV):
        found.append(os.environ[API_KEY_ENV])
    if key_file is not None:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file {key_file}: cannot read it ({e.strerror or e})") from None
        from_file = [s.strip() for s in lines if s.strip() and not s.strip().startswith("#")]
        if not from_file:
            raise ValueError(f"--api-key-file {key_file}: no key in it (one key per line)")
        found += from_file
    if any(not k.strip() for k in found):
        raise ValueError("an API key must not be empty")
    return tuple(k.strip() for k in found)


class Guard:
    def __init__(
        self,
        app,
        api_keys: tuple[str, ...] = (),
        max_body_bytes: int | None = None,
        read_timeout: float | None = None,
    ):
        self.app, self.max_body_bytes, self.read_timeout = app, max_body_bytes, read_timeout
        self.keys = [k.encode() for k in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.keys and scope["path"].startswith(KEYED) and not self.authorized(headers):
            message = "a valid API key is required: send it as 'Authorization: Bearer <key>'"
            body = error_body(message, "invalid_request_error", code="invalid_api_key")
            return await _reply(send, 401, body, [(b"www-authenticate", b"Bearer")])
        limit = self.max_body_bytes
        if scope["method"] in ("GET", "HEAD") or (limit is None and self.read_timeout is None):
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and limit is not None and (not length.isdigit() or int(length) > limit):
            return await _reply(send, 413, _too_large(limit))  # before reading a byte of it
        # read the body here, up to the limit and within the time, then hand it on
        messages, size = [], 0
        deadline = (
            None if self.read_timeout is None else asyncio.get_running_loop().time() + self.read_timeout
        )
        while True:
            try:
                left = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
                message = await asyncio.wait_for(receive(), left)
            except TimeoutError:
                return await _reply(send, 408, _too_slow(self.read_timeout), [(b"connection", b"close")])
            messages.append(message)
            size += len(message.get("body", b""))
            if limit is not None and size > limit:
                return await _reply(send, 413, _too_large(limit))
            if message["type"] != "http.request" or not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)

    def authorized(self, headers: dict) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        ok = False
        for key in self.keys:  # every key compared, in constant time: no early exit to time
            ok |= hmac.compare_digest(token, key)
        return ok


def timed_h11(read_timeout: float):
    """uvicorn's h11 protocol, answering 408 and closing a connection whose request headers
    have not arrived `read_timeout` seconds after it opened or after its previous response
    (uvicorn times out only idle keep-alive connections, and any byte resets that)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers arrived: its body is the Guard's
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's headers

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(read_timeout, self._late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _late(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return  # closed, or a request is being answered
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
            )
            self.transport.close()

    return TimedH11


def _too_slow(seconds: float) -> dict:
    return error_body(
        f"the request body did not arrive within {seconds:g} s of its headers (--read-timeout)",
        "invalid_request_error",
        code="request_timeout",
    )


def _too_large(limit: int) -> dict:
    return error_body(
        f"the request body is larger than this server's limit of {limit} bytes (--max-body-mb)",
        "invalid_request_error",
    )


async def _reply(send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head + (headers or [])})
    await send({"type": "http.response.body", "body": data})
