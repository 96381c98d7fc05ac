"""What every HTTP request passes before the app sees it: the API key and the body's size.

`Guard` is plain ASGI middleware, so it answers before FastAPI parses (or even reads) a body:
- with API keys set, every `/v1` route wants `Authorization: Bearer <key>` (401 otherwise, as
  OpenAI answers a wrong key; the keys are compared in constant time); `/health` and
  `/metrics` stay open, for load balancers and scrapers;
- a body over `max_body_bytes` is answered 413: at once when its Content-Length says so, and
  while it arrives when it is sent chunked (nothing beyond the limit is kept).
"""

from __future__ import annotations

import hmac
import json
import os
from pathlib import Path

from .protocol import error_body

API_KEY_ENV = "TREESPEC_API_KEY"


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
    def __init__(self, app, api_keys: tuple[str, ...] = (), max_body_bytes: int | None = None):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.keys = [k.encode() for k in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.keys and scope["path"].startswith("/v1") and not self.authorized(headers):
            message = "a valid API key is required: send it as 'Authorization: Bearer <key>'"
            body = error_body(message, "invalid_request_error", code="invalid_api_key")
            return await _reply(send, 401, body, [(b"www-authenticate", b"Bearer")])
        limit = self.max_body_bytes
        if limit is None or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None:  # the server reads no more than it declares
            if not length.isdigit() or int(length) > limit:
                return await _reply(send, 413, _too_large(limit))
            return await self.app(scope, receive, send)
        messages, size = [], 0  # chunked: read it here, up to the limit, then hand it on
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > limit:
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
